"""Watched folders stay where the user put them (issue 44, item 6).

`tandem docs watch / unwatch / sync / include`; a watched folder later replaced by a symlink
or by another folder of the same name is refused, not followed; `/`, the home folder and very
large trees need `--yes`; a document removed from a watched folder stays removed until it is
included again; a removed document's text leaves the stored citations, however it left."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from app.conversations import REMOVED_EXCERPT, ConversationStore
from collab.plumbing.paths import conversations_path, index_dir
from personal_index import watched
from personal_index.watched import WatchBook, count_entries, watch_guard

Tandem = Callable[..., tuple[int, str, str]]
SECRET = "The vault combination is 9911-4417."


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home folder of its own (the guard compares against it)."""
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(folder))
    return folder


@pytest.fixture
def tandem(tmp_path, embedder_dir, monkeypatch, capsys, home) -> Tandem:
    """`app.cli.main` in this process against a data dir of its own (the embedder linked in)."""
    from app.cli import main

    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    os.symlink(embedder_dir, data / "models" / "all-minilm-l6-v2-onnx")
    monkeypatch.setenv("TANDEM_DATA_DIR", str(data))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path / "config"))

    def run(*args: str) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def notes(tmp_path: Path) -> Path:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "apples.txt").write_text("Apples ripen in the orchard by late September.\n")
    (folder / "boats.md").write_text("# Boats\nThe sailing boat Marisol is moored at pier 7.\n")
    return folder


def indexed(tandem: Tandem) -> set[str]:
    code, out, _ = tandem("docs", "list", "--json")
    assert code == 0
    return {row["path"] for row in json.loads(out) if row["status"] == "indexed"}


def excluded(tandem: Tandem) -> set[str]:
    return {
        r["path"]
        for r in json.loads(tandem("docs", "list", "--json")[1])
        if r["status"] == "excluded"
    }


def test_watch_sync_and_unwatch_from_the_cli(tandem: Tandem, notes: Path) -> None:
    """`docs watch` records and syncs the folder; `docs sync` picks up a new file; `docs
    unwatch` stops syncing it and keeps its documents; the commands say so plainly."""
    code, out, _ = tandem("docs", "watch", notes)
    assert code == 0, out
    assert "2 indexed" in out and f"watching {notes}" in out
    assert indexed(tandem) == {str(notes / "apples.txt"), str(notes / "boats.md")}
    assert f"watching {notes}" in tandem("docs", "list")[1]

    (notes / "pears.txt").write_text("Pears grow on the north wall.\n")
    code, out, _ = tandem("docs", "sync")
    assert code == 0, out
    assert "indexed    " + str(notes / "pears.txt") in out and "1 indexed, 2 unchanged" in out
    assert str(notes / "pears.txt") in indexed(tandem)

    code, out, _ = tandem("docs", "unwatch", notes)
    assert code == 0 and "stopped watching" in out and "3 documents stay" in out
    (notes / "plums.txt").write_text("Plums, too.\n")
    code, out, _ = tandem("docs", "sync")
    assert code == 0 and "no watched folders" in out
    assert len(indexed(tandem)) == 3  # kept, and the new file was not synced
    code, _, err = tandem("docs", "unwatch", notes)
    assert code == 2 and "is not watched" in err
    code, _, err = tandem("docs", "sync", notes)
    assert code == 2 and "is not watched" in err


def test_the_home_folder_root_and_large_trees_need_yes(
    tandem: Tandem, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (home / "todo.txt").write_text("Call the plumber about the kitchen tap.\n")
    for folder in (home, Path("/"), home.parent):  # the parent holds the home folder
        code, out, err = tandem("docs", "watch", folder)
        assert code == 2 and "--yes" in err and "refused" in err, (folder, err)
    assert "whole home folder" in tandem("docs", "watch", home)[2]
    assert "whole disk" in tandem("docs", "watch", "/")[2]
    big = tmp_path / "big"
    big.mkdir()
    for i in range(6):
        (big / f"n{i}.txt").write_text(f"note {i}\n")
    monkeypatch.setattr(watched, "LARGE_TREE", 5)
    code, _, err = tandem("docs", "watch", big)
    assert code == 2 and "more than 5 files and folders" in err
    code, out, _ = tandem("docs", "list")
    assert "watching" not in out and indexed(tandem) == set()  # nothing was recorded

    code, out, _ = tandem("docs", "watch", home, "--yes")
    assert code == 0 and "1 indexed" in out
    assert indexed(tandem) == {str(home / "todo.txt")}


def test_counting_a_tree_stops_at_the_bound(tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / f"d{i}").mkdir()
        (tmp_path / f"d{i}" / "f.txt").write_text("x")
    (tmp_path / ".hidden").mkdir()
    assert count_entries(tmp_path, 10) == 11  # stopped at one past the bound
    assert count_entries(tmp_path, 1000) == 60  # hidden entries are not counted
    assert watch_guard(tmp_path, limit=100) is None
    assert watch_guard(tmp_path, limit=59) == "more than 59 files and folders"


def test_a_folder_replaced_by_a_symlink_is_refused_not_followed(
    tandem: Tandem, notes: Path, tmp_path: Path
) -> None:
    """Watch a folder, replace it with a symlink to another folder holding other files, sync:
    nothing from the other folder is indexed and the notice says why. Watching it again is
    the consent to follow it."""
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "vault.txt").write_text(SECRET + "\n")
    assert tandem("docs", "watch", notes)[0] == 0
    notes.rename(tmp_path / "notes.old")
    notes.symlink_to(other)
    code, out, _ = tandem("docs", "sync")
    assert code == 1
    assert "refused" in out and f"now leads to {other}" in out and "tandem docs watch" in out
    assert not any(p.startswith(str(other)) for p in indexed(tandem))
    code, out, _ = tandem("search", "vault combination", "--json")
    assert code == 0 and "9911" not in out

    code, out, _ = tandem("docs", "watch", notes)  # consent: follow it there
    assert code == 0 and "1 indexed" in out
    assert indexed(tandem) == {str(other / "vault.txt")}  # the old place's documents left


def test_another_folder_of_the_same_name_is_refused(
    tandem: Tandem, notes: Path, tmp_path: Path
) -> None:
    assert tandem("docs", "watch", notes)[0] == 0
    before = indexed(tandem)
    notes.rename(tmp_path / "notes.old")
    notes.mkdir()  # same path, another folder (another inode)
    (notes / "vault.txt").write_text(SECRET + "\n")
    code, out, _ = tandem("docs", "sync")
    assert code == 1 and "replaced by another folder of the same name" in out
    assert indexed(tandem) == before  # nothing read, nothing purged


def test_an_older_tandems_watched_folder_is_recorded_at_its_first_sync(
    tandem: Tandem, notes: Path, tmp_path: Path
) -> None:
    """A folder watched before records existed (only the store's folders table) is recorded
    as it resolves at its first sync; a later swap is refused."""
    from retrieval.embedder import DIM
    from retrieval.store import IndexStore

    with IndexStore(index_dir(), DIM) as store:
        store.add_folder(str(notes))
    code, out, _ = tandem("docs", "sync")
    assert code == 0 and "2 indexed" in out
    with WatchBook(index_dir()) as book:
        record = book.get(str(notes))
    assert record is not None and record.real_path == str(notes)
    assert (record.dev, record.ino) == (notes.stat().st_dev, notes.stat().st_ino)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "vault.txt").write_text(SECRET + "\n")
    notes.rename(tmp_path / "notes.old")
    notes.symlink_to(other)
    assert tandem("docs", "sync")[0] == 1
    assert not any(p.startswith(str(other)) for p in indexed(tandem))


async def test_the_watcher_refuses_a_swapped_folder_and_says_why(
    tmp_path: Path, embedder_dir: Path, notes: Path, home: Path
) -> None:
    """The app's path: `FolderWatcher.sync` reads nothing of the other folder and hands the
    notice to its listener; it does not listen to the moved folder any more."""
    from personal_index.index import PersonalIndex
    from personal_index.watch import FolderWatcher

    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "vault.txt").write_text(SECRET + "\n")
    told: list[tuple[str, str | None]] = []
    with PersonalIndex(tmp_path / "index", embedder_dir) as index:
        index.watch(notes)
        watcher = FolderWatcher(index, on_synced=lambda f, r, e: told.append((f, e)))
        assert await watcher.sync(str(notes))
        assert watcher._where([str(notes)]) == {str(notes): str(notes)}
        notes.rename(tmp_path / "notes.old")
        notes.symlink_to(other)
        assert await watcher.sync(str(notes)) is None
        assert told[-1][0] == str(notes) and "now leads to" in (told[-1][1] or "")
        assert not any(d.path.startswith(str(other)) for d in index.documents())
        assert watcher._where([str(notes)]) == {}  # not listened to


def test_a_removed_document_stays_removed_until_included(tandem: Tandem, notes: Path) -> None:
    apples = notes / "apples.txt"
    assert tandem("docs", "watch", notes)[0] == 0
    code, out, _ = tandem("docs", "remove", apples)
    assert code == 0 and "removed 1 document" in out
    assert f"stays out of the watched folder {notes}" in out and "docs include" in out
    apples.write_text("Apples ripen in the orchard by late September, and keep.\n")  # changed
    code, out, _ = tandem("docs", "sync")
    assert code == 0 and "excluded" in out
    assert indexed(tandem) == {str(notes / "boats.md")}
    assert excluded(tandem) == {str(apples)}
    listing = tandem("docs", "list")[1]
    assert f"excluded {apples}" in listing and "docs include" in listing
    code, out, _ = tandem("ingest", notes)  # by hand too: the user's choice holds
    assert str(apples) not in indexed(tandem) and "excluded" in out

    code, out, _ = tandem("docs", "include", apples)
    assert code == 0 and f"included {apples} again" in out and "1 indexed" in out
    assert indexed(tandem) == {str(apples), str(notes / "boats.md")}
    assert excluded(tandem) == set()
    code, _, err = tandem("docs", "include", apples)
    assert code == 2 and "nothing excluded" in err


def test_an_excluded_subfolder_is_not_entered_and_removing_the_watched_folder_unwatches(
    tandem: Tandem, notes: Path
) -> None:
    (notes / "private").mkdir()
    (notes / "private" / "diary.txt").write_text(SECRET + "\n")
    assert tandem("docs", "watch", notes)[0] == 0
    assert tandem("docs", "remove", notes / "private")[0] == 0
    code, out, _ = tandem("docs", "sync")
    assert code == 0 and f"skipped    {notes / 'private'}  excluded" in out
    assert "diary" not in out  # the excluded folder is not entered
    assert excluded(tandem) == {str(notes / "private")}

    code, out, _ = tandem("docs", "remove", notes)  # the watched folder itself
    assert code == 0 and f"stopped watching {notes}" in out and "removed 2 documents" in out
    assert "watching" not in tandem("docs", "list")[1] and excluded(tandem) == set()


def _citations(path: Path, other: str) -> list[dict]:
    return [
        {
            "number": 1,
            "side": "device",
            "title": "apples.txt",
            "location": "line 1",
            "score": 0.81,
            "excerpt": "Apples ripen…",
            "path": str(path),
            "text": "Apples ripen in the orchard by late September.",
            "found_by": "both",
        },
        {
            "number": 2,
            "side": "device",
            "title": "apples.txt.bak",
            "location": "",
            "score": 0.5,
            "excerpt": "Backup",
            "path": str(path) + ".bak",
            "text": "Backup",
        },
        {
            "number": 3,
            "side": "cloud",
            "title": "Apple",
            "location": "",
            "score": 0.6,
            "excerpt": "The apple is…",
            "path": None,
            "text": "The apple is a fruit.",
        },
        {
            "number": 4,
            "side": "device",
            "title": "boats.md",
            "location": "lines 1–2",
            "score": 0.7,
            "excerpt": "The sailing…",
            "path": other,
            "text": "The sailing boat",
        },
    ]


def _stored(message_id: int) -> list[dict]:
    with ConversationStore(conversations_path()) as store:
        (row,) = [m for m in store.messages(1) if m.id == message_id]
    return row.citations


def test_removed_documents_leave_the_stored_citations(tandem: Tandem, notes: Path) -> None:
    """`docs remove` and a sync that finds the file deleted both drop the cited text; what
    was shown (title, location, score, side, path) stays, marked removed."""
    apples, boats = notes / "apples.txt", notes / "boats.md"
    assert tandem("docs", "watch", notes)[0] == 0
    with ConversationStore(conversations_path()) as store:
        cid = store.create().id
        store.add_message(cid, "user", "When do apples ripen?", "local")
        mid = store.add_message(
            cid,
            "assistant",
            "In late September [1].",
            "local",
            citations=_citations(apples, str(boats)),
        )
    assert tandem("docs", "remove", apples)[0] == 0
    first, backup, cloud, boat = _stored(mid)
    assert first["text"] == "" and first["excerpt"] == REMOVED_EXCERPT and first["removed"]
    kept = ("number", "side", "title", "location", "score", "path", "found_by")
    assert {k: first[k] for k in kept} == {k: _citations(apples, "")[0][k] for k in kept}
    assert backup["text"] == "Backup" and cloud["text"] == "The apple is a fruit."
    assert boat["text"] == "The sailing boat"  # not removed (yet)

    boats.unlink()
    assert tandem("docs", "sync")[0] == 0
    boat = _stored(mid)[3]
    assert boat["text"] == "" and boat["removed"] and boat["title"] == "boats.md"
    raw = conversations_path().read_bytes()
    assert b"orchard by late September" not in raw and b"The sailing boat" not in raw


async def test_a_removal_made_in_the_app_drops_the_cited_text(
    tmp_path: Path, embedder_dir: Path, notes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The TUI removes through the Assistant's index: its listener scrubs the history."""
    from app.assistant import Assistant
    from app.settings import Settings
    from personal_index.index import PersonalIndex

    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    apples = notes / "apples.txt"
    index = PersonalIndex(tmp_path / "index", embedder_dir)
    assistant = Assistant(Settings(), index=index)
    try:
        store = assistant.conversations
        cid = store.create().id
        mid = store.add_message(
            cid,
            "assistant",
            "Late September [1].",
            "local",
            citations=_citations(apples, "/elsewhere/b.md"),
        )
        opened = await asyncio.to_thread(assistant.open_index)
        await asyncio.to_thread(opened.ingest, [notes])
        await asyncio.to_thread(opened.remove, apples)
        (first, *_rest) = next(m for m in store.messages(cid) if m.id == mid).citations
        assert first["removed"] and first["text"] == "" and first["score"] == 0.81
    finally:
        await assistant.close()


def test_forget_document_text_matches_whole_names(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "c.sqlite") as store:
        cid = store.create().id
        cited = _citations(Path("/n/apples.txt"), "/n2/boats.md")
        store.add_message(cid, "assistant", "x", "local", citations=cited)
        assert store.forget_document_text(["/n/apples.txt"]) == 1  # not apples.txt.bak
        assert store.forget_document_text(["/n"]) == 1  # the .bak now, not /n2
        assert store.forget_document_text(["/n"]) == 0  # already removed
        citations = store.messages(cid)[0].citations
        assert [bool(c.get("removed")) for c in citations] == [True, True, False, False]
        assert store.forget_document_text(["/n2/"]) == 1
