"""The Documents screen, driven with Pilot against a real (empty, tmp_path) private index."""

from __future__ import annotations

import fcntl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from textual import events
from textual.app import App
from textual.message import Message
from textual.widgets import Button, DataTable, DirectoryTree, Input, ProgressBar, Static
from textual.worker import WorkerState

from app.tui.documents import (
    INGEST_GROUP,
    REFRESH_GROUP,
    REMOVE_GROUP,
    ConfirmRemove,
    DocumentsScreen,
    ProgressCoalescer,
    human_bytes,
    summarize,
)
from personal_index.ingest import FileResult, Progress

_GROUPS = {INGEST_GROUP, REFRESH_GROUP, REMOVE_GROUP}


class Host(App[None]):
    """A bare app that opens the Documents screen and records what it is told."""

    def __init__(self, get_index: Callable[[], Any], start: Path) -> None:
        super().__init__()
        self.get_index, self.start = get_index, start
        self.changed = 0
        self.notes: list[str] = []

    def on_mount(self) -> None:
        self.push_screen(DocumentsScreen(self.get_index, start_path=self.start))

    def on_documents_screen_index_changed(self, event: DocumentsScreen.IndexChanged) -> None:
        self.changed += 1

    def notify(self, message: str, **kwargs: Any) -> None:
        self.notes.append(message)
        super().notify(message, **kwargs)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Two indexable files, a corrupt PDF and an unsupported file."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Alpha notes: the quarterly garden plan and tomato seedlings.\n")
    (docs / "b.md").write_text("# Beta\n\nMarkdown about sourdough starters and hydration.\n")
    (docs / "broken.pdf").write_bytes(b"this is not a pdf \x00\x01\x02 at all")
    (docs / "notes.xyz").write_text("unsupported")
    return docs


async def settle(pilot: Any) -> None:
    """Wait until the screen's workers are done and the UI has applied their results."""
    app = pilot.app
    for _ in range(600):
        busy = [
            w
            for w in app.workers
            if w.group in _GROUPS and w.state in (WorkerState.PENDING, WorkerState.RUNNING)
        ]
        if busy:
            await app.workers.wait_for_complete(busy)
        await pilot.pause()
        if not any(
            w.group in _GROUPS and w.state in (WorkerState.PENDING, WorkerState.RUNNING)
            for w in app.workers
        ):
            return
    raise AssertionError("workers did not finish")


async def type_path(pilot: Any, screen: DocumentsScreen, path: Path, *, paste: bool = True) -> None:
    """Put `path` in the path box (pasted, or typed key by key, which is slower) and press Enter."""
    box = screen.query_one("#documents-path", Input)
    box.focus()
    box.value = ""
    if paste:
        box.post_message(events.Paste(str(path)))
        await pilot.pause()
    else:
        await pilot.press(*str(path))
    await pilot.press("enter")


def file_rows(screen: DocumentsScreen) -> dict[str, tuple[str, str, str]]:
    """The per-file table as {shown path: (outcome, chunks, reason)}."""
    table = screen.query_one("#documents-files", DataTable)
    rows = {}
    for i in range(table.row_count):
        path, outcome, chunks, reason = (str(c) for c in table.get_row_at(i))
        rows[path] = (outcome, chunks, reason)
    return rows


def document_keys(screen: DocumentsScreen) -> set[str]:
    table = screen.query_one("#documents-list", DataTable)
    return {key.value for key in table.rows}


def stats_text(screen: DocumentsScreen) -> str:
    return str(screen.query_one("#documents-stats", Static).render())


@pytest.fixture
def host(private_index, folder: Path) -> Host:
    return Host(lambda: private_index, folder)


async def test_ingest_typed_folder_then_reingest(host: Host, folder: Path, private_index) -> None:
    messages: list[Message] = []
    async with host.run_test(size=(100, 40), message_hook=messages.append) as pilot:
        await settle(pilot)
        screen = host.screen
        assert isinstance(screen, DocumentsScreen)
        assert "0 documents" in stats_text(screen)

        await type_path(pilot, screen, folder, paste=False)
        await settle(pilot)

        bar = screen.query_one("#documents-progress", ProgressBar)
        assert bar.total == 4 and bar.progress == 4
        rows = file_rows(screen)
        assert set(rows) == {"a.txt", "b.md", "broken.pdf", "notes.xyz"}
        assert rows["a.txt"][0] == "indexed" and int(rows["a.txt"][1]) >= 1
        assert rows["b.md"][0] == "indexed"
        assert rows["broken.pdf"][0] == "failed" and rows["broken.pdf"][2]
        assert rows["notes.xyz"][0] == "skipped" and ".xyz" in rows["notes.xyz"][2]
        assert screen.message_text.startswith("Done: 2 indexed, 1 failed, 1 skipped")

        expected = {str(folder / n) for n in ("a.txt", "b.md", "broken.pdf")}
        assert document_keys(screen) == expected
        assert {d.path for d in private_index.documents()} == expected
        stats = stats_text(screen)
        assert "2 documents" in stats and "1 failed" in stats and "flat index" in stats
        assert host.changed == 1
        assert sum(isinstance(m, DocumentsScreen.IndexChanged) for m in messages) >= 1
        # The progress wake-ups were coalesced: never more messages than files.
        wakes = [m for m in messages if isinstance(m, DocumentsScreen.IngestProgress)]
        assert 1 <= len(wakes) <= 4

        # Again: nothing changed on disk, so nothing is re-embedded and nothing is announced.
        await type_path(pilot, screen, folder)
        await settle(pilot)
        rows = file_rows(screen)
        assert rows["a.txt"][0] == "unchanged" and rows["b.md"][0] == "unchanged"
        assert rows["broken.pdf"][0] == "failed"  # failed files are retried every time
        assert screen.message_text.startswith("Done: 2 unchanged, 1 failed, 1 skipped")
        assert host.changed == 2  # the failed file was recorded again


async def test_add_highlighted_tree_entry_with_key(host: Host, folder: Path) -> None:
    async with host.run_test(size=(100, 40)) as pilot:
        await settle(pilot)
        screen = host.screen
        tree = screen.query_one("#documents-tree", DirectoryTree)
        tree.focus()
        for _ in range(100):  # the tree loads folders in a worker of its own
            if tree.root.children:
                break
            await pilot.pause()
        target = folder / "b.md"
        for _ in range(10):
            node = tree.cursor_node
            if node is not None and node.data is not None and node.data.path == target:
                break
            await pilot.press("down")
        else:
            raise AssertionError("could not reach b.md in the tree")
        assert screen.query_one("#documents-path", Input).value == str(target)

        await pilot.press("a")
        await settle(pilot)
        assert [(r.path, r.outcome) for r in screen.last_results] == [(str(target), "indexed")]
        assert [v[0] for v in file_rows(screen).values()] == ["indexed"]
        assert document_keys(screen) == {str(target)}
        assert host.changed == 1

        await pilot.press("a")  # the tree still has focus: the same file, now unchanged
        await settle(pilot)
        assert [v[0] for v in file_rows(screen).values()] == ["unchanged"]
        assert host.changed == 1


async def test_remove_asks_first(host: Host, folder: Path, private_index) -> None:
    private_index.ingest([folder / "a.txt", folder / "b.md"])
    async with host.run_test(size=(100, 40)) as pilot:
        await settle(pilot)
        screen = host.screen
        table = screen.query_one("#documents-list", DataTable)
        assert document_keys(screen) == {str(folder / "a.txt"), str(folder / "b.md")}
        table.focus()
        table.move_cursor(row=table.get_row_index(str(folder / "a.txt")))

        await pilot.press("d")
        assert isinstance(host.screen, ConfirmRemove)
        await pilot.press("n")  # keep it
        await settle(pilot)
        assert host.screen is screen and len(document_keys(screen)) == 2 and host.changed == 0

        await pilot.press("d")
        assert isinstance(host.screen, ConfirmRemove)
        await pilot.click("#confirm-no")  # the buttons work as well as the keys
        await settle(pilot)
        assert host.screen is screen and len(document_keys(screen)) == 2

        await pilot.press("delete")
        assert isinstance(host.screen, ConfirmRemove)
        await pilot.press("y")
        await settle(pilot)
        assert host.screen is screen
        assert document_keys(screen) == {str(folder / "b.md")}
        assert [d.path for d in private_index.documents()] == [str(folder / "b.md")]
        assert host.changed == 1
        assert "1 documents" in stats_text(screen) or "1 document" in stats_text(screen)
        assert screen.message_text.startswith("Removed")


@pytest.fixture
def held_lock(private_index) -> Iterator[None]:
    """Another process's ingest, as far as the index can tell."""
    with open(private_index.store.root / ".ingest.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
        fcntl.flock(lock, fcntl.LOCK_UN)


async def test_busy_index_is_a_plain_message(host: Host, folder: Path, held_lock) -> None:
    async with host.run_test(size=(100, 40)) as pilot:
        await settle(pilot)
        screen = host.screen
        await type_path(pilot, screen, folder)
        await settle(pilot)
        assert host.screen is screen
        assert "busy" in screen.message_text.lower()
        assert screen.query_one("#documents-status", Static).has_class("-error")
        assert any("busy" in n.lower() for n in host.notes)
        assert not screen.query_one("#documents-add", Button).disabled
        assert screen.last_results == [] and host.changed == 0


async def test_second_add_refused_and_escape_leaves_ingest_running(
    private_index, folder: Path
) -> None:
    gate = threading.Event()

    def slow_index() -> Any:
        gate.wait(30)
        return private_index

    host = Host(slow_index, folder)
    async with host.run_test(size=(100, 40)) as pilot:
        await pilot.pause()
        screen = host.screen
        await type_path(pilot, screen, folder)
        await pilot.pause()
        assert screen.ingest_running()
        assert screen.query_one("#documents-add", Button).disabled

        await pilot.press("enter")  # the path is still in the box: a second add
        assert "already running" in screen.message_text

        await pilot.press("escape")
        await pilot.pause()
        assert host.screen is not screen
        assert any("background" in n for n in host.notes)

        gate.set()
        await settle(pilot)
        assert host.changed == 1  # told to the app although the screen is gone
        assert any(n.startswith("Ingest of") and "2 indexed" in n for n in host.notes)
    assert len(private_index.documents()) == 3


async def test_missing_path_and_empty_input(host: Host, tmp_path: Path) -> None:
    async with host.run_test(size=(100, 40)) as pilot:
        await settle(pilot)
        screen = host.screen
        await type_path(pilot, screen, tmp_path / "nope")
        assert "No such file or folder" in screen.message_text
        screen.query_one("#documents-path", Input).value = ""
        await pilot.press("enter")
        assert "Type a path" in screen.message_text
        assert not screen.ingest_running()


async def test_fits_80x24(host: Host) -> None:
    async with host.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        screen = host.screen
        for selector, min_height in (
            ("#documents-tree", 4),
            ("#documents-files", 4),
            ("#documents-list", 5),
            ("#documents-path", 1),
            ("#documents-progress", 1),
        ):
            widget = screen.query_one(selector)
            assert widget.region.height >= min_height, selector
            assert screen.region.contains_region(widget.region), selector
        assert screen.query_one("#documents-path").region.width >= 20
        assert screen.query_one("#documents-add").region.width >= 5

        screen.query_one("#documents-tree").focus()
        order = []
        for _ in range(5):
            await pilot.press("tab")
            order.append(host.focused.id if host.focused else None)
        assert order == [
            "documents-path",
            "documents-add",
            "documents-files",
            "documents-list",
            "documents-tree",
        ]


async def test_index_that_cannot_open_is_a_message(folder: Path) -> None:
    def broken() -> Any:
        raise RuntimeError("embedder missing")

    host = Host(broken, folder)
    async with host.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        screen = host.screen
        assert isinstance(screen, DocumentsScreen)
        assert "embedder missing" in screen.message_text
        await type_path(pilot, screen, folder)
        await settle(pilot)
        assert "embedder missing" in screen.message_text
        assert host.screen is screen and not screen.query_one("#documents-add", Button).disabled


def test_binding_ids() -> None:
    ids = {b.id: b.key for b in DocumentsScreen.BINDINGS}  # type: ignore[union-attr]
    assert ids == {
        "documents_add": "a",
        "documents_remove": "d,delete",
        "documents_refresh": "r",
        "documents_rescan": "s",
        "documents_unwatch": "w",
        "documents_include": "i",
        "documents_back": "escape",
    }


def _progress(i: int, total: int) -> Progress:
    return Progress(i, total, 1, FileResult(f"/f{i}.txt", "indexed", 1))


def test_coalescer_keeps_newest_progress_and_every_result() -> None:
    wakes: list[ProgressCoalescer] = []
    coalescer = ProgressCoalescer(wakes.append)
    for i in range(1, 1001):
        coalescer.push(_progress(i, 1000))
    assert len(wakes) == 1  # one pending wake-up, however many files finished
    latest, results = coalescer.drain()
    assert latest is not None and latest.done == 1000
    assert [r.path for r in results] == [f"/f{i}.txt" for i in range(1, 1001)]
    assert coalescer.drain() == (None, [])
    coalescer.push(_progress(1, 1))  # drained: the next push wakes the UI again
    assert len(wakes) == 2


def test_coalescer_from_threads_loses_nothing() -> None:
    coalescer = ProgressCoalescer(lambda _: None)
    seen: list[FileResult] = []

    def producer(base: int) -> None:
        for i in range(500):
            coalescer.push(_progress(base + i, 2000))

    threads = [threading.Thread(target=producer, args=(k * 500,)) for k in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        seen.extend(coalescer.drain()[1])
    for t in threads:
        t.join()
    seen.extend(coalescer.drain()[1])
    assert sorted(r.path for r in seen) == sorted(f"/f{i}.txt" for i in range(2000))


def test_wake_failure_does_not_stop_the_ingest() -> None:
    def boom(_: ProgressCoalescer) -> None:
        raise RuntimeError("screen gone")

    coalescer = ProgressCoalescer(boom)
    coalescer.push(_progress(1, 1))
    assert coalescer.drain()[0] is not None


def test_summary_and_sizes() -> None:
    results = [
        FileResult("/a", "indexed", 3),
        FileResult("/b", "unchanged"),
        FileResult("/c", "failed", reason="bad"),
        FileResult("/d", "indexed", 1),
    ]
    assert summarize(results) == "2 indexed, 1 unchanged, 1 failed"
    assert summarize([]) == "nothing to ingest"
    assert human_bytes(512) == "512 B" and human_bytes(1536) == "1.5 KB"


async def test_a_scanned_pdf_is_read_by_ocr_and_labelled(private_index, tmp_path: Path) -> None:
    """Issue 47: a scan added from the Documents screen is indexed from OCR, and its row says
    which pages OCR read; a photo with no text fails with the reason, not "0 chunks"."""
    from PIL import Image

    from benchmarks.ocr_scans import LETTERS, scan_page, scanned_pdf

    docs = tmp_path / "scans"
    docs.mkdir()
    (docs / "letter.pdf").write_bytes(scanned_pdf([scan_page(LETTERS[3], 150)], 150))
    Image.new("RGB", (640, 480), (90, 140, 200)).save(docs / "sky.png")
    host = Host(lambda: private_index, docs)
    async with host.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        screen = host.screen
        assert isinstance(screen, DocumentsScreen)
        await type_path(pilot, screen, docs)
        await settle(pilot)
        rows = file_rows(screen)
        assert rows["letter.pdf"][:2] == ("indexed", "1"), rows
        assert rows["sky.png"] == ("failed", "", "no text found: OCR found no text in it"), rows
        table = screen.query_one("#documents-list", DataTable)
        status = str(table.get_row(str(docs / "letter.pdf"))[-1])
        assert status == "indexed · OCR p. 1", status
    hits = private_index.search("When does the museum bus leave?", k=1)
    assert hits and hits[0].path == str(docs / "letter.pdf") and hits[0].page == 1
