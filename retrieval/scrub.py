"""Scrubbing deleted text out of the index's files, as a debt recorded in the file itself.

A deleted chunk's text can stay in ``index.sqlite`` in three places: the database file's old
page versions (until a WAL checkpoint copies the new ones over them), the WAL's old frames
(until the WAL is truncated) and, without FTS5's own secure-delete (SQLite < 3.42), the keyword
index's segments (until 'optimize' merges them). ``PRAGMA secure_delete`` zeroes what a delete
frees in the new page versions; the scrub does the rest.

The debt is written in the same transaction as the delete (`owe`) and cleared only when a
scrub has finished (`scrub`), so a process killed in between leaves it in the file and the next
store to open the file pays it. Each delete writes a fresh token and a scrub clears only the
token it read before it started, so a delete committed meanwhile by another process stays owed.

Text deleted before schema 5 may also sit in free pages and cell slack that no pragma
overwrote: the upgrade owes one `compact` (optimize + VACUUM), paid at the next open.
"""

from __future__ import annotations

import logging
import secrets
import sqlite3

from collab.plumbing.migrations import transaction

log = logging.getLogger(__name__)

#: ``meta`` keys: deleted text may still be in the files (a token), and an upgrade's VACUUM.
OWED = "scrub_owed"
COMPACT_OWED = "compact_owed"

_UPSERT = "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = ?"
_OPTIMIZE = "INSERT INTO chunks_fts(chunks_fts) VALUES ('optimize')"


def fts_secure_delete() -> bool:
    """Whether FTS5 overwrites a deleted row's terms itself (SQLite ≥ 3.42, switched on at
    open); a function, so that a test can take the other path on a newer SQLite."""
    return sqlite3.sqlite_version_info >= (3, 42, 0)


def owe(conn: sqlite3.Connection) -> None:
    """Record, in the caller's transaction, that deleted text may still be in the files."""
    token = secrets.token_hex(8)
    conn.execute(_UPSERT, [OWED, token, token])


def owe_compact(conn: sqlite3.Connection) -> None:
    """Record, in the caller's transaction (a migration), that the file needs one VACUUM."""
    conn.execute(_UPSERT, [COMPACT_OWED, "1", "1"])


def _get(conn: sqlite3.Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
    return None if row is None else str(row[0])


def scrub(conn: sqlite3.Connection, name: str, *, keywords: bool = True) -> None:
    """Pay the debt if there is one: merge the keyword index's segments (before 3.42; only
    with `keywords`, since it rewrites the whole keyword index: ~0.45 s at 10k chunks, so an
    ingest merges once, at its end), then checkpoint the WAL into the database and truncate
    it. A reader in another process can hold the checkpoint back, and a writer the merge:
    then the debt stays for the next flush or open."""
    token = _get(conn, OWED)  # read first: a delete after this owes a scrub of its own
    if token is None:
        return
    merge = keywords and not fts_secure_delete()
    try:
        if merge:
            with transaction(conn):
                conn.execute(_OPTIMIZE)
        busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            log.debug("WAL checkpoint of %s postponed: another connection is reading", name)
            return
        if not (keywords or fts_secure_delete()):
            return  # the deleted terms wait for the ingest's last flush
        with transaction(conn):
            conn.execute("DELETE FROM meta WHERE key = ? AND value = ?", [OWED, token])
    except sqlite3.OperationalError as exc:  # the delete itself is committed: not an error
        log.warning("scrub of %s postponed: %s", name, exc)


def compact(conn: sqlite3.Connection, name: str) -> None:
    """Pay an upgrade's VACUUM once: merge the keyword index's segments and rebuild the file,
    so text an older Tandem deleted without overwriting it is gone; the checkpoint that puts
    the new pages over the old ones is owed like any scrub. On an error (a full disk) it is
    logged and tried again at the next open."""
    if _get(conn, COMPACT_OWED) is None:
        return
    log.info("compacting %s once, for text that an older Tandem deleted", name)
    try:
        with transaction(conn):
            conn.execute(_OPTIMIZE)
        conn.execute("VACUUM")
        with transaction(conn):
            conn.execute("DELETE FROM meta WHERE key = ?", [COMPACT_OWED])
            owe(conn)
    except sqlite3.Error as exc:
        log.warning("compacting %s postponed to its next open: %s", name, exc)
