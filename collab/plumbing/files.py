"""Crash-safe file writes and streaming file hashes, the one copy every package uses.

A kill (or a power cut) at any instant must leave a file either as it was or as it was meant to
be, never half-written: `atomic_write` writes a hidden temporary sibling, fsyncs it, renames it
over the target (atomic on POSIX within one file system) and fsyncs the folder so the rename
itself is durable. `publish` is the same idea for a file or folder built in a `fresh_partial`
sibling (a model conversion, an ONNX export): it appears whole or not at all.

Private files (the index, conversations, logs, exports) must never exist, even for an instant,
with modes other local users can read: `private_opener`, `create_private_file` and
`make_private_dir` create them 0600 / 0700 whatever the umask, and `tighten` narrows what an
older Tandem left readable. `private_sqlite_file` does both for a SQLite database, whose
`-wal`, `-shm` and `-journal` files SQLite creates with the main file's permissions.

Standard library only: imported by the device, the cloud, packaging and the benchmarks alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "SQLITE_SIDE_FILES",
    "atomic_write",
    "create_private_file",
    "discard_temp_files",
    "fresh_partial",
    "fsync_dir",
    "make_private_dir",
    "private_opener",
    "private_sqlite_file",
    "publish",
    "sha256_file",
    "sha256_files",
    "tighten",
]

log = logging.getLogger(__name__)

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700
_OTHERS = 0o077  # group and other bits: what "private" takes away
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")

_TMP_SUFFIX = ".tmp"
_HASH_BLOCK = 1 << 22  # 4 MiB: large enough that the syscall count does not matter


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX); a no-op where folders cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _create_temp(path: Path, mode: int | None) -> tuple[int, Path]:
    """A new, unique `.<name>.<random>.tmp` beside `path`, opened for writing. Without `mode`
    it is created like any new file (0o666 less the umask), unlike `tempfile.mkstemp`'s 0o600,
    so a replaced file keeps the permissions it always had; with `mode` it has exactly that
    from its creation, before a byte is written (a kill mid-write must not leave a secret in a
    file others can read)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        except FileExistsError:
            continue
        if mode is not None:
            os.fchmod(fd, mode)  # exactly `mode`: the umask only ever narrowed it
        return fd, tmp


def atomic_write(
    path: Path, data: str | bytes, *, mode: int | None = None, encoding: str = "utf-8"
) -> None:
    """Replace `path` with `data` (text is encoded with `encoding`) so that readers and crashes
    see the old content or the new, never a mix. `mode` (e.g. 0o600 for a file holding a
    secret) is the temporary file's from its creation, so the content is never visible with
    looser permissions, even in a temporary file left by a kill.

    The temporary file is unique (`.<name>.<random>.tmp`), so two writers never share one; it
    is removed on any error. The parent folder must exist."""
    path = Path(path)
    payload = data.encode(encoding) if isinstance(data, str) else data
    fd, tmp = _create_temp(path, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def discard_temp_files(path: Path) -> None:
    """Delete the temporary siblings that `atomic_write(path, ...)` calls killed mid-write left
    behind (call it only where one process owns `path`)."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*{_TMP_SUFFIX}"):
        stale.unlink(missing_ok=True)


def publish(partial: Path, final: Path) -> None:
    """Move a finished `partial` file or folder into place, replacing any stale `final`.

    A folder cannot be renamed over a non-empty one, so the old `final` is removed first: a
    kill in between leaves no `final` (rebuilt next time), never a mix of old and new."""
    final = Path(final)
    if final.is_dir() and not final.is_symlink():
        shutil.rmtree(final)
    elif final.exists() or final.is_symlink():
        final.unlink()
    os.replace(partial, final)
    fsync_dir(final.parent)


def fresh_partial(final: Path) -> Path:
    """An empty `<final>.partial` path to build `final` in before `publish`: leftovers of a
    killed run are discarded."""
    final = Path(final)
    partial = final.with_name(final.name + ".partial")
    if partial.is_dir() and not partial.is_symlink():
        shutil.rmtree(partial)
    elif partial.exists() or partial.is_symlink():
        partial.unlink()
    return partial


def sha256_file(
    path: Path,
    progress: Callable[[int], object] | None = None,
    *,
    copy_to: BinaryIO | None = None,
) -> str:
    """Hex sha256 of a file, read in blocks (model files are gigabytes). `progress` is called
    with each block's size (a tqdm bar's `update`); `copy_to` also receives every block."""
    return sha256_files([path], progress, copy_to=copy_to)


def sha256_files(
    paths: Iterable[Path],
    progress: Callable[[int], object] | None = None,
    *,
    copy_to: BinaryIO | None = None,
) -> str:
    """Hex sha256 of the concatenation of `paths` (a model split into parts), streamed as
    `sha256_file` streams one file."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            while block := fh.read(_HASH_BLOCK):
                digest.update(block)
                if copy_to is not None:
                    copy_to.write(block)
                if progress is not None:
                    progress(len(block))
    return digest.hexdigest()


# --------------------------------------------------------------------------- private files


def private_opener(path: str | os.PathLike[str], flags: int) -> int:
    """An `opener` for `open()` that creates a missing file 0600 (an existing file keeps its
    mode: `tighten` it). `open(path, "a", opener=private_opener)`."""
    return os.open(path, flags, PRIVATE_FILE_MODE)


def create_private_file(path: Path) -> bool:
    """Create `path` empty and 0600 if it does not exist (True if this call created it), so a
    program that then opens it (SQLite) never creates it under the umask."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def make_private_dir(folder: Path) -> Path:
    """Create `folder` and its missing parents 0700 (`mkdir(parents=True)` gives parents the
    umask's 0755). Existing folders are left as they are: `tighten` the ones Tandem owns."""
    folder = Path(folder)
    missing: list[Path] = []
    here = folder
    while not os.path.lexists(here) and here != here.parent:
        missing.append(here)
        here = here.parent
    for part in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process was first
            os.mkdir(part, PRIVATE_DIR_MODE)
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} exists and is not a folder")
    return folder


def tighten(paths: Iterable[Path]) -> list[Path]:
    """Take the group and other permission bits off each existing file or folder in `paths`
    (symlinks and what they point to are left alone); returns those that changed. A path
    this user cannot change (owned by another) is logged and skipped."""
    changed: list[Path] = []
    for path in paths:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) or not st.st_mode & _OTHERS:
            continue
        try:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~_OTHERS)
        except OSError as exc:
            log.warning("could not make %s private: %s", path, exc)
            continue
        changed.append(Path(path))
    return changed


def private_sqlite_file(path: Path) -> list[Path]:
    """Make a SQLite database private before it is opened: create it 0600 if it is new (SQLite
    then creates its -wal, -shm and -journal with the same mode) and tighten the files an
    older Tandem left readable. Returns the paths that were tightened."""
    path = Path(path)
    create_private_file(path)
    return tighten([path, *(path.with_name(path.name + s) for s in SQLITE_SIDE_FILES)])
