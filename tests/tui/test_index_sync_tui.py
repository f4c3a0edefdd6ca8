"""The open app and the private index stay in step (issue 28, item 3): a document ingested by
`tandem ingest` in another terminal is used by the app's next answer, and a folder added in the
app is watched: a file dropped into it is indexed within seconds, and `s` rescans."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from textual.widgets import DataTable, Input, Static

from app.tui.documents import DocumentsScreen
from tests.tui.test_app import SIZE, ask, make_app, ready, until

ROOT = Path(__file__).resolve().parents[2]


def _cli_env(data: Path, embedder_dir: Path) -> dict[str, str]:
    models = data / "models"
    models.mkdir(parents=True, exist_ok=True)
    link = models / embedder_dir.name
    if not link.exists():
        os.symlink(embedder_dir, link)
    return {**os.environ, "TANDEM_DATA_DIR": str(data), "PYTHONPATH": str(ROOT)}


async def test_a_cli_ingest_while_the_app_is_open_is_used_by_its_next_answer(
    tiny_device, isolated_dirs, embedder_dir, tmp_path
):
    from personal_index.index import PersonalIndex

    index = PersonalIndex(isolated_dirs.data / "index", embedder_dir)  # empty at start
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "boat.md").write_text("# Boat\nThe sailing boat Marisol is moored at pier 7.\n")
    app = make_app(tiny_device, index)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await ask(pilot, "Where is the boat moored?")
            assert app.sources == []  # nothing indexed yet
            env = _cli_env(isolated_dirs.data, embedder_dir)
            cmd = [sys.executable, "-m", "app.cli", "ingest", str(notes)]
            done = await asyncio.to_thread(
                subprocess.run, cmd, env=env, capture_output=True, text=True, timeout=300
            )
            assert done.returncode == 0, done.stderr
            await ask(pilot, "Where is the boat moored?")  # no restart, no refresh
            assert [s["path"] for s in app.sources] == [str(notes / "boat.md")]
            assert app.sources[0]["side"] == "device"
    finally:
        index.close()


async def test_a_folder_added_in_the_app_is_watched_and_rescanned(
    tiny_device, isolated_dirs, embedder_dir, tmp_path
):
    from personal_index.index import PersonalIndex

    index = PersonalIndex(isolated_dirs.data / "index", embedder_dir)
    folder = tmp_path / "journal"
    folder.mkdir()
    (folder / "monday.txt").write_text("Monday: repaired the fence by the orchard.\n")
    app = make_app(tiny_device, index)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press("f2")
            await until(pilot, lambda: isinstance(app.screen, DocumentsScreen))
            screen = app.screen
            box = screen.query_one("#documents-path", Input)
            box.value = str(folder)
            box.focus()
            await pilot.press("enter")
            docs = screen.query_one("#documents-list", DataTable)
            await until(pilot, lambda: docs.row_count == 1)
            line = screen.query_one("#documents-folders", Static)
            await until(pilot, lambda: "journal (synced" in str(line.render()))
            assert [f.path for f in index.folders()] == [str(folder)]
            # a file dropped into the folder reaches the index (and the screen) by itself
            await until(pilot, lambda: app.watcher is not None)
            await pilot.pause(0.5)
            started = time.monotonic()
            (folder / "tuesday.txt").write_text("Tuesday: the apple harvest began.\n")
            await until(pilot, lambda: docs.row_count == 2, timeout=20)
            took = time.monotonic() - started
            print(f"a new file reached the open Documents screen in {took:.2f} s")
            # a deleted file leaves the index by itself too
            (folder / "monday.txt").unlink()
            await until(pilot, lambda: docs.row_count == 1, timeout=20)
            assert {Path(d.path).name for d in index.documents()} == {"tuesday.txt"}
            # a rescan is one key: it syncs though nothing changed
            await pilot.pause(1.0)
            (before,) = index.folders()
            docs.focus()  # the key is the screen's, not the path box's
            await pilot.press("s")
            assert "Rescanning" in screen.message_text
            await until(
                pilot, lambda: (index.folders()[0].synced_at or 0) > (before.synced_at or 0)
            )
    finally:
        index.close()
