"""The cloud's websocket held to its bounds (issue 16): a dead peer is found by the heartbeat,
a socket that never says Hello is closed however much it sends, a request flooded with frames
is cancelled alone, a device that reads nothing is cut off, and a batch or a DRAGON side
cannot announce more drafts than the protocol allows."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest

from cloud_backend import session as session_module
from cloud_backend.config import ServerConfig
from cloud_backend.metrics import ServerMetrics
from cloud_backend.session import AppState, Session
from collab.protocol import (
    AggregatorPolicy,
    Done,
    DragonDraft,
    DragonSetup,
    Error,
    ErrorCode,
    FinishReason,
    Generate,
    Limits,
    Mode,
    Ping,
    Side,
    TokenChunk,
    TopKDraft,
    Verdict,
    decode,
    encode,
)
from edge_runtime.client import CloudClient
from tests import test_server
from tests.test_server import TOKEN, hello, raw, wait_for

engine, start_cloud = test_server.engine, test_server.start_cloud  # the tiny cloud's fixtures


async def _sessions(cloud, n: int) -> bool:
    return (await cloud.health())["sessions"] == n


async def test_heartbeat_finds_a_dead_device_and_frees_its_session(start_cloud):
    """A device that stops answering websocket pings (gone without a FIN) is dropped within
    1.5 heartbeats of its last frame, and its engine session with it; a device whose client
    reads the socket (and so answers pings) stays, idle or not."""
    beat = 0.2
    cloud = await start_cloud(heartbeat_s=beat)
    alive = CloudClient(cloud.url, TOKEN, Mode.CLOUD, "", cloud.engine.tokenizer_hash, "alive")
    async with alive, aiohttp.ClientSession() as http:
        dead = await http.ws_connect(cloud.url, headers=cloud.headers(), autoping=False)
        await dead.send_bytes(encode(hello(cloud.engine)))
        assert (await dead.receive(timeout=5)).type == aiohttp.WSMsgType.BINARY  # HelloAck
        last = time.monotonic()
        await wait_for(lambda: _sessions(cloud, 1), timeout=5)
        found = time.monotonic() - last
        assert found < 1.5 * beat + 0.5, found
        assert cloud.engine.cache_bytes == 0  # its engine session is closed
        await asyncio.sleep(4 * beat)
        await alive.ping()  # the live one was never taken for dead
        await dead.close()


async def test_a_socket_that_never_says_hello_is_closed_however_much_it_sends(start_cloud):
    cloud = await start_cloud(hello_timeout_s=0.5)
    async with raw(cloud, greet=False) as s:
        t0 = time.monotonic()
        closed = None
        while closed is None and time.monotonic() - t0 < 5:
            await s.send(Ping(1))  # not a Hello: an Error each, and no more time
            wsmsg = await s.ws.receive(timeout=5)
            if wsmsg.type != aiohttp.WSMsgType.BINARY:
                closed = wsmsg
            else:
                err = decode(wsmsg.data)
                if isinstance(err, Error) and err.code == ErrorCode.LIMIT:
                    assert "no Hello within 0.5 s" in err.message
                    closed = await s.ws.receive(timeout=5)
            await asyncio.sleep(0.05)
        assert closed is not None and closed.type == aiohttp.WSMsgType.CLOSE
        assert closed.data == aiohttp.WSCloseCode.POLICY_VIOLATION
        assert time.monotonic() - t0 < 2.0


async def test_a_flooded_request_is_cancelled_alone_and_the_session_goes_on(
    start_cloud, monkeypatch
):
    """Frames for a request that does not read them (cloud mode reads only Cancel) are bounded:
    past the bound the request is cancelled with a LIMIT error and its Done; the session then
    answers the next request as usual."""
    monkeypatch.setattr(session_module, "INBOX_FRAMES", 8)
    cloud = await start_cloud()
    async with raw(cloud) as s:
        await s.send(Generate("Tell me everything.", max_new_tokens=400, request_id=1))
        for _ in range(20):
            await s.send(TokenChunk(np.asarray([7]), request_id=1))
        frames = await s.recv_until(Done)
        errors = [f for f in frames if isinstance(f, Error)]
        assert len(errors) == 1 and errors[0].code == ErrorCode.LIMIT
        assert "request 1 was sent more frames than it had read" in errors[0].message
        assert frames[-1].reason == FinishReason.CANCELLED
        await s.ping_pong()
        await s.send(Generate("Hi", max_new_tokens=3, request_id=2))
        done = (await s.recv_until(Done))[-1]
        assert done.request_id == 2 and done.reason in (FinishReason.STOP, FinishReason.LENGTH)


async def test_a_device_that_reads_nothing_is_cut_off(engine):
    """A send that cannot hand its frame to the socket within send_timeout_s drops the
    connection (a close frame could not get through either) instead of holding the session's
    send lock for ever. The websocket here is a stand-in for aiohttp's whose buffer is full."""

    class FullSocket:
        closed = False

        async def send_bytes(self, data: bytes) -> None:
            await asyncio.Event().wait()  # the peer's window never opens

    aborted = []
    config = ServerConfig(token=TOKEN, send_timeout_s=0.2)
    state = AppState(config, engine, None, {"default": TOKEN}, ServerMetrics())
    session = Session(state, FullSocket(), "peer", abort=lambda: aborted.append(True))  # type: ignore[arg-type]
    t0 = time.monotonic()
    with pytest.raises(ConnectionResetError, match="stopped reading"):
        await asyncio.wait_for(session.send(Ping(1)), 5)
    assert aborted == [True] and time.monotonic() - t0 < 1.0
    assert not session._send_lock.locked()


def _topk(tokens: list[int], more: int, step: int) -> TopKDraft:
    ids = [[t] for t in tokens]
    return TopKDraft(tokens, ids, [[1.0]] * len(tokens), more=more, request_id=1, step=step)


async def test_a_split_batch_cannot_grow_past_max_draft_tokens(start_cloud):
    """Each part of a streamed batch announces the drafts still to come; a part larger than
    what the batch has left is refused, so a batch never exceeds max_draft_tokens."""
    cloud = await start_cloud(limits=Limits(max_draft_tokens=6))
    async with raw(cloud, greet=hello(cloud.engine, Mode.SPLIT, "tk-slt")) as s:
        assert (await s.recv()).accepted
        await s.send(Generate("Hello there", max_new_tokens=30, request_id=1))
        first = await s.recv()
        assert isinstance(first, TokenChunk)
        await s.send(_topk([11, 12], more=5, step=1))  # 2 + 5 > 6
        err = await s.recv()
        assert isinstance(err, Error) and "at most 6 drafts were left" in err.message
        await s.send(_topk([11, 12], more=3, step=1))  # a batch of 5 announced
        await s.send(_topk([13, 14], more=2, step=3))  # 2 + 2 > the 3 left
        err = await s.recv()
        assert isinstance(err, Error) and "at most 3 drafts were left" in err.message
        await s.send(_topk([13, 14, 15], more=0, step=3))  # the batch's honest end
        verdict = await s.recv()
        assert isinstance(verdict, Verdict) and verdict.step == 1


async def test_a_dragon_side_cannot_draft_past_its_lookahead(start_cloud):
    """The device aggregates, so the cloud applies no target until the device sends one: the
    device's drafts pile up in the cloud's ledger only to the lookahead; the next is refused."""
    cloud = await start_cloud()
    async with raw(cloud, greet=hello(cloud.engine, Mode.DRAGON)) as s:
        assert (await s.recv()).accepted
        await s.send(Generate("Hi", max_new_tokens=20, retrieve=False, request_id=1))
        setup = DragonSetup(2, AggregatorPolicy.DEVICE, Side.DEVICE, lookahead=2, request_id=1)
        await s.send(setup)
        for step in range(3):
            await s.send(DragonDraft(1000, [1000], [1.0], 0.0, 0.01, request_id=1, step=step))
        frames = []
        while not any(isinstance(f, Error) for f in frames):
            frames.append(await s.recv())
        err = frames[-1]
        assert err.code == ErrorCode.MALFORMED and "past the lookahead of 2" in err.message
        cloud_drafts = [f for f in frames if isinstance(f, DragonDraft)]
        assert len(cloud_drafts) <= 2  # the cloud keeps to its own lookahead too
        await s.ping_pong()


async def test_a_cancel_that_meets_a_finishing_send_is_not_lost(engine):
    """Found by the session fuzzer: the send timeout used asyncio.wait_for, which in Python
    3.11 returns the result, dropping the cancel, when the send ends as the task is cancelled.
    A request cancelled at that moment (its session closing) then went on to wait for frames
    that never came, and its session never ended: a slot held for good."""
    outer: list[asyncio.Task] = []

    class SocketThatFinishesAsTheTaskIsCancelled:
        closed = False

        async def send_bytes(self, data: bytes) -> None:
            outer[0].cancel()  # the teardown's cancel, at the very moment the send is done

    config = ServerConfig(token=TOKEN)
    state = AppState(config, engine, None, {"default": TOKEN}, ServerMetrics())
    session = Session(state, SocketThatFinishesAsTheTaskIsCancelled(), "peer")  # type: ignore[arg-type]
    outer.append(asyncio.create_task(session.send(Ping(1))))
    await asyncio.wait(outer, timeout=5)
    assert outer[0].cancelled()
