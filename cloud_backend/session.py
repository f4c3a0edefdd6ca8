"""One websocket session of the cloud: handshake, reader loop, the running request, cleanup.

A session is a Hello/HelloAck handshake (protocol version, tokenizer, mode), then a reader loop
that never blocks on the model. Pings are answered at once, even while a request computes,
because requests run in their own task and the engine steps on its worker thread. A frame that
does not decode gets an Error frame and the session carries on with its state untouched
(docs/protocol.md#design); only the transport itself closing ends a session.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from cloud_backend.admission import IPNetwork, RequestRate
from cloud_backend.config import DEFAULT_TOKEN_NAME, ServerConfig
from cloud_backend.context import DraftPace, RequestContext, RequestInbox
from cloud_backend.engine_api import CloudEngine, CloudSequence
from cloud_backend.logfmt import kv
from cloud_backend.metrics import RequestMetrics, ServerMetrics
from cloud_backend.modes import REQUESTS, serve_request
from collab.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Done,
    Error,
    ErrorCode,
    FinishReason,
    Generate,
    Hello,
    HelloAck,
    Limits,
    Message,
    Mode,
    Ping,
    Pong,
    ProtocolError,
    decode,
    encode,
    peek_header,
    peek_version,
    request_frames,
)
from collab.variants import DEFAULT_VARIANT, variant_names

log = logging.getLogger("tandem.cloud")

RTT_ALPHA = 0.2  # EWMA weight of a new round-trip sample (the device's client uses the same)
# A request's frames waiting to be read: far above what any mode keeps in flight (a pipelined
# split batch streams at most 2 × max_draft_tokens drafts, DRAGON a lookahead of drafts), so
# only a device that floods its request reaches it, and the request is cancelled.
INBOX_FRAMES = 1024
INBOX_BYTES = 64 * 1024 * 1024
MAX_PINGS = 16  # our Pings awaiting a Pong: older ones are forgotten


def _error_label(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


def _peek_request_id(frame: bytes) -> int:
    """The header's request id of a frame that failed to decode, if the header is ours."""
    raw = peek_header(frame)
    return 0 if raw is None else raw.request_id


@dataclass
class AppState:
    """What every session of one app shares: settings, engine, corpus, metrics, sessions."""

    config: ServerConfig
    engine: CloudEngine
    corpus: Any | None
    tokens: dict[str, str]  # access tokens by name
    metrics: ServerMetrics
    request_rate: RequestRate = field(init=False)
    started: float = field(default_factory=time.monotonic)
    sessions: dict[int, Session] = field(default_factory=dict)  # handshake accepted
    websockets: set[web.WebSocketResponse] = field(default_factory=set)  # all, for shutdown
    held: Counter[str] = field(default_factory=Counter)  # websockets by access token name
    proxies: list[IPNetwork] = field(init=False)  # whose X-Forwarded-For names the client
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.request_rate = RequestRate(self.config.requests_per_minute)
        self.proxies = self.config.proxy_networks()


@dataclass
class _Request:
    """The one request a session may run at a time, with its own byte counts."""

    id: int
    mode: str
    inbox: RequestInbox = field(default_factory=lambda: RequestInbox(INBOX_FRAMES, INBOX_BYTES))
    bytes_up: int = 0
    bytes_down: int = 0
    metrics: RequestMetrics | None = None
    task: asyncio.Task[None] | None = None
    finished: bool = False
    overflowed: bool = False  # cancelled for flooding its inbox


class Session:
    """One websocket: handshake, reader loop, the running request, cleanup."""

    def __init__(
        self,
        state: AppState,
        ws: web.WebSocketResponse,
        peer: str | None,
        user: str = DEFAULT_TOKEN_NAME,
        abort: Callable[[], None] | None = None,
    ) -> None:
        self.state = state
        self.ws = ws
        self.peer = peer or "?"
        self.user = user  # the name of the access token it came with
        self._abort = abort
        self.id = next(state.ids)
        self.limits: Limits = state.config.limits
        self.idle_s = state.config.idle_timeout_s
        self.engine_session: CloudSequence | None = None
        self.mode: Mode | None = None
        self.variant = ""
        self.request: _Request | None = None
        self.last_request_id = 0
        self.bytes_in = self.bytes_out = 0
        self.frames_in = self.frames_out = 0
        self.requests = 0
        self.opened = time.monotonic()
        # the last frame of a request, either way: pings and errors keep no session open
        self.last_activity = self.opened
        self._send_lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self.rtt_s: float | None = None  # round trip to the device, from our Pings
        self.pace = DraftPace()  # split: the cloud's verify passes and the device's drafting gap
        self._pings: set[int] = set()

    # ---- sending ---------------------------------------------------------------------------
    async def send(self, msg: Message) -> None:
        """Encode, send one binary frame, count its bytes (per session, per request)."""
        frame = encode(msg)
        if self.ws.closed:
            raise ConnectionResetError("the device has disconnected")
        async with self._send_lock:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel
                async with asyncio.timeout(self.state.config.send_timeout_s):
                    await self.ws.send_bytes(frame)
            except TimeoutError:
                self._cut_off()
                raise ConnectionResetError("the device stopped reading") from None
        n = len(frame)
        self.bytes_out += n
        self.frames_out += 1
        self.state.metrics.bytes.labels(direction="down").inc(n)
        req = self.request
        if req is not None and msg.request_id == req.id:
            req.bytes_down += n
            if not isinstance(msg, Error):
                self.last_activity = time.monotonic()
        if isinstance(msg, Error):
            self.state.metrics.errors.labels(code=_error_label(msg.code)).inc()

    async def _try_send(self, msg: Message) -> bool:
        """Send from the reader loop: a peer gone mid-send ends the loop, not the server."""
        try:
            await self.send(msg)
            return True
        except (ConnectionError, RuntimeError):
            return False

    async def _error(self, code: ErrorCode, message: str, request_id: int = 0) -> bool:
        log.info(
            kv(
                "error_frame",
                session=self.id,
                request=request_id,
                code=code.name,
                message=message,
            )
        )
        return await self._try_send(Error(code, message, request_id=request_id))

    def _count_in(self, n: int, request_id: int | None = None) -> None:
        self.bytes_in += n
        self.frames_in += 1
        self.state.metrics.bytes.labels(direction="up").inc(n)
        req = self.request
        if req is not None and request_id == req.id and not req.finished:
            req.bytes_up += n

    def _cut_off(self) -> None:
        """A device that takes no frame for send_timeout_s: its send buffer is full and stays
        so. Drop the connection (a close frame could not get through either)."""
        wait = self.state.config.send_timeout_s
        log.info(kv("session_stalled", session=self.id, send_timeout_s=wait))
        if self._abort is not None:
            self._abort()

    # ---- lifecycle -------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            if await self._handshake():
                await self._read_frames()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(kv("session_failed", session=self.id))
        finally:
            await self._teardown()

    async def _receive(self, deadline: float | None = None) -> Any:
        """The next websocket message, or None once no request's frame went either way for
        `idle_s` seconds (a cloud answer streaming down is activity; a split request waiting
        for drafts that never come is not, nor are pings: a session kept open only by them
        would hold its slot for ever), or at `deadline` (monotonic) whatever came."""
        while True:
            left = self.last_activity + self.idle_s - time.monotonic()
            if deadline is not None:
                left = min(left, deadline - time.monotonic())
            if left <= 0:
                return None
            try:
                return await self.ws.receive(timeout=left)
            except TimeoutError:
                continue

    async def _handshake(self) -> bool:
        """Wait for a Hello; accept or refuse it. Malformed frames before it get an Error, but
        do not buy time: the Hello must come within hello_timeout_s of the upgrade."""
        wait = self.state.config.hello_timeout_s
        deadline = self.opened + wait
        while True:
            wsmsg = await self._receive(deadline)
            if wsmsg is None:
                await self._error(ErrorCode.LIMIT, f"no Hello within {wait:g} s; closing")
                await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"no hello")
                return False
            if wsmsg.type == WSMsgType.TEXT:
                self._count_in(len(wsmsg.data.encode("utf-8")))
                if not await self._text_frame():
                    return False
                continue
            if wsmsg.type != WSMsgType.BINARY:
                return False
            frame: bytes = wsmsg.data
            self._count_in(len(frame))
            version = peek_version(frame)
            if version is not None and version != PROTOCOL_VERSION:
                return await self._refuse(
                    "version",
                    f"the device speaks protocol version {version} and this cloud speaks "
                    f"version {PROTOCOL_VERSION}: update Tandem on the older side",
                )
            try:
                msg = decode(frame, self.limits)
            except ProtocolError as exc:
                if not await self._error(ErrorCode.MALFORMED, exc.reason, _peek_request_id(frame)):
                    return False
                continue
            if not isinstance(msg, Hello):
                sent = await self._error(
                    ErrorCode.MALFORMED,
                    f"the first frame must be Hello, not {type(msg).__name__}",
                    msg.request_id,
                )
                if not sent:
                    return False
                continue
            return await self._answer_hello(msg)

    async def _answer_hello(self, hello: Hello) -> bool:
        engine = self.state.engine
        if hello.protocol_version != PROTOCOL_VERSION:
            return await self._refuse(
                "version",
                f"the device speaks protocol version {hello.protocol_version} and this cloud "
                f"speaks version {PROTOCOL_VERSION}: update Tandem on the older side",
            )
        if not hmac.compare_digest(hello.tokenizer_hash, engine.tokenizer_hash):
            device = hello.model_name or "unnamed"
            return await self._refuse(
                "tokenizer",
                f"device model {device!r} (tokenizer {hello.tokenizer_hash.hex()[:8]}…) and "
                f"cloud model {engine.name!r} (tokenizer {engine.tokenizer_hash.hex()[:8]}…) "
                "do not share a vocabulary; pick a device model with the cloud model's "
                "tokenizer",
            )
        if hello.mode not in REQUESTS:
            supported = " and ".join(m.name.lower() for m in REQUESTS)
            extra = " (local mode needs no cloud)" if hello.mode == Mode.LOCAL else ""
            return await self._refuse(
                "mode",
                f"this cloud serves {supported} modes, not {hello.mode.name.lower()}{extra}",
            )
        variant = ""
        if hello.mode == Mode.SPLIT:
            variant = hello.variant or DEFAULT_VARIANT
            if variant not in variant_names():
                return await self._refuse(
                    "variant",
                    f"unknown split variant {variant!r}; this cloud serves "
                    + ", ".join(variant_names()),
                )
        # Accepted (capacity was checked before the upgrade: server._overloaded).
        self.state.sessions[self.id] = self
        self.mode, self.variant = hello.mode, variant
        self.engine_session = engine.open_session(
            on_evict=self._evicted_from_worker, tenant=self.user
        )
        ack = HelloAck(True, limits=self.limits, model_name=engine.name)
        log.info(
            kv(
                "session_open",
                session=self.id,
                peer=self.peer,
                user=self.user,
                mode=hello.mode.name.lower(),
                variant=variant or "-",
                device_model=hello.model_name or "-",
                sessions=len(self.state.sessions),
            )
        )
        return await self._try_send(ack)

    async def _refuse(self, why: str, reason: str) -> bool:
        self.state.metrics.refusals.labels(reason=why).inc()
        log.info(kv("session_refused", session=self.id, peer=self.peer, why=why, reason=reason))
        ack = HelloAck(False, limits=self.limits, reason=reason, model_name=self.state.engine.name)
        await self._try_send(ack)
        await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=why.encode())
        return False

    async def _text_frame(self) -> bool:
        return await self._error(
            ErrorCode.MALFORMED, "text frames are not part of the protocol; send binary frames"
        )

    async def _read_frames(self) -> None:
        while True:
            wsmsg = await self._receive()
            if wsmsg is None:
                await self._error(
                    ErrorCode.LIMIT,
                    f"idle timeout: nothing sent or received for {self.idle_s:g} s; closing",
                )
                log.info(kv("session_idle", session=self.id, idle_s=self.idle_s))
                await self.ws.close(code=WSCloseCode.OK, message=b"idle timeout")
                return
            if wsmsg.type == WSMsgType.BINARY:
                if not await self._on_frame(wsmsg.data, time.monotonic_ns()):
                    return
            elif wsmsg.type == WSMsgType.TEXT:
                self._count_in(len(wsmsg.data.encode("utf-8")))
                if not await self._text_frame():
                    return
            else:  # CLOSE, CLOSING, CLOSED, ERROR
                if wsmsg.type == WSMsgType.ERROR:
                    log.info(kv("session_transport_error", session=self.id, error=wsmsg.data))
                return

    async def _on_frame(self, frame: bytes, received_ns: int) -> bool:
        """Handle one binary frame; False when the peer is gone."""
        rid = _peek_request_id(frame)
        self._count_in(len(frame), rid)
        try:
            msg = decode(frame, self.limits)
        except ProtocolError as exc:
            return await self._error(ErrorCode.MALFORMED, exc.reason, rid)
        if isinstance(msg, Ping):
            return await self._try_send(
                Pong(
                    msg.sent_ns,
                    received_ns,
                    time.monotonic_ns(),
                    request_id=msg.request_id,
                    epoch=msg.epoch,
                    step=msg.step,
                )
            )
        if isinstance(msg, Generate):
            self.last_activity = time.monotonic()
            return await self._start_request(msg, len(frame))
        if isinstance(msg, request_frames()):  # as each mode declares (collab.protocol.modes)
            return await self._route(msg, len(frame))
        if isinstance(msg, Error):
            log.info(
                kv(
                    "device_error",
                    session=self.id,
                    request=msg.request_id,
                    code=_error_label(msg.code),
                    message=msg.message,
                )
            )
            return True
        if isinstance(msg, Pong):
            self._on_pong(msg, received_ns)
            return True
        if isinstance(msg, Hello):
            return await self._error(
                ErrorCode.MALFORMED, "the session is already open: Hello comes only first"
            )
        return await self._error(
            ErrorCode.MALFORMED,
            f"{type(msg).__name__} is not a frame a device sends to this cloud; ignored",
            msg.request_id,
        )

    async def ping(self) -> None:
        """Ask the device for a Pong; its round trip updates `rtt_s` (DRAGON's scheduler)."""
        sent = time.monotonic_ns()
        self._pings.add(sent)
        if len(self._pings) > MAX_PINGS:  # a device that answers none cannot grow the set
            self._pings.discard(min(self._pings))
        await self.send(Ping(sent))

    def _on_pong(self, pong: Pong, received_ns: int) -> None:
        if pong.ping_sent_ns not in self._pings:
            return
        self._pings.discard(pong.ping_sent_ns)
        rtt = (received_ns - pong.ping_sent_ns) / 1e9
        self.rtt_s = rtt if self.rtt_s is None else (1 - RTT_ALPHA) * self.rtt_s + RTT_ALPHA * rtt

    async def _route(self, msg: Message, nbytes: int) -> bool:
        req = self.request
        if req is not None and not req.finished and msg.request_id == req.id:
            if req.overflowed:
                return True  # cancelled for flooding: the rest of its frames are dropped
            if not req.inbox.offer(msg, nbytes):
                return await self._overflow(req)
            self.last_activity = time.monotonic()
            if isinstance(msg, Cancel) and self.engine_session is not None:
                self.engine_session.cancel()  # a long prefill stops now, not at its end
            return True
        if msg.request_id <= self.last_request_id:
            log.debug(
                kv(
                    "stale_frame",
                    session=self.id,
                    request=msg.request_id,
                    frame=type(msg).__name__,
                )
            )
            return True
        return await self._error(
            ErrorCode.MALFORMED, f"no active request {msg.request_id}", msg.request_id
        )

    async def _overflow(self, req: _Request) -> bool:
        """The device sent its request more frames than it reads: cancel that request (its
        Done follows as for a Cancel); the session and other sessions go on."""
        inbox = req.inbox
        req.overflowed = True
        log.info(
            kv(
                "request_flooded",
                session=self.id,
                request=req.id,
                frames=inbox.qsize(),
                bytes=inbox.nbytes,
            )
        )
        inbox.replace_all(Cancel(request_id=req.id))
        if self.engine_session is not None:
            self.engine_session.cancel()
        return await self._error(
            ErrorCode.LIMIT,
            f"request {req.id} was sent more frames than it had read ({inbox.max_frames} "
            f"frames or {inbox.max_bytes // 2**20} MiB waiting); it is cancelled",
            req.id,
        )

    # ---- requests --------------------------------------------------------------------------
    async def _start_request(self, gen: Generate, nbytes: int) -> bool:
        if gen.request_id <= self.last_request_id:
            return await self._error(
                ErrorCode.MALFORMED,
                f"request id {gen.request_id} is not newer than {self.last_request_id}: "
                "request ids must increase within a session",
                gen.request_id,
            )
        active = self.request
        if active is not None and not active.finished:
            return await self._turn_down(
                gen,
                ErrorCode.BUSY,
                f"request {active.id} is still running: cancel it or wait for its Done",
            )
        wait = self.state.request_rate.take(self.user)
        if wait > 0:
            self.state.metrics.refusals.labels(reason="rate").inc()
            log.info(
                kv(
                    "request_rate_limited",
                    session=self.id,
                    user=self.user,
                    retry_after_s=round(wait, 1),
                )
            )
            return await self._turn_down(
                gen,
                ErrorCode.RATE_LIMITED,
                f"this access token has used its {self.state.config.requests_per_minute} "
                f"requests per minute: retry in {max(1, math.ceil(wait))} s",
            )
        assert self.mode is not None and self.engine_session is not None
        self.last_request_id = gen.request_id
        self.requests += 1
        mode = self.mode.name.lower()
        req = _Request(gen.request_id, mode, bytes_up=nbytes)
        req.metrics = RequestMetrics(self.state.metrics, mode)
        ctx = RequestContext(
            engine=self.state.engine,
            session=self.engine_session,
            corpus=self.state.corpus,
            corpus_k=self.state.config.corpus_k,
            corpus_floor=self.state.config.corpus_floor,
            corpus_focus_words=self.state.config.corpus_focus_words,
            mode=self.mode,
            variant=self.variant,
            limits=self.limits,
            send=self.send,
            inbox=req.inbox,
            traffic=lambda: (req.bytes_up, req.bytes_down),
            metrics=req.metrics,
            ping=self.ping,
            cache_salt=self._cache_salt(),
            rtt=lambda: self.rtt_s,
            pace=self.pace,
        )
        self.request = req
        req.task = asyncio.create_task(
            self._run_request(gen, ctx, req), name=f"tandem-request-{self.id}-{req.id}"
        )
        return True

    async def _turn_down(self, gen: Generate, code: ErrorCode, text: str) -> bool:
        """Turn a Generate down: its Error, then its Done (every request ends with one, so
        the device stops waiting at once and may answer on its own)."""
        self.last_request_id = gen.request_id
        rid = gen.request_id
        return await self._error(code, text, rid) and await self._try_send(
            Done(FinishReason.ERROR, request_id=rid)
        )

    async def _run_request(self, gen: Generate, ctx: RequestContext, req: _Request) -> None:
        start = time.perf_counter()
        outcome = "error"
        done: Done | None = None
        try:
            done = await serve_request(gen, ctx)
            outcome = done.reason.name.lower()
        except asyncio.CancelledError:
            outcome = "disconnected"
            raise
        except (ConnectionError, RuntimeError) as exc:
            if not self.ws.closed:
                await self._internal_error(gen, req, start, exc)
            else:
                outcome = "disconnected"
        except Exception as exc:
            await self._internal_error(gen, req, start, exc)
        finally:
            req.finished = True
            if self.request is req:
                self.request = None
            m = req.metrics
            assert m is not None
            log.info(
                kv(
                    "request_done",
                    session=self.id,
                    request=req.id,
                    mode=req.mode,
                    variant=self.variant or "-",
                    outcome=outcome,
                    tokens=done.tokens if done else m.n_tokens,
                    rounds=done.rounds if done else m.n_rounds,
                    drafted=m.n_drafted,
                    accepted=m.n_accepted,
                    bytes_up=req.bytes_up,
                    bytes_down=req.bytes_down,
                    ttft_s=m.ttft_s if m.ttft_s is not None else "-",
                    elapsed_s=time.perf_counter() - start,
                )
            )

    async def _internal_error(
        self, gen: Generate, req: _Request, start: float, exc: BaseException
    ) -> None:
        """decoding raised: log it, tell the device in plain words, end the request."""
        log.error(
            kv("request_failed", session=self.id, request=req.id, error=repr(exc)),
            exc_info=exc,
        )
        m = req.metrics
        assert m is not None
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.send(
                Error(
                    ErrorCode.INTERNAL,
                    "the cloud failed while answering this request; its log has the details",
                    request_id=req.id,
                )
            )
            if self.engine_session is not None:
                self.engine_session.release(keep=False)
            await self.send(
                Done(
                    FinishReason.ERROR,
                    tokens=m.n_tokens,
                    rounds=m.n_rounds,
                    drafted=m.n_drafted,
                    accepted=m.n_accepted,
                    bytes_up=req.bytes_up,
                    bytes_down=req.bytes_down,
                    elapsed_s=time.perf_counter() - start,
                    request_id=req.id,
                )
            )

    # ---- eviction and cleanup --------------------------------------------------------------
    def _cache_salt(self) -> bytes:
        """The scope this session shares public documents' cached KV within (a session of
        another scope cannot time whether a document was recently used here)."""
        scope = self.state.config.document_cache_scope
        if scope == "all":
            return b""
        if scope == "user":
            return f"user:{self.user}".encode()
        return f"session:{self.id}".encode()

    def _evicted_from_worker(self) -> None:
        """Called by the engine's worker thread: hop to the event loop."""
        with contextlib.suppress(RuntimeError):  # loop already closed: nothing to record
            self._loop.call_soon_threadsafe(self._evicted)

    def _evicted(self) -> None:
        self.state.metrics.evictions.inc()
        req = self.request
        # an idle session's kept conversation going is the budget at work, not a problem
        (log.warning if req is not None else log.info)(
            kv(
                "kv_evicted",
                session=self.id,
                request=req.id if req else "-",
                kv_budget_bytes=self.state.engine.kv_budget_bytes,
            )
        )

    async def _teardown(self) -> None:
        req = self.request
        if req is not None and req.task is not None and not req.task.done():
            req.task.cancel()
            if self.engine_session is not None:
                self.engine_session.cancel()  # stop the step in flight on the worker
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await req.task
        if self.engine_session is not None:
            self.engine_session.close()
        was_open = self.state.sessions.pop(self.id, None) is not None
        if not self.ws.closed:
            with contextlib.suppress(Exception):
                await self.ws.close()
        if was_open:
            log.info(
                kv(
                    "session_closed",
                    session=self.id,
                    requests=self.requests,
                    bytes_in=self.bytes_in,
                    bytes_out=self.bytes_out,
                    frames_in=self.frames_in,
                    frames_out=self.frames_out,
                    elapsed_s=time.monotonic() - self.opened,
                    close_code=self.ws.close_code,
                )
            )
