"""One private index, many processes, folders kept in sync (issue 28, item 3).

A document ingested or removed by another process (`tandem ingest` in a second terminal while
the app is open) is used by this process's next search without a restart; a watched folder's
new, changed, deleted and renamed files reach the index within seconds."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from retrieval.store import ChunkRecord, DocumentMeta, IndexStore

DIM = 8


def _doc(store: IndexStore, path: str, vector: np.ndarray) -> None:
    meta = DocumentMeta(path, 1, 1.0, path)
    store.replace_document(meta, [ChunkRecord(0, f"text of {path}")], vector[None, :])


def test_a_store_sees_what_another_connection_wrote_before_its_next_search(tmp_path):
    """Two stores on one folder (as two processes hold it): writes by one are found and
    removals are gone in the other's next search; nothing is re-read while nothing changed."""
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(3, DIM)).astype(np.float32)
    with IndexStore(tmp_path, DIM) as app, IndexStore(tmp_path, DIM) as cli:
        _doc(app, "/a.txt", vecs[0])
        assert [h.path for h in app.search(vecs[1], 3)] == ["/a.txt"]
        _doc(cli, "/b.txt", vecs[1])  # the "CLI" ingests while the "app" is open
        assert app.search(vecs[1], 1)[0].path == "/b.txt"
        cli.remove_paths(["/a.txt"])
        assert [h.path for h in app.search(vecs[0], 3)] == ["/b.txt"]
        # the app's own writes and the CLI's, interleaved, still agree with SQLite
        _doc(app, "/c.txt", vecs[2])
        _doc(cli, "/a.txt", vecs[0])
        assert sorted(h.path for h in app.search(vecs[0], 5)) == ["/a.txt", "/b.txt", "/c.txt"]
        assert app.check_consistency(deep=True) == []
        assert cli.check_consistency(deep=True) == []


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )


@pytest.fixture
def data_env(tmp_path, embedder_dir, monkeypatch):
    """A data dir whose models folder is the prepared embedder's, for this process and the CLI."""
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    os.symlink(embedder_dir, data / "models" / embedder_dir.name)
    monkeypatch.setenv("TANDEM_DATA_DIR", str(data))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path / "config"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return data, env


async def test_a_cli_ingest_reaches_the_open_assistant_before_its_next_answer(
    tmp_path, data_env, near_drafter
):
    """The app's Assistant opened an empty index; `tandem ingest` runs in another process;
    the next local answer cites the new document (before: no passages until a restart), and
    after `tandem docs remove` in that process, it is cited no more."""
    from app.assistant import Assistant
    from app.settings import Settings
    from edge_runtime.events import Citation

    _, env = data_env
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "boat.md").write_text("# Boat\nThe sailing boat Marisol is moored at pier 7.\n")
    assistant = Assistant(Settings(k=1, max_tokens=4), device=near_drafter)
    assistant.open_index()

    async def cited(question: str) -> list[str]:
        exchange = assistant.exchange(question, "local", save=False)
        return [e.path for e in [e async for e in exchange.events()] if isinstance(e, Citation)]

    try:
        assert await cited("Where is the boat moored?") == []
        done = await asyncio.to_thread(_cli, "ingest", str(notes), env=env)
        assert done.returncode == 0, done.stderr
        assert await cited("Where is the boat moored?") == [str(notes / "boat.md")]
        gone = await asyncio.to_thread(_cli, "docs", "remove", str(notes), env=env)
        assert gone.returncode == 0, gone.stderr
        assert await cited("Where is the boat moored?") == []
        assert assistant.index is not None
        assert assistant.index.store.check_consistency(deep=True) == []
    finally:
        await assistant.close()


async def _until(condition, timeout: float = 15.0) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError("timed out waiting for the watched folder to sync")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_a_watched_folder_follows_new_changed_deleted_and_renamed_files(
    tmp_path, embedder_dir
):
    from personal_index.index import PersonalIndex
    from personal_index.watch import FolderWatcher

    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "first.txt").write_text("The first note is about apples.\n")
    index = PersonalIndex(tmp_path / "index", embedder_dir)
    syncs: list[str] = []
    watcher = FolderWatcher(index, on_synced=lambda f, r, e: syncs.append(f))
    index.watch(folder)
    stop = asyncio.Event()
    task = asyncio.ensure_future(watcher.run(stop))

    def paths() -> set[str]:
        return {Path(d.path).name for d in index.documents()}

    def text_of(name: str) -> str:
        hits = index.search(name, k=5)
        return " ".join(h.text for h in hits if Path(h.path).name == name)

    try:
        await _until(lambda: paths() == {"first.txt"})  # the start-up sync
        await asyncio.sleep(0.3)  # the watcher is listening
        (folder / "second.md").write_text("# Second\nPears grow on the north wall.\n")
        took = [await _until(lambda: paths() == {"first.txt", "second.md"})]
        (folder / "first.txt").write_text("The first note is now about cherries.\n")
        took.append(await _until(lambda: "cherries" in text_of("first.txt")))
        (folder / "second.md").rename(folder / "renamed.md")
        took.append(await _until(lambda: paths() == {"first.txt", "renamed.md"}))
        (folder / "first.txt").unlink()
        took.append(await _until(lambda: paths() == {"renamed.md"}))
        (folder / ".hidden.txt").write_text("never indexed\n")
        (folder / "sub").mkdir()
        (folder / "sub" / "deep.txt").write_text("A note in a subfolder about plums.\n")
        took.append(await _until(lambda: paths() == {"renamed.md", "deep.txt"}))
        print(f"a change reached the index in {max(took):.2f} s at most ({took})")
        assert max(took) < 10
        (row,) = index.folders()
        assert row.path == str(folder) and row.synced_at is not None
        assert row.synced_at > time.time() - 10
        assert index.store.check_consistency(deep=True) == []
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        index.close()
    assert syncs and set(syncs) == {str(folder)}


async def test_a_rescan_picks_up_changes_and_a_vanished_folder_takes_its_documents(
    tmp_path, embedder_dir
):
    """With the watcher not listening (the app was closed), `rescan` (one key in the app, and
    what the app does at start) syncs: a removed folder's documents are purged."""
    from personal_index.index import PersonalIndex
    from personal_index.watch import FolderWatcher

    folder = tmp_path / "trip"
    folder.mkdir()
    (folder / "plan.txt").write_text("Day one: the ferry to the island.\n")
    with PersonalIndex(tmp_path / "index", embedder_dir) as index:
        index.watch(folder)
        watcher = FolderWatcher(index)
        assert [r.outcome for r in await watcher.sync(str(folder)) or []] == ["indexed"]
        (folder / "plan.txt").unlink()
        folder.rmdir()
        results = await watcher.sync(str(folder))
        assert results and results[0].outcome == "removed"
        assert index.documents() == [] and not index.has_documents()
        assert [f.path for f in index.folders()] == [str(folder)]  # still watched: may return
