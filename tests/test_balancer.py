"""The shipped load balancer, run (issue 33, part 5): Debian's HAProxy with deploy/haproxy.cfg
(adapted to loopback by benchmarks.balancer.render: plain bind, one `server` line per replica,
no container DNS; balancing, checks, retries and timeouts as shipped) in front of two real
`tandem serve` processes on the tiny model. Sessions go to the replica with the fewest; a
replica at max_sessions answers 503 and HAProxy retries the upgrade on the other; a killed
replica is taken out by the /healthz check; a replica killed mid-answer leaves the device to
finish it, and the next question reaches the live one; the throttle counts wrong tokens per
client address as HAProxy forwards it, not per balancer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from benchmarks.balancer import SHIPPED, Balancer, check, free_port, haproxy, render
from collab.protocol import Mode
from edge_runtime.client import CloudBusy, CloudClient
from edge_runtime.device import DeviceModel
from edge_runtime.events import Failure, Stats, TextDelta
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext
from tests.test_serve_stop import METRICS_TOKEN, TOKEN, Served

pytestmark = pytest.mark.balancer

NAMES = ("cloud1", "cloud2")
MAX_SESSIONS = {"cloud1": 3, "cloud2": 4}  # small: the 503 test fills them
AUTH_FAILURES = 3  # wrong tokens from one client, then 429
CHECK_S = 5  # the shipped `inter 5s fall 2`: a dead replica is out within 2 checks


class Replicas:
    """Two `tandem serve` processes on fixed loopback ports (a killed one restarts on its
    port, so the balancer's config stays true)."""

    def __init__(self, tiny: dict[str, Path], folder: Path) -> None:
        self.tiny, self.folder = tiny, folder
        self.ports = {name: free_port() for name in NAMES}
        self.served: dict[str, Served] = {}
        self.revive()

    def _start(self, name: str) -> Served:
        config = self.folder / f"{name}.toml"
        config.write_text(
            f'[cloud]\ntoken = "{TOKEN}"\nmetrics_token = "{METRICS_TOKEN}"\n'
            f"port = {self.ports[name]}\ncorpus_enabled = false\n"
            f"max_sessions = {MAX_SESSIONS[name]}\nauth_failures = {AUTH_FAILURES}\n"
            'trusted_proxies = ["127.0.0.1"]\n'
        )
        return Served(
            [
                sys.executable,
                "-m",
                "app.cli",
                "serve",
                "--config",
                str(config),
                "--engine",
                "ort",
                "--model-dir",
                str(self.tiny["onnx-fp32"]),
                "--threads",
                "1",
            ]
        )

    def revive(self) -> None:
        """Start whichever replica is not running (both at once: ~10 s of imports each)."""
        dead = [n for n in NAMES if n not in self.served or not self.alive(n)]
        with concurrent.futures.ThreadPoolExecutor(len(NAMES)) as pool:
            for name, served in zip(dead, pool.map(self._start, dead), strict=True):
                self.served[name] = served

    def alive(self, name: str) -> bool:
        return self.served[name].process.poll() is None

    @property
    def servers(self) -> list[tuple[str, int]]:
        return [(name, self.ports[name]) for name in NAMES]

    def url(self, name: str) -> str:
        return f"ws://127.0.0.1:{self.ports[name]}/v1/session"

    def kill(self, name: str) -> None:
        """SIGKILL: a crash, no goodbye to anyone."""
        self.served[name].process.send_signal(signal.SIGKILL)
        self.served[name].process.wait(10)

    async def sessions(self) -> dict[str, int]:
        """Each live replica's open sessions, from its own /healthz (with the metrics token:
        to anyone else it says only its status)."""
        out = {}
        headers = {"Authorization": f"Bearer {METRICS_TOKEN}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            for name in NAMES:
                if not self.alive(name):
                    continue
                url = f"http://127.0.0.1:{self.ports[name]}/healthz"
                async with http.get(url) as resp:
                    out[name] = (await resp.json())["sessions"]
        return out

    async def settled(self, want: dict[str, int], timeout: float = 5.0) -> dict[str, int]:
        """The session counts once they are `want` (a closed session leaves in a moment)."""
        deadline = time.monotonic() + timeout
        while (now := await self.sessions()) != want and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return now

    def close(self) -> None:
        for served in self.served.values():
            if served.process.poll() is None:
                served.process.terminate()
                served.process.wait(30)


@pytest.fixture(scope="module")
def replicas(tiny, tmp_path_factory) -> Iterator[Replicas]:
    if haproxy() is None:
        pytest.fail("HAProxy is not installed: the test command installs Debian's haproxy")
    pair = Replicas(tiny, tmp_path_factory.mktemp("replicas"))
    yield pair
    pair.close()


@pytest.fixture
def balancer(replicas, tmp_path) -> Iterator[Balancer]:
    """A fresh HAProxy (fresh counters) in front of both replicas, alive."""
    replicas.revive()
    lb = Balancer(tmp_path, replicas.servers)
    yield lb
    lb.close()


@pytest.fixture
async def clients() -> AsyncIterator[list[CloudClient]]:
    """The device sessions a test opens; all closed at its end."""
    opened: list[CloudClient] = []
    yield opened
    await asyncio.gather(*(c.close() for c in opened), return_exceptions=True)


async def open_session(url: str, device: DeviceModel, into: list[CloudClient]) -> CloudClient:
    """A cloud-mode session as the device opens it (token, Hello, HelloAck)."""
    client = CloudClient(url, TOKEN, Mode.CLOUD, "", device.tokenizer_hash, "tiny")
    into.append(client)
    await client.connect()
    return client


async def landed(replicas: Replicas, before: dict[str, int]) -> str:
    """The replica whose session count rose by one since `before`."""
    for _ in range(100):
        now = await replicas.sessions()
        grew = [n for n in now if now[n] == before.get(n, 0) + 1]
        if grew:
            return grew[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no replica took the session: {before} -> {now}")


# ---------------------------------------------------------------------------- the config


def test_the_shipped_config_passes_haproxys_check_and_the_copy_keeps_its_lines(tmp_path):
    """The file as shipped (its certificate path pointed at a real one) parses in HAProxy, and
    the loopback copy the tests run differs from it only in the lines render adapts."""
    import trustme

    pem = tmp_path / "tandem.pem"
    pem.write_bytes(trustme.CA().issue_cert("localhost").private_key_and_cert_chain_pem.bytes())
    shipped = SHIPPED.read_text()
    assert "crt /etc/haproxy/tandem.pem" in shipped
    (tmp_path / "shipped.cfg").write_text(shipped.replace("/etc/haproxy/tandem.pem", str(pem)))
    done = check(tmp_path / "shipped.cfg")
    assert done.returncode == 0, done.stdout + done.stderr
    copy = render(8443, [("cloud1", 8001), ("cloud2", 8002)], tmp_path / "s.sock")
    (tmp_path / "copy.cfg").write_text(copy)
    done = check(tmp_path / "copy.cfg")
    assert done.returncode == 0, done.stdout + done.stderr
    kept = {line.split("#")[0].rstrip() for line in copy.splitlines()}
    adapted = ("bind ", "server-template ", "maxconn ", "resolvers ", "nameserver ", "hold ")
    for line in shipped.splitlines():
        body = line.split("#")[0].rstrip()
        if body and not body.strip().startswith(adapted):
            assert body in kept, f"the tested copy lost the shipped line {body!r}"
    for setting in (
        "balance leastconn",
        "retry-on 503",
        "option httpchk GET /healthz",
        "option forwardfor",
        "inter 5s fall 2 rise 2",
        "timeout http-request 10s",
    ):
        assert setting in copy


# ---------------------------------------------------------------------------- balancing


async def test_sessions_go_to_the_replica_with_the_fewest(balancer, replicas, device, clients):
    """Four sessions split 2/2; with one replica's two closed, the next two both go to it
    (round robin would split them again)."""
    where: list[tuple[CloudClient, str]] = []
    for _ in range(4):
        before = await replicas.sessions()
        client = await open_session(balancer.url, device, clients)
        where.append((client, await landed(replicas, before)))
    assert await replicas.sessions() == {"cloud1": 2, "cloud2": 2}
    emptied = where[0][1]
    for client, name in where:
        if name == emptied:
            await client.close()
    other = next(n for n in NAMES if n != emptied)
    assert await replicas.settled({emptied: 0, other: 2}) == {emptied: 0, other: 2}
    for _ in range(50):  # HAProxy sees the closes too
        if balancer.stats()[emptied].current == 0:
            break
        await asyncio.sleep(0.05)
    for _ in range(2):
        before = await replicas.sessions()
        await open_session(balancer.url, device, clients)
        assert await landed(replicas, before) == emptied
    assert await replicas.sessions() == {emptied: 2, other: 2}


async def test_a_full_replica_answers_503_and_the_balancer_retries_the_other(
    balancer, replicas, device, clients
):
    """cloud1 is filled directly (the balancer does not see those sessions, so it keeps
    choosing cloud1): each upgrade it sends there gets 503 and is redispatched to cloud2, and
    every device gets its session. With both full, the device gets the 503 and its
    Retry-After."""
    for _ in range(MAX_SESSIONS["cloud1"]):
        await open_session(replicas.url("cloud1"), device, clients)
    for _ in range(MAX_SESSIONS["cloud2"]):
        await open_session(balancer.url, device, clients)  # raises CloudBusy if not retried
    assert await replicas.sessions() == MAX_SESSIONS
    stats = balancer.stats()
    assert stats["cloud1"].retries >= MAX_SESSIONS["cloud2"] - 1, stats  # all but a first tie
    assert stats["cloud1"].redispatches == stats["cloud1"].retries
    assert stats["cloud2"].responses_1xx == MAX_SESSIONS["cloud2"]
    with pytest.raises(CloudBusy) as busy:
        await open_session(balancer.url, device, clients)
    assert busy.value.retry_after_s == 5, busy.value


# ---------------------------------------------------------------------------- throttle


async def status_of(
    url: str, token: str, source: str, headers: dict[str, str] | None = None
) -> int:
    """The HTTP status of a websocket upgrade sent from loopback address `source`."""
    connector = aiohttp.TCPConnector(local_addr=(source, 0))
    async with aiohttp.ClientSession(connector=connector) as http:
        try:
            ws = await http.ws_connect(
                url, headers={"Authorization": f"Bearer {token}", **(headers or {})}
            )
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status
        await ws.close()
        return 101


async def test_the_throttle_counts_wrong_tokens_per_client_behind_the_balancer(balancer, replicas):
    """Every connection reaches a replica from the balancer's 127.0.0.1; the replica trusts
    its X-Forwarded-For (trusted_proxies) and counts 127.0.0.2's failures apart from
    127.0.0.3's. Each replica counts in its own memory, so cloud2 is put in maintenance here:
    with both in the pool a client gets up to AUTH_FAILURES wrong tries on each."""
    balancer.command("disable server clouds/cloud2")
    url, wrong = balancer.url, "not-the-token-0123456789"
    for _ in range(AUTH_FAILURES):
        assert await status_of(url, wrong, "127.0.0.2") == 401
    assert await status_of(url, wrong, "127.0.0.2") == 429
    assert await status_of(url, wrong, "127.0.0.3") == 401  # another client: not locked out
    # a forged header is dropped by the balancer: 127.0.0.3 cannot spend 127.0.0.2's count
    spoof = {"X-Forwarded-For": "127.0.0.2"}
    assert await status_of(url, wrong, "127.0.0.3", spoof) == 401
    assert await status_of(url, TOKEN, "127.0.0.2") == 101  # the right token is let in
    assert balancer.stats()["cloud2"].total == 0


# ---------------------------------------------------------------------------- replicas die


async def test_a_dead_replica_is_taken_out_by_the_health_check(balancer, replicas, device, clients):
    """cloud1 is killed; HAProxy's /healthz check (shipped: every 5 s, down after 2 fails)
    marks it DOWN, and from then on sessions go to cloud2 without even a try at cloud1."""
    replicas.kill("cloud1")
    took = balancer.wait_status("cloud1", "DOWN", timeout=2 * CHECK_S + 5)
    before = balancer.stats()["cloud1"]
    for _ in range(3):
        await open_session(balancer.url, device, clients)
    assert await replicas.sessions() == {"cloud2": 3}
    after = balancer.stats()["cloud1"]
    assert (after.total, after.retries) == (before.total, before.retries), (before, after)
    print(f"cloud1 marked DOWN {took:.1f} s after it was killed")


async def test_a_replica_killed_mid_answer_the_device_finishes_and_asks_the_live_one(
    balancer, replicas, device
):
    """The real device client in cloud mode through the balancer; at the answer's first text
    the replica serving it is killed. The device says so, finishes the answer itself, and its
    next question opens a session on the live replica (before the health check has noticed:
    the connection to the dead one is refused and HAProxy redispatches it)."""
    ctx = ModeContext(device=device, cloud=CloudSettings(balancer.url, TOKEN))
    mode = build_mode("cloud", ctx)
    options = AnswerOptions(max_new_tokens=400, temperature=0.0, k=0)
    events: list[object] = []
    killed = ""
    try:
        async with asyncio.timeout(60):
            async for event in mode.answer("Tell me a very long story.", [], options):
                events.append(event)
                if isinstance(event, TextDelta) and not killed:
                    killed = next(n for n, k in (await replicas.sessions()).items() if k == 1)
                    replicas.kill(killed)
        failures = [e for e in events if isinstance(e, Failure)]
        assert len(failures) == 1 and failures[0].recoverable, failures
        stats = events[-1]
        assert isinstance(stats, Stats) and stats.finish in ("stop", "length"), events[-3:]
        live = next(n for n in NAMES if n != killed)
        again: list[object] = []
        async with asyncio.timeout(60):
            again = [e async for e in mode.answer("And then?", [], options)]
        assert not [e for e in again if isinstance(e, Failure)], again[-3:]
        assert isinstance(again[-1], Stats) and again[-1].bytes_down > 0  # the cloud answered
        assert await replicas.sessions() == {live: 1}  # the device's kept session
    finally:
        await mode.close()
