"""The device against a cloud it cannot trust: a scripted websocket server (no model) that
answers the handshake and then sends what a script says, lies included. The device must turn
every lie into a plain CloudError, never crash or act on it, and never send the liar anything
it would not send an honest cloud."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from aiohttp import WSMsgType, web

from collab.dragon.ledger import DRAGON_LOOKAHEAD
from collab.protocol import (
    DEFAULT_LIMITS,
    Cancel,
    Draft,
    DragonDraft,
    DragonSetup,
    Generate,
    Hello,
    HelloAck,
    Limits,
    Message,
    Mode,
    Ping,
    Pong,
    TokenChunk,
    Verdict,
    decode,
    encode,
)
from edge_runtime import client as client_module
from edge_runtime.client import CloudClient, CloudProtocolError, ConnectionLost
from edge_runtime.events import Failure
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions
from edge_runtime.split_costs import SplitCosts
from tests.test_modes import QUESTIONS, ask, context

Reply = Callable[[Message], Sequence[Message]]  # the cloud's answer to each device frame


@pytest.fixture
async def hostile_cloud() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Start a scripted cloud: `start(ack, frames, reply)` sends `frames` after the handshake,
    then `reply(msg)` for every frame the device sends (or, `deaf`, reads nothing more);
    returns its URL."""
    runners: list[web.AppRunner] = []

    async def start(
        ack: HelloAck,
        frames: Sequence[Message] = (),
        reply: Reply | None = None,
        deaf: bool = False,
    ) -> str:
        async def session(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(compress=False)
            await ws.prepare(request)
            first = await ws.receive()
            assert first.type == WSMsgType.BINARY and isinstance(decode(first.data), Hello)
            await ws.send_bytes(encode(ack))
            for frame in frames:
                await ws.send_bytes(encode(frame))
            if deaf:  # reads nothing more, so answers no websocket ping: a vanished peer
                await asyncio.Event().wait()
            async for wsmsg in ws:  # until the device leaves
                for frame in reply(decode(wsmsg.data)) if reply else ():
                    await ws.send_bytes(encode(frame))
            return ws

        app = web.Application()
        app.router.add_get("/v1/session", session)
        runner = web.AppRunner(app, shutdown_timeout=1.0)  # a deaf handler never returns
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"ws://{host}:{port}/v1/session"

    yield start
    for runner in runners:
        await runner.cleanup()


def client(url: str, **kw: Any) -> CloudClient:
    return CloudClient(url, "token", Mode.CLOUD, "", b"\x01" * 32, "tiny-device", **kw)


async def test_frames_are_read_within_the_devices_limits_not_the_ones_the_cloud_announced(
    hostile_cloud,
):
    """The cloud announces limits as wide as the format allows, then sends a token id past the
    vocabulary and a chunk longer than the device reads: both are refused as unreadable."""
    wide = Limits(*(2**32 - 1 for _ in range(7)))
    too_many = np.zeros(DEFAULT_LIMITS.max_chunk_tokens + 1, dtype=np.uint32)
    frames = [
        TokenChunk(np.asarray([DEFAULT_LIMITS.vocab_size + 5]), request_id=1),
        TokenChunk(too_many, request_id=1),
    ]
    url = await hostile_cloud(HelloAck(True, wide, "", "hostile"), frames)
    async with client(url) as device:
        assert device.limits == wide  # what the cloud said it accepts, kept as said
        for _ in frames:
            with pytest.raises(CloudProtocolError, match="cannot read"):
                await device.recv(timeout=5)


ACK = HelloAck(True, DEFAULT_LIMITS, "", "hostile")
FIRST_TOKEN = 785  # any id: the cloud's first token of the answer


def lying_verdicts(lie: Callable[..., Verdict], first: int = FIRST_TOKEN) -> Reply:
    """A split cloud that answers Generate with a first token and every draft with `lie`."""

    def reply(msg: Message) -> Sequence[Message]:
        header = {"request_id": msg.request_id}
        if isinstance(msg, Generate):
            return [TokenChunk(np.asarray([first]), **header)]
        if isinstance(msg, Draft):
            return [lie(msg, epoch=msg.epoch, step=msg.step, **header)]
        return []

    return reply


LIES = {
    # more drafts accepted than were sent
    "judged drafts never sent": lambda d, **h: Verdict(d.token_ids.size + 3, FIRST_TOKEN, **h),
    # a rejection left to the device with no distribution it could sample (tk-slt's cloud
    # resamples itself; dssd's P_j all zeros)
    "a correction with nothing to sample": lambda d, **h: Verdict(
        0, p_probs=np.zeros(DEFAULT_LIMITS.vocab_size, dtype=np.float32), f32=True, **h
    ),
}


@pytest.mark.parametrize("lie", LIES)
@pytest.mark.parametrize("variant", ["tk-slt", "dssd"])
@pytest.mark.parametrize("pipeline", [False, True])
async def test_a_lying_verdict_is_a_plain_failure_and_the_device_finishes(
    hostile_cloud, near_drafter, lie, variant, pipeline
):
    url = await hostile_cloud(ACK, reply=lying_verdicts(LIES[lie]))
    split = build_mode("split", context(near_drafter, url, variant))
    split.costs = SplitCosts(as2=False)
    options = AnswerOptions(max_new_tokens=12, temperature=0.0, pipeline=pipeline)
    _, stats, events = await asyncio.wait_for(ask(split, QUESTIONS[0], options), 60)
    failures = [e for e in events if isinstance(e, Failure)]
    assert len(failures) == 1 and failures[0].recoverable, failures
    assert "never sent" in failures[0].message or "cannot be used" in failures[0].message
    assert stats.tokens > 1  # the device finished the answer
    await split.close()


async def frames_sent(
    mode: Any, question: str, options: AnswerOptions
) -> tuple[list[Message], Any, list[Any]]:
    """One answer, and every frame the device sent the cloud for it (pings aside)."""
    client = await mode.client()
    sent: list[Message] = []
    client.on_frame_sent = lambda frame: sent.append(decode(frame))
    _, stats, events = await asyncio.wait_for(ask(mode, question, options), 60)
    return [m for m in sent if not isinstance(m, Ping | Pong)], stats, events


def _same_frame(a: Message, b: Message) -> bool:
    """The same bytes but for the request id."""
    return encode(replace(a, request_id=0)) == encode(replace(b, request_id=0))


@pytest.mark.parametrize("lie", LIES)
@pytest.mark.parametrize("variant", ["tk-slt", "dssd"])
async def test_a_lying_cloud_is_sent_nothing_an_honest_one_would_not_be(
    hostile_cloud, cloud_url, near_drafter, lie, variant
):
    """Frame by frame: the liar starts the answer as the honest cloud did (the same first
    token), so the device owes it the same frames until the lie: the same Generate and the
    same first draft, byte for byte, and at most the rest of that draft's batch; then nothing
    but a Cancel, all for this request."""
    options = AnswerOptions(max_new_tokens=12, temperature=0.0)
    honest = build_mode("split", context(near_drafter, cloud_url, variant))
    honest.costs = SplitCosts(as2=False)
    fair, fair_stats, _ = await frames_sent(honest, QUESTIONS[0], options)
    await honest.close()
    url = await hostile_cloud(ACK, reply=lying_verdicts(LIES[lie], fair_stats.token_ids[0]))
    split = build_mode("split", context(near_drafter, url, variant))
    split.costs = SplitCosts(as2=False)
    told, stats, _ = await frames_sent(split, QUESTIONS[0], options)
    await split.close()
    assert isinstance(told[0], Generate) and _same_frame(told[0], fair[0])
    first = told[1]
    assert isinstance(first, Draft) and _same_frame(first, fair[1])
    # Drafting goes on while the first part is judged (the batch streams, PicoSpec): the
    # rest of that batch may follow before the device reads the lie, and nothing else.
    parts = list(itertools.takewhile(lambda m: isinstance(m, Draft), told[2:]))
    assert all(isinstance(m, Cancel) for m in told[2 + len(parts) :]), told
    for k, part in enumerate(parts, 1):
        assert part.epoch == 0 and part.more == first.more - k, told
        honest = fair[1 + k]
        if isinstance(honest, Draft) and (honest.epoch, honest.more) == (0, part.more):
            assert _same_frame(part, honest)
    assert {m.request_id for m in told} == {told[0].request_id}
    assert stats.tokens > 1  # and the device answered on its own


# ---------------------------------------------------------------------------- the link itself


async def test_a_cloud_that_stops_answering_is_found_by_the_heartbeat(hostile_cloud):
    """The cloud vanishes without a FIN (it answers no websocket ping): the device's recv()
    ends with ConnectionLost, in plain words, within 1.5 heartbeats."""
    beat = 0.2
    url = await hostile_cloud(ACK, deaf=True)
    async with client(url, heartbeat_s=beat) as device:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ConnectionLost, match=r"stopped answering .*heartbeat"):
            await device.recv(timeout=10)
        assert asyncio.get_running_loop().time() - t0 < 1.5 * beat + 0.5


async def test_a_cloud_that_floods_the_device_is_held_back_not_buffered(hostile_cloud, monkeypatch):
    """Frames the device has not taken yet are bounded in bytes: past the bound the reader
    stops reading the socket (TCP holds the cloud back) until recv() takes some. Nothing is
    lost and the order is kept."""
    monkeypatch.setattr(client_module, "INBOX_BYTES", 64 * 1024)
    n, size = 400, 1000  # 400 frames of ~4 KB: 1.6 MB, 25 times the bound
    frames = [TokenChunk(np.full(size, i, dtype=np.uint32), request_id=1) for i in range(n)]
    url = await hostile_cloud(ACK, frames)
    async with client(url) as device:
        await asyncio.sleep(0.5)  # the cloud has sent all it could
        assert device._inbox_bytes <= 64 * 1024 + 4 * size + 64
        for i in range(n):
            msg = await device.recv(timeout=10)
            assert isinstance(msg, TokenChunk) and int(msg.token_ids[0]) == i
            assert device._inbox_bytes <= 64 * 1024 + 4 * size + 64


async def test_a_silent_cloud_mid_answer_is_given_up_on_and_the_device_finishes(
    hostile_cloud, near_drafter
):
    """Alive (it answers pings) but silent after Generate: the answer fails after the stall
    bound, in plain words, and the device answers instead."""
    url = await hostile_cloud(ACK, reply=lambda msg: [])
    ctx = context(near_drafter, url)
    assert ctx.cloud is not None
    ctx.cloud.stall_timeout_s = 0.5
    mode = build_mode("cloud", ctx)
    options = AnswerOptions(max_new_tokens=6, temperature=0.0)
    _, stats, events = await asyncio.wait_for(ask(mode, QUESTIONS[0], options), 30)
    failures = [e for e in events if isinstance(e, Failure)]
    assert len(failures) == 1 and failures[0].recoverable
    assert "no answer from the cloud within 0.5 s" in failures[0].message
    assert stats.tokens > 0  # the device answered
    await mode.close()


async def test_an_overloaded_cloud_is_reported_and_the_device_answers(near_drafter):
    """HTTP 503 with Retry-After at the upgrade: the device says the cloud is overloaded and
    when to try again, and answers on its own (no retries against a cloud that said when)."""
    calls = []

    async def overloaded(request: web.Request) -> web.Response:
        calls.append(1)
        return web.Response(status=503, text="overloaded\n", headers={"Retry-After": "7"})

    app = web.Application()
    app.router.add_get("/v1/session", overloaded)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        mode = build_mode("cloud", context(near_drafter, f"ws://{host}:{port}/v1/session"))
        options = AnswerOptions(max_new_tokens=6, temperature=0.0)
        _, stats, events = await asyncio.wait_for(ask(mode, QUESTIONS[0], options), 30)
        failures = [e for e in events if isinstance(e, Failure)]
        assert len(failures) == 1 and failures[0].recoverable
        assert "overloaded" in failures[0].message and "try again in 7 s" in failures[0].message
        assert stats.tokens > 0 and calls == [1]
        await mode.close()
    finally:
        await runner.cleanup()


def _dragon_drafts(n: int) -> Reply:
    """A DRAGON cloud that answers the setup with `n` drafts at once, whatever the lookahead."""

    def reply(msg: Message) -> Sequence[Message]:
        if not isinstance(msg, DragonSetup):
            return []
        return [
            DragonDraft(
                FIRST_TOKEN, [FIRST_TOKEN], [1.0], 0.0, 0.01, request_id=msg.request_id, step=step
            )
            for step in range(n)
        ]

    return reply


async def test_a_dragon_cloud_drafting_past_its_lookahead_is_a_plain_failure(
    hostile_cloud, near_drafter
):
    # the cloud aggregates (in name: it sends no target), so the device applies nothing and
    # every draft it sent stays unresolved; with the device aggregating, a rejection of the
    # cloud's first draft would make the rest stale instead, depending on timing
    url = await hostile_cloud(ACK, reply=_dragon_drafts(DRAGON_LOOKAHEAD + 2))
    mode = build_mode("dragon", context(near_drafter, url, aggregator="cloud"))
    options = AnswerOptions(max_new_tokens=8, temperature=0.0)
    _, stats, events = await asyncio.wait_for(ask(mode, QUESTIONS[0], options), 60)
    failures = [e for e in events if isinstance(e, Failure)]
    assert len(failures) == 1 and failures[0].recoverable, failures
    assert "broke the DRAGON protocol" in failures[0].message
    assert "past the lookahead" in failures[0].message
    assert stats.tokens > 0  # the device finished the answer
    await mode.close()
