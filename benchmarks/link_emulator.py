"""An emulated network link: a TCP proxy with per-direction delay, jitter, bandwidth and loss,
and the faults a real link has: resets, a peer that vanishes without a FIN, partitions.

This kernel has no netem, so tests and benchmarks put this proxy between the device and the
cloud on loopback (docs/benchmarks/index.md#measuring-honestly). Each direction is shaped on its
own: bytes leave a token
bucket at the link's rate (serialisation), then arrive after the one-way delay plus jitter.
Jitter never reorders bytes (it is a TCP stream): a chunk is never delivered before the one
read ahead of it.

Run on its own, it serves the link until interrupted:

    python benchmarks/link_emulator.py --target 127.0.0.1:8765 --listen 8766 \\
        --delay-ms 25 --jitter-ms 5 --up-kbit 10000 --down-kbit 50000

Point the device at the listening port. Delay and jitter are one-way and apply to both
directions; bandwidth is per direction (kbit/s; omit for unlimited).

Faults, at the level a TCP stream sees them (tests/test_link_faults.py):
- loss: a chunk is lost with probability `loss` and arrives one retransmission timeout late,
  holding back the bytes behind it (head-of-line blocking);
- `reset()`: every open connection ends with a TCP reset on both sides;
- `vanish()`: open connections stay open but nothing crosses them any more, either way (the
  peer is gone without a FIN: a closed laptop lid, a pulled cable, a dead NAT entry);
- `partition(seconds)`: nothing crosses the link for a while, then the bytes held back arrive
  in order (TCP retransmitting across the gap); connections opened meanwhile wait too;
- a bandwidth collapse mid-answer is `retune()` with a small bandwidth."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import struct
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LinkProfile:
    """One direction of a link. delay and jitter in seconds (jitter: uniform in [0, jitter]
    added to the delay); bandwidth in bytes per second (None = unlimited); burst in bytes."""

    delay: float = 0.0
    jitter: float = 0.0
    bandwidth: float | None = None
    burst: int = 16_384
    loss: float = 0.0  # probability that a chunk is lost and sent again `rto` later
    rto: float = 0.2  # TCP's retransmission timeout (Linux's minimum)

    def __post_init__(self) -> None:
        if self.delay < 0 or self.jitter < 0 or self.rto < 0:
            raise ValueError("delay, jitter and rto must be ≥ 0")
        if not 0 <= self.loss < 1:
            raise ValueError("loss must be in [0, 1)")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError("bandwidth must be > 0 bytes/s (or None for unlimited)")
        if self.burst <= 0:
            raise ValueError("burst must be > 0 bytes")


@dataclass
class LinkStats:
    bytes_up: int = 0
    bytes_down: int = 0
    connections: int = 0


@dataclass
class _Shaper:
    """Token bucket + propagation delay for one direction of one connection."""

    profile: LinkProfile
    rng: random.Random
    tokens: float = field(init=False)
    refilled_at: float = 0.0
    last_delivery: float = 0.0

    def __post_init__(self) -> None:
        self.tokens = float(self.profile.burst)

    def delivery_time(self, now: float, size: int) -> float:
        """When a chunk of `size` bytes read at `now` reaches the other side."""
        p = self.profile
        sent = now
        if p.bandwidth is not None:
            self.tokens = min(p.burst, self.tokens + (now - self.refilled_at) * p.bandwidth)
            self.refilled_at = now
            if self.tokens < size:
                sent = now + (size - self.tokens) / p.bandwidth
                self.tokens = 0.0
                self.refilled_at = sent
            else:
                self.tokens -= size
        arrival = sent + p.delay + (self.rng.uniform(0.0, p.jitter) if p.jitter else 0.0)
        if p.loss and self.rng.random() < p.loss:
            arrival += p.rto
        self.last_delivery = max(arrival, self.last_delivery)  # never overtake earlier bytes
        return self.last_delivery


class LinkEmulator:
    """Listens on `listen_host:port` (0 = any free port) and forwards each connection to
    `target`, shaping device→cloud with `up` and cloud→device with `down`."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        up: LinkProfile = LinkProfile(),
        down: LinkProfile = LinkProfile(),
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: int | None = None,
    ) -> None:
        self.target = (target_host, target_port)
        self.up, self.down = up, down
        self.listen = (listen_host, listen_port)
        self.stats = LinkStats()
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._shapers: list[tuple[_Shaper, str]] = []
        self._connections: set[_Connection] = set()
        self._healed_at = 0.0  # loop time a partition ends (0: none)

    # ---- faults ------------------------------------------------------------------------------
    def reset(self) -> None:
        """End every open connection now with a TCP reset on both sides."""
        for conn in list(self._connections):
            conn.abort()

    def vanish(self) -> None:
        """The other side is gone without a FIN: open connections stay open, but nothing more
        crosses them either way (what is sent is lost). New connections work."""
        for conn in self._connections:
            conn.dead = True

    def partition(self, seconds: float) -> None:
        """Nothing crosses the link for `seconds` from now; then what was held back arrives."""
        self._healed_at = asyncio.get_running_loop().time() + seconds

    async def _healed(self) -> None:
        loop = asyncio.get_running_loop()
        while (left := self._healed_at - loop.time()) > 0:
            await asyncio.sleep(left)

    def retune(self, up: LinkProfile, down: LinkProfile) -> None:
        """Change the link from now on, open connections included (a latency trace replayed
        during an answer). Bytes already in flight keep their delivery times."""
        self.up, self.down = up, down
        for shaper, direction in self._shapers:
            shaper.profile = up if direction == "up" else down

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the link is not started")
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, *self.listen)
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> LinkEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        await self._healed()  # a connection opened across a partition waits for its end
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        for sock_w in (client_w, server_w):
            sock = sock_w.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    # Nagle would add delay of its own; the emulator adds exactly what it is told.
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        shapers = [(_Shaper(self.up, self._rng), "up"), (_Shaper(self.down, self._rng), "down")]
        self._shapers += shapers
        conn = _Connection(client_w, server_w)
        self._connections.add(conn)
        pipes = [
            asyncio.create_task(self._pipe(client_r, server_w, *shapers[0], conn)),
            asyncio.create_task(self._pipe(server_r, client_w, *shapers[1], conn)),
        ]
        self._tasks.update(pipes)
        await asyncio.gather(*pipes, return_exceptions=True)
        self._tasks.difference_update(pipes)
        self._shapers = [s for s in self._shapers if s not in shapers]
        self._connections.discard(conn)
        for w in (client_w, server_w):
            w.close()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        shaper: _Shaper,
        direction: str,
        conn: _Connection,
    ) -> None:
        """Read as bytes arrive; a second task writes each chunk at its delivery time (after a
        partition's end; never, once the connection has vanished)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                await asyncio.sleep(max(0.0, at - loop.time()))
                await self._healed()
                if conn.dead:
                    continue
                writer.write(data)
                await writer.drain()
                if direction == "up":
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
            if writer.can_write_eof() and not conn.dead:
                writer.write_eof()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(shaper.profile.burst):
                if conn.dead:
                    continue  # swallowed: nothing reaches a side that has vanished
                queue.put_nowait((shaper.delivery_time(loop.time(), len(data)), data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
            with contextlib.suppress(ConnectionError, OSError):
                await sender


@dataclass(eq=False)
class _Connection:
    """Both sockets of one proxied connection."""

    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    dead: bool = False  # vanished: nothing more crosses it

    def abort(self) -> None:
        for writer in (self.client, self.server):
            transport = writer.transport
            sock = transport.get_extra_info("socket")
            if sock is not None:  # SO_LINGER 0: close() sends a RST, not a FIN
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()


def main() -> None:
    """Serve an emulated link between a device and a cloud until interrupted."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--target", required=True, help="HOST:PORT of the cloud")
    parser.add_argument("--listen", type=int, default=0, help="port to listen on (0 = any)")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--up-kbit", type=float, help="device → cloud bandwidth")
    parser.add_argument("--down-kbit", type=float, help="cloud → device bandwidth")
    args = parser.parse_args()
    host, port = args.target.rsplit(":", 1)

    def profile(kbit: float | None) -> LinkProfile:
        rate = kbit * 1000 / 8 if kbit else None
        return LinkProfile(args.delay_ms / 1000, args.jitter_ms / 1000, rate)

    async def run() -> None:
        link = LinkEmulator(
            host, int(port), profile(args.up_kbit), profile(args.down_kbit), listen_port=args.listen
        )
        await link.start()
        print(f"link 127.0.0.1:{link.port} -> {args.target} (Ctrl-C to stop)", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await link.close()
            print(f"up {link.stats.bytes_up:,} B, down {link.stats.bytes_down:,} B")

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
