"""Stand-in parse functions for the parse worker's child (`ParseWorker(target=...)`): each runs
the real parser except on its trigger, so the tests can prove what the worker does when a
parser hangs or crashes, and see the bytes the child was given. Light: the child imports it."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import time
from pathlib import Path

from personal_index.parsers import ParseLimits, parse_bytes
from retrieval.document import ParsedDocument

HANG = "tests.ingest_hooks:parse_or_hang"
CRASH = "tests.ingest_hooks:parse_or_crash"
TITLED_BY_SHA = "tests.ingest_hooks:parse_titled_by_sha"


def parse_or_hang(path: Path, data: bytes, limits: ParseLimits) -> ParsedDocument:
    """A parser stuck for ever on a file that starts with HANG (no signal handler, no timer:
    only killing the process ends it)."""
    if data.startswith(b"HANG"):
        while True:
            time.sleep(3600)
    return parse_bytes(path, data, limits)


def parse_or_crash(path: Path, data: bytes, limits: ParseLimits) -> ParsedDocument:
    """A parser that segfaults (as a C extension would) on a file that starts with CRASH."""
    if data.startswith(b"CRASH"):
        os.kill(os.getpid(), signal.SIGSEGV)
    return parse_bytes(path, data, limits)


def parse_titled_by_sha(path: Path, data: bytes, limits: ParseLimits) -> ParsedDocument:
    """The real parse, titled by the sha256 of the bytes it parsed."""
    doc = parse_bytes(path, data, limits)
    return dataclasses.replace(doc, title=hashlib.sha256(data).hexdigest())
