"""A real cloud on its own thread and a bare websocket to it, for the tests and fuzzers that
drive a session frame by frame from synchronous code (Hypothesis rules, atheris inputs).

The server runs on its own thread and event loop, as in production; the client's loop runs
only while a call waits for what the cloud says back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp

from cloud_backend.config import ServerConfig
from cloud_backend.engine import LLMEngine
from cloud_backend.server import run_server
from collab import protocol as p

T = TypeVar("T")
TOKEN = "test-token-0123456789"
FROM_CLOUD = (
    p.HelloAck,
    p.TokenChunk,
    p.Verdict,
    p.DragonDraft,
    p.DragonTarget,
    p.DragonSequence,
    p.Ping,
    p.Pong,
    p.Error,
    p.Done,
    p.Citations,
)


class _Collect(logging.Handler):
    """Keeps the ERROR records (a session or request that failed inside the cloud)."""

    def __init__(self, into: list[logging.LogRecord]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


class ServerThread:
    """`tandem serve` on loopback on a thread of its own, with the ERROR records it logs."""

    def __init__(self, eng: LLMEngine, limits: p.Limits, **config: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.tokenizer_hash: bytes = eng.tokenizer_hash
        self.limits = limits
        self.errors: list[logging.LogRecord] = []
        ready: list[str] = []
        started = threading.Event()
        settings = ServerConfig(
            port=0,
            token=TOKEN,
            limits=limits,
            idle_timeout_s=120,
            hello_timeout_s=120,
            heartbeat_s=120,  # the client's loop is still between calls: no pongs then
            **config,
        )

        def on_ready(url: str) -> None:
            ready.append(url)
            started.set()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.task = self.loop.create_task(run_server(settings, eng, ready=on_ready))
            with contextlib.suppress(asyncio.CancelledError):
                self.loop.run_until_complete(self.task)

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        assert started.wait(30), "the server did not start"
        self.url = ready[0]
        self.handler = _Collect(self.errors)
        logging.getLogger("tandem.cloud").addHandler(self.handler)

    def stop(self) -> None:
        logging.getLogger("tandem.cloud").removeHandler(self.handler)
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(30)


class Link:
    """One websocket of the test's client, read only when a step listens."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, server: ServerThread, drain_s: float = 0.01
    ) -> None:
        self.loop, self.url, self.tokenizer_hash = loop, server.url, server.tokenizer_hash
        self.max_frame_bytes = server.limits.max_frame_bytes
        self.drain_s = drain_s  # how long a send listens for what the cloud says back
        self.http: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.closed_with: int | None = None

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def open(self, mode: str, variant: str) -> p.HelloAck:
        async def go() -> p.HelloAck:
            self.http = aiohttp.ClientSession()
            self.ws = await self.http.ws_connect(
                self.url, headers={"Authorization": f"Bearer {TOKEN}"}, max_msg_size=0
            )
            hello = p.Hello(self.tokenizer_hash, p.Mode[mode.upper()], variant)
            await self.ws.send_bytes(p.encode(hello))
            frames = await self.listen(10.0, until=p.HelloAck)
            ack = frames[-1]
            assert isinstance(ack, p.HelloAck)
            return ack

        return self.run(go())

    def send(self, frame: bytes, text: bool = False) -> list[p.Message]:
        """Send one frame; what comes back within drain_s (a frame past max_frame_bytes: up
        to the cloud's closing, which it must do)."""
        too_big = len(frame) > self.max_frame_bytes

        async def go() -> list[p.Message]:
            assert self.ws is not None
            if self.ws.closed:
                return []
            with contextlib.suppress(ConnectionError):
                await (
                    self.ws.send_str(frame.decode("latin-1")) if text else self.ws.send_bytes(frame)
                )
            out = await self.listen(self.drain_s)
            while too_big and self.closed_with is None:
                got = await self.listen(10.0)
                assert got or self.closed_with is not None, "an oversized frame left it open"
                out += got
            return out

        return self.run(go())

    async def listen(self, wait: float, until: type | None = None) -> list[p.Message]:
        """Frames that arrive within `wait` s of each other (or up to one of type `until`)."""
        assert self.ws is not None
        out: list[p.Message] = []
        while self.closed_with is None:
            try:
                wsmsg = await self.ws.receive(timeout=wait)
            except TimeoutError:
                break
            if wsmsg.type != aiohttp.WSMsgType.BINARY:
                assert wsmsg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), wsmsg
                self.closed_with = self.ws.close_code
                break
            msg = p.decode(wsmsg.data)  # raises if the cloud sent something unreadable
            assert isinstance(msg, FROM_CLOUD), msg
            out.append(msg)
            if until is not None and isinstance(msg, until):
                break
        return out

    def ping(self, sent_ns: int) -> list[p.Message]:
        """Everything up to the Pong of this Ping (the session answers it within 10 s)."""

        async def go() -> list[p.Message]:
            assert self.ws is not None
            await self.ws.send_bytes(p.encode(p.Ping(sent_ns)))
            out: list[p.Message] = []
            while not any(isinstance(m, p.Pong) and m.ping_sent_ns == sent_ns for m in out):
                got = await self.listen(10.0, until=p.Pong)
                assert got, f"no Pong within 10 s (closed with {self.closed_with})"
                out += got
            return out

        return self.run(go())

    def close(self) -> None:
        async def go() -> None:
            if self.ws is not None:
                await self.ws.close()
            if self.http is not None:
                await self.http.close()

        self.run(go())
