"""Repeated log lines, rate-limited: a device that sends ten thousand malformed frames costs the
log a few lines and one count, not ten thousand lines.

A line's event is the first word of its message (`kv` lines start with it); when the first
field is `session=...` the line also belongs to that session. Per window of `window_s`:
at most `per_session` lines of one event from one session (a flooding device cannot hide
other devices' lines of the same event), and at most `per_event` lines of one event in all
(a device that reconnects for every few frames is held too). What is held back is counted,
and one `log_suppressed event=... lines=N` line says so once the event's window has ended
(written before the next line that passes, or when the log is closed)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cloud_backend.logfmt import kv

__all__ = ["PER_EVENT", "PER_SESSION", "WINDOW_S", "RepeatLimiter", "limit_repeats"]

PER_SESSION = 20  # lines of one event for one session per window: a session's story stays whole
PER_EVENT = 1000  # lines of one event per window, all sessions together (a busy server's)
WINDOW_S = 60.0
MAX_KEYS = 4096  # windows remembered at once: the limiter's memory is bounded too
OTHER = "(other)"  # the event of lines past MAX_KEYS distinct events
SUMMARY = "tandem_suppressed_summary"  # set on the limiter's own records: they always pass
_SWEEP_S = 1.0  # how often ended windows are looked for


@dataclass
class _Window:
    start: float
    passed: int = 0
    suppressed: int = 0
    level: int = logging.NOTSET  # the highest level held back


def _event_of(record: logging.LogRecord) -> tuple[str, str]:
    """(event, session): the message's first word and its `session=` first field, if any."""
    try:
        text = record.getMessage()
    except Exception:  # a broken format: the handler reports it; group it by its template
        text = str(record.msg)
    event, _, rest = text.partition(" ")
    session = rest.partition(" ")[0] if rest.startswith("session=") else ""
    return event[:80], session[:80]


class RepeatLimiter(logging.Filter):
    """A handler's filter that holds back repeated lines (see the module). It writes its
    summaries through `handler`, the handler it filters for."""

    def __init__(
        self,
        handler: logging.Handler,
        *,
        per_session: int = PER_SESSION,
        per_event: int = PER_EVENT,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.handler = handler
        self.per_session, self.per_event, self.window_s = per_session, per_event, window_s
        self._clock = clock
        self._lock = threading.Lock()  # records come from the event loop and worker threads
        self._events: dict[tuple[str, str], _Window] = {}  # (logger, event)
        self._sessions: dict[tuple[str, str, str], _Window] = {}  # (logger, event, session)
        self._next_sweep = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, SUMMARY, False):
            return True
        event, session = _event_of(record)
        due: list[logging.LogRecord] = []
        with self._lock:
            now = self._clock()
            if now >= self._next_sweep:
                self._sweep(now, due)
            passes = self._count(record, event, session, now, due)
        for summary in due:  # before this record: the count is of lines older than it
            self.handler.handle(summary)
        return passes

    def report(self) -> None:
        """Write the counts of every window still open (at shutdown: none is lost)."""
        due: list[logging.LogRecord] = []
        with self._lock:
            for key, window in self._events.items():
                self._summarise(key, window, due)
            self._events.clear()
            self._sessions.clear()
        for summary in due:
            self.handler.handle(summary)

    def _count(
        self,
        record: logging.LogRecord,
        event: str,
        session: str,
        now: float,
        due: list[logging.LogRecord],
    ) -> bool:
        key = (record.name, event)
        if key not in self._events and len(self._events) >= MAX_KEYS:
            key = (record.name, OTHER)
        window = self._events.get(key)
        if window is None or now - window.start >= self.window_s:
            if window is not None:
                self._summarise(key, window, due)
            window = self._events[key] = _Window(now)
        mine = self._session_window(key, session, now)
        full = mine is not None and mine.passed >= self.per_session
        if full or window.passed >= self.per_event:
            window.suppressed += 1
            window.level = max(window.level, record.levelno)
            return False
        window.passed += 1
        if mine is not None:
            mine.passed += 1
        return True

    def _session_window(self, key: tuple[str, str], session: str, now: float) -> _Window | None:
        if not session:
            return None
        skey = (*key, session)
        mine = self._sessions.get(skey)
        if mine is not None and now - mine.start < self.window_s:
            return mine
        if mine is None and len(self._sessions) >= MAX_KEYS:
            return None  # too many at once: the event's own bound still holds
        mine = self._sessions[skey] = _Window(now)
        return mine

    def _sweep(self, now: float, due: list[logging.LogRecord]) -> None:
        """Summarise and forget the windows that have ended (a flood that stopped is reported
        with the next line of any event, not only with the next of its own)."""
        self._next_sweep = now + min(_SWEEP_S, self.window_s)
        for key, window in list(self._events.items()):
            if now - window.start >= self.window_s:
                self._summarise(key, window, due)
                del self._events[key]
        for skey, mine in list(self._sessions.items()):
            if now - mine.start >= self.window_s:
                del self._sessions[skey]

    def _summarise(
        self, key: tuple[str, str], window: _Window, due: list[logging.LogRecord]
    ) -> None:
        if not window.suppressed:
            return
        name, event = key
        summary = logging.LogRecord(
            name,
            window.level,
            __file__,
            0,
            kv("log_suppressed", event=event, lines=window.suppressed, window_s=self.window_s),
            None,
            None,
        )
        setattr(summary, SUMMARY, True)
        due.append(summary)
        window.suppressed = 0


def limit_repeats(
    handler: logging.Handler,
    *,
    per_session: int = PER_SESSION,
    per_event: int = PER_EVENT,
    window_s: float = WINDOW_S,
) -> RepeatLimiter:
    """Install a `RepeatLimiter` on `handler` and return it (`report()` it before closing)."""
    limiter = RepeatLimiter(
        handler, per_session=per_session, per_event=per_event, window_s=window_s
    )
    handler.addFilter(limiter)
    return limiter
