"""The cloud's transport: an aiohttp app with health, metrics and one websocket per session.

Each websocket is a `Session` (cloud_backend.session); the model is loaded by
`cloud_backend.loading.build_engine`. The access token is checked on the HTTP upgrade request,
before any websocket exists, so an unauthenticated peer never reaches the protocol parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from aiohttp import WSCloseCode, hdrs, web

from cloud_backend.admission import AuthThrottle, client_address
from cloud_backend.config import ConfigError, ServerConfig
from cloud_backend.engine_api import CloudEngine
from cloud_backend.logfmt import kv
from cloud_backend.metrics import CONTENT_TYPE, ServerMetrics
from cloud_backend.session import AppState, Session
from collab.protocol import SESSION_PATH, ErrorCode

log = logging.getLogger("tandem.cloud")

STATE = web.AppKey("tandem_state", AppState)


# ---------------------------------------------------------------------------- HTTP handlers


def _set_nodelay(transport: Any) -> None:
    """Small frames (a Pong, a one-token Verdict) must not wait for Nagle's algorithm.
    aiohttp already sets TCP_NODELAY on every connection; this makes sure of it."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _unauthorized(reason: str) -> web.Response:
    challenge = f'Bearer realm="tandem", error="invalid_token", error_description="{reason}"'
    return web.Response(status=401, text=reason + "\n", headers={hdrs.WWW_AUTHENTICATE: challenge})


THROTTLE = web.AppKey("tandem_auth_throttle", AuthThrottle)


def _bearer(request: web.Request) -> str:
    """The token of `Authorization: Bearer <token>` ('' without one)."""
    scheme, _, given = request.headers.get(hdrs.AUTHORIZATION, "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else ""


def _check_auth(request: web.Request, tokens: dict[str, str]) -> str | web.Response:
    """The name of the bearer token if it is one of `tokens`; else the 401 to return. Every
    token is compared, in constant time, whatever matched (no timing says which is close)."""
    given = _bearer(request)
    if not given:
        return _unauthorized(
            "missing access token: send the header 'Authorization: Bearer <token>'"
        )
    found = None
    for name, token in tokens.items():
        if hmac.compare_digest(given.encode("utf-8"), token.encode("utf-8")):
            found = name
    return found if found is not None else _unauthorized("wrong access token")


RETRY_AFTER_S = 5  # what an overloaded cloud tells a device to wait before trying again


def _overloaded(state: AppState) -> web.Response:
    """TGI's answer to a client past --max-concurrent-requests, in HTTP: 503 with Retry-After,
    before any websocket exists (a websocket not yet past Hello holds a slot too)."""
    reason = f"the cloud is overloaded: all {state.config.max_sessions} sessions are in use"
    return _refused(state, 503, "busy", reason)


def _refused(state: AppState, status: int, why: str, reason: str) -> web.Response:
    """A session refused before its websocket exists, counted, with when to retry."""
    state.metrics.refusals.labels(reason=why).inc()
    return web.Response(
        status=status,
        text=f"{reason}; retry after {RETRY_AFTER_S} s\n",
        headers={hdrs.RETRY_AFTER: str(RETRY_AFTER_S)},
    )


def _throttled(wait: float) -> web.Response:
    return web.Response(
        status=429,
        text="too many wrong access tokens from this address; wait\n",
        headers={hdrs.RETRY_AFTER: str(max(1, round(wait)))},
    )


def _token_full(state: AppState, user: str) -> web.Response:
    """This access token holds all the sessions it may (the others' slots stay free)."""
    cap = state.config.sessions_per_token()
    reason = f"this access token already holds its {cap} sessions on this cloud: close one"
    return _refused(state, 429, "token_sessions", reason)


async def _session_handler(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    # Every X-Forwarded-For line, in order: a client may send lines of its own and a proxy
    # may add its own line after them, so the first line alone would believe the client.
    forwarded = ", ".join(request.headers.getall(hdrs.X_FORWARDED_FOR, ()))
    client = client_address(request.remote, forwarded, state.proxies)
    user = _check_auth(request, state.tokens)
    if isinstance(user, web.Response):  # a right token is let in whatever the count
        throttle = request.app[THROTTLE]
        wait = throttle.retry_after(client)
        throttle.failed(client)
        state.metrics.errors.labels(code=ErrorCode.AUTH.name).inc()
        if wait > 0:
            log.info(kv("auth_throttled", client=client, retry_after_s=round(wait, 1)))
            return _throttled(wait)
        log.info(kv("auth_refused", client=client, reason=(user.text or "").strip()))
        return user
    config = state.config
    ws = web.WebSocketResponse(
        # The largest legal frame and no more: a bigger one closes the transport with 1009
        # before it is buffered. No compression (no decompression bomb); a ping every
        # heartbeat_s and a peer silent for half of it after the ping is dead (1006).
        max_msg_size=config.limits.max_frame_bytes,
        compress=False,
        autoping=True,
        heartbeat=config.heartbeat_s,
    )
    if not ws.can_prepare(request).ok:
        return web.Response(
            status=400, text="this endpoint speaks websocket only (GET with Upgrade: websocket)\n"
        )
    if len(state.websockets) >= config.max_sessions:
        log.info(kv("session_refused", client=client, user=user, why="busy"))
        return _overloaded(state)
    if state.held[user] >= config.sessions_per_token():
        log.info(kv("session_refused", client=client, user=user, why="token_sessions"))
        return _token_full(state, user)
    state.websockets.add(ws)  # counted from here: no await between the checks and these lines
    state.held[user] += 1
    try:
        await ws.prepare(request)
        _set_nodelay(request.transport)
        await Session(state, ws, client, user, abort=_aborter(request)).run()
    finally:
        state.websockets.discard(ws)
        state.held[user] -= 1
    return ws


def _aborter(request: web.Request) -> Callable[[], None]:
    """Drop the TCP connection at once (a peer that reads nothing cannot take a close frame)."""

    def abort() -> None:
        if request.transport is not None:
            request.transport.abort()

    return abort


async def _healthz(request: web.Request) -> web.Response:
    """200 while the engine runs, 503 once it cannot (a load balancer's health check). Its
    status alone to anyone; the detail (model, sessions, uptime) only where /metrics could be
    read: with the metrics token, or on the metrics bind."""
    state = request.app[STATE]
    alive = state.engine.alive
    body: dict[str, Any] = {"status": "ok" if alive else "engine down"}
    if _metrics_allowed(request):
        body |= {
            "model": state.engine.name,
            "sessions": len(state.sessions),
            "max_sessions": state.config.max_sessions,
            "uptime_s": round(time.monotonic() - state.started, 3),
        }
    return web.json_response(body, status=200 if alive else 503)


METRICS_BIND = web.AppKey("tandem_metrics_bind", bool)


def _metrics_allowed(request: web.Request) -> bool:
    """Whether this request may read the metrics: it carries the metrics token, or it came in
    on the metrics bind where none is set."""
    expected = request.app[STATE].config.metrics_token
    if expected is None:
        return request.app.get(METRICS_BIND, False)
    return hmac.compare_digest(_bearer(request).encode("utf-8"), expected.encode("utf-8"))


async def _metrics(request: web.Request) -> web.Response:
    """Aggregates only (no series carries a session, a user or an address), and only to the
    holder of the metrics token where one is set: an access token is not enough."""
    state = request.app[STATE]
    if not _metrics_allowed(request):
        return _unauthorized("/metrics needs the metrics token (not an access token)")
    body = state.metrics.render()
    # aiohttp refuses a content_type with parameters; pass the full header instead.
    return web.Response(body=body, headers={hdrs.CONTENT_TYPE: CONTENT_TYPE})


# ---------------------------------------------------------------------------- app and server


def create_app(
    config: ServerConfig, engine: CloudEngine, corpus: Any | None = None
) -> web.Application:
    """The aiohttp application. Refuses to exist without an access token."""
    tokens = config.access_tokens()
    metrics = ServerMetrics()
    state = AppState(config, engine, corpus, tokens, metrics)
    metrics.watch_kv_cache(lambda: engine.cache_bytes)
    if engine.documents is not None:
        metrics.watch_document_cache(engine.documents)
    if isinstance(getattr(engine, "rows_out", None), int):  # vLLM's
        metrics.watch_rows_out(lambda: engine.rows_out)  # type: ignore[attr-defined]
    metrics.sessions.set_function(lambda: len(state.sessions))
    app = web.Application()
    app[STATE] = state
    app[THROTTLE] = AuthThrottle(config.auth_failures, config.auth_window_s)
    app.router.add_get("/healthz", _healthz)
    if config.metrics_token is not None and config.metrics_port is None:
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


async def _serve_metrics(app: web.Application, config: ServerConfig) -> web.AppRunner:
    """/metrics alone on its own bind (a port only the operator's network reaches); the
    metrics token, where set, is still asked for."""
    metrics_app = web.Application()
    metrics_app[STATE] = app[STATE]
    metrics_app[METRICS_BIND] = True
    metrics_app.router.add_get("/metrics", _metrics)
    metrics_app.router.add_get("/healthz", _healthz)  # with its detail, as /metrics
    metrics_runner = web.AppRunner(metrics_app, access_log=None, handle_signals=False)
    await metrics_runner.setup()
    site = web.TCPSite(metrics_runner, config.metrics_host, config.metrics_port)
    await site.start()
    host, port = metrics_runner.addresses[0][:2]
    log.info(kv("metrics_serving", url=f"http://{_host(host)}:{port}/metrics"))
    return metrics_runner


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _url(host: str, port: int, tls: bool) -> str:
    return f"{'wss' if tls else 'ws'}://{_host(host)}:{port}{SESSION_PATH}"


def tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The server's TLS context (TLS 1.2 at least) from its certificate chain and key."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot use the TLS certificate {config.tls_cert}: {exc}") from None
    return ctx


async def run_server(
    config: ServerConfig,
    engine: CloudEngine,
    corpus: Any | None = None,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until cancelled. Port 0 picks a free port; `ready(url)` gets the bound one."""
    app = create_app(config, engine, corpus)
    # stopping waits this long for the sessions' handlers (their websockets are closed first)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=10.0)
    await runner.setup()
    runners = [runner]
    try:
        tls = tls_context(config)
        site = web.TCPSite(runner, config.host, config.port, ssl_context=tls)
        await site.start()
        host, port = runner.addresses[0][:2]
        url = _url(host, port, tls is not None)
        log.info(
            kv(
                "serving",
                url=url,
                model=engine.name,
                runtime=type(engine.lm).__name__,
                max_sessions=config.max_sessions,
                idle_timeout_s=config.idle_timeout_s,
                corpus="on" if corpus is not None else "off",
            )
        )
        if config.metrics_port is not None:
            runners.append(await _serve_metrics(app, config))
        if ready is not None:
            ready(url)
        await asyncio.Event().wait()
    finally:
        for each in reversed(runners):
            await each.cleanup()
        log.info(kv("stopped", model=engine.name))
