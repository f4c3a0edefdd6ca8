"""The device's websocket client against a real cloud server on loopback (tiny model)."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import pytest

from collab.protocol import (
    Done,
    Error,
    ErrorCode,
    Generate,
    Hello,
    HelloAck,
    Limits,
    Mode,
    Ping,
    TokenChunk,
    decode,
)
from edge_runtime.client import (
    AuthError,
    CloudClient,
    CloudError,
    CloudTimeout,
    CloudUnavailable,
    ConnectionLost,
    HandshakeRefused,
)
from tests import test_server
from tests.test_server import ENGINE_NAME, TOKEN, Cloud, wait_for

# The same real servers as tests/test_server.py (fixtures shared by reference).
engine = test_server.engine
start_cloud = test_server.start_cloud
cloud = test_server.cloud


def make_client(
    cloud: Cloud, token: str = TOKEN, mode: Mode = Mode.CLOUD, variant: str = "", **kw
) -> CloudClient:
    kw.setdefault("tokenizer_hash", cloud.engine.tokenizer_hash)
    kw.setdefault("model_name", "tiny-device")
    return CloudClient(cloud.url, token, mode, variant, **kw)


async def until_done(client: CloudClient, timeout: float = 30.0) -> list:
    frames = []
    while not frames or not isinstance(frames[-1], Done):
        frames.append(await client.recv(timeout=timeout))
    return frames


async def test_connect_learns_the_cloud_model_and_limits(cloud):
    async with make_client(cloud) as client:
        assert client.connected
        assert client.cloud_model_name == ENGINE_NAME
        assert client.limits == cloud.config.limits
        sock = client._ws.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    assert not client.connected


@pytest.mark.parametrize("token", ["", "not-the-token"])
async def test_bad_token_raises_auth_error(cloud, token):
    client = make_client(cloud, token=token)
    with pytest.raises(AuthError) as info:
        await client.connect(retries=3)  # never retried: retrying cannot fix a token
    assert "access token" in str(info.value)
    assert isinstance(info.value, CloudError)


async def test_tokenizer_mismatch_raises_handshake_refused(cloud):
    client = make_client(cloud, tokenizer_hash=b"\x02" * 32, model_name="smollm2-135m")
    with pytest.raises(HandshakeRefused) as info:
        await client.connect()
    assert "smollm2-135m" in str(info.value) and ENGINE_NAME in str(info.value)
    assert "smollm2-135m" in info.value.reason
    assert not client.connected


async def test_local_mode_refused(cloud):
    with pytest.raises(HandshakeRefused, match="local"):
        await make_client(cloud, mode=Mode.LOCAL).connect()


async def test_unreachable_cloud_retries_with_backoff_then_gives_up(engine):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = CloudClient(
        f"ws://127.0.0.1:{port}/v1/session", TOKEN, Mode.CLOUD, "", engine.tokenizer_hash, "d"
    )
    start = time.perf_counter()
    with pytest.raises(CloudUnavailable) as info:
        await client.connect(retries=2, backoff_s=0.1)
    # two waits: [0.05, 0.1] + [0.1, 0.2]
    assert time.perf_counter() - start >= 0.15
    assert "connection refused" in str(info.value)


async def test_ping_measures_rtt_even_during_a_request(cloud):
    async with make_client(cloud) as client:
        rtt = await client.ping()
        assert 0 < rtt < 1.0 and client.rtt_s == rtt
        await client.send(Generate("A long story, please.", max_new_tokens=120, request_id=1))
        assert isinstance(await client.recv(timeout=30), TokenChunk)
        during = await client.ping()
        assert 0 < during < 5.0
        assert client.rtt_s != rtt  # the EWMA moved
        frames = await until_done(client)
        assert not any(type(f).__name__ == "Pong" for f in frames)  # consumed by the client


async def test_byte_counters_agree_with_the_server_and_the_hook(cloud):
    sent: list[bytes] = []
    client = make_client(cloud)
    client.on_frame_sent = sent.append
    await client.connect()
    try:
        await client.ping()
        await client.send(Generate("hello there", max_new_tokens=8, request_id=1))
        done = (await until_done(client))[-1]
        await client.ping()  # everything the server sent before this Pong is counted
        metrics = await cloud.metrics()
        assert metrics[("tandem_bytes_total", (("direction", "up"),))] == client.bytes_up
        assert metrics[("tandem_bytes_total", (("direction", "down"),))] == client.bytes_down
        assert sum(map(len, sent)) == client.bytes_up and len(sent) == client.frames_up
        kinds = [type(decode(f)) for f in sent]
        assert kinds[0] is Hello and kinds.count(Ping) == 2 and Generate in kinds
        assert done.bytes_up == len(sent[kinds.index(Generate)])
        assert client.frames_down >= done.tokens + 3  # HelloAck, chunks, Done, Pongs
    finally:
        await client.close()


async def test_server_closing_surfaces_error_then_connection_lost(start_cloud):
    cloud = await start_cloud(idle_timeout_s=0.3)
    client = make_client(cloud)
    await client.connect()
    err = await client.recv(timeout=5)
    assert isinstance(err, Error) and err.code == ErrorCode.LIMIT
    with pytest.raises(ConnectionLost):
        await client.recv(timeout=5)
    with pytest.raises(ConnectionLost):  # and stays lost
        await client.recv(timeout=5)
    assert not client.connected
    with pytest.raises(ConnectionLost):
        await client.send(Generate("x", request_id=1))
    up = client.bytes_up
    await client.ensure_connected()  # a fresh session; totals carry on
    assert client.connected and client.bytes_up > up
    await client.ping()
    await client.close()


async def test_recv_timeout_and_use_after_close(cloud):
    client = make_client(cloud)
    with pytest.raises(ConnectionLost):
        await client.recv(timeout=0.1)
    await client.connect()
    with pytest.raises(CloudTimeout):
        await client.recv(timeout=0.05)
    with pytest.raises(TimeoutError):  # CloudTimeout is a TimeoutError too
        await client.recv(timeout=0.05)
    await client.close()
    await client.close()  # idempotent
    with pytest.raises(ConnectionLost):
        await client.recv(timeout=1)
    with pytest.raises(ConnectionLost):
        await client.ping()


async def test_busy_error_is_returned_not_raised(cloud):
    async with make_client(cloud) as client:
        await client.send(Generate("story", max_new_tokens=100, request_id=1))
        await client.send(Generate("other", request_id=2))
        frames = []
        while not any(isinstance(f, Error) for f in frames):
            frames.append(await client.recv(timeout=30))
        err = next(f for f in frames if isinstance(f, Error))
        assert err.code == ErrorCode.BUSY and err.request_id == 2
        await until_done(client)


async def test_sessions_close_when_clients_close(cloud):
    clients = [make_client(cloud) for _ in range(3)]
    acks = await asyncio.gather(*(c.connect() for c in clients))
    assert all(isinstance(a, HelloAck) and a.accepted for a in acks)
    assert (await cloud.health())["sessions"] == 3
    await asyncio.gather(*(c.close() for c in clients))

    async def none_left() -> bool:
        return (await cloud.health())["sessions"] == 0

    await wait_for(none_left)


async def test_oversized_frame_ends_the_session_with_a_plain_reason(start_cloud):
    cloud = await start_cloud(limits=Limits(max_frame_bytes=4096))
    async with make_client(cloud) as client:
        assert client.limits.max_frame_bytes == 4096
        await client.send(TokenChunk(np.arange(3000), request_id=1))  # over the transport cap
        with pytest.raises(ConnectionLost, match="larger than the connection allows"):
            await client.recv(timeout=5)
