"""app.conversations: CRUD, ordering, history turns, exports and schema migrations."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest

from app import conversations as conv
from app.conversations import (
    DEFAULT_TITLE,
    SCHEMA_VERSION,
    ConversationNotFound,
    ConversationStore,
    ConversationStoreError,
    MessageNotFound,
    SchemaTooNewError,
    export_paths,
    slugify,
    title_from_question,
)
from collab.plumbing import migrations
from collab.plumbing.migrations import user_version

CITATIONS = [
    {
        "number": 1,
        "side": "device",
        "title": "notes.md",
        "location": "p. 2",
        "score": 0.8123,
        "excerpt": "the excerpt",
        "path": "/docs/notes.md",
        "text": "full passage",
    },
    {
        "number": 2,
        "side": "cloud",
        "title": "Photosynthesis",
        "location": "",
        "score": 0.5,
        "excerpt": "plants",
        "path": "",
        "text": "Plants make sugar.",
    },
]


@pytest.fixture
def store(tmp_path: Path):
    with ConversationStore(tmp_path / "sub" / "conversations.sqlite") as s:
        yield s


def test_creates_folders_and_schema(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "c.sqlite"
    ConversationStore(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    conn.close()


def test_crud(store: ConversationStore) -> None:
    first = store.create()
    assert first.title == DEFAULT_TITLE and first.messages == 0
    second = store.create("Second")
    assert store.get(second.id).title == "Second"
    store.rename(first.id, "  Renamed\n title ")
    assert store.get(first.id).title == "Renamed title"
    with pytest.raises(ValueError):
        store.rename(first.id, "   ")
    with pytest.raises(ConversationNotFound):
        store.rename(999, "x")
    message = store.add_message(first.id, "user", "hi", "local")
    store.add_message(first.id, "assistant", "hello", "local")
    assert store.get(first.id).messages == 2
    store.delete(first.id)
    with pytest.raises(ConversationNotFound, match="no conversation with id"):
        store.get(first.id)
    with pytest.raises(KeyError):
        store.messages(first.id)
    with pytest.raises(MessageNotFound):
        store.update_message(message, text="gone")
    leftover = store.conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
    assert leftover == 0
    assert [c.id for c in store.list()] == [second.id]
    with pytest.raises(ConversationNotFound):
        store.delete(first.id)


def test_list_is_newest_updated_first(store: ConversationStore) -> None:
    a, b, c = store.create("a"), store.create("b"), store.create("c")
    assert [r.title for r in store.list()] == ["c", "b", "a"]
    store.add_message(a.id, "user", "bump", "local")
    assert [r.title for r in store.list()] == ["a", "c", "b"]
    assert store.get(a.id).updated_at >= store.get(c.id).updated_at
    assert store.list()[0].messages == 1
    del b


def test_invalid_role_and_status(store: ConversationStore) -> None:
    cid = store.create().id
    with pytest.raises(ValueError, match="role"):
        store.add_message(cid, "system", "x", "local")
    with pytest.raises(ValueError, match="status"):
        store.add_message(cid, "assistant", "x", "local", status="done")
    with pytest.raises(ConversationNotFound):
        store.add_message(12345, "user", "x", "local")


def test_streaming_updates_and_round_trip(store: ConversationStore) -> None:
    cid = store.create().id
    store.add_message(cid, "user", "What is 2+2?", "split")
    mid = store.add_message(cid, "assistant", "", "split", status="streaming")
    store.update_message(mid, text="It is")
    store.update_message(mid, text="It is 4.", citations=CITATIONS, stats={"tokens": 3})
    store.update_message(mid, status="complete")
    messages = store.messages(cid)
    assert [m.role for m in messages] == ["user", "assistant"]
    answer = messages[1]
    assert answer.text == "It is 4." and answer.status == "complete"
    assert answer.citations == CITATIONS and answer.stats == {"tokens": 3}
    assert answer.error is None and answer.mode == "split"
    store.update_message(mid, status="failed", error="link lost")
    assert store.messages(cid)[1].error == "link lost"
    with pytest.raises(ValueError):
        store.update_message(mid, status="bogus")


def test_turns_pairs_finished_answers(store: ConversationStore) -> None:
    cid = store.create().id
    store.add_message(cid, "user", "q1", "local")
    store.add_message(cid, "assistant", "a1", "local")
    store.add_message(cid, "user", "q2", "cloud")
    store.add_message(cid, "assistant", "", "cloud", status="failed", error="boom")
    store.add_message(cid, "user", "q3", "split")
    store.add_message(cid, "assistant", "partial", "split", status="cancelled")
    store.add_message(cid, "user", "q4 unanswered", "local")
    assert store.turns(cid) == [
        ("q1", "a1", "local", None, None),
        ("q3", "partial", "split", None, None),
    ]
    # what the cloud saw of an answer is kept with it (a prefix, in characters)
    store.add_message(cid, "user", "q5", "dragon")
    mid = store.add_message(cid, "assistant", "", "dragon", status="streaming")
    store.update_message(
        mid,
        text="cloud part, device part",
        status="complete",
        shared_chars=10,
        shared_with="embedded",
    )
    assert store.turns(cid)[-1] == (
        "q5",
        "cloud part, device part",
        "dragon",
        "cloud part",
        "embedded",
    )


def test_answers_stored_before_provenance_was_recorded_stay_private(tmp_path: Path) -> None:
    """A version-1 file's answers did not record what the cloud saw (a dragon answer may
    have been finished on the device): after the migration none is sent to the cloud."""
    path = tmp_path / "v1.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    migrations.migrate(conn, conv.MIGRATIONS[:1], name="v1")
    conn.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('t', 0, 0)")
    conn.execute(
        "INSERT INTO messages (conversation_id, role, text, mode, created_at) VALUES "
        "(1, 'user', 'q', 'dragon', 0), (1, 'assistant', 'cloud + device text', 'dragon', 0)"
    )
    conn.close()
    with ConversationStore(path) as s:
        assert user_version(s.conn) == SCHEMA_VERSION
        assert s.turns(1) == [("q", "cloud + device text", "dragon", None, None)]


def test_title_from_first_question(store: ConversationStore) -> None:
    cid = store.create().id
    question = "How   do I configure\nthe private index for my research notes and papers?"
    store.set_title_from_question(cid, question)
    title = store.get(cid).title
    assert title.startswith("How do I configure the private index")
    assert len(title) <= 49 and title.endswith("…") and "\n" not in title
    store.set_title_from_question(cid, "A second question")
    assert store.get(cid).title == title, "only the default title is replaced"
    named = store.create("Mine").id
    store.set_title_from_question(named, "Question")
    assert store.get(named).title == "Mine"
    assert title_from_question("short") == "short"
    assert title_from_question("   ") == ""


def test_export_markdown(store: ConversationStore) -> None:
    cid = store.create("Plants").id
    store.add_message(cid, "user", "How do plants eat?", "rag")
    store.add_message(
        cid,
        "assistant",
        "They photosynthesise [1][2].\n\n```\ncode\n```",
        "rag",
        citations=CITATIONS,
    )
    store.add_message(cid, "user", "More?", "local")
    store.add_message(cid, "assistant", "Well, partly", "local", status="cancelled")
    text = store.export_markdown(cid)
    assert text.startswith("# Plants\n")
    assert "**You**\n\nHow do plants eat?" in text
    assert "**Tandem** (rag)\n\nThey photosynthesise [1][2].\n\n```\ncode\n```" in text
    assert "- [1] notes.md (p. 2) · device · 0.81" in text
    assert "- [2] Photosynthesis · cloud · 0.50" in text
    assert "**Tandem** (local) (cancelled)\n\nWell, partly" in text
    assert text.index("Sources") < text.index("More?")


def test_export_json(store: ConversationStore, tmp_path: Path) -> None:
    cid = store.create("Ünïcödé ☃ title").id
    store.add_message(cid, "user", "Grüße 👋", "local")
    store.add_message(cid, "assistant", "こんにちは", "local", citations=CITATIONS, stats={"a": 1})
    data = store.export_json(cid)
    assert data["schema"] == 1 and data["title"] == "Ünïcödé ☃ title"
    assert isinstance(data["created_at"], float)
    assert [m["text"] for m in data["messages"]] == ["Grüße 👋", "こんにちは"]
    assert data["messages"][1]["citations"] == CITATIONS
    assert data["messages"][1]["stats"] == {"a": 1}
    assert set(data["messages"][0]) >= {"id", "role", "mode", "status", "error", "created_at"}
    json.dumps(data)  # serialisable as is
    md_path, json_path = store.export_files(cid, tmp_path / "exports")
    assert md_path.name == f"unicode-title-{cid}.md" and json_path.suffix == ".json"
    assert json.loads(json_path.read_text(encoding="utf-8")) == data
    assert "# Ünïcödé ☃ title" in md_path.read_text(encoding="utf-8")


def test_export_paths_are_pure(store: ConversationStore, tmp_path: Path) -> None:
    row = store.create("Same title")
    other = store.create("Same title")
    md, js = export_paths(tmp_path / "nowhere", row)
    assert md == tmp_path / "nowhere" / f"same-title-{row.id}.md"
    assert js == tmp_path / "nowhere" / f"same-title-{row.id}.json"
    assert export_paths(tmp_path, other)[0] != export_paths(tmp_path, row)[0]
    assert not (tmp_path / "nowhere").exists()


def test_slugify() -> None:
    assert slugify("Hello, World!") == "hello-world"
    assert slugify("☃☃") == "conversation"
    assert len(slugify("x" * 200)) == 40


def test_migrates_an_older_database(tmp_path: Path) -> None:
    """A version-0 file (an empty or pre-history database) gains the schema; other data stays."""
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE keep_me (x INTEGER)")
    conn.execute("INSERT INTO keep_me VALUES (42)")
    conn.commit()
    conn.close()
    with ConversationStore(path) as s:
        cid = s.create("after migration").id
        assert s.get(cid).title == "after migration"
        assert s.conn.execute("SELECT x FROM keep_me").fetchone() == (42,)
        assert user_version(s.conn) == SCHEMA_VERSION


def test_a_future_migration_runs_once_and_keeps_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list structure: adding a version is one more function, applied on the next open."""
    path = tmp_path / "c.sqlite"
    with ConversationStore(path) as s:
        cid = s.create("kept").id
        s.add_message(cid, "user", "q", "local")
    calls: list[int] = []

    def add_pinned(conn: sqlite3.Connection) -> None:
        calls.append(1)
        conn.execute("ALTER TABLE conversations ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")

    monkeypatch.setattr(conv, "MIGRATIONS", [*conv.MIGRATIONS, add_pinned])
    with ConversationStore(path) as s:
        assert user_version(s.conn) == SCHEMA_VERSION + 1
        assert s.get(cid).title == "kept" and s.messages(cid)[0].text == "q"
    ConversationStore(path).close()
    assert calls == [1]


def test_a_failing_migration_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.sqlite"
    with ConversationStore(path) as s:
        s.create("kept")

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("ALTER TABLE conversations ADD COLUMN half_done TEXT")
        raise RuntimeError("migration bug")

    monkeypatch.setattr(conv, "MIGRATIONS", [*conv.MIGRATIONS, broken])
    with pytest.raises(RuntimeError, match="migration bug"):
        ConversationStore(path)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    columns = [row[1] for row in conn.execute("PRAGMA table_info(conversations)")]
    assert "half_done" not in columns
    conn.close()


def test_newer_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with ConversationStore(path) as s:
        s.create("from the future")
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 7")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(SchemaTooNewError, match=rf"schema version 7.*up to {SCHEMA_VERSION}"):
        ConversationStore(path)
    assert path.read_bytes() == before


def test_corrupt_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    path.write_bytes(b"this is not a database at all" * 100)
    before = path.read_bytes()
    with pytest.raises(ConversationStoreError, match="not a usable conversation history"):
        ConversationStore(path)
    assert path.read_bytes() == before


def test_threads_can_write(store: ConversationStore) -> None:
    cid = store.create().id
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(20):
                store.add_message(cid, "user", f"{n}-{i}", "local")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.get(cid).messages == 80


def test_closed_store_says_so(tmp_path: Path) -> None:
    s = ConversationStore(tmp_path / "c.sqlite")
    s.close()
    s.close()
    with pytest.raises(ConversationStoreError, match="closed"):
        s.list()
