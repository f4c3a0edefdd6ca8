"""Conversations from the command line: the history's full-text search (FTS5, schema v4),
`tandem chats list|show|search|export`, and `tandem ask --continue / --conversation ID`."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from app import conversations as conv
from app.conversations import SCHEMA_VERSION, ConversationStore, SearchHit
from collab.plumbing import migrations
from collab.plumbing.migrations import user_version

HOSTILE = ['"', "*", "NEAR(", "OR", "-x", "", "   ", 'a"b', "text:x", "(", "AND NOT", "^", "'"]


@pytest.fixture
def store(tmp_path: Path):
    with ConversationStore(tmp_path / "conversations.sqlite") as s:
        yield s


def _trip(store: ConversationStore) -> int:
    cid = store.create("Lisbon trip").id
    store.add_message(cid, "user", "Where was breakfast served at the café?", "local")
    answer = store.add_message(cid, "assistant", "", "local", status="streaming")
    store.update_message(answer, text="At Casa Azul, by the tandem bicycle shop.")
    store.update_message(answer, status="complete")
    return cid


def test_search_finds_questions_and_answers_best_first(store: ConversationStore) -> None:
    cid = _trip(store)
    other = store.create("Bikes").id
    store.add_message(other, "user", "bicycle bicycle bicycle tyres", "local")
    (question,) = store.search("breakfast")
    assert question == SearchHit(
        cid,
        "Lisbon trip",
        1,
        "user",
        "Where was «breakfast» served at the café?",
        question.created_at,
        store.get(cid).updated_at,
    )
    (answer,) = store.search("casa azul")  # an answer's words, written while it streamed
    assert (answer.conversation_id, answer.role, answer.message_id) == (cid, "assistant", 2)
    assert "«Casa» «Azul»" in answer.snippet
    assert store.search("BREAKFAST tandem") == []  # every word, in one message
    hits = store.search("bicycle")
    assert [h.conversation_id for h in hits] == [other, cid]  # bm25: the denser match first
    assert len(store.search("bicycle", limit=1)) == 1
    assert [h.message_id for h in store.search("bicy*")] == [h.message_id for h in hits]


def test_search_ignores_accents_and_case(store: ConversationStore) -> None:
    cid = _trip(store)
    store.add_message(cid, "user", "Und was kostet der Kaffee in München?", "local")
    assert [h.role for h in store.search("cafe")] == ["user"]
    assert [h.role for h in store.search("CAFÉ")] == ["user"]
    assert len(store.search("munchen")) == 1 and len(store.search("MÜNCHEN")) == 1


def test_hostile_queries_never_raise(store: ConversationStore) -> None:
    """FTS5 syntax (quotes, stars, NEAR, OR, a leading minus, column filters) is searched as
    text: a user's query is never a syntax error; one with no word in it finds nothing."""
    cid = _trip(store)
    store.add_message(cid, "user", 'near the "x" or OR', "local")
    for query in HOSTILE:
        hits = store.search(query)
        assert isinstance(hits, list), query
    assert store.search("") == [] and store.search('"') == [] and store.search("*") == []
    assert [h.message_id for h in store.search("NEAR(")] == [3]  # the word near
    assert [h.message_id for h in store.search("OR")] == [3]
    assert [h.message_id for h in store.search('"x"')] == [3]


def test_deleting_a_conversation_removes_its_hits(store: ConversationStore) -> None:
    cid = _trip(store)
    kept = store.create("kept").id
    store.add_message(kept, "user", "breakfast again", "local")
    assert len(store.search("breakfast")) == 2
    store.delete(cid)
    assert [h.conversation_id for h in store.search("breakfast")] == [kept]
    assert store.search("azul") == []
    raw = store.path.read_bytes()
    assert b"azul" not in raw.lower()  # neither the text nor the index's words for it


def test_a_v3_history_migrates_and_finds_its_old_messages(tmp_path: Path) -> None:
    path = tmp_path / "v3.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    assert migrations.migrate(conn, conv.MIGRATIONS[:3], name="v3") == 3
    conn.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('old', 0, 0)")
    conn.execute(
        "INSERT INTO messages (conversation_id, role, text, mode, created_at) VALUES "
        "(1, 'user', 'Who owns the tandem?', 'local', 0), "
        "(1, 'assistant', 'Ada owns it.', 'local', 0)"
    )
    conn.close()
    with ConversationStore(path) as s:
        assert user_version(s.conn) == SCHEMA_VERSION == 4
        assert [(h.message_id, h.role) for h in s.search("tandem")] == [(1, "user")]
        assert [(h.message_id, h.role) for h in s.search("ada")] == [(2, "assistant")]
        s.add_message(1, "user", "And the kayak?", "local")  # kept in step after it
        assert [h.message_id for h in s.search("kayak")] == [3]


# -------------------------------------------------------------------------- tandem chats


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("TANDEM_CLOUD_URL", raising=False)
    return tmp_path


def _tandem(capsys, *argv: str) -> tuple[int, str, str]:
    from app.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_chats_on_an_empty_install(home: Path, capsys) -> None:
    from collab.plumbing.paths import conversations_path

    assert _tandem(capsys, "chats", "list") == (0, "no conversations\n", "")
    assert _tandem(capsys, "chats", "list", "--json") == (0, "[]\n", "")
    assert _tandem(capsys, "chats", "search", "x") == (0, "no matches\n", "")
    code, out, err = _tandem(capsys, "chats", "show", "3")
    assert (code, out, err) == (2, "", "error: no conversation with id 3\n")
    assert not conversations_path().exists()  # looking creates nothing


def test_chats_list_show_search_export(home: Path, capsys) -> None:
    from collab.plumbing.paths import conversations_path

    with ConversationStore(conversations_path()) as s:
        cid = _trip(s)
        evil = s.create("\x1b]0;pwned\x07 notes").id
        s.add_message(evil, "user", "red \x1b[31mtext\x1b[0m \x9b2J here", "local")

    code, out, _ = _tandem(capsys, "chats", "list")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2
    assert lines[0].split()[0] == str(evil) and lines[1].split()[0] == str(cid)
    assert "2 messages" in lines[1] and lines[1].endswith("Lisbon trip")
    assert "\x1b" not in out and "]0;pwned notes" in lines[0]
    code, out, _ = _tandem(capsys, "chats", "list", "--json")
    rows = json.loads(out)
    assert [(r["id"], r["title"], r["messages"]) for r in rows][1] == (cid, "Lisbon trip", 2)
    assert {"updated_at", "created_at"} <= set(rows[0])

    code, out, _ = _tandem(capsys, "chats", "show", str(cid))
    assert code == 0 and out.startswith("# Lisbon trip\n")
    assert out.index("Where was breakfast") < out.index("At Casa Azul")
    assert "You · " in out and "Tandem (local) · " in out
    with ConversationStore(conversations_path()) as s:
        s.add_message(cid, "assistant", "half", "local", status="streaming")
    assert "Tandem (local) (incomplete) · " in _tandem(capsys, "chats", "show", str(cid))[1]
    with ConversationStore(conversations_path()) as s:
        s.conn.execute("DELETE FROM messages WHERE text = 'half'")
    code, out, _ = _tandem(capsys, "chats", "show", str(evil))
    assert "\x1b" not in out and "\x9b" not in out and "red [31mtext[0m 2J here" in out
    code, out, _ = _tandem(capsys, "chats", "show", str(cid), "--json")
    shown = json.loads(out)
    assert [m["text"] for m in shown["messages"]][1] == "At Casa Azul, by the tandem bicycle shop."

    code, out, _ = _tandem(capsys, "chats", "search", "cafe")
    assert code == 0 and out.splitlines()[0].split()[:2] == [str(cid), "Lisbon"]
    assert "«café»" in out
    code, out, _ = _tandem(capsys, "chats", "search", "NEAR( OR", "--json")
    assert code == 0 and json.loads(out) == []
    code, out, _ = _tandem(capsys, "chats", "search", "azul", "--json")
    (hit,) = json.loads(out)
    assert (hit["conversation_id"], hit["role"], hit["title"]) == (cid, "assistant", "Lisbon trip")

    code, out, _ = _tandem(capsys, "chats", "export", str(cid))
    with ConversationStore(conversations_path()) as s:
        assert out == s.export_markdown(cid)
        exported = s.export_json(cid)
    code, out, _ = _tandem(capsys, "chats", "export", str(cid), "--format", "json")
    assert code == 0 and json.loads(out) == exported
    target = home / "trip.json"
    code, out, err = _tandem(
        capsys, "chats", "export", str(cid), "--format", "json", "--out", str(target)
    )
    assert (code, out, err) == (0, "", f"exported to {target}\n")
    assert json.loads(target.read_text()) == exported
    assert target.stat().st_mode & 0o777 == 0o600
    folder = home / "exports"
    folder.mkdir()
    assert _tandem(capsys, "chats", "export", str(cid), "--out", str(folder))[0] == 0
    assert sorted(p.name for p in folder.iterdir()) == [
        f"lisbon-trip-{cid}.json",
        f"lisbon-trip-{cid}.md",
    ]
    for argv in (["show", "999"], ["export", "999"], ["export", "999", "--format", "json"]):
        assert _tandem(capsys, "chats", *argv) == (2, "", "error: no conversation with id 999\n")


# ---------------------------------------------------------------------------- tandem ask


def test_continue_and_conversation_are_exclusive() -> None:
    from app.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["ask", "q", "-c"])
    assert args.continue_ and args.conversation is None
    assert parser.parse_args(["ask", "q", "--conversation", "4"]).conversation == 4
    plain = parser.parse_args(["ask", "q"])
    assert not plain.continue_ and plain.conversation is None
    with pytest.raises(SystemExit):
        parser.parse_args(["ask", "q", "--continue", "--conversation", "4"])


async def test_ask_an_unknown_conversation_is_a_plain_error(home: Path, capsys) -> None:
    from app.ask import run_ask
    from app.cli import build_parser

    args = build_parser().parse_args(["ask", "hi", "--conversation", "999"])
    assert await run_ask(args) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == "error: no conversation with id 999\n"


async def test_ask_continue_twice_keeps_one_conversation(
    home: Path, capsys, tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tandem ask --continue` in local mode: the first starts a conversation (none yet), the
    second continues it with the first turn as its history; plain `ask` saves nothing."""
    from app.ask import run_ask
    from app.cli import build_parser
    from app.settings import Settings, save_settings
    from collab.plumbing.paths import conversations_path
    from edge_runtime.modes.local import LocalMode

    histories: list[list[tuple[str, str]]] = []
    generate = LocalMode.generate

    def spy(self, question, history, options, answer):
        histories.append([(t.question, t.answer) for t in history])
        return generate(self, question, history, options, answer)

    monkeypatch.setattr(LocalMode, "generate", spy)
    save_settings(Settings(device_model=str(tiny["onnx-quant"]), k=1, max_tokens=6))
    parser = build_parser()
    assert (
        await run_ask(parser.parse_args(["ask", "Who owns the kayak?", "--continue", "--json"]))
        == 0
    )
    first = json.loads(capsys.readouterr().out)
    assert first["answer"] and isinstance(first["conversation_id"], int)
    assert await run_ask(parser.parse_args(["ask", "And the tent?", "-c"])) == 0
    printed = capsys.readouterr()
    assert printed.err.startswith("(continuing: Who owns the kayak?)\n")
    assert "continuing" not in printed.out  # stdout is the answer
    with ConversationStore(conversations_path()) as s:
        (only,) = s.list()
        messages = s.messages(only.id)
    assert only.id == first["conversation_id"]
    assert [(m.role, m.status) for m in messages] == [
        ("user", "complete"),
        ("assistant", "complete"),
    ] * 2
    assert [messages[0].text, messages[2].text] == ["Who owns the kayak?", "And the tent?"]
    assert messages[1].text == first["answer"]
    assert histories == [[], [("Who owns the kayak?", first["answer"])]]

    assert await run_ask(parser.parse_args(["ask", "Fresh?", "--json"])) == 0
    assert "conversation_id" not in json.loads(capsys.readouterr().out)
    assert (
        await run_ask(
            parser.parse_args(["ask", "Third?", "--conversation", str(only.id), "--json"])
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["conversation_id"] == only.id
    with ConversationStore(conversations_path()) as s:
        assert [c.messages for c in s.list()] == [6]  # "Fresh?" was not saved
    assert histories[-1][-1][0] == "And the tent?"
