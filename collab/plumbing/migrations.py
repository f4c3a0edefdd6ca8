"""SQLite schema migrations keyed on `PRAGMA user_version`: the one engine every store uses.

A store lists its migrations, `migrations[i]` taking the schema from version i to i + 1. The
rule, the same for every store: each step and its version bump run in one `BEGIN IMMEDIATE`
transaction, and any error rolls that step back, so a failed or killed migration leaves the
file at the last version it fully reached, never half-way. The version is read inside the
transaction, so two processes opening one file migrate it once. A file written by a newer
program (a version past the list) is refused and left untouched: reading it could lose what
this code does not know about.

Standard library only (the conversation store is imported at start-up).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

__all__ = ["Migration", "SchemaTooNewError", "migrate", "transaction", "user_version"]

log = logging.getLogger(__name__)

Migration = Callable[[sqlite3.Connection], None]


class SchemaTooNewError(RuntimeError):
    """The file was written by a newer program; it was not changed."""


def user_version(conn: sqlite3.Connection) -> int:
    """The schema version recorded in the database header."""
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any error. IMMEDIATE takes the write lock at
    the start, so a read-then-write cannot fail half-way on another writer. `conn` must not be
    inside a transaction already."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")  # inside: a COMMIT that fails (a full disk) is rolled back too
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def migrate(
    conn: sqlite3.Connection,
    migrations: Sequence[Migration],
    *,
    target: int | None = None,
    name: str = "database",
) -> int:
    """Apply the pending steps of `migrations` up to `target` (default: all), one transaction
    each; return the version the file has afterwards. `name` says which file in messages.

    Raises SchemaTooNewError, changing nothing, when the file's version is past the list."""
    known = len(migrations)
    target = known if target is None else target
    if not 0 <= target <= known:
        raise ValueError(f"target version {target} is outside 0..{known}")
    while True:
        with transaction(conn):
            version = user_version(conn)
            if version > known:
                raise SchemaTooNewError(
                    f"{name} has schema version {version}, newer than this Tandem reads (up to "
                    f"{known}). Upgrade Tandem, or move the file aside to start afresh; "
                    "it was not changed."
                )
            if version >= target:
                return version
            log.info("migrating %s: schema %d -> %d", name, version, version + 1)
            migrations[version](conn)
            conn.execute(f"PRAGMA user_version = {version + 1}")
