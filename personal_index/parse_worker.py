"""Parsing in a child process with a deadline, because a stuck parser can only be stopped there.

A parser library looping on a crafted file (pypdf and CPython's html.parser have had such
bugs) cannot be interrupted inside a thread; a process can be killed. `ParseWorker` keeps one
child alive across files (starting one costs about a second of imports: paid once per ingest,
not per file), sends it a file's bytes, and waits at most `timeout_s` for the sections. Past
the deadline the child is killed and the file fails with "parse took longer than 30 s"; the
next file starts a fresh child. A child that dies (a crash in a C extension, the memory cap)
fails only the file it was parsing.

The child never writes to the terminal (its stdout and stderr are /dev/null: the TUI owns the
screen); what its libraries log is sent back with each answer and logged here.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import resource
import threading
import warnings
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from personal_index.parsers import DEFAULT_LIMITS, ParseError, ParseLimits
from retrieval.document import ParsedDocument

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PARSE_TIMEOUT_S", "PARSER", "ParseWorker"]

DEFAULT_PARSE_TIMEOUT_S = 30.0
PARSER = "personal_index.parsers:parse_bytes"
"""The function the child runs, as "module:name" (tests name a stand-in that hangs)."""

# The child's address space: a parse that needs more fails with MemoryError ("out of memory")
# instead of pushing the device into swap. Far above what a capped file needs.
MEMORY_CAP_BYTES = 4 << 30
_MAX_LOG_RECORDS = 20


class _Collect(logging.Handler):
    """Keeps the child's log records of the current file, to send back with the answer."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < _MAX_LOG_RECORDS:
            with contextlib.suppress(Exception):
                self.records.append((record.name, record.levelno, record.getMessage()))


def _serve(conn: Connection, target: str) -> None:
    """The child's loop: (path, bytes, limits) in, ("ok" | "error", result, logs) out, until
    None or the parent's end of the pipe closes (the parent died: nothing to finish)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    warnings.simplefilter("ignore")
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = MEMORY_CAP_BYTES if hard == resource.RLIM_INFINITY else min(hard, MEMORY_CAP_BYTES)
        if soft == resource.RLIM_INFINITY or soft > cap:
            resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    collect = _Collect()
    root = logging.getLogger()
    root.handlers[:] = [collect]
    root.setLevel(logging.INFO)
    module, _, name = target.partition(":")
    parse = getattr(importlib.import_module(module), name)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        path, data, limits = job
        collect.records = []
        reply: tuple[str, Any]
        try:
            reply = ("ok", parse(Path(path), data, limits))
        except ParseError as exc:
            reply = ("error", exc.reason)
        except MemoryError:
            reply = ("error", "out of memory while parsing")
        except Exception as exc:  # a parser bug must not end the worker
            reply = ("error", f"unexpected error: {type(exc).__name__}: {exc}")
        try:
            conn.send((*reply, collect.records))
        except Exception as exc:  # a result that cannot be sent (pickling, memory)
            conn.send(("error", f"unexpected error: {type(exc).__name__}", []))


class ParseWorker:
    """One parsing child at a time, started on first use, restarted after a kill. `parse` is
    called from one thread at a time; `close` may come from any thread (it ends a wait)."""

    def __init__(self, timeout_s: float = DEFAULT_PARSE_TIMEOUT_S, target: str = PARSER) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive (got {timeout_s!r})")
        self.timeout_s = timeout_s
        self.target = target
        self.starts = 0
        """How many children were started (the first, then one after each kill or crash)."""
        self._lock = threading.Lock()
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._closed = False

    def __enter__(self) -> ParseWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _child(self) -> Connection:
        with self._lock:
            if self._closed:
                raise ParseError("ingest stopped")
            if self._proc is None or not self._proc.is_alive() or self._conn is None:
                self._stop_locked()
                ctx = multiprocessing.get_context("spawn")  # never fork a process with threads
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_serve, args=(child, self.target), name="tandem-parse", daemon=True
                )
                proc.start()
                child.close()
                self._proc, self._conn = proc, parent
                self.starts += 1
            return self._conn

    def parse(
        self, path: Path, data: bytes, limits: ParseLimits = DEFAULT_LIMITS
    ) -> ParsedDocument:
        """The sections of `data` (the bytes of `path`), parsed in the child. Raises ParseError
        for a bad file, for one past the deadline ("parse took longer than 30 s") and for one
        the child died on."""
        conn = self._child()
        try:
            conn.send((str(path), data, limits))
            if not conn.poll(self.timeout_s):
                self._stop()
                raise ParseError(f"parse took longer than {self.timeout_s:g} s")
            status, payload, records = conn.recv()
        except (EOFError, OSError) as exc:
            code = self._stop()
            if self._closed:
                raise ParseError("ingest stopped") from exc
            raise ParseError(f"the parser stopped unexpectedly (exit code {code})") from exc
        for name, level, message in records:
            logging.getLogger(name).log(level, "%s: %s", path, message)
        if status != "ok":
            raise ParseError(str(payload))
        if not isinstance(payload, ParsedDocument):
            raise ParseError(f"unexpected answer from the parser: {type(payload).__name__}")
        return payload

    def _stop(self) -> int | None:
        with self._lock:
            return self._stop_locked()

    def _stop_locked(self) -> int | None:
        """Kill the child (if any) and wait for it; its exit code."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        code = None
        if proc is not None:  # first the child: its death ends a wait on the pipe in `parse`
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            code = proc.exitcode
            with contextlib.suppress(ValueError):
                proc.close()
        if conn is not None:
            conn.close()
        return code

    def open(self) -> None:
        """Allow children again after `close` (the next `parse` starts one)."""
        with self._lock:
            self._closed = False

    def close(self) -> None:
        """Stop the child (asked to leave if idle, killed if it does not within a second) and
        start no other until `open`: a `parse` waiting meanwhile fails with "ingest stopped"."""
        with self._lock:
            self._closed = True
            proc, conn = self._proc, self._conn
            if proc is not None and conn is not None and proc.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    conn.send(None)
                proc.join(1)
            self._stop_locked()
