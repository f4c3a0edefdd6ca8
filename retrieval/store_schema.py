"""The store's SQLite schema and its migrations, one per version: an index written by any
earlier version opens, upgraded in place (`collab.plumbing.migrations`)."""

from __future__ import annotations

import sqlite3

from sqlite_utils import Database

from collab.plumbing import migrations
from collab.plumbing.migrations import Migration, user_version
from retrieval import scrub


def _migrate_v0_to_v1(conn: sqlite3.Connection) -> None:
    """Initial schema: documents, chunks (with vectors), meta."""
    for sql in (
        """CREATE TABLE documents (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            path TEXT NOT NULL UNIQUE,
            size INTEGER NOT NULL,
            mtime REAL NOT NULL,
            sha256 TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('indexed', 'failed')),
            error TEXT,
            title TEXT,
            kind TEXT,
            chunk_count INTEGER NOT NULL DEFAULT 0,
            indexed_at REAL NOT NULL
        )""",
        """CREATE TABLE chunks (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            document_id INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
            ordinal INTEGER NOT NULL,
            text TEXT NOT NULL,
            page INTEGER,
            title TEXT,
            line_start INTEGER,
            line_end INTEGER,
            char_start INTEGER,
            char_end INTEGER,
            vector BLOB NOT NULL
        )""",
        "CREATE INDEX chunks_document_id ON chunks(document_id)",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    ):
        conn.execute(sql)


def _migrate_v1_to_v2(conn: sqlite3.Connection) -> None:
    """Make (document, ordinal) unique, so a duplicate chunk is impossible rather than merely
    avoided, and index documents by status for the failed-files listing."""
    conn.execute(
        "DELETE FROM chunks WHERE id NOT IN "
        "(SELECT min(id) FROM chunks GROUP BY document_id, ordinal)"
    )
    conn.execute(
        "UPDATE documents SET chunk_count = "
        "(SELECT count(*) FROM chunks WHERE chunks.document_id = documents.id)"
    )
    conn.execute("CREATE UNIQUE INDEX chunks_document_ordinal ON chunks(document_id, ordinal)")
    conn.execute("CREATE INDEX documents_status ON documents(status)")


def _migrate_v2_to_v3(conn: sqlite3.Connection) -> None:
    """Folders the user asked to keep in sync (watched by the app), with their last sync."""
    conn.execute(
        """CREATE TABLE folders (
            path TEXT PRIMARY KEY,
            added_at REAL NOT NULL,
            synced_at REAL
        )"""
    )


#: FTS5's tokenizer: Porter stems ("decorators" finds "decorator"); unicode61 splits at
#: punctuation, so `max_file_mb`, `os.path.join` and `--flag` are indexed as their parts and
#: found again as phrases (`retrieval.keywords`).
FTS_TOKENIZER = "porter unicode61 remove_diacritics 2"


def _migrate_v3_to_v4(conn: sqlite3.Connection) -> None:
    """The keyword index: each chunk's heading path and text in FTS5 (BM25), an external-content
    table over ``chunks`` kept by triggers, so it commits with the chunk rows. Chunks of an older
    index get the heading they can have (document title › section title) and are marked for
    re-embedding by the next ingest (``chunk_format``)."""
    conn.execute("ALTER TABLE chunks ADD COLUMN heading TEXT")
    conn.execute("ALTER TABLE documents ADD COLUMN chunk_format INTEGER NOT NULL DEFAULT 1")
    conn.execute(
        "UPDATE chunks SET heading = (SELECT CASE "
        "WHEN d.title IS NULL THEN chunks.title "
        "WHEN chunks.title IS NULL OR chunks.title = d.title THEN d.title "
        "ELSE d.title || ' › ' || chunks.title END "
        "FROM documents d WHERE d.id = chunks.document_id)"
    )
    conn.execute(
        "CREATE VIRTUAL TABLE chunks_fts USING fts5(heading, text, content='chunks', "
        f"content_rowid='id', tokenize='{FTS_TOKENIZER}')"
    )
    conn.execute(
        "CREATE TRIGGER chunks_fts_insert AFTER INSERT ON chunks BEGIN "
        "INSERT INTO chunks_fts(rowid, heading, text) VALUES (new.id, new.heading, new.text); END"
    )
    conn.execute(
        "CREATE TRIGGER chunks_fts_delete AFTER DELETE ON chunks BEGIN "
        "INSERT INTO chunks_fts(chunks_fts, rowid, heading, text) "
        "VALUES ('delete', old.id, old.heading, old.text); END"
    )
    conn.execute(
        "CREATE TRIGGER chunks_fts_update AFTER UPDATE ON chunks BEGIN "
        "INSERT INTO chunks_fts(chunks_fts, rowid, heading, text) "
        "VALUES ('delete', old.id, old.heading, old.text); "
        "INSERT INTO chunks_fts(rowid, heading, text) VALUES (new.id, new.heading, new.text); END"
    )
    conn.execute("INSERT INTO chunks_fts(chunks_fts) VALUES ('rebuild')")


def _migrate_v4_to_v5(conn: sqlite3.Connection) -> None:
    """Older versions could leave deleted text in free pages and FTS5 segments (a scrub owed at
    a kill was forgotten): owe a file that ever held a document one VACUUM, paid at open
    (`retrieval.scrub.compact`)."""
    if conn.execute("SELECT 1 FROM sqlite_sequence LIMIT 1").fetchone() is not None:
        scrub.owe_compact(conn)


def _migrate_v5_to_v6(conn: sqlite3.Connection) -> None:
    """Which pages OCR read and which gave no text ("3,4,9"); NULL in rows written before
    OCR, so the ingester can tell a scan it never tried to read (issue 47)."""
    conn.execute("ALTER TABLE documents ADD COLUMN ocr_pages TEXT")
    conn.execute("ALTER TABLE documents ADD COLUMN unread_pages TEXT NOT NULL DEFAULT ''")


#: MIGRATIONS[i] brings a database from schema version i to i + 1.
MIGRATIONS: list[Migration] = [
    _migrate_v0_to_v1,
    _migrate_v1_to_v2,
    _migrate_v2_to_v3,
    _migrate_v3_to_v4,
    _migrate_v4_to_v5,
    _migrate_v5_to_v6,
]
SCHEMA_VERSION = len(MIGRATIONS)


def schema_version(db: Database) -> int:
    """The schema version recorded in the database header (``PRAGMA user_version``)."""
    return user_version(db.conn)


def migrate(db: Database, target: int | None = None) -> int:
    """Apply pending migrations in order (``collab.plumbing.migrations``: each in its own
    transaction with its version bump, so a kill mid-migration leaves the previous version
    intact). Returns the resulting version."""
    file = db.conn.execute("PRAGMA database_list").fetchone()[2] or "in memory"
    return migrations.migrate(db.conn, MIGRATIONS, target=target, name=f"index {file}")
