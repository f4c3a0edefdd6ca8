"""Crash-safe file writes and streaming file hashes, the one copy every package uses.

A kill (or a power cut) at any instant must leave a file either as it was or as it was meant to
be, never half-written: `atomic_write` writes a hidden temporary sibling, fsyncs it, renames it
over the target (atomic on POSIX within one file system) and fsyncs the folder so the rename
itself is durable. `publish` is the same idea for a file or folder built in a `fresh_partial`
sibling (a model conversion, an ONNX export): it appears whole or not at all.

Standard library only: imported by the device, the cloud, packaging and the benchmarks alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "atomic_write",
    "discard_temp_files",
    "fresh_partial",
    "fsync_dir",
    "publish",
    "sha256_file",
    "sha256_files",
]

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
