"""The emulated link on loopback: delay, bandwidth, jitter without reordering, closing."""

from __future__ import annotations

import asyncio
import time

import pytest

from benchmarks.link_emulator import LinkEmulator, LinkProfile


async def echo_server() -> asyncio.Server:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def blob_server(size: int) -> asyncio.Server:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read(1)
        w.write(b"x" * size)
        await w.drain()
        w.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def port_of(server: asyncio.Server) -> int:
    return server.sockets[0].getsockname()[1]


async def round_trip(port: int, n: int = 5) -> float:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        w.write(b"p")
        await w.drain()
        await r.readexactly(1)
        times.append(time.perf_counter() - t)
    w.close()
    return sorted(times)[len(times) // 2]


def test_delay_adds_to_the_round_trip():
    async def main() -> tuple[float, float]:
        server = await echo_server()
        direct = await round_trip(port_of(server))
        async with LinkEmulator(
            "127.0.0.1", port_of(server), up=LinkProfile(delay=0.04), down=LinkProfile(delay=0.02)
        ) as link:
            shaped = await round_trip(link.port)
        server.close()
        return direct, shaped

    direct, shaped = asyncio.run(main())
    assert direct < 0.01
    assert 0.06 <= shaped < 0.09


def test_retune_changes_an_open_connection():
    """A latency trace: the same connection sees 20 ms, then 120 ms, then 20 ms again."""

    async def main() -> list[float]:
        server = await echo_server()
        fast, slow = LinkProfile(delay=0.01), LinkProfile(delay=0.06)
        async with LinkEmulator("127.0.0.1", port_of(server), fast, fast) as link:
            r, w = await asyncio.open_connection("127.0.0.1", link.port)
            out = []
            for profile in (fast, slow, fast):
                link.retune(profile, profile)
                t = time.perf_counter()
                w.write(b"p")
                await w.drain()
                await r.readexactly(1)
                out.append(time.perf_counter() - t)
            w.close()
        server.close()
        return out

    before, during, after = asyncio.run(main())
    assert before < 0.05 and 0.12 <= during < 0.16 and after < 0.05


@pytest.mark.parametrize("bandwidth", [100_000, 400_000])
def test_bandwidth_limits_throughput(bandwidth):
    size = 100_000

    async def main() -> float:
        server = await blob_server(size)
        async with LinkEmulator(
            "127.0.0.1", port_of(server), down=LinkProfile(bandwidth=bandwidth, burst=4096)
        ) as link:
            r, w = await asyncio.open_connection("127.0.0.1", link.port)
            t = time.perf_counter()
            w.write(b"go")
            await w.drain()
            got = await r.readexactly(size)
            elapsed = time.perf_counter() - t
            assert got == b"x" * size
            assert link.stats.bytes_down == size
            w.close()
        server.close()
        return elapsed

    elapsed = asyncio.run(main())
    expected = (size - 4096) / bandwidth
    assert 0.85 * expected <= elapsed <= 1.3 * expected + 0.05


def test_jitter_never_reorders_bytes():
    messages = b"".join(f"{i:05d}".encode() for i in range(2000))

    async def main() -> bytes:
        server = await echo_server()
        async with LinkEmulator(
            "127.0.0.1",
            port_of(server),
            up=LinkProfile(delay=0.005, jitter=0.02),
            down=LinkProfile(delay=0.005, jitter=0.02),
            seed=1,
        ) as link:
            r, w = await asyncio.open_connection("127.0.0.1", link.port)
            for i in range(0, len(messages), 50):  # many small writes, each jittered
                w.write(messages[i : i + 50])
                await w.drain()
                await asyncio.sleep(0.0005)
            got = await r.readexactly(len(messages))
            w.close()
        server.close()
        return got

    assert asyncio.run(main()) == messages


def test_a_closed_server_closes_the_client_side():
    async def main() -> bytes:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(b"bye")
            await w.drain()
            w.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with LinkEmulator("127.0.0.1", port_of(server), down=LinkProfile(delay=0.01)) as link:
            r, w = await asyncio.open_connection("127.0.0.1", link.port)
            data = await asyncio.wait_for(r.read(), timeout=5)  # until EOF
            w.close()
        server.close()
        return data

    assert asyncio.run(main()) == b"bye"


def test_bad_profiles_are_refused():
    for bad in ({"delay": -1}, {"jitter": -0.1}, {"bandwidth": 0}, {"burst": 0}):
        with pytest.raises(ValueError):
            LinkProfile(**bad)


# ---------------------------------------------------------------------------- faults


async def _echo_link(**profile: float) -> tuple[asyncio.Server, LinkEmulator]:
    server = await echo_server()
    shape = LinkProfile(**profile)
    link = LinkEmulator("127.0.0.1", port_of(server), shape, shape, seed=3)
    await link.start()
    return server, link


async def _proxied(link: LinkEmulator) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection through the link, after one echo (so the proxy has it open)."""
    r, w = await asyncio.open_connection("127.0.0.1", link.port)
    w.write(b"o")
    await r.readexactly(1)
    return r, w


def test_loss_delays_a_chunk_by_the_rto_and_keeps_the_order():
    async def main() -> tuple[list[float], bytes]:
        server, link = await _echo_link(loss=0.5, rto=0.1)
        r, w = await asyncio.open_connection("127.0.0.1", link.port)
        times, got = [], b""
        for i in range(20):
            t = time.perf_counter()
            w.write(bytes([i]))
            await w.drain()
            got += await r.readexactly(1)
            times.append(time.perf_counter() - t)
        w.close()
        await link.close()
        server.close()
        return times, got

    times, got = asyncio.run(main())
    assert got == bytes(range(20))
    late = sum(t >= 0.1 for t in times)
    assert 5 <= late <= 19  # each way loses half: most round trips pay at least one RTO


def test_reset_ends_open_connections_and_new_ones_work():
    async def main() -> None:
        server, link = await _echo_link()
        r, w = await _proxied(link)
        link.reset()
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            w.write(b"p")
            await w.drain()
            await asyncio.wait_for(r.readexactly(1), 2)
        assert await round_trip(link.port) < 0.05
        await link.close()
        server.close()

    asyncio.run(main())


def test_vanish_leaves_connections_open_but_silent():
    async def main() -> None:
        server, link = await _echo_link()
        r, w = await _proxied(link)
        link.vanish()
        w.write(b"p")
        await w.drain()  # the write itself succeeds: nothing says the peer is gone
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(r.readexactly(1), 0.3)
        assert await round_trip(link.port) < 0.05  # a new connection gets through
        w.close()
        await link.close()
        server.close()

    asyncio.run(main())


def test_a_partition_holds_bytes_then_delivers_them_in_order():
    async def main() -> tuple[float, bytes]:
        server, link = await _echo_link()
        r, w = await asyncio.open_connection("127.0.0.1", link.port)
        t = time.perf_counter()
        link.partition(0.3)
        w.write(b"abc")
        await w.drain()
        got = await asyncio.wait_for(r.readexactly(3), 2)
        took = time.perf_counter() - t
        w.close()
        await link.close()
        server.close()
        return took, got

    took, got = asyncio.run(main())
    assert got == b"abc" and 0.3 <= took < 0.5
