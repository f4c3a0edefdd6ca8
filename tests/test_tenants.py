"""A cloud many people share (issue 33): no tenant can lock another out, hold every session,
push another's KV cache out, or read the others' traffic off /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloud_backend.admission import AuthThrottle, client_address
from cloud_backend.config import ConfigError, ServerConfig
from cloud_backend.engine import LLMEngine
from collab.protocol import Done, Error, Generate, Mode, Ping
from edge_runtime.client import CloudBusy, CloudClient
from model_runtime.tokenizer import load_tokenizer
from model_runtime.torch_runtime import TorchCausalLM
from tests import test_server
from tests.test_server import METRICS_TOKEN, TOKEN, raw

engine, start_cloud = test_server.engine, test_server.start_cloud
ALICE = "alice-" + "s" * 20  # a second user's access token
WRONG = {"Authorization": "Bearer wrong"}


async def status_of(url: str, headers: dict[str, str]) -> int:
    """The HTTP status of a websocket upgrade (101 when a session opened)."""
    async with aiohttp.ClientSession() as http:
        try:
            ws = await http.ws_connect(url, headers=headers)
        except aiohttp.WSServerHandshakeError as refused:
            return refused.status
        await ws.close()
        return 101


def forwarded(client: str, headers: dict[str, str] | None = None) -> dict[str, str]:
    return {**(headers or {}), "X-Forwarded-For": client}


# ---------------------------------------------------------------------------- admission


async def test_a_right_token_comes_in_whatever_its_address_failed(start_cloud):
    """Ten wrong guesses from 127.0.0.1 (every local process of the embedded cloud) used to
    lock every user of that address out; now they throttle only the wrong tokens."""
    cloud = await start_cloud(auth_failures=3, auth_window_s=30)
    for _ in range(3):
        assert await status_of(cloud.url, WRONG) == 401
    assert await status_of(cloud.url, WRONG) == 429  # guessing is throttled
    assert await status_of(cloud.url, cloud.headers()) == 101  # the right token is not


async def test_failures_count_per_client_behind_a_trusted_proxy(start_cloud):
    cloud = await start_cloud(auth_failures=3, auth_window_s=30, trusted_proxies=["127.0.0.1"])
    for _ in range(3):
        assert await status_of(cloud.url, forwarded("10.0.0.1", WRONG)) == 401
    assert await status_of(cloud.url, forwarded("10.0.0.1", WRONG)) == 429
    assert await status_of(cloud.url, forwarded("10.0.0.2", WRONG)) == 401  # another client
    assert await status_of(cloud.url, forwarded("10.0.0.1", cloud.headers())) == 101


async def test_a_forwarded_address_from_an_untrusted_peer_is_ignored(start_cloud):
    """Without trusted proxies a client cannot dodge its count by naming another address."""
    cloud = await start_cloud(auth_failures=3, auth_window_s=30)
    for n in range(3):
        assert await status_of(cloud.url, forwarded(f"10.0.0.{n}", WRONG)) == 401
    assert await status_of(cloud.url, forwarded("10.0.0.9", WRONG)) == 429


async def raw_status(http_url: str, lines: list[str]) -> int:
    """The status of a GET of the session path sent byte for byte, with these header lines
    (a client can repeat a header; an HTTP library might fold the lines into one)."""
    host, port = http_url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    head = ["GET /v1/session HTTP/1.1", f"Host: {host}", *lines, "Connection: close", "", ""]
    writer.write("\r\n".join(head).encode())
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    writer.close()
    await writer.wait_closed()
    return status


async def test_every_forwarded_for_line_is_read(start_cloud):
    """A client sends an X-Forwarded-For line of its own and a proxy adds another line (it
    need not append to the client's): the address is the last line's, whatever the first
    says, so a client cannot dodge its count by changing its own line."""
    cloud = await start_cloud(auth_failures=3, auth_window_s=30, trusted_proxies=["127.0.0.1"])
    wrong = "Authorization: Bearer wrong"
    for n in range(3):
        lines = [wrong, f"X-Forwarded-For: 10.0.0.{n}", "X-Forwarded-For: 10.0.0.9"]
        assert await raw_status(cloud.http, lines) == 401
    lines = [wrong, "X-Forwarded-For: 10.0.0.7", "X-Forwarded-For: 10.0.0.9"]
    assert await raw_status(cloud.http, lines) == 429  # 10.0.0.9 guessed three times
    assert await raw_status(cloud.http, [wrong, "X-Forwarded-For: 10.0.0.8"]) == 401


def test_the_client_is_the_nearest_address_no_trusted_proxy_wrote():
    proxies = ServerConfig(trusted_proxies=["10.1.0.0/16", "::1"]).proxy_networks()
    assert client_address("10.1.2.3", "203.0.113.7", proxies) == "203.0.113.7"
    # the client wrote its own header first: only the entries our proxies appended count
    assert client_address("10.1.2.3", "1.1.1.1, 203.0.113.7, 10.1.9.9", proxies) == "203.0.113.7"
    assert client_address("::1", "2001:db8::5", proxies) == "2001:db8::5"
    assert client_address("192.0.2.1", "203.0.113.7", proxies) == "192.0.2.1"  # not a proxy
    assert client_address("10.1.2.3", "", proxies) == "10.1.2.3"
    assert client_address("10.1.2.3", "unknown", proxies) == "unknown"
    with pytest.raises(ConfigError, match="not an address"):
        ServerConfig(trusted_proxies=["balancer.local"])


def test_the_wrong_token_map_is_bounded():
    throttle = AuthThrottle(limit=3, window=60, max_clients=100)
    for n in range(10_000):
        throttle.failed(f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}")
    for _ in range(50):
        throttle.failed("10.0.0.1")
    assert len(throttle) == 100  # the longest quiet forgotten first; the latest kept
    assert throttle.retry_after("10.0.0.1") > 0
    assert throttle.retry_after("10.0.0.5") == 0


# ---------------------------------------------------------------------------- sessions


async def test_one_token_cannot_hold_every_session(start_cloud):
    cloud = await start_cloud(max_sessions=4, tokens={"alice": ALICE})
    assert cloud.config.sessions_per_token() == 2  # several tokens: half the slots each
    async with raw(cloud), raw(cloud):
        assert await status_of(cloud.url, cloud.headers()) == 429
        device = CloudClient(cloud.url, TOKEN, Mode.CLOUD, "", cloud.engine.tokenizer_hash, "d")
        with pytest.raises(CloudBusy, match="holds all the sessions") as busy:
            await device.connect()
        assert busy.value.retry_after_s == 5
        await device.close()
        async with raw(cloud, token=ALICE), raw(cloud, token=ALICE):
            pass  # alice's slots were left free for her
    async with raw(cloud), raw(cloud):  # slots come back when sessions close
        pass
    metrics = await cloud.metrics()
    assert metrics[("tandem_handshake_refusals_total", (("reason", "token_sessions"),))] == 2


async def test_pings_do_not_keep_a_session_open(start_cloud):
    """Idle is measured by requests: a session that only pings is closed on time, so it
    cannot hold its slot for ever; one that asks is not."""
    cloud = await start_cloud(idle_timeout_s=0.6)
    async with raw(cloud) as pinger:

        async def ping_on() -> None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                while True:
                    await pinger.send(Ping(time.monotonic_ns()))
                    await asyncio.sleep(0.1)

        start, pinging = time.monotonic(), asyncio.create_task(ping_on())
        try:
            async with asyncio.timeout(3):
                while not isinstance(msg := await pinger.recv(), Error):
                    pass  # its Pongs
        finally:
            pinging.cancel()
        assert "idle timeout" in msg.message and time.monotonic() - start < 2
    async with raw(cloud) as asker:
        for rid in range(1, 5):  # ~1.2 s of questions, twice the idle timeout
            await asker.send(Generate("hi", max_new_tokens=2, request_id=rid))
            await asker.recv_until(Done)
            await asyncio.sleep(0.3)
        await asker.ping_pong()


# ---------------------------------------------------------------------------- KV cache


async def test_a_greedy_tenant_evicts_its_own_sessions_first(tiny):
    """Over the budget, the tenant holding the most gives up its least recently used cache:
    bob's one session (least recently used of all) survives alice's six."""
    engine = LLMEngine(TorchCausalLM(tiny["hf"]), load_tokenizer(tiny["hf"]), "tiny")
    try:
        evicted: list[str] = []
        bob = engine.open_session(on_evict=lambda: evicted.append("bob"), tenant="bob")
        await bob.prefill(list(range(1, 9)))
        engine.kv_budget_bytes = 4 * bob.nbytes  # room for four sessions of this size
        alice = []
        for n in range(6):
            s = engine.open_session(on_evict=lambda n=n: evicted.append(f"a{n}"), tenant="alice")
            await s.prefill(list(range(1, 9)))
            alice.append(s)
        assert evicted == ["a0", "a1", "a2"]  # alice's own, oldest first; bob untouched
        await bob.forward([9])
        assert bob.length == 9 and engine.cache_bytes <= engine.kv_budget_bytes
    finally:
        engine.close()


async def test_a_tenant_is_held_to_its_share(tiny):
    engine = LLMEngine(TorchCausalLM(tiny["hf"]), load_tokenizer(tiny["hf"]), "tiny")
    try:
        evicted: list[str] = []
        probe = engine.open_session(tenant="probe")
        await probe.prefill(list(range(1, 9)))
        engine.kv_tenant_bytes = 2 * probe.nbytes
        probe.close()
        for n in range(4):
            s = engine.open_session(on_evict=lambda n=n: evicted.append(f"a{n}"), tenant="alice")
            await s.prefill(list(range(1, 9)))
        assert evicted == ["a0", "a1"]  # the budget had room; alice's share did not
    finally:
        engine.close()


# ---------------------------------------------------------------------------- metrics


async def test_metrics_need_the_metrics_token(start_cloud):
    cloud = await start_cloud(tokens={"alice": ALICE})
    async with aiohttp.ClientSession() as http:
        for headers in ({}, cloud.headers(), cloud.headers(ALICE)):  # access tokens: no
            async with http.get(cloud.http + "/metrics", headers=headers) as resp:
                assert resp.status == 401
                assert "tandem_" not in await resp.text()
    await cloud.metrics()  # the metrics token: yes
    with pytest.raises(ConfigError, match="metrics_token is also an access token"):
        ServerConfig(token=TOKEN, metrics_token=TOKEN).access_tokens()


async def test_metrics_on_their_own_bind_only(start_cloud):
    cloud = await start_cloud(metrics_token=None, metrics_port=0)
    async with (
        aiohttp.ClientSession() as http,
        http.get(cloud.http + "/metrics", headers=cloud.headers()) as resp,
    ):
        assert resp.status == 404  # not on the service's bind
    without = await start_cloud(metrics_token=None)
    async with aiohttp.ClientSession() as http, http.get(without.http + "/metrics") as resp:
        assert resp.status == 404  # neither set: not served at all


async def test_metrics_are_aggregates_only(start_cloud):
    cloud = await start_cloud(tokens={"alice": ALICE})
    async with raw(cloud) as s, raw(cloud, token=ALICE) as a:
        for session in (s, a):
            await session.send(Generate("hi", max_new_tokens=3, request_id=1))
            await session.recv_until(Done)
        async with (
            aiohttp.ClientSession() as http,
            http.get(cloud.http + "/metrics", headers=cloud.headers(METRICS_TOKEN)) as resp,
        ):
            text = await resp.text()
    labels = {
        name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        for name in sample.labels
    }
    assert labels <= {"mode", "direction", "code", "reason", "kind", "le"}, labels
    assert "alice" not in text and "127.0.0.1" not in text
