"""Parsing in a child process with a deadline, because a stuck parser can only be stopped there.

A parser library looping on a crafted file (pypdf and CPython's html.parser have had such
bugs) cannot be interrupted inside a thread; a process can be killed. `ParseWorker` keeps one
child alive across files (starting one costs about a second of imports: paid once per ingest,
not per file), sends it a file's bytes, and waits at most `timeout_s` for the sections. Past
the deadline the child is killed and the file fails with "parse took longer than 30 s"; the
next file starts a fresh child. A child that dies (a crash in a C extension, the memory cap)
fails only the file it was parsing.

A scan needs longer: before OCR reads a page (`personal_index.ocr.announce_page`) the child
says so, and the deadline moves to at least `ocr_page_s` (20 s) from then. A 40-page scan is
not failed at 30 s, and a page the OCR engine is stuck on still is, 20 s after it began.

The child never writes to the terminal (its stdout and stderr are /dev/null: the TUI owns the
screen); what its libraries log is sent back with each answer and logged here.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import resource
import subprocess
import sys
import threading
import time
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from personal_index import ocr
from personal_index.parsers import DEFAULT_LIMITS, ParseError, ParseLimits
from retrieval.document import ParsedDocument

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PARSE_TIMEOUT_S", "PARSER", "ParseWorker"]

DEFAULT_PARSE_TIMEOUT_S = 30.0
DEFAULT_OCR_PAGE_S = 20.0
"""How long one scanned page may take from the moment OCR starts on it (about 1–2 s here)."""
PARSER = "personal_index.parsers:parse_bytes"
"""The function the child runs, as "module:name" (tests name a stand-in that hangs)."""

# The child's address space: a parse that needs more fails with MemoryError ("out of memory")
# instead of pushing the device into swap. Far above what a capped file needs.
MEMORY_CAP_BYTES = 4 << 30
_MAX_LOG_RECORDS = 20
_BOOT = "from personal_index.parse_worker import _main; _main()"


class _Collect(logging.Handler):
    """Keeps the child's log records of the current file, to send back with the answer."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < _MAX_LOG_RECORDS:
            with contextlib.suppress(Exception):
                self.records.append((record.name, record.levelno, record.getMessage()))


def _main() -> None:
    """The child's entry point (`python -c`): the jobs come on stdin and the answers go out on
    stdout, both taken over as pipes before stdin, stdout and stderr become /dev/null."""
    inbox = Connection(os.dup(0), writable=False)
    outbox = Connection(os.dup(1), readable=False)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    _serve(inbox, outbox, sys.argv[1])


def _serve(inbox: Connection, outbox: Connection, target: str) -> None:
    """The child's loop: (path, bytes, limits) in, ("ok" | "error", result, logs) out, until
    None or the parent's end of the pipe closes (the parent died: nothing to finish)."""
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
    ocr.set_page_listener(lambda: outbox.send(("page", None, [])))
    while True:
        try:
            job = inbox.recv()
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
            outbox.send((*reply, collect.records))
        except Exception as exc:  # a result that cannot be sent (pickling, memory)
            outbox.send(("error", f"unexpected error: {type(exc).__name__}", []))


class ParseWorker:
    """One parsing child at a time, started on first use, restarted after a kill. `parse` is
    called from one thread at a time; `close` may come from any thread (it ends a wait)."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_PARSE_TIMEOUT_S,
        target: str = PARSER,
        ocr_page_s: float = DEFAULT_OCR_PAGE_S,
    ) -> None:
        if not timeout_s > 0 or not ocr_page_s > 0:
            raise ValueError(f"timeouts must be positive (got {timeout_s!r}, {ocr_page_s!r})")
        self.timeout_s = timeout_s
        self.ocr_page_s = ocr_page_s
        self.target = target
        self.starts = 0
        """How many children were started (the first, then one after each kill or crash)."""
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._pipes: tuple[Connection, Connection] | None = None  # (to the child, from it)
        self._closed = False

    def __enter__(self) -> ParseWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _child(self) -> tuple[Connection, Connection]:
        with self._lock:
            if self._closed:
                raise ParseError("ingest stopped")
            if self._proc is None or self._proc.poll() is not None or self._pipes is None:
                self._stop_locked()
                # A fresh interpreter (never a fork of a process with threads) that imports
                # what this one does: the same sys.path, and nothing from the working folder
                # (`-P`: `-c` would put it first, so a `personal_index/` there would run).
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
                proc = subprocess.Popen(
                    [sys.executable, "-P", "-c", _BOOT, self.target],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    env=env,
                    close_fds=True,
                )
                assert proc.stdin is not None and proc.stdout is not None
                to_child = Connection(os.dup(proc.stdin.fileno()), readable=False)
                from_child = Connection(os.dup(proc.stdout.fileno()), writable=False)
                proc.stdin.close()
                proc.stdout.close()
                self._proc, self._pipes = proc, (to_child, from_child)
                self.starts += 1
            return self._pipes

    def parse(
        self, path: Path, data: bytes, limits: ParseLimits = DEFAULT_LIMITS
    ) -> ParsedDocument:
        """The sections of `data` (the bytes of `path`), parsed in the child. Raises ParseError
        for a bad file, for one past the deadline ("parse took longer than 30 s") and for one
        the child died on."""
        to_child, from_child = self._child()
        scanned = 0
        deadline = time.monotonic() + self.timeout_s
        try:
            to_child.send((str(path), data, limits))
            while True:
                if not from_child.poll(max(0.0, deadline - time.monotonic())):
                    self._stop()
                    raise ParseError(self._too_long(scanned))
                status, payload, records = from_child.recv()
                if status != "page":
                    break
                scanned += 1
                deadline = max(deadline, time.monotonic() + self.ocr_page_s)
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

    def _too_long(self, scanned: int) -> str:
        if scanned == 0:
            return f"parse took longer than {self.timeout_s:g} s"
        return f"OCR took longer than {self.ocr_page_s:g} s on scanned page {scanned}"

    def _stop(self) -> int | None:
        with self._lock:
            return self._stop_locked()

    def _stop_locked(self) -> int | None:
        """Kill the child (if any) and wait for it; its exit code."""
        proc, pipes = self._proc, self._pipes
        self._proc = self._pipes = None
        code = None
        if proc is not None:  # first the child: its death ends a wait on the pipe in `parse`
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            code = proc.returncode
        for pipe in pipes or ():
            pipe.close()
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
            proc, pipes = self._proc, self._pipes
            if proc is not None and pipes is not None and proc.poll() is None:
                with contextlib.suppress(OSError, ValueError):
                    pipes[0].send(None)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(1)
            self._stop_locked()
