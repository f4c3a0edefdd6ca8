"""Sources open where they cite (issue 47, item 4): from the source screen, **o** opens the
cited file in $VISUAL/$EDITOR at its line, else in the desktop's viewer (at the page where a
PDF viewer takes one), else in the built-in pager at that place: a text file from disk, any
other document as indexed, each page marked. A public source has no file to open."""

from __future__ import annotations

import stat
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from textual.widgets import TextArea

from app.assistant import Assistant
from app.settings import Settings
from app.tui.app import TandemApp
from app.tui.chat_view import AnswerView, CitationLine
from app.tui.help import HelpScreen
from app.tui.open_source import Pager, Place, editor_command, pager_text, place_of, viewer_command
from app.tui.sources import SourceScreen
from collab.sources import Source
from tests.tui.test_app import until

SIZE = (120, 36)
HOSTILE_LINE = "line 30: [b]not bold[/b] \x1b[31mnot red\x1b[0m"


def device_source(path: Path, location: str) -> Source:
    return Source("notes", location, 0.7, "the cited passage", 1, "device", str(path))


def test_the_place_is_read_from_the_citation(tmp_path: Path) -> None:
    f = tmp_path / "a.md"
    assert place_of(device_source(f, "p. 3, lines 4–9")) == Place(f, 3, 4)
    assert place_of(device_source(f, "line 7")) == Place(f, None, 7)
    assert place_of(device_source(f, "")) == Place(f)
    assert place_of(Source("Tasmania", "Wikipedia", 0.6, "…", 1, "cloud")) is None
    assert place_of(Source("notes", "line 3", 0.6, "…", 1, "device")) is None  # no file


def test_the_editor_opens_at_the_line_where_it_takes_one(tmp_path: Path) -> None:
    text, pdf = Place(tmp_path / "a.md", None, 12), Place(tmp_path / "b.pdf", 2, None)
    path = str(text.path)
    assert editor_command(text, {"EDITOR": "vim"}) == ["vim", "+12", path]
    assert editor_command(text, {"EDITOR": "/usr/bin/nano"}) == ["/usr/bin/nano", "+12", path]
    assert editor_command(text, {"EDITOR": "emacs -nw"}) == ["emacs", "-nw", "+12", path]
    assert editor_command(text, {"EDITOR": "code --wait"}) == ["code", "--wait", "-g", f"{path}:12"]
    assert editor_command(text, {"EDITOR": "ed"}) == ["ed", path]  # no line it takes
    assert editor_command(text, {"VISUAL": "nvim", "EDITOR": "nano"})[0] == "nvim"  # type: ignore[index]
    assert editor_command(text, {}) is None
    assert editor_command(text, {"EDITOR": "'unclosed"}) is None
    assert editor_command(pdf, {"EDITOR": "vim"}) is None  # not text: a viewer's


def test_the_viewer_takes_the_page_where_it_can(tmp_path: Path) -> None:
    pdf = Place(tmp_path / "b.pdf", 4, None)

    def having(*names: str):
        return lambda name: f"/usr/bin/{name}" if name in names else None

    assert viewer_command(pdf, having("zathura", "xdg-open")) == [
        "zathura",
        "-P",
        "4",
        str(pdf.path),
    ]
    assert viewer_command(pdf, having("xdg-open")) == ["xdg-open", str(pdf.path)]
    assert viewer_command(pdf, having("open")) == ["open", str(pdf.path)]
    assert viewer_command(pdf, having()) is None


def chunk(text: str, page: int | None, start: int, end: int, line: int | None = None) -> Any:
    return SimpleNamespace(
        text=text, page=page, char_start=start, char_end=end, line_start=line, line_end=line
    )


def test_the_pager_shows_a_text_file_at_its_line_and_other_files_as_indexed(tmp_path: Path):
    notes = tmp_path / "notes.md"
    notes.write_text("".join(f"line {i}\n" for i in range(1, 30)) + HOSTILE_LINE + "\n")
    text, row = pager_text(Place(notes, None, 30), lambda path: [])
    assert text.splitlines()[row] == "line 30: [b]not bold[/b] [31mnot red[0m"  # no ESC

    chunks = [
        chunk("Page one text.", 1, 0, 14),
        chunk("Second page, first part. Overlap", 2, 0, 32),
        chunk("Overlap and the rest.", 2, 25, 46),
    ]
    text, row = pager_text(Place(tmp_path / "scan.pdf", 2, None), lambda path: chunks)
    lines = text.splitlines()
    assert lines[row - 2 : row + 1] == ["── page 2 ──", "", "Second page, first part. Overlap"]
    assert " and the rest." in lines and "── page 1 ──" in lines  # the overlap shown once
    gone = pager_text(Place(tmp_path / "gone.pdf", 1, None), lambda path: [])[0]
    assert "nothing of it is in the index" in gone


def make_app(tiny_device, citation: dict[str, Any]) -> TandemApp:
    s = Settings(k=1, max_tokens=12, default_mode="local")
    app = TandemApp(s, Assistant(s, device=tiny_device), connect_cloud=False)
    cid = app.store.create("Notes").id
    app.store.add_message(cid, "user", "Where is line 30?", "local")
    app.store.add_message(cid, "assistant", "It says not bold. [1]", "local", citations=[citation])
    return app


async def open_first_source(pilot) -> None:
    app = pilot.app
    await until(pilot, lambda: len(app.query(AnswerView)) == 1)
    app.query(AnswerView)[0].query_one(CitationLine).focus()
    await pilot.press("enter")
    await until(pilot, lambda: isinstance(app.screen, SourceScreen))


@pytest.fixture
def notes(tmp_path: Path) -> Path:
    path = tmp_path / "notes.md"
    path.write_text("".join(f"line {i}\n" for i in range(1, 30)) + HOSTILE_LINE + "\n")
    return path


@pytest.fixture
def bare_path(tmp_path: Path, monkeypatch) -> Path:
    """No editor, and a PATH holding only what the test puts there: no viewer."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("EDITOR", raising=False)
    monkeypatch.delenv("VISUAL", raising=False)
    return bin_dir


def citation(path: Path, location: str) -> dict[str, Any]:
    return {
        "number": 1,
        "side": "device",
        "title": path.name,
        "location": location,
        "score": 0.7,
        "text": "line 30",
        "path": str(path),
    }


async def test_with_no_editor_nor_viewer_the_pager_opens_at_the_line(
    isolated_dirs, tiny_device, notes: Path, bare_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("EDITOR", "vim")  # set, but a headless app cannot hand it the terminal
    app = make_app(tiny_device, citation(notes, "line 30"))
    async with app.run_test(size=SIZE) as pilot:
        await open_first_source(pilot)
        await pilot.press("o")
        await until(pilot, lambda: isinstance(app.screen, Pager))
        area = app.screen.query_one(TextArea)
        assert area.cursor_location[0] == 29
        assert area.document.get_line(29) == "line 30: [b]not bold[/b] [31mnot red[0m"
        assert area.read_only
        await pilot.press("escape")
        await until(pilot, lambda: isinstance(app.screen, SourceScreen))
        await pilot.press("f1")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        listed = app.screen.bindings  # type: ignore[attr-defined]
        assert ("o", "Open file (this screen)", "open_source") in listed


async def test_the_desktop_viewer_gets_the_file_where_installed(
    isolated_dirs, tiny_device, tmp_path: Path, bare_path: Path
) -> None:
    args = tmp_path / "viewer.args"
    viewer = bare_path / "xdg-open"
    viewer.write_text(f"#!/bin/sh\necho \"$@\" > '{args}'\n")
    viewer.chmod(viewer.stat().st_mode | stat.S_IXUSR)
    pdf = tmp_path / "scan.pdf"
    pdf.write_bytes(b"%PDF-1.4 not really\n")
    app = make_app(tiny_device, citation(pdf, "p. 2"))
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await open_first_source(pilot)
        await pilot.press("o")
        deadline = time.monotonic() + 10
        while not args.exists() and time.monotonic() < deadline:
            await pilot.pause(0.05)
        assert args.read_text().strip() == str(pdf)
        notes = [str(n.message) for n in app._notifications]
        assert any("with xdg-open (it takes no page" in n for n in notes)
        assert isinstance(app.screen, SourceScreen)  # no pager: the viewer has it


async def test_a_public_source_has_no_file_to_open(isolated_dirs, tiny_device, bare_path) -> None:
    public = {
        "number": 1,
        "side": "cloud",
        "title": "Tasmania",
        "location": "Wikipedia",
        "score": 0.6,
        "text": "Tasmania is an island state.",
    }
    app = make_app(tiny_device, public)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await open_first_source(pilot)
        await pilot.press("o")
        await until(
            pilot,
            lambda: any("no file on this device" in str(n.message) for n in app._notifications),
        )
        assert isinstance(app.screen, SourceScreen)


async def test_a_pdf_with_no_viewer_opens_in_the_pager_at_its_page_as_indexed(
    isolated_dirs, tiny_device, tmp_path: Path, bare_path: Path, private_index
) -> None:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    for page in ("The first page talks about bicycles.", "The second page names Ada."):
        pdf.add_page()
        pdf.multi_cell(0, 10, page)
    path = tmp_path / "letters.pdf"
    pdf.output(str(path))
    private_index.ingest([path])
    stored = private_index.store.document_chunks(str(path))
    assert [c.page for c in stored] == [1, 2] and "Ada" in stored[1].text
    assert private_index.store.document_chunks(str(tmp_path / "nothing.pdf")) == []

    s = Settings(k=1, max_tokens=12, default_mode="local")
    app = TandemApp(s, Assistant(s, device=tiny_device, index=private_index), connect_cloud=False)
    cid = app.store.create("Letters").id
    app.store.add_message(cid, "user", "Who is named?", "local")
    app.store.add_message(cid, "assistant", "Ada. [1]", "local", citations=[citation(path, "p. 2")])
    async with app.run_test(size=SIZE) as pilot:
        await open_first_source(pilot)
        await pilot.press("o")
        await until(pilot, lambda: isinstance(app.screen, Pager))
        area = app.screen.query_one(TextArea)
        row = area.cursor_location[0]
        assert area.document.get_line(row - 2) == "── page 2 ──"
        assert "Ada" in area.document.get_line(row)
