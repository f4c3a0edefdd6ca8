"""The device's connection to the cloud: one websocket, binary protocol frames, byte counts.

One background task reads the socket. It answers nothing itself except Pongs, which it
consumes to keep an RTT estimate (so `ping()` works while a request streams, and callers of
`recv()` never see them); every other frame, Error frames included, goes to `recv()`. Every
failure surfaces as a `CloudError` whose message can be shown to the user as is.

`on_frame_sent` receives exactly the bytes of every frame sent, before they leave: the privacy
test inspects all of them. Every frame that left is also written, with its message, into the
ledger of the answer the session serves (`sent`: `edge_runtime.sent`), here where it is sent
and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import re
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from aiohttp import WSCloseCode, WSMsgType, hdrs

from collab.protocol import (
    DEFAULT_LIMITS,
    SESSION_PATH,
    Error,
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
)
from edge_runtime.sent import SentLedger

log = logging.getLogger("tandem.edge.client")

RTT_ALPHA = 0.2  # EWMA weight of a new RTT sample
HEARTBEAT_S = 5.0  # websocket ping every this; a cloud silent for half of it after: dead
# Frames read but not yet taken, readable or not: past either bound the reader waits (TCP
# holds the cloud back). The count bounds what a flood of tiny frames holds beyond its bytes.
INBOX_BYTES = 32 * 1024 * 1024
INBOX_FRAMES = 4096


class CloudError(Exception):
    """Anything that went wrong talking to the cloud; `str(exc)` is meant for the user."""


class AuthError(CloudError):
    """The cloud refused the access token (HTTP 401)."""


class HandshakeRefused(CloudError):
    """The cloud answered Hello with a refusal (vocabulary, mode, version, busy)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the cloud refused the session: {reason}")
        self.reason = reason


class CloudUnavailable(CloudError):
    """The cloud cannot be reached, or is not a Tandem cloud."""


class CloudUntrusted(CloudError):
    """The link would not be private: a certificate that does not verify, or ws:// to another
    machine (not retried: retrying cannot fix either)."""


class CloudBusy(CloudError):
    """The cloud is overloaded (HTTP 503), or this access token holds all the sessions it may
    (429): it said when to try again; retrying sooner is no use."""

    def __init__(self, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ConnectionLost(CloudError):
    """The connection closed (or was never opened)."""


class CloudTimeout(CloudError, TimeoutError):
    """No answer in time (a `TimeoutError` too, for callers that catch that)."""


class CloudProtocolError(CloudError):
    """The cloud sent a frame this device cannot read."""


_CLOSE_REASONS: dict[int, str] = {
    WSCloseCode.ABNORMAL_CLOSURE: "it broke off without a goodbye (the network or the cloud "
    "went away)",
    WSCloseCode.MESSAGE_TOO_BIG: "a frame was larger than the connection allows",
    WSCloseCode.GOING_AWAY: "the cloud is shutting down",
    WSCloseCode.TRY_AGAIN_LATER: "the cloud is busy; try again later",
    WSCloseCode.POLICY_VIOLATION: "the cloud ended the session",
}


def _busy(exc: aiohttp.WSServerHandshakeError) -> CloudBusy:
    """A 503's (the cloud full) or a 429's (this access token holds all the sessions it may)
    refusal in plain words, with its Retry-After (seconds) when it has one."""
    retry = exc.headers.get(hdrs.RETRY_AFTER, "") if exc.headers else ""
    try:
        after: float | None = min(max(0.0, float(retry)), 3600.0)
    except ValueError:
        after = None
    when = f"try again in {after:g} s" if after is not None else "try again later"
    if exc.status == 429:
        why = (
            "this access token holds all the sessions the cloud allows it (close another device's)"
        )
    else:
        why = "the cloud is overloaded (all its sessions are in use)"
    return CloudBusy(f"{why}: {when}", after)


def session_url(url: str) -> str:
    """`url` with the session path added when it has none (`ws://host:port`, as people type a
    server's address and as earlier versions took it); a URL with a path is kept as given."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL at all: connecting says so, in the user's words
        return url
    if parts.path not in ("", "/"):
        return url
    return urlunsplit(parts._replace(path=SESSION_PATH))


def shown_url(url: str) -> str:
    """`url` as messages, logs and the status bar may show it: no user info, query or fragment
    (where a token written into the URL would be)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:  # not a URL: shown only up to anything that may carry a secret
        return re.split(r"[@?#]", url, maxsplit=1)[0]
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _loopback(host: str) -> bool:
    """Whether `host` is this machine (where ws:// exposes nothing)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _plain(exc: BaseException) -> str:
    """A short description of a connection error, without a traceback's jargon."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        inner = exc.os_error
        if isinstance(inner, ConnectionRefusedError):
            return "connection refused (is the cloud server running?)"
        if isinstance(inner, socket.gaierror):
            return "unknown host name"
        return inner.strerror or str(inner)
    return str(exc) or type(exc).__name__


class CloudClient:
    """A device's session with the cloud. Not thread-safe: use it from one event loop."""

    def __init__(
        self,
        url: str,
        token: str,
        mode: Mode,
        variant: str,
        tokenizer_hash: bytes,
        model_name: str,
        limits: Limits = DEFAULT_LIMITS,
        connect_timeout: float = 10.0,
        heartbeat_s: float | None = HEARTBEAT_S,
        ca_file: str | None = None,
        allow_insecure: bool = False,
    ) -> None:
        self.url = session_url(url)
        self.shown_url = shown_url(self.url)  # what messages name: never a token in the URL
        self.mode = Mode(mode)
        self.variant = variant
        self.tokenizer_hash = tokenizer_hash
        self.model_name = model_name
        self.connect_timeout = connect_timeout
        self.heartbeat_s = heartbeat_s
        self.ca_file, self.allow_insecure = ca_file, allow_insecure
        self._token = token
        self._own_limits = limits
        # the server's, once connected: what it accepts. What it sends is read within this
        # device's own limits, never within limits the server announced for itself.
        self.limits: Limits = limits
        self.cloud_model_name = ""
        self.on_frame_sent: Callable[[bytes], None] | None = None
        # the ledger of the answer this session serves now (`serve`, by the mode that takes
        # it); None, or an ended answer's: what is sent belongs to no answer, except the Hello
        # of a session opened outside one, held for the first answer that takes it
        self.sent: SentLedger | None = None
        self._unlisted_hello: tuple[Message, int] | None = None
        self.bytes_up = self.bytes_down = 0
        self.frames_up = self.frames_down = 0
        self.rtt_s: float | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._inbox: asyncio.Queue[tuple[Message | CloudError, int]] | None = None
        self._inbox_bytes = 0  # wire bytes of the frames in the inbox (unreadable ones too)
        self._inbox_room = asyncio.Event()  # set while the inbox is under its bounds
        self._pings: dict[int, asyncio.Future[float]] = {}
        self._send_lock = asyncio.Lock()

    # ---- state -----------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return (
            self._ws is not None
            and not self._ws.closed
            and self._reader is not None
            and not self._reader.done()
        )

    async def __aenter__(self) -> CloudClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- connecting ------------------------------------------------------------------------
    async def connect(
        self, retries: int = 0, backoff_s: float = 0.25, max_backoff_s: float = 8.0
    ) -> HelloAck:
        """Open the websocket and shake hands; retry an unreachable cloud `retries` times with
        exponential backoff and jitter (never a refused token or handshake: retrying cannot
        fix those)."""
        attempt = 0
        while True:
            try:
                return await self._connect_once()
            except (CloudUnavailable, ConnectionLost) as exc:
                if attempt >= retries:
                    raise
                delay = min(max_backoff_s, backoff_s * 2**attempt)
                delay = delay / 2 + random.uniform(0, delay / 2)
                log.info("cloud unavailable (%s); retrying in %.2f s", exc, delay)
                await asyncio.sleep(delay)
                attempt += 1

    async def ensure_connected(self, retries: int = 3) -> None:
        """Reconnect if the connection dropped (counters keep their totals)."""
        if not self.connected:
            await self.connect(retries=retries)

    def _tls(self) -> ssl.SSLContext | bool:
        """What protects the connection: certificate verification for wss:// (the system's
        trust store, or `ca_file`); for ws://, nothing, so only to loopback unless allowed."""
        url = urlsplit(self.url)
        if url.scheme == "wss":
            try:
                return ssl.create_default_context(cafile=self.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise CloudUnavailable(f"cannot read the CA bundle {self.ca_file}: {exc}") from None
        if url.scheme != "ws":
            raise CloudUnavailable(
                f"the cloud URL must start with ws:// or wss://: {self.shown_url}"
            )
        if not self.allow_insecure and not _loopback(url.hostname or ""):
            raise CloudUntrusted(
                f"refusing to send the access token and your questions unencrypted to "
                f"{url.hostname}: use a wss:// URL, or allow it explicitly "
                "(cloud_allow_insecure = true in the settings)"
            )
        return False

    async def _connect_once(self) -> HelloAck:
        tls = self._tls()
        await self._drop_connection()
        http = aiohttp.ClientSession()
        try:
            async with asyncio.timeout(self.connect_timeout):
                ws = await http.ws_connect(
                    self.url,
                    ssl=tls,
                    headers={hdrs.AUTHORIZATION: f"Bearer {self._token}"},
                    max_msg_size=self._own_limits.max_frame_bytes,
                    compress=0,
                    autoping=True,
                    heartbeat=self.heartbeat_s,
                )
        except aiohttp.WSServerHandshakeError as exc:
            await http.close()
            if exc.status == 401:
                raise AuthError(self._auth_message(exc)) from None
            if exc.status in (429, 503):
                raise _busy(exc) from None
            raise CloudUnavailable(
                f"{self.shown_url} did not open a session (HTTP {exc.status}): is it a Tandem "
                "cloud?"
            ) from None
        except aiohttp.ClientConnectorCertificateError as exc:
            await http.close()
            raise CloudUntrusted(
                f"the cloud at {self.shown_url} did not prove who it is (its TLS certificate: "
                f"{getattr(exc.certificate_error, 'verify_message', exc.certificate_error)}); set "
                "cloud_ca to the CA that signed it if it is yours"
            ) from None
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            await http.close()
            raise CloudUnavailable(
                f"cannot reach the cloud at {self.shown_url}: {_plain(exc)}"
            ) from None
        sock = ws.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._http, self._ws = http, ws
        try:
            hello = Hello(self.tokenizer_hash, self.mode, self.variant, model_name=self.model_name)
            await self._send_frame(ws, encode(hello), hello)
            ack = await self._await_hello_ack(ws)
        except BaseException:
            await self._drop_connection()
            raise
        if not ack.accepted:
            await self._drop_connection()
            raise HandshakeRefused(ack.reason)
        self.limits = ack.limits
        self.cloud_model_name = ack.model_name
        inbox: asyncio.Queue[tuple[Message | CloudError, int]] = asyncio.Queue()
        self._inbox, self._inbox_bytes = inbox, 0
        self._inbox_room.set()
        self._reader = asyncio.create_task(self._read_loop(ws, inbox), name="tandem-cloud-reader")
        log.info(
            "connected to %s: model=%s mode=%s variant=%s",
            self.shown_url,
            ack.model_name,
            self.mode.name.lower(),
            self.variant or "-",
        )
        return ack

    def _auth_message(self, exc: aiohttp.WSServerHandshakeError) -> str:
        detail = ""
        challenge = exc.headers.get(hdrs.WWW_AUTHENTICATE, "") if exc.headers else ""
        match = re.search(r'error_description="([^"]*)"', challenge)
        if match:
            detail = f" ({match.group(1)})"
        return (
            f"the cloud refused the access token{detail}: check the token set for the cloud "
            "(TANDEM_CLOUD_TOKEN on the server, the cloud token in this device's settings)"
        )

    async def _await_hello_ack(self, ws: aiohttp.ClientWebSocketResponse) -> HelloAck:
        deadline = time.monotonic() + self.connect_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CloudUnavailable(
                    f"the cloud at {self.shown_url} did not answer the handshake within "
                    f"{self.connect_timeout:g} s"
                )
            try:
                wsmsg = await ws.receive(timeout=left)
            except TimeoutError:
                continue
            if wsmsg.type != WSMsgType.BINARY:
                if wsmsg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                    raise CloudUnavailable("the cloud closed the connection during the handshake")
                if wsmsg.type == WSMsgType.ERROR:
                    raise CloudUnavailable(f"the handshake failed: {_plain(wsmsg.data)}")
                continue
            self._count_down(len(wsmsg.data))
            try:
                msg = decode(wsmsg.data, self._own_limits)
            except ProtocolError as exc:
                raise CloudProtocolError(
                    f"the cloud's handshake answer is unreadable ({exc.reason}): is it a "
                    "Tandem cloud of the same version?"
                ) from None
            if isinstance(msg, HelloAck):
                return msg
            if isinstance(msg, Error):
                raise HandshakeRefused(msg.message)

    async def _drop_connection(self) -> None:
        """Close whatever connection there is; pending pings fail, the inbox is dropped."""
        reader, ws, http = self._reader, self._ws, self._http
        self._reader = self._ws = self._http = None
        if ws is not None and not ws.closed:
            with contextlib.suppress(Exception):
                await ws.close()
        if reader is not None and not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        if http is not None:
            await http.close()
        self._fail_pings(ConnectionLost("the connection to the cloud was closed"))

    async def close(self) -> None:
        """End the session (idempotent)."""
        await self._drop_connection()
        if self._inbox is not None:
            self._inbox.put_nowait((ConnectionLost("the connection to the cloud was closed"), 0))

    # ---- sending ---------------------------------------------------------------------------
    async def send(self, msg: Message) -> None:
        """Encode and send one frame; counts it in bytes_up/frames_up."""
        ws = self._ws
        if ws is None or ws.closed:
            raise ConnectionLost("not connected to the cloud")
        try:
            frame = encode(msg)
        except ProtocolError as exc:  # this side's bug (a NaN from its model): not sent
            raise CloudProtocolError(
                f"this device made a {type(msg).__name__} frame it cannot send: {exc.reason}"
            ) from None
        await self._send_frame(ws, frame, msg)

    def serve(self, ledger: SentLedger | None) -> None:
        """Write what this session sends from now on into `ledger` (the answer in progress;
        None: no answer), with the Hello that opened it if no answer has listed it yet."""
        self.sent = ledger
        held = self._unlisted_hello
        if ledger is not None and held is not None and ledger.record(*held):
            self._unlisted_hello = None

    async def _send_frame(
        self, ws: aiohttp.ClientWebSocketResponse, frame: bytes, msg: Message
    ) -> None:
        """The one place a frame leaves: counted, and written into the answer's ledger."""
        if self.on_frame_sent is not None:
            self.on_frame_sent(frame)
        async with self._send_lock:  # the ledger in the order the frames left
            try:
                await ws.send_bytes(frame)
            except (ConnectionError, RuntimeError) as exc:
                raise ConnectionLost(
                    f"the connection to the cloud was lost: {_plain(exc)}"
                ) from None
            self.bytes_up += len(frame)
            self.frames_up += 1
            self._ledger(msg, len(frame))

    def _ledger(self, msg: Message, nbytes: int) -> None:
        if self.sent is not None and self.sent.record(msg, nbytes):
            return
        if isinstance(msg, Hello):  # a session opened before any answer: the first one lists it
            self._unlisted_hello = (msg, nbytes)
        else:
            log.debug("%s sent while no answer holds the session", type(msg).__name__)

    # ---- receiving -------------------------------------------------------------------------
    def _count_down(self, n: int) -> None:
        self.bytes_down += n
        self.frames_down += 1

    async def recv(self, timeout: float | None = None) -> Message:
        """The next frame from the cloud (Pongs excepted). Raises ConnectionLost once the
        connection is gone (and on every later call), CloudTimeout after `timeout` s."""
        inbox = self._inbox
        if inbox is None:
            raise ConnectionLost("not connected to the cloud")
        try:
            async with asyncio.timeout(timeout):  # not wait_for: 3.11's can swallow a cancel
                item, nbytes = await inbox.get()
        except TimeoutError:
            raise CloudTimeout(f"no answer from the cloud within {timeout:g} s") from None
        if isinstance(item, ConnectionLost):
            inbox.put_nowait((item, 0))  # stays lost for every later recv()
            raise ConnectionLost(str(item))
        self._inbox_bytes -= nbytes
        if self._inbox_bytes < INBOX_BYTES and inbox.qsize() < INBOX_FRAMES:
            self._inbox_room.set()
        if isinstance(item, CloudError):
            raise item
        return item

    async def _read_loop(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        inbox: asyncio.Queue[tuple[Message | CloudError, int]],
    ) -> None:
        why = "the connection to the cloud was closed"
        try:
            while True:
                wsmsg = await ws.receive()
                if wsmsg.type == WSMsgType.BINARY:
                    received_ns = time.monotonic_ns()
                    self._count_down(len(wsmsg.data))
                    try:
                        msg = decode(wsmsg.data, self._own_limits)
                    except ProtocolError as exc:
                        unreadable = CloudProtocolError(
                            f"the cloud sent a frame this device cannot read: {exc.reason}"
                        )  # held within the inbox's bounds like any frame
                        await self._queue(inbox, unreadable, len(wsmsg.data))
                        continue
                    if isinstance(msg, Pong):
                        self._on_pong(msg, received_ns)
                    elif isinstance(msg, Ping):
                        await self.send(
                            Pong(
                                msg.sent_ns,
                                received_ns,
                                time.monotonic_ns(),
                                request_id=msg.request_id,
                            )
                        )
                    else:
                        await self._queue(inbox, msg, len(wsmsg.data))
                elif wsmsg.type == WSMsgType.TEXT:
                    self._count_down(len(wsmsg.data.encode("utf-8")))
                    log.warning("ignored a text frame from the cloud")
                else:
                    why = self._close_reason(ws, wsmsg)
                    return
        except CloudError as exc:
            why = str(exc)
        except Exception as exc:  # the reader must end with ConnectionLost, never silently
            log.warning("cloud connection reader failed", exc_info=exc)
            why = f"the connection to the cloud failed: {_plain(exc)}"
        finally:
            lost = ConnectionLost(why)
            inbox.put_nowait((lost, 0))
            self._fail_pings(lost)

    async def _queue(
        self,
        inbox: asyncio.Queue[tuple[Message | CloudError, int]],
        item: Message | CloudError,
        nbytes: int,
    ) -> None:
        """Hand a frame (or why it cannot be read) to recv(). A cloud that sends faster than
        the device reads is not read from while INBOX_BYTES or INBOX_FRAMES wait: TCP holds it
        back, the device's memory stays bounded."""
        self._inbox_bytes += nbytes
        inbox.put_nowait((item, nbytes))
        if self._inbox_bytes >= INBOX_BYTES or inbox.qsize() >= INBOX_FRAMES:
            self._inbox_room.clear()
            await self._inbox_room.wait()

    def _close_reason(self, ws: aiohttp.ClientWebSocketResponse, wsmsg: Any) -> str:
        code = ws.close_code
        if wsmsg.type == WSMsgType.ERROR:
            if isinstance(wsmsg.data, aiohttp.ServerTimeoutError):  # the heartbeat's verdict
                return (
                    "the cloud stopped answering (no reply to the connection's heartbeat "
                    f"within {1.5 * (self.heartbeat_s or 0):g} s)"
                )
            return f"the connection to the cloud failed: {_plain(wsmsg.data)}"
        if code in _CLOSE_REASONS:
            return f"the connection to the cloud closed: {_CLOSE_REASONS[code]}"
        extra = wsmsg.extra if isinstance(wsmsg.extra, str) and wsmsg.extra else ""
        if extra:
            return f"the cloud closed the connection ({extra})"
        if code in (None, WSCloseCode.OK):
            return "the cloud closed the connection"
        return f"the connection to the cloud was lost (close code {code})"

    # ---- RTT -------------------------------------------------------------------------------
    def _on_pong(self, pong: Pong, received_ns: int) -> None:
        rtt = (received_ns - pong.ping_sent_ns) / 1e9
        if not 0 <= rtt < 3600:  # not one of this process's pings
            return
        self.rtt_s = rtt if self.rtt_s is None else (1 - RTT_ALPHA) * self.rtt_s + RTT_ALPHA * rtt
        fut = self._pings.pop(pong.ping_sent_ns, None)
        if fut is not None and not fut.done():
            fut.set_result(rtt)

    def _fail_pings(self, exc: CloudError) -> None:
        pings, self._pings = self._pings, {}
        for fut in pings.values():
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # mark retrieved: a ping nobody awaits is not an error

    async def ping(self, timeout: float = 5.0) -> float:
        """One application-level round trip in seconds (also folded into `rtt_s`)."""
        if not self.connected:
            raise ConnectionLost("not connected to the cloud")
        sent = time.monotonic_ns()
        while sent in self._pings:
            sent += 1
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._pings[sent] = fut
        try:
            await self.send(Ping(sent))
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            raise CloudTimeout(f"the cloud did not answer a ping within {timeout:g} s") from None
        finally:
            self._pings.pop(sent, None)
