"""The device against a cloud it cannot trust: a scripted websocket server (no model) that
answers the handshake and then sends what a script says, lies included. The device must turn
every lie into a plain CloudError, never crash or act on it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import numpy as np
import pytest
from aiohttp import WSMsgType, web

from collab.protocol import (
    DEFAULT_LIMITS,
    Draft,
    Generate,
    Hello,
    HelloAck,
    Limits,
    Message,
    Mode,
    TokenChunk,
    Verdict,
    decode,
    encode,
)
from edge_runtime.client import CloudClient, CloudProtocolError
from edge_runtime.events import Failure
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions
from edge_runtime.split_costs import SplitCosts
from tests import test_modes
from tests.test_modes import QUESTIONS, ask, context

near_drafter = test_modes.near_drafter  # the tiny device model of tests/test_modes.py


Reply = Callable[[Message], Sequence[Message]]  # the cloud's answer to each device frame


@pytest.fixture
async def hostile_cloud() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Start a scripted cloud: `start(ack, frames, reply)` sends `frames` after the handshake,
    then `reply(msg)` for every frame the device sends; returns its URL."""
    runners: list[web.AppRunner] = []

    async def start(ack: HelloAck, frames: Sequence[Message] = (), reply: Reply | None = None,
                    ) -> str:  # fmt: skip
        async def session(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(compress=False)
            await ws.prepare(request)
            first = await ws.receive()
            assert first.type == WSMsgType.BINARY and isinstance(decode(first.data), Hello)
            await ws.send_bytes(encode(ack))
            for frame in frames:
                await ws.send_bytes(encode(frame))
            async for wsmsg in ws:  # until the device leaves
                for frame in reply(decode(wsmsg.data)) if reply else ():
                    await ws.send_bytes(encode(frame))
            return ws

        app = web.Application()
        app.router.add_get("/v1/session", session)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"ws://{host}:{port}/v1/session"

    yield start
    for runner in runners:
        await runner.cleanup()


def client(url: str) -> CloudClient:
    return CloudClient(url, "token", Mode.CLOUD, "", b"\x01" * 32, "tiny-device")


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


def lying_verdicts(lie: Callable[..., Verdict]) -> Reply:
    """A split cloud that answers Generate with a first token and every draft with `lie`."""

    def reply(msg: Message) -> Sequence[Message]:
        header = {"request_id": msg.request_id}
        if isinstance(msg, Generate):
            return [TokenChunk(np.asarray([FIRST_TOKEN]), **header)]
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
