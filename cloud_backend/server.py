"""The cloud's transport: an aiohttp app with health, metrics and one websocket per session.

Each websocket is a session: a Hello/HelloAck handshake (protocol version, tokenizer, mode),
then a reader loop that never blocks on the model. Pings are answered at once, even while a
request computes, because requests run in their own task and the engine steps on its worker
thread. A frame that does not decode gets an Error frame and the session carries on with its
state untouched (DESIGN.md §4); only the transport itself closing ends a session.

The access token is checked on the HTTP upgrade request, before any websocket exists, so an
unauthenticated peer never reaches the protocol parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, hdrs, web

from cloud_backend.config import ConfigError, ServerConfig
from cloud_backend.context import RequestContext
from cloud_backend.engine import EngineSession, LLMEngine
from cloud_backend.metrics import CONTENT_TYPE, RequestMetrics, ServerMetrics
from cloud_backend.modes import REQUESTS, serve_request
from collab.protocol import (
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    Cancel,
    CloudDecode,
    Done,
    DsdDraft,
    DssdDraft,
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
    TokenChunk,
    TopKDraft,
    decode,
    encode,
)
from collab.variants import DEFAULT_VARIANT, variant_names

log = logging.getLogger("tandem.cloud")

SESSION_PATH = "/v1/session"
# Frames that belong to the running request and go to its inbox.
_REQUEST_FRAMES = (Cancel, DsdDraft, DssdDraft, TopKDraft, CloudDecode, TokenChunk)
_RID = struct.Struct("<I")
_RID_OFFSET = 6  # magic(2) version(1) type(1) flags(2), then the request id


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return repr(text) if (" " in text or not text) else text


def _kv(event: str, **fields: Any) -> str:
    """One structured log line: an event name and key=value fields, easy to grep and parse."""
    return event + "".join(f" {k}={_fmt(v)}" for k, v in fields.items())


def _error_label(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


def _peek_request_id(frame: bytes) -> int:
    """The header's request id of a frame that failed to decode, if the header is ours."""
    if len(frame) >= HEADER_SIZE and frame[:2] == MAGIC:
        return _RID.unpack_from(frame, _RID_OFFSET)[0]
    return 0


def _set_nodelay(transport: Any) -> None:
    """Small frames (a Pong, a one-token Verdict) must not wait for Nagle's algorithm.
    aiohttp already sets TCP_NODELAY on every connection; this makes sure of it."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass
class _AppState:
    config: ServerConfig
    engine: LLMEngine
    corpus: Any | None
    token: str
    metrics: ServerMetrics
    started: float = field(default_factory=time.monotonic)
    sessions: dict[int, _Session] = field(default_factory=dict)  # handshake accepted
    websockets: set[web.WebSocketResponse] = field(default_factory=set)  # all, for shutdown
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))


STATE = web.AppKey("tandem_state", _AppState)


@dataclass
class _Request:
    """The one request a session may run at a time, with its own byte counts."""

    id: int
    mode: str
    inbox: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)
    bytes_up: int = 0
    bytes_down: int = 0
    metrics: RequestMetrics | None = None
    task: asyncio.Task[None] | None = None
    finished: bool = False


class _Session:
    """One websocket: handshake, reader loop, the running request, cleanup."""

    def __init__(self, state: _AppState, ws: web.WebSocketResponse, peer: str | None) -> None:
        self.state = state
        self.ws = ws
        self.peer = peer or "?"
        self.id = next(state.ids)
        self.limits: Limits = state.config.limits
        self.idle_s = state.config.idle_timeout_s
        self.engine_session: EngineSession | None = None
        self.mode: Mode | None = None
        self.variant = ""
        self.request: _Request | None = None
        self.last_request_id = 0
        self.bytes_in = self.bytes_out = 0
        self.frames_in = self.frames_out = 0
        self.requests = 0
        self.opened = time.monotonic()
        self.last_activity = self.opened  # last frame in either direction
        self._send_lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()

    # ---- sending ---------------------------------------------------------------------------
    async def send(self, msg: Message) -> None:
        """Encode, send one binary frame, count its bytes (per session, per request)."""
        frame = encode(msg)
        if self.ws.closed:
            raise ConnectionResetError("the device has disconnected")
        async with self._send_lock:
            await self.ws.send_bytes(frame)
        n = len(frame)
        self.last_activity = time.monotonic()
        self.bytes_out += n
        self.frames_out += 1
        self.state.metrics.bytes.labels(direction="down").inc(n)
        req = self.request
        if req is not None and msg.request_id == req.id:
            req.bytes_down += n
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
            _kv(
                "error_frame", session=self.id, request=request_id, code=code.name,
                message=message,
            )
        )  # fmt: skip
        return await self._try_send(Error(code, message, request_id=request_id))

    def _count_in(self, n: int, request_id: int | None = None) -> None:
        self.last_activity = time.monotonic()
        self.bytes_in += n
        self.frames_in += 1
        self.state.metrics.bytes.labels(direction="up").inc(n)
        req = self.request
        if req is not None and request_id == req.id and not req.finished:
            req.bytes_up += n

    # ---- lifecycle -------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            if await self._handshake():
                await self._read_frames()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(_kv("session_failed", session=self.id))
        finally:
            await self._teardown()

    async def _receive(self) -> Any:
        """The next websocket message, or None once no frame went either way for `idle_s`
        seconds: a cloud answer streaming down is activity, a split request waiting for
        drafts that never come is not."""
        while True:
            left = self.last_activity + self.idle_s - time.monotonic()
            if left <= 0:
                return None
            try:
                return await self.ws.receive(timeout=left)
            except TimeoutError:
                continue

    async def _handshake(self) -> bool:
        """Wait for a Hello; accept or refuse it. Malformed frames before it get an Error."""
        while True:
            wsmsg = await self._receive()
            if wsmsg is None:
                await self._error(
                    ErrorCode.LIMIT, f"idle timeout: no Hello within {self.idle_s:g} s; closing"
                )
                await self.ws.close(code=WSCloseCode.OK, message=b"idle timeout")
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
            if len(frame) >= 3 and frame[:2] == MAGIC and frame[2] != PROTOCOL_VERSION:
                return await self._refuse(
                    "version",
                    f"the device speaks protocol version {frame[2]} and this cloud speaks "
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
        if len(self.state.sessions) >= self.state.config.max_sessions:
            return await self._refuse(
                "busy",
                f"the cloud is busy: all {self.state.config.max_sessions} sessions are in use; "
                "try again later",
                close_code=WSCloseCode.TRY_AGAIN_LATER,
            )
        # Accepted. No await between the capacity check and the registration.
        self.state.sessions[self.id] = self
        self.mode, self.variant = hello.mode, variant
        self.engine_session = engine.open_session(on_evict=self._evicted_from_worker)
        ack = HelloAck(True, limits=self.limits, model_name=engine.name)
        log.info(
            _kv(
                "session_open", session=self.id, peer=self.peer, mode=hello.mode.name.lower(),
                variant=variant or "-", device_model=hello.model_name or "-",
                sessions=len(self.state.sessions),
            )
        )  # fmt: skip
        return await self._try_send(ack)

    async def _refuse(
        self, why: str, reason: str, close_code: int = WSCloseCode.POLICY_VIOLATION
    ) -> bool:
        self.state.metrics.refusals.labels(reason=why).inc()
        log.info(_kv("session_refused", session=self.id, peer=self.peer, why=why, reason=reason))
        ack = HelloAck(False, limits=self.limits, reason=reason, model_name=self.state.engine.name)
        await self._try_send(ack)
        await self.ws.close(code=close_code, message=why.encode())
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
                log.info(_kv("session_idle", session=self.id, idle_s=self.idle_s))
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
                    log.info(_kv("session_transport_error", session=self.id, error=wsmsg.data))
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
                    msg.sent_ns, received_ns, time.monotonic_ns(),
                    request_id=msg.request_id, epoch=msg.epoch, step=msg.step,
                )
            )  # fmt: skip
        if isinstance(msg, Generate):
            return await self._start_request(msg, len(frame))
        if isinstance(msg, _REQUEST_FRAMES):
            return await self._route(msg)
        if isinstance(msg, Error):
            log.info(
                _kv(
                    "device_error", session=self.id, request=msg.request_id,
                    code=_error_label(msg.code), message=msg.message,
                )
            )  # fmt: skip
            return True
        if isinstance(msg, Pong):
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

    async def _route(self, msg: Message) -> bool:
        req = self.request
        if req is not None and not req.finished and msg.request_id == req.id:
            req.inbox.put_nowait(msg)
            if isinstance(msg, Cancel) and self.engine_session is not None:
                self.engine_session.cancel()  # a long prefill stops now, not at its end
            return True
        if msg.request_id <= self.last_request_id:
            log.debug(
                _kv(
                    "stale_frame", session=self.id, request=msg.request_id,
                    frame=type(msg).__name__,
                )
            )  # fmt: skip
            return True
        return await self._error(
            ErrorCode.MALFORMED, f"no active request {msg.request_id}", msg.request_id
        )

    # ---- requests --------------------------------------------------------------------------
    async def _start_request(self, gen: Generate, nbytes: int) -> bool:
        active = self.request
        if active is not None and not active.finished:
            return await self._error(
                ErrorCode.BUSY,
                f"request {active.id} is still running: cancel it or wait for its Done",
                gen.request_id,
            )
        if gen.request_id <= self.last_request_id:
            return await self._error(
                ErrorCode.MALFORMED,
                f"request id {gen.request_id} is not newer than {self.last_request_id}: "
                "request ids must increase within a session",
                gen.request_id,
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
            mode=self.mode,
            variant=self.variant,
            limits=self.limits,
            send=self.send,
            inbox=req.inbox,
            traffic=lambda: (req.bytes_up, req.bytes_down),
            metrics=req.metrics,
        )
        self.request = req
        req.task = asyncio.create_task(
            self._run_request(gen, ctx, req), name=f"tandem-request-{self.id}-{req.id}"
        )
        return True

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
                _kv(
                    "request_done", session=self.id, request=req.id, mode=req.mode,
                    variant=self.variant or "-", outcome=outcome,
                    tokens=done.tokens if done else m.n_tokens,
                    rounds=done.rounds if done else m.n_rounds,
                    drafted=m.n_drafted, accepted=m.n_accepted,
                    bytes_up=req.bytes_up, bytes_down=req.bytes_down,
                    ttft_s=m.ttft_s if m.ttft_s is not None else "-",
                    elapsed_s=time.perf_counter() - start,
                )
            )  # fmt: skip

    async def _internal_error(
        self, gen: Generate, req: _Request, start: float, exc: BaseException
    ) -> None:
        """decoding raised: log it, tell the device in plain words, end the request."""
        log.error(
            _kv("request_failed", session=self.id, request=req.id, error=repr(exc)),
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
                self.engine_session.release()
            await self.send(
                Done(
                    FinishReason.ERROR, tokens=m.n_tokens, rounds=m.n_rounds,
                    drafted=m.n_drafted, accepted=m.n_accepted, bytes_up=req.bytes_up,
                    bytes_down=req.bytes_down, elapsed_s=time.perf_counter() - start,
                    request_id=req.id,
                )
            )  # fmt: skip

    # ---- eviction and cleanup --------------------------------------------------------------
    def _evicted_from_worker(self) -> None:
        """Called by the engine's worker thread: hop to the event loop."""
        with contextlib.suppress(RuntimeError):  # loop already closed: nothing to record
            self._loop.call_soon_threadsafe(self._evicted)

    def _evicted(self) -> None:
        self.state.metrics.evictions.inc()
        req = self.request
        log.warning(
            _kv(
                "kv_evicted", session=self.id, request=req.id if req else "-",
                kv_budget_bytes=self.state.engine.kv_budget_bytes,
            )
        )  # fmt: skip

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
                _kv(
                    "session_closed", session=self.id, requests=self.requests,
                    bytes_in=self.bytes_in, bytes_out=self.bytes_out,
                    frames_in=self.frames_in, frames_out=self.frames_out,
                    elapsed_s=time.monotonic() - self.opened,
                    close_code=self.ws.close_code,
                )
            )  # fmt: skip


# ---------------------------------------------------------------------------- HTTP handlers


def _unauthorized(reason: str) -> web.Response:
    challenge = f'Bearer realm="tandem", error="invalid_token", error_description="{reason}"'
    return web.Response(status=401, text=reason + "\n", headers={hdrs.WWW_AUTHENTICATE: challenge})


def _check_auth(request: web.Request, token: str) -> web.Response | None:
    """None if the bearer token is right; else the 401 to return."""
    scheme, _, given = request.headers.get(hdrs.AUTHORIZATION, "").partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        return _unauthorized(
            "missing access token: send the header 'Authorization: Bearer <token>'"
        )
    if not hmac.compare_digest(given.encode("utf-8"), token.encode("utf-8")):
        return _unauthorized("wrong access token")
    return None


async def _session_handler(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    refusal = _check_auth(request, state.token)
    if refusal is not None:
        state.metrics.errors.labels(code=ErrorCode.AUTH.name).inc()
        log.info(_kv("auth_refused", peer=request.remote or "?", reason=refusal.text.strip()))
        return refusal
    ws = web.WebSocketResponse(
        # Twice the protocol's frame limit: a frame somewhat over it still gets a readable
        # Error (decode refuses it) and the session survives; beyond this the transport
        # closes with 1009 before buffering more.
        max_msg_size=2 * state.config.limits.max_frame_bytes,
        compress=False,
        autoping=True,
    )
    if not ws.can_prepare(request).ok:
        return web.Response(
            status=400, text="this endpoint speaks websocket only (GET with Upgrade: websocket)\n"
        )
    await ws.prepare(request)
    _set_nodelay(request.transport)
    state.websockets.add(ws)
    try:
        await _Session(state, ws, request.remote).run()
    finally:
        state.websockets.discard(ws)
    return ws


async def _healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        {
            "status": "ok",
            "model": state.engine.name,
            "sessions": len(state.sessions),
            "max_sessions": state.config.max_sessions,
            "uptime_s": round(time.monotonic() - state.started, 3),
        }
    )


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    # aiohttp refuses a content_type with parameters; pass the full header instead.
    return web.Response(body=body, headers={hdrs.CONTENT_TYPE: CONTENT_TYPE})


# ---------------------------------------------------------------------------- app and server


def create_app(
    config: ServerConfig, engine: LLMEngine, corpus: Any | None = None
) -> web.Application:
    """The aiohttp application. Refuses to exist without an access token."""
    token = config.require_token()
    metrics = ServerMetrics()
    state = _AppState(config, engine, corpus, token, metrics)
    metrics.watch_kv_cache(lambda: engine.cache_bytes)
    metrics.sessions.set_function(lambda: len(state.sessions))
    app = web.Application()
    app[STATE] = state
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get(SESSION_PATH, _session_handler)
    previous_observer = engine.on_step

    async def on_startup(app: web.Application) -> None:
        engine.on_step = metrics.step

    async def on_shutdown(app: web.Application) -> None:
        for ws in list(state.websockets):
            with contextlib.suppress(Exception):
                await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")

    async def on_cleanup(app: web.Application) -> None:
        if engine.on_step == metrics.step:
            engine.on_step = previous_observer

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


def _url(host: str, port: int) -> str:
    host = f"[{host}]" if ":" in host else host
    return f"ws://{host}:{port}{SESSION_PATH}"


async def run_server(
    config: ServerConfig,
    engine: LLMEngine,
    corpus: Any | None = None,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until cancelled. Port 0 picks a free port; `ready(url)` gets the bound one."""
    app = create_app(config, engine, corpus)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        url = _url(host, port)
        log.info(
            _kv(
                "serving", url=url, model=engine.name, runtime=type(engine.lm).__name__,
                max_sessions=config.max_sessions, idle_timeout_s=config.idle_timeout_s,
                corpus="on" if corpus is not None else "off",
            )
        )  # fmt: skip
        if ready is not None:
            ready(url)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        log.info(_kv("stopped", model=engine.name))


# ---------------------------------------------------------------------------- model loading

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _tokenizer_dir(model_dir: Any) -> Any:
    """The model folder itself (prepare saves the tokenizer beside every variant), else the
    sibling `hf` folder of a prepared model."""
    for candidate in (model_dir, model_dir.parent / "hf"):
        if any((candidate / name).is_file() for name in _TOKENIZER_FILES):
            return candidate
    raise ConfigError(f"no tokenizer files (tokenizer.json) in {model_dir}")


def _model_name(model_dir: Any) -> str:
    """A prepared model lives in `<models>/<key>/<variant>/`: name it by its key."""
    if (model_dir.parent / "manifest.json").is_file():
        return model_dir.parent.name
    return model_dir.name


def build_engine(config: ServerConfig) -> LLMEngine:
    """Load the cloud model (ONNX Runtime or torch) and its tokenizer into an engine."""
    from model_runtime.tokenizer import load_tokenizer

    model_dir = config.model_dir
    if model_dir is None:
        # Only here does the cloud look at the device's model store: a deployment that
        # passes model_dir never imports the packaging code.
        from tandem_packaging.prepare import model_path
        from tandem_packaging.sources import PrepareError

        variant = "onnx-quant" if config.engine == "ort" else "hf"
        try:
            model_dir = model_path("cloud", variant)
        except PrepareError as exc:
            raise ConfigError(str(exc)) from None
    if not model_dir.is_dir():
        raise ConfigError(f"model folder {model_dir} does not exist")
    log.info(_kv("loading_model", path=str(model_dir), engine=config.engine))
    if config.engine == "ort":
        from model_runtime.ort_runtime import OrtCausalLM

        lm: Any = OrtCausalLM(model_dir, threads=config.threads, allow_spinning=False)
    else:
        import torch

        from model_runtime.torch_runtime import TorchCausalLM

        dtype = torch.bfloat16 if config.torch_dtype == "bfloat16" else torch.float32
        lm = TorchCausalLM(model_dir, dtype=dtype, threads=config.threads)
    tokenizer = load_tokenizer(_tokenizer_dir(model_dir))
    name = config.model_name or _model_name(model_dir)
    return LLMEngine(lm, tokenizer, name, kv_budget_bytes=config.kv_budget_bytes)
