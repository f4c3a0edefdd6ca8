"""Reading a file to ingest without being hung or led astray (issue 28 item 2).

A folder the user ingests may hold things that are not documents: a FIFO (opening it for
reading blocks until a writer comes), a device (`/dev/zero` never ends), a socket, a symlink
to a file outside the folder. `refusal` says, from `lstat`/`stat` alone (neither blocks), why
such a path is not read; `read_document` then opens the file without blocking
(`O_NONBLOCK`), checks with `fstat` that what it opened is a regular file inside the folder
(the check that counts: the path may have been swapped since `refusal`), and reads at most
the size cap. Those bytes are the ones hashed and parsed, so the stored checksum is that of
the text indexed.

Standard library only and light: `app.settings` imports the default cap from here.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["DEFAULT_MAX_FILE_MB", "MB", "Refused", "read_document", "refusal", "too_large"]

DEFAULT_MAX_FILE_MB = 50
"""The default per-file size cap (the `ingest_max_mb` setting), in MB (10^6 bytes)."""

MB = 1_000_000

_KINDS = (
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISDIR, "folder"),
)

_READ_BLOCK = 1 << 20


class Refused(Exception):
    """A file that ingest does not read. `skip` is True for what is not a document of the folder
    (a FIFO, a device, a symlink leading out: outcome "skipped") and False for a document that
    cannot be indexed as it is (too large, unreadable: outcome "failed")."""

    def __init__(self, reason: str, *, skip: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.skip = skip


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "special file")
    return f"not a regular file ({kind})"


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def too_large(size: int, max_bytes: int) -> str:
    """The reason for a file over the cap: "too large (12.0 MB > 10 MB cap)"."""
    return f"too large ({size / MB:.1f} MB > {max_bytes / MB:g} MB cap)"


def refusal(path: Path, root: Path) -> str | None:
    """Why `path` (found under the resolved folder `root`, or `root` itself) is not read, or
    None. Only `lstat`/`stat` are called, which never block on a FIFO or a device."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            if not _inside(os.path.realpath(path), str(root)):
                return "symlink leads outside the folder"
            st = os.stat(path)
    except OSError as exc:  # a dangling symlink, a file removed meanwhile
        return f"cannot read file: {exc.strerror or exc}"
    return _not_regular(st.st_mode)


def read_document(path: Path, root: Path, max_bytes: int) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file `path` (at most `max_bytes` of them) and its `fstat`, taken
    before reading (a file changed while being read then looks changed at the next ingest).

    Raises `Refused`: not a regular file, a symlink leading outside `root`, larger than
    `max_bytes`, or unreadable."""
    real = os.path.realpath(path)
    if not _inside(real, str(root)):
        raise Refused("symlink leads outside the folder", skip=True)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except OSError as exc:  # ENXIO: a socket; ELOOP: swapped for a symlink since realpath
        raise Refused(f"cannot read file: {exc.strerror or exc}", skip=False) from exc
    try:
        st = os.fstat(fd)
        if (reason := _not_regular(st.st_mode)) is not None:
            raise Refused(reason, skip=True)
        opened = _opened_path(fd)
        if opened is not None and not _inside(opened, str(root)):
            raise Refused("symlink leads outside the folder", skip=True)
        if st.st_size > max_bytes:
            raise Refused(too_large(st.st_size, max_bytes), skip=False)
        data = _read_at_most(fd, max_bytes + 1)
        if len(data) > max_bytes:  # it grew while being read
            raise Refused(too_large(len(data), max_bytes), skip=False)
        return data, st
    except OSError as exc:
        raise Refused(f"cannot read file: {exc.strerror or exc}", skip=False) from exc
    finally:
        os.close(fd)


def _opened_path(fd: int) -> str | None:
    """Where the open file really is (Linux: /proc/self/fd), so a folder on the way swapped
    for a symlink after `realpath` is caught; None where the system cannot say."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _read_at_most(fd: int, limit: int) -> bytes:
    parts: list[bytes] = []
    left = limit
    while left > 0:
        block = os.read(fd, min(left, _READ_BLOCK))
        if not block:
            break
        parts.append(block)
        left -= len(block)
    return b"".join(parts)
