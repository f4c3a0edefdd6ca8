"""The device against a cloud it cannot trust: a scripted websocket server (no model) that
answers the handshake and then sends what a script says, lies included. The device must turn
every lie into a plain CloudError, never crash or act on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import numpy as np
import pytest
from aiohttp import WSMsgType, web

from collab.protocol import (
    DEFAULT_LIMITS,
    Hello,
    HelloAck,
    Limits,
    Mode,
    TokenChunk,
    decode,
    encode,
)
from edge_runtime.client import CloudClient, CloudProtocolError


@pytest.fixture
async def hostile_cloud() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Start a scripted cloud: `start(ack, frames)` returns its URL."""
    runners: list[web.AppRunner] = []

    async def start(ack: HelloAck, frames: Sequence[bytes]) -> str:
        async def session(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(compress=False)
            await ws.prepare(request)
            first = await ws.receive()
            assert first.type == WSMsgType.BINARY and isinstance(decode(first.data), Hello)
            await ws.send_bytes(encode(ack))
            for frame in frames:
                await ws.send_bytes(frame)
            async for _ in ws:  # hold the session open until the device leaves
                pass
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
        encode(TokenChunk(np.asarray([DEFAULT_LIMITS.vocab_size + 5]), request_id=1)),
        encode(TokenChunk(too_many, request_id=1)),
    ]
    url = await hostile_cloud(HelloAck(True, wide, "", "hostile"), frames)
    async with client(url) as device:
        assert device.limits == wide  # what the cloud said it accepts, kept as said
        for _ in frames:
            with pytest.raises(CloudProtocolError, match="cannot read"):
                await device.recv(timeout=5)
