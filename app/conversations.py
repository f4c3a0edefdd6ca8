"""Conversation history in SQLite, with `PRAGMA user_version` migrations.

The schema version lives in the file header (`PRAGMA user_version`); `MIGRATIONS[i]` takes a
database from version i to i + 1, run by `collab.plumbing.migrations` (each step with its
bump in one transaction, so a failed step leaves the file at the version before it). A file
from a newer Tandem is refused, never rewritten.

This uses the standard library's sqlite3 rather than sqlite-utils: importing sqlite-utils also
imports numpy (and pandas when present), and this module is imported at start-up.
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import json
import logging
import os
import re
import sqlite3
import threading
import time
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from collab.plumbing import migrations
from collab.plumbing.files import (
    PRIVATE_FILE_MODE,
    atomic_write,
    make_private_dir,
    private_sqlite_file,
)
from collab.plumbing.migrations import transaction
from collab.sources import Source
from edge_runtime import sent_kinds

logger = logging.getLogger(__name__)

DEFAULT_TITLE = "New conversation"
TITLE_CHARS = 48
ROLES = ("user", "assistant")
STATUSES = ("complete", "cancelled", "failed", "streaming")
EXPORT_SCHEMA = 1
REMOVED_EXCERPT = "(removed from the index)"
"""What a citation of a removed document previews instead of its text."""


class ConversationStoreError(RuntimeError):
    """The history file cannot be used (corrupt, written by a newer Tandem, or not writable:
    a full disk)."""


class SchemaTooNewError(ConversationStoreError):
    """The file was written by a newer Tandem; reading it could lose what we do not know."""


class ConversationNotFound(KeyError):
    """No conversation with that id (deleted, or never created)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message plain
        return str(self.args[0]) if self.args else "conversation not found"


class MessageNotFound(KeyError):
    """No message with that id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "message not found"


def _v1_initial(conn: sqlite3.Connection) -> None:
    """v0 -> v1: the initial schema."""
    conn.execute(
        """
        CREATE TABLE conversations (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            title TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )
        """
    )
    conn.execute(
        """
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id INTEGER NOT NULL
                REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
            text TEXT NOT NULL DEFAULT '',
            mode TEXT NOT NULL DEFAULT '',
            created_at REAL NOT NULL,
            citations TEXT NOT NULL DEFAULT '[]',
            stats TEXT NOT NULL DEFAULT '{}',
            status TEXT NOT NULL DEFAULT 'complete',
            error TEXT
        )
        """
    )
    conn.execute("CREATE INDEX messages_by_conversation ON messages (conversation_id, id)")
    conn.execute("CREATE INDEX conversations_by_updated ON conversations (updated_at)")


def _v2_shared_chars(conn: sqlite3.Connection) -> None:
    """v1 -> v2: each answer records how much of it the cloud saw (`shared_chars`: the length
    of the prefix the cloud produced, verified or aggregated; NULL when the question never
    reached the cloud). Answers stored before this version did not record it: they stay NULL,
    so the cloud is never sent an old turn that the device may have finished alone."""
    conn.execute("ALTER TABLE messages ADD COLUMN shared_chars INTEGER")


def _v3_shared_with(conn: sqlite3.Connection) -> None:
    """v2 -> v3: each shared answer records which cloud saw it (`shared_with`: the cloud's
    identity, edge_runtime.cloud_identity: URL and server name, never the token), so history
    goes back only to that cloud. Answers stored before this version did not record it: which
    cloud was configured then is unknown, so they stay NULL and are sent to no cloud."""
    conn.execute("ALTER TABLE messages ADD COLUMN shared_with TEXT")


def _v4_search(conn: sqlite3.Connection) -> None:
    """v3 -> v4: full-text search over every message's text, questions and answers
    (`messages_fts`, an external-content FTS5 table: it keeps only the index, the text stays
    in `messages`). Triggers keep it in step with every write to `messages`, whoever makes
    it (a cascade from a deleted conversation included); the messages stored before this
    version are indexed here. Accents are folded (`café` finds `cafe`)."""
    conn.execute(
        "CREATE VIRTUAL TABLE messages_fts USING fts5(text, content='messages', "
        "content_rowid='id', tokenize='unicode61 remove_diacritics 2')"
    )
    conn.execute(
        "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN "
        "INSERT INTO messages_fts (rowid, text) VALUES (new.id, new.text); END"
    )
    conn.execute(
        "CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN "
        "INSERT INTO messages_fts (messages_fts, rowid, text) "
        "VALUES ('delete', old.id, old.text); END"
    )
    conn.execute(
        "CREATE TRIGGER messages_fts_update AFTER UPDATE OF text ON messages BEGIN "
        "INSERT INTO messages_fts (messages_fts, rowid, text) "
        "VALUES ('delete', old.id, old.text); "
        "INSERT INTO messages_fts (rowid, text) VALUES (new.id, new.text); END"
    )
    conn.execute("INSERT INTO messages_fts (messages_fts) VALUES ('rebuild')")


# MIGRATIONS[i] takes the schema from version i to i + 1. Add v5 as one more function here.
MIGRATIONS: list[migrations.Migration] = [
    _v1_initial,
    _v2_shared_chars,
    _v3_shared_with,
    _v4_search,
]
SCHEMA_VERSION = len(MIGRATIONS)  # 4


def migrate(conn: sqlite3.Connection, path: Path | str = "database") -> int:
    """Bring `conn` to the newest schema; return the version it has afterwards.

    `conn` must be in autocommit mode (isolation_level=None) so the transactions are ours.
    """
    # MIGRATIONS is read at call time, so tests can add a step.
    return migrations.migrate(conn, MIGRATIONS, name=str(path))


class StoredTurn(NamedTuple):
    """One finished exchange as the history keeps it (what `edge_runtime.modes.base.Turn`
    is built from; this module does not import the modes)."""

    question: str
    answer: str
    mode: str
    shared: str | None  # the part of the answer the cloud saw (None: not even the question)
    shared_with: str | None  # that cloud's identity (None: unknown: sent to no cloud)


@dataclass(frozen=True)
class ConversationRow:
    id: int
    title: str
    created_at: float
    updated_at: float
    messages: int


@dataclass(frozen=True)
class MessageRow:
    id: int
    conversation_id: int
    role: str  # "user" | "assistant"
    text: str
    mode: str
    created_at: float
    citations: list[dict] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    status: str = "complete"  # complete | cancelled | failed | streaming
    error: str | None = None
    shared_chars: int | None = None  # assistant: how much of `text` the cloud saw (None: none)
    shared_with: str | None = None  # assistant: the identity of the cloud that saw it


@dataclass(frozen=True)
class SearchHit:
    """One message that matches a search: where it is, and a plain-text snippet of it (the
    matched words between « and », cut text marked …; control characters not stripped)."""

    conversation_id: int
    title: str  # the conversation's
    message_id: int
    role: str  # "user" | "assistant"
    snippet: str
    created_at: float  # the message's
    updated_at: float  # the conversation's


SNIPPET_TOKENS = 12
"""About how many words of a message a search hit's snippet shows."""


def fts_query(query: str) -> str:
    """`query` as an FTS5 expression that cannot be a syntax error: each whitespace-separated
    term a quoted phrase (inner quotes doubled), all of them required (AND). A term ending in
    `*` matches as a prefix (`bicy*`). Terms with no letter or digit (`"`, `*`, `-`) match
    nothing and are dropped; "" when nothing is left. FTS5 operators (`OR`, `NEAR(`, `-x`,
    `col:`) are searched as words."""
    terms = []
    for term in query.split():
        prefix = term.endswith("*")
        term = term.rstrip("*")
        if not any(c.isalnum() for c in term):
            continue
        terms.append('"' + term.replace('"', '""') + '"' + ("*" if prefix else ""))
    return " ".join(terms)


_CONVERSATION_SELECT = """
    SELECT c.id, c.title, c.created_at, c.updated_at,
           (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS messages
    FROM conversations c
"""
_MESSAGE_COLUMNS = (
    "id, conversation_id, role, text, mode, created_at, citations, stats, status, error, "
    "shared_chars, shared_with"
)


def _loads(text: str | None, default: Any) -> Any:
    """Decode a JSON column; a damaged value reads as the default rather than breaking the view."""
    if not text:
        return default
    try:
        return json.loads(text)
    except ValueError:
        logger.warning("ignoring a damaged JSON value in the conversation history")
        return default


def _message(row: tuple) -> MessageRow:
    citations = _loads(row[6], [])
    stats = _loads(row[7], {})
    return MessageRow(
        id=row[0],
        conversation_id=row[1],
        role=row[2],
        text=row[3],
        mode=row[4],
        created_at=row[5],
        citations=citations if isinstance(citations, list) else [],
        stats=stats if isinstance(stats, dict) else {},
        status=row[8],
        error=row[9],
        shared_chars=row[10],
        shared_with=row[11],
    )


def _conversation(row: tuple) -> ConversationRow:
    return ConversationRow(*row)


def title_from_question(question: str, limit: int = TITLE_CHARS) -> str:
    """The first ~`limit` characters of a question on one line, cut at a word when possible."""
    text = " ".join(question.split())
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    if space >= limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,.;:") + "…"


def slugify(title: str, limit: int = 40) -> str:
    """A file-name-safe, lower-case ASCII slug of a title ("conversation" when nothing is left)."""
    ascii_text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    slug = slug[:limit].rstrip("-")
    return slug or "conversation"


def export_paths(folder: Path, conversation: ConversationRow) -> tuple[Path, Path]:
    """Where a conversation's exports go: `<folder>/<slug>-<id>.md` and `.json` (the id keeps
    two conversations with the same title apart). Creates nothing."""
    stem = f"{slugify(conversation.title)}-{conversation.id}"
    folder = Path(folder)
    return folder / f"{stem}.md", folder / f"{stem}.json"


def _source_line(index: int, citation: Mapping[str, Any]) -> str:
    """ "[n] title (location) · side · score" for the Markdown export (a source without a
    title is named by its path)."""
    src = Source.from_dict(citation, number=index)
    src = replace(src, title=src.title or src.path or "untitled")
    return f"[{src.number}] {src.heading} · {src.side} · {src.score_label}"


def _sent_lines(sent: Any) -> list[str]:
    """An answer's ledger in the Markdown export: the summary, a line per kind, and each text
    that left quoted under its kind."""
    rows = sent if isinstance(sent, list) else None
    lines = [f"What was sent: {sent_kinds.summary(rows)}", ""]
    for row in rows or []:
        lines.append(f"- {sent_kinds.row_line(row)}")
        for text in sent_kinds.texts(row):
            lines += ["", *(f"  > {line}" for line in text.splitlines() or [""]), ""]
    return [*lines, ""] if rows else lines


class ConversationStore:
    """The conversation history: conversations and their messages, one SQLite file.

    One connection shared across threads behind a lock: the app writes from the event loop and
    possibly from workers.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self._make_private()
            self._conn: sqlite3.Connection | None = sqlite3.connect(
                self.path, check_same_thread=False, isolation_level=None
            )
        except (OSError, sqlite3.Error) as exc:
            raise ConversationStoreError(f"{self.path}: cannot open: {exc}") from exc
        try:
            # A deleted conversation (with the document text its citations quote) is
            # overwritten in the file, not merely unlinked; per connection, so every table.
            self._conn.execute("PRAGMA secure_delete = ON")
            self._conn.execute("PRAGMA foreign_keys = ON")
            self._conn.execute("PRAGMA busy_timeout = 5000")
            migrate(self._conn, self.path)
        except migrations.SchemaTooNewError as exc:
            self._conn.close()
            raise SchemaTooNewError(str(exc)) from exc
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise ConversationStoreError(
                f"{self.path}: not a usable conversation history ({exc}); "
                "it was not changed. Move it aside to start a new one."
            ) from exc

    # -- plumbing ---------------------------------------------------------------------------

    def _make_private(self) -> None:
        """The history quotes private documents: its file is created 0600 before SQLite opens
        it (SQLite gives its -journal/-wal/-shm the same mode) in a folder created 0700; a file
        an older Tandem left readable is tightened (logged once)."""
        make_private_dir(self.path.parent)
        changed = private_sqlite_file(self.path)
        if changed:
            logger.warning(
                "made %s private to this user (it was readable by other local users)",
                ", ".join(str(p) for p in changed),
            )

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise ConversationStoreError(f"{self.path}: the store is closed")
        return self._conn

    @contextlib.contextmanager
    def _saving(self) -> Iterator[sqlite3.Connection]:
        """The lock and one transaction. A write the disk refuses (full, failing) is rolled
        back and becomes a plain error; everything saved before it stays as it was."""
        with self._lock:
            try:
                with transaction(self.conn) as conn:
                    yield conn
            except sqlite3.OperationalError as exc:
                raise ConversationStoreError(
                    f"could not save the conversation to {self.path} ({exc}): is the disk "
                    "full? Everything saved before is kept."
                ) from exc

    def _write(self, sql: str, params: Iterable[Any] = ()) -> sqlite3.Cursor:
        """Run one statement (callers hold the lock; alone, it is its own transaction)."""
        return self.conn.execute(sql, tuple(params))

    def _get(self, conversation_id: int) -> ConversationRow:
        row = self.conn.execute(
            _CONVERSATION_SELECT + " WHERE c.id = ?", (conversation_id,)
        ).fetchone()
        if row is None:
            raise ConversationNotFound(f"no conversation with id {conversation_id}")
        return _conversation(row)

    def _touch(self, conversation_id: int, now: float | None = None) -> None:
        self._write(
            "UPDATE conversations SET updated_at = ? WHERE id = ?",
            (time.time() if now is None else now, conversation_id),
        )

    # -- conversations ----------------------------------------------------------------------

    def create(self, title: str = DEFAULT_TITLE) -> ConversationRow:
        title = title.strip() or DEFAULT_TITLE
        now = time.time()
        with self._saving():
            cursor = self._write(
                "INSERT INTO conversations (title, created_at, updated_at) VALUES (?, ?, ?)",
                (title, now, now),
            )
            return self._get(int(cursor.lastrowid or 0))

    def list(self) -> list[ConversationRow]:
        """All conversations, the most recently updated first."""
        with self._lock:
            rows = self.conn.execute(
                _CONVERSATION_SELECT + " ORDER BY c.updated_at DESC, c.id DESC"
            ).fetchall()
        return [_conversation(row) for row in rows]

    def get(self, conversation_id: int) -> ConversationRow:
        with self._lock:
            return self._get(conversation_id)

    def rename(self, conversation_id: int, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            raise ValueError("a conversation title cannot be empty")
        with self._saving():
            cursor = self._write(
                "UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id)
            )
            if cursor.rowcount == 0:
                raise ConversationNotFound(f"no conversation with id {conversation_id}")

    def set_title_from_question(self, conversation_id: int, question: str) -> None:
        """Name a conversation after its first question, while it still has the default title."""
        title = title_from_question(question)
        if not title:
            return
        with self._saving():
            self._write(
                "UPDATE conversations SET title = ? WHERE id = ? AND title = ?",
                (title, conversation_id, DEFAULT_TITLE),
            )

    def delete(self, conversation_id: int) -> None:
        """Delete a conversation and its messages (one transaction). The search index's
        segments are merged, so that its words for them do not linger in the file (an FTS5
        delete only marks them; secure_delete then overwrites the freed pages)."""
        with self._saving() as conn:
            conn.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
            cursor = conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            if cursor.rowcount == 0:
                raise ConversationNotFound(f"no conversation with id {conversation_id}")
            conn.execute("INSERT INTO messages_fts (messages_fts) VALUES ('optimize')")

    def search(self, query: str, limit: int = 50) -> builtins.list[SearchHit]:
        """Messages (questions and answers) that hold every word of `query`, the best match
        first (bm25), at most `limit`. Accents and case do not matter; any text is a valid
        query (see `fts_query`); one with no word in it finds nothing."""
        expression = fts_query(query)
        if not expression or limit <= 0:
            return []
        with self._lock:
            rows = self.conn.execute(
                "SELECT m.conversation_id, c.title, m.id, m.role, "
                "snippet(messages_fts, 0, '«', '»', '…', ?), m.created_at, c.updated_at "
                "FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid "
                "JOIN conversations c ON c.id = m.conversation_id "
                "WHERE messages_fts MATCH ? ORDER BY messages_fts.rank, m.id DESC LIMIT ?",
                (SNIPPET_TOKENS, expression, limit),
            ).fetchall()
        return [SearchHit(*row) for row in rows]

    # -- messages ---------------------------------------------------------------------------

    def add_message(
        self,
        conversation_id: int,
        role: str,
        text: str,
        mode: str,
        *,
        citations: Iterable[Mapping[str, Any]] = (),
        stats: Mapping[str, Any] | None = None,
        status: str = "complete",
        error: str | None = None,
    ) -> int:
        """Append a message; returns its id (the app updates it while an answer streams)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
        now = time.time()
        citations_json = json.dumps([dict(c) for c in citations], ensure_ascii=False)
        stats_json = json.dumps(dict(stats or {}), ensure_ascii=False)
        with self._saving():
            self._get(conversation_id)  # a clear error rather than a foreign-key failure
            cursor = self._write(
                "INSERT INTO messages (conversation_id, role, text, mode, created_at, citations,"
                " stats, status, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, text, mode, now, citations_json, stats_json, status, error),
            )
            self._touch(conversation_id, now)
            return int(cursor.lastrowid or 0)

    def update_message(
        self,
        message_id: int,
        *,
        text: str | None = None,
        citations: Iterable[Mapping[str, Any]] | None = None,
        stats: Mapping[str, Any] | None = None,
        status: str | None = None,
        error: str | None = None,
        shared_chars: int | None = None,
        shared_with: str | None = None,
    ) -> None:
        """Change the given fields of a message: partial answers while streaming, then the final."""
        if status is not None and status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
        columns: dict[str, Any] = {}
        if text is not None:
            columns["text"] = text
        if citations is not None:
            columns["citations"] = json.dumps([dict(c) for c in citations], ensure_ascii=False)
        if stats is not None:
            columns["stats"] = json.dumps(dict(stats), ensure_ascii=False)
        if status is not None:
            columns["status"] = status
        if error is not None:
            columns["error"] = error
        if shared_chars is not None:
            columns["shared_chars"] = shared_chars
        if shared_with is not None:
            columns["shared_with"] = shared_with
        with self._saving():
            row = self.conn.execute(
                "SELECT conversation_id FROM messages WHERE id = ?", (message_id,)
            ).fetchone()
            if row is None:
                raise MessageNotFound(f"no message with id {message_id}")
            if columns:
                assignments = ", ".join(f"{name} = ?" for name in columns)
                self._write(
                    f"UPDATE messages SET {assignments} WHERE id = ?",
                    (*columns.values(), message_id),
                )
            self._touch(row[0])

    def messages(self, conversation_id: int) -> builtins.list[MessageRow]:
        """A conversation's messages in the order they were added."""
        with self._lock:
            self._get(conversation_id)
            rows = self.conn.execute(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? ORDER BY id",
                (conversation_id,),
            ).fetchall()
        return [_message(row) for row in rows]

    def turns(self, conversation_id: int) -> builtins.list[StoredTurn]:
        """Finished (question, answer, mode, shared, shared_with) tuples for the model's
        history; `shared` is the part of the answer the cloud saw, None if the question never
        reached it; `shared_with` the identity of that cloud (None: unknown, sent to none).

        A turn is a user message directly followed by an assistant message with non-empty text:
        cancelled partial answers count; failed answers with no text do not.
        """
        result: builtins.list[StoredTurn] = []
        rows = self.messages(conversation_id)
        for question, answer in itertools.pairwise(rows):
            if question.role == "user" and answer.role == "assistant" and answer.text.strip():
                n = answer.shared_chars
                shared = None if n is None else answer.text[: max(0, n)]
                cloud = answer.shared_with if shared is not None else None
                result.append(StoredTurn(question.text, answer.text, answer.mode, shared, cloud))
        return result

    def forget_document_text(self, paths: Iterable[str]) -> int:
        """Drop the passage text from every stored device citation of a document at or under
        one of `paths` (they left the private index): what was shown stays (title, location,
        score, side, path), the text and excerpt go and the citation is marked "removed".
        Returns how many citations changed. The old rows are overwritten (secure_delete)."""
        bases = [p.rstrip(os.sep) or os.sep for p in paths]

        def removed(citation: object) -> bool:
            if not isinstance(citation, dict) or citation.get("side") != "device":
                return False
            where = citation.get("path")
            return (
                isinstance(where, str)
                and not citation.get("removed")
                and any(where == b or where.startswith(b.rstrip(os.sep) + os.sep) for b in bases)
            )

        changed = 0
        with self._saving() as conn:
            rows = conn.execute(
                "SELECT id, citations FROM messages WHERE citations LIKE '%\"device\"%'"
            ).fetchall()
            for message_id, text in rows:
                citations = _loads(text, [])
                if not isinstance(citations, list) or not any(map(removed, citations)):
                    continue
                kept = []
                for c in citations:
                    if removed(c):
                        c = {**c, "text": "", "excerpt": REMOVED_EXCERPT, "removed": True}
                        changed += 1
                    kept.append(c)
                conn.execute(
                    "UPDATE messages SET citations = ? WHERE id = ?",
                    (json.dumps(kept, ensure_ascii=False), message_id),
                )
        return changed

    # -- export -----------------------------------------------------------------------------

    def export_markdown(self, conversation_id: int) -> str:
        """The conversation as Markdown: answers verbatim, each followed by its sources and
        what left this device for it (edge_runtime.sent: its ledger, with the texts)."""
        conversation = self.get(conversation_id)
        lines = [f"# {conversation.title}", ""]
        for message in self.messages(conversation_id):
            if message.role == "user":
                lines += ["**You**", "", message.text, ""]
                continue
            heading = f"**Tandem** ({message.mode})" if message.mode else "**Tandem**"
            if message.status == "cancelled":
                heading += " (cancelled)"
            elif message.status == "failed":
                heading += " (failed)"
            elif message.status == "streaming":
                heading += " (incomplete)"
            lines += [heading, ""]
            if message.text:
                lines += [message.text, ""]
            if message.error:
                lines += [f"> Error: {message.error}", ""]
            if message.citations:
                lines += ["Sources:", ""]
                lines += [
                    f"- {_source_line(i, c)}" for i, c in enumerate(message.citations, start=1)
                ]
                lines.append("")
            lines += _sent_lines(message.stats.get("sent"))
        return "\n".join(lines).rstrip("\n") + "\n"

    def export_json(self, conversation_id: int) -> dict[str, Any]:
        """The conversation with every message in full (citations and stats included)."""
        conversation = self.get(conversation_id)
        return {
            "schema": EXPORT_SCHEMA,
            "id": conversation.id,
            "title": conversation.title,
            "created_at": conversation.created_at,
            "updated_at": conversation.updated_at,
            "messages": [asdict(m) for m in self.messages(conversation_id)],
        }

    def export_files(self, conversation_id: int, folder: Path) -> tuple[Path, Path]:
        """Write `<folder>/<slug>-<id>.md` and `.json`; returns both paths."""
        md_path, json_path = export_paths(folder, self.get(conversation_id))
        make_private_dir(md_path.parent)
        # 0600 from creation (they quote private documents), and whole or not at all
        atomic_write(md_path, self.export_markdown(conversation_id), mode=PRIVATE_FILE_MODE)
        atomic_write(
            json_path,
            json.dumps(self.export_json(conversation_id), ensure_ascii=False, indent=2) + "\n",
            mode=PRIVATE_FILE_MODE,
        )
        return md_path, json_path

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
