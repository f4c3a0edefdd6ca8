"""What each watched folder was when the user watched it, and what the user took out of it.

A watched folder is kept where the user put it. At watch time its real path and its device and
inode (`os.stat`: `st_dev`, `st_ino`) are recorded; every sync first checks that the folder
still resolves to that real path and is still that folder. One that now leads elsewhere (it
was replaced by a symlink, or by another folder of the same name) is refused with a plain
notice and nothing in it is read. Watching it again (`tandem docs watch PATH`, or adding it in
the Documents screen) records where it leads now: that is the user's consent to follow it.

Folders that an older Tandem watched have no record here (only `IndexStore.folders`): each is
upgraded at its first sync, recorded as it resolves then.

A document the user removes from inside a watched folder is excluded from that folder's syncs
(and from every ingest into this index) until the user includes it again; removing the watched
folder itself stops watching it. Unwatching a folder drops its exclusions with its record.

The records live in their own small SQLite file next to the index (`watch.sqlite`, 0600),
standard library only: the CLI reads them without loading the embedder."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from collab.plumbing import migrations
from collab.plumbing.files import private_sqlite_file
from collab.plumbing.migrations import transaction

if TYPE_CHECKING:
    from retrieval.store import IndexStore

log = logging.getLogger(__name__)

WATCH_DB = "watch.sqlite"
LARGE_TREE = 10_000
"""Watching a folder holding more files and folders than this needs the user's confirmation
(counted up to one past it: the disk is never walked whole)."""
EXCLUDED_REASON = "excluded: you removed it from the index (include it to bring it back)"


class WatchNeedsConfirmation(ValueError):
    """Watching this folder would index far more than a folder of notes (`/`, the home
    folder, a very large tree): the user must confirm (`--yes`, or yes in the app)."""

    def __init__(self, folder: str, reason: str) -> None:
        super().__init__(f"watching {folder} would index {reason}")
        self.folder, self.reason = folder, reason


class FolderMovedError(RuntimeError):
    """A watched folder now resolves to another place or is another folder: not synced."""


def absolute(path: str | os.PathLike[str]) -> str:
    """A path as the user means it: `~` expanded, made absolute, symlinks left as they are."""
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def is_under(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies inside it (by name, not by prefix of a name)."""
    base = folder.rstrip(os.sep) or os.sep
    return path == base or path.startswith(base if base.endswith(os.sep) else base + os.sep)


def watch_guard(folder: str | os.PathLike[str], *, limit: int | None = None) -> str | None:
    """Why watching `folder` needs a confirmation, or None: the whole disk, the home folder or
    a folder holding it, or more than `limit` (`LARGE_TREE`) entries. Counting stops at
    `limit` + 1 and skips what an ingest skips (hidden entries, symlinked folders), so it is
    quick on any tree."""
    limit = LARGE_TREE if limit is None else limit
    real = Path(os.path.realpath(folder))
    home = Path(os.path.realpath(os.path.expanduser("~")))
    if real == real.parent:
        return "the whole disk (/)"
    if real == home:
        return "your whole home folder"
    if home.is_relative_to(real):
        return f"a folder that holds your home folder ({home})"
    if count_entries(real, limit) > limit:
        return f"more than {limit:,} files and folders"
    return None


def count_entries(folder: Path, limit: int) -> int:
    """Visible files and folders under `folder`, counted up to `limit` + 1."""
    count, todo = 0, [folder]
    while todo:
        try:
            with os.scandir(todo.pop()) as entries:
                for entry in entries:
                    if entry.name.startswith("."):
                        continue
                    count += 1
                    if count > limit:
                        return count
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(Path(entry.path))
        except OSError:  # a folder we may not read: the ingest skips it too
            continue
    return count


@dataclass(frozen=True)
class WatchRecord:
    """A watched folder as it was when watched: `path` as the user named it, `real_path`
    where it led, and which folder it was (device and inode)."""

    path: str
    real_path: str
    dev: int
    ino: int
    recorded_at: float


@dataclass(frozen=True)
class Exclusion:
    """A file (or folder) the user removed from inside the watched folder `folder`."""

    folder: str
    path: str
    excluded_at: float


@dataclass(frozen=True)
class FolderCheck:
    """Where a sync of `folder` may read. `ok`: `real_path`, checked; `gone`: the folder no
    longer exists (its documents, under `real_path`, leave the index); `moved`: it resolves
    elsewhere or is another folder, `notice` says which, and nothing is read."""

    folder: str
    state: Literal["ok", "gone", "moved"]
    real_path: str
    notice: str | None = None
    upgraded: bool = False  # an older Tandem's folder, recorded now


@dataclass(frozen=True)
class Removal:
    """What `remove_documents` did: documents removed at or under `path`, the watched folder
    that now excludes it (None: not inside one), the folders no longer watched."""

    path: str
    documents: int
    excluded_from: str | None = None
    unwatched: tuple[str, ...] = ()


def _v1_initial(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE watched (
            path TEXT PRIMARY KEY,
            real_path TEXT NOT NULL,
            dev INTEGER NOT NULL,
            ino INTEGER NOT NULL,
            recorded_at REAL NOT NULL
        )"""
    )
    conn.execute(
        """CREATE TABLE exclusions (
            folder TEXT NOT NULL,
            path TEXT NOT NULL,
            excluded_at REAL NOT NULL,
            PRIMARY KEY (folder, path)
        )"""
    )


MIGRATIONS: list[migrations.Migration] = [_v1_initial]


class WatchBook:
    """The watch records and exclusions of the index in `root` (`watch.sqlite`).

    Opened on first use, and only created by a write: reading an index that never watched a
    folder (the cloud's public corpus, a new install) creates no file. Thread-safe (one lock):
    the app syncs in worker threads. Another process (the CLI) may write at the same time."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / WATCH_DB
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None

    def _open(self, create: bool) -> sqlite3.Connection | None:
        if self._conn is None:
            if not create and not self.path.exists():
                return None
            private_sqlite_file(self.path)
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            try:
                conn.execute("PRAGMA secure_delete = ON")  # removed names are overwritten
                conn.execute("PRAGMA busy_timeout = 5000")
                migrations.migrate(conn, MIGRATIONS, name=str(self.path))
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _rows(self, sql: str, params: Sequence[object] = ()) -> list[tuple]:
        with self._lock:
            conn = self._open(create=False)
            return [] if conn is None else conn.execute(sql, tuple(params)).fetchall()

    def _write(self, *statements: tuple[str, Sequence[object]]) -> int:
        with self._lock:
            conn = self._open(create=True)
            assert conn is not None
            changed = 0
            with transaction(conn):
                for sql, params in statements:
                    changed += conn.execute(sql, tuple(params)).rowcount
            return changed

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> WatchBook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- records -------------------------------------------------------------------------
    def record(self, folder: str) -> WatchRecord:
        """Record `folder` as it resolves now (watching it, or again: consent to follow it)."""
        real = os.path.realpath(folder)
        st = os.stat(real)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"{folder} is not a folder")
        rec = WatchRecord(folder, real, st.st_dev, st.st_ino, time.time())
        self._write(
            (
                "INSERT INTO watched (path, real_path, dev, ino, recorded_at) VALUES "
                "(?, ?, ?, ?, ?) ON CONFLICT (path) DO UPDATE SET real_path = excluded.real_path,"
                " dev = excluded.dev, ino = excluded.ino, recorded_at = excluded.recorded_at",
                (rec.path, rec.real_path, rec.dev, rec.ino, rec.recorded_at),
            )
        )
        return rec

    def get(self, folder: str) -> WatchRecord | None:
        rows = self._rows(
            "SELECT path, real_path, dev, ino, recorded_at FROM watched WHERE path = ?", [folder]
        )
        return WatchRecord(*rows[0]) if rows else None

    def real_path(self, folder: str) -> str:
        """Where `folder` led when watched (an older Tandem's folder: where it leads now)."""
        rec = self.get(folder)
        return rec.real_path if rec is not None else os.path.realpath(folder)

    def forget(self, folder: str) -> None:
        """Drop `folder`'s record and its exclusions (it is no longer watched)."""
        with self._lock:
            if self._open(create=False) is None:
                return
            self._write(
                ("DELETE FROM watched WHERE path = ?", [folder]),
                ("DELETE FROM exclusions WHERE folder = ?", [folder]),
            )

    def check(self, folder: str, *, upgrade: bool = True) -> FolderCheck:
        """Whether a sync of the watched `folder` may read it, and where (see `FolderCheck`).
        A folder without a record (watched by an older Tandem) is recorded as it resolves now
        when `upgrade`, and read there."""
        rec = self.get(folder)
        if not os.path.lexists(folder):
            real = rec.real_path if rec is not None else os.path.realpath(folder)
            return FolderCheck(folder, "gone", real)
        real = os.path.realpath(folder)
        follow = (
            f"Not synced: nothing there is read. `tandem docs watch {folder}` (or adding it "
            f"again in the Documents screen) follows it; `tandem docs unwatch {folder}` stops "
            "watching it."
        )
        try:
            st = os.stat(real)
        except OSError as exc:
            return FolderCheck(
                folder,
                "moved",
                real,
                f"{folder} now leads to {real}, which cannot be opened ({exc.strerror}). {follow}",
            )
        if not stat.S_ISDIR(st.st_mode):
            return FolderCheck(folder, "moved", real, f"{folder} is no longer a folder. {follow}")
        if rec is None:
            if upgrade:
                self.record(folder)
                log.info("recorded the watched folder %s as it resolves now: %s", folder, real)
            return FolderCheck(folder, "ok", real, upgraded=upgrade)
        if real != rec.real_path:
            return FolderCheck(
                folder,
                "moved",
                real,
                f"{folder} now leads to {real}, not to "
                f"{rec.real_path} where it led when you watched it. {follow}",
            )
        if (st.st_dev, st.st_ino) != (rec.dev, rec.ino):
            return FolderCheck(
                folder,
                "moved",
                real,
                f"{folder} was replaced by another folder of the same "
                f"name since you watched it. {follow}",
            )
        return FolderCheck(folder, "ok", real)

    def folder_holding(self, path: str, folders: Iterable[str]) -> str | None:
        """The innermost of the watched `folders` that `path` lies inside (not the folder
        itself), by the folder's recorded real path or its own."""
        best: tuple[int, str] | None = None
        for folder in folders:
            for base in {self.real_path(folder), folder}:
                inside = is_under(path, base) and path != base.rstrip(os.sep)
                if inside and (best is None or len(base) > best[0]):
                    best = (len(base), folder)
        return None if best is None else best[1]

    # ---- exclusions ----------------------------------------------------------------------
    def exclude(self, folder: str, path: str) -> None:
        """Keep `path` (a file or a folder) out of `folder`'s syncs until it is included."""
        self._write(
            (
                "INSERT INTO exclusions (folder, path, excluded_at) VALUES (?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (folder, path, time.time()),
            )
        )

    def include(self, path: str) -> list[Exclusion]:
        """Drop the exclusions at or under `path` (as typed or resolved); returns them."""
        targets = {absolute(path), os.path.realpath(absolute(path))}
        gone = [e for e in self.exclusions() if any(is_under(e.path, t) for t in targets)]
        if gone:
            self._write(
                *(
                    ("DELETE FROM exclusions WHERE folder = ? AND path = ?", (e.folder, e.path))
                    for e in gone
                )
            )
        return gone

    def exclusions(self, folder: str | None = None) -> list[Exclusion]:
        """The exclusions of `folder` (None: of every folder), by path."""
        sql = "SELECT folder, path, excluded_at FROM exclusions"
        rows = (
            self._rows(sql + " ORDER BY path")
            if folder is None
            else self._rows(sql + " WHERE folder = ? ORDER BY path", [folder])
        )
        return [Exclusion(*r) for r in rows]

    def excluded_paths(self) -> list[str]:
        """Every excluded path (an ingest skips them and what lies under them)."""
        return [e.path for e in self.exclusions()]


def remove_documents(store: IndexStore, book: WatchBook, path: str | os.PathLike[str]) -> Removal:
    """Remove the documents at or under `path` (as typed; else as it resolves). Inside a
    watched folder, the path is excluded from that folder's syncs so that it stays removed;
    a watched folder at or under `path` is no longer watched."""
    target = absolute(path)
    removed = store.remove_prefix(target)
    real = os.path.realpath(target)
    if not removed and real != target and (again := store.remove_prefix(real)):
        target, removed = real, again
    folders = [f.path for f in store.folders()]
    unwatched = tuple(
        f for f in folders if is_under(f, target) or is_under(book.real_path(f), target)
    )
    for folder in unwatched:
        store.remove_folder(folder)
        book.forget(folder)
    holder = book.folder_holding(target, [f for f in folders if f not in unwatched])
    if removed and holder is not None:
        book.exclude(holder, target)
    return Removal(target, removed, holder if removed else None, unwatched)


def unwatch(store: IndexStore, book: WatchBook, folder: str | os.PathLike[str]) -> str | None:
    """Stop watching `folder` (as typed, or the watched folder that leads where it leads);
    its documents stay. Returns the folder as it was watched, None if it was not."""
    target = absolute(folder)
    real = os.path.realpath(target)
    watched = [row.path for row in store.folders()]
    found = next((f for f in watched if f == target), None) or next(
        (f for f in watched if book.real_path(f) == real), None
    )
    if found is not None:
        store.remove_folder(found)
        book.forget(found)
    return found
