"""A file or folder dropped on the terminal (issue 47, item 5): the terminal pastes its path
into the prompt; a prompt that is one existing path offers to add it, and a yes ingests it on
the Documents screen. A no keeps the text; a question that mentions a path is a question.
Every spelling terminals paste is read, and a hostile file name is shown as text."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest

from app.assistant import Assistant
from app.settings import Settings
from app.tui.app import TandemApp
from app.tui.chat_view import AnswerView, PromptInput
from app.tui.documents import DocumentsScreen
from app.tui.dropped import ConfirmAdd, dropped_path
from tests.tui.test_app import until

SIZE = (120, 36)
HOSTILE = "notes [b]bold [@click=app.quit]q"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    folder = tmp_path / HOSTILE
    folder.mkdir()
    (folder / "bike.txt").write_text("The tandem's frame number is TX-4471.\n", encoding="utf-8")
    return folder


def test_every_spelling_a_terminal_pastes_is_read(folder: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(folder.parent))
    file = folder / "bike.txt"
    escaped = "".join("\\" + c if c in " []@=" else c for c in str(file))
    assert dropped_path(str(file)) == file
    assert dropped_path(f"  '{file}' ") == file
    assert dropped_path(f'"{file}"') == file
    assert dropped_path(escaped) == file
    assert dropped_path("file://" + quote(str(file))) == file
    assert dropped_path("file://localhost" + quote(str(file))) == file
    assert dropped_path(f"~/{HOSTILE}") == folder
    assert dropped_path(f"{file}\n") == file  # a trailing newline from the paste


@pytest.mark.parametrize(
    "text",
    [
        "What does my note say about the tandem?",
        "bike.txt",  # relative: a word, not a drop
        "/no/such/file.pdf",
        "file://otherhost/etc/hostname",
        "summarise /etc/hostname",
        "/etc/hostname\n/etc/hosts",  # two drops at once are not one path
        "/" + "x" * 5000,  # longer than any name the file system takes
    ],
)
def test_anything_else_is_a_question(text: str) -> None:
    assert dropped_path(text) is None


def make_app(tiny_device, private_index) -> TandemApp:
    s = Settings(k=1, max_tokens=12, default_mode="local")
    return TandemApp(s, Assistant(s, device=tiny_device, index=private_index), connect_cloud=False)


async def drop(pilot, path: Path) -> None:
    prompt = pilot.app.query_one(PromptInput)
    prompt.focus()
    prompt.insert_text_at_cursor(f"'{path}'")  # as a terminal's paste arrives
    await pilot.press("enter")


async def test_a_dropped_folder_is_added_after_a_yes(
    isolated_dirs, tiny_device, private_index, folder: Path
) -> None:
    app = make_app(tiny_device, private_index)
    async with app.run_test(size=SIZE) as pilot:
        await drop(pilot, folder)
        await until(pilot, lambda: isinstance(app.screen, ConfirmAdd))
        asked = str(app.screen.query_one("#confirm-question").render())
        assert HOSTILE in asked and "watched" in asked  # the name literally, not markup
        assert not app.query(AnswerView)  # no question was asked
        await pilot.press("y")
        await until(pilot, lambda: isinstance(app.screen, DocumentsScreen))
        screen = app.screen
        assert isinstance(screen, DocumentsScreen)
        await until(pilot, lambda: bool(screen.last_results), timeout=120)
        assert [(Path(r.path).name, r.outcome) for r in screen.last_results] == [
            ("bike.txt", "indexed")
        ]
        assert str(folder) in [f.path for f in private_index.store.folders()]  # watched
        assert app.is_running  # [@click=app.quit] was not obeyed
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, DocumentsScreen))
        assert app.query_one(PromptInput).value == ""


async def test_a_no_keeps_the_text_and_adds_nothing(
    isolated_dirs, tiny_device, private_index, folder: Path
) -> None:
    app = make_app(tiny_device, private_index)
    async with app.run_test(size=SIZE) as pilot:
        await drop(pilot, folder / "bike.txt")
        await until(pilot, lambda: isinstance(app.screen, ConfirmAdd))
        assert "file" in str(app.screen.query_one("#confirm-question").render())
        await pilot.press("n")
        await until(pilot, lambda: not isinstance(app.screen, ConfirmAdd))
        assert app.query_one(PromptInput).value == f"'{folder / 'bike.txt'}'"
        assert not isinstance(app.screen, DocumentsScreen)
        assert private_index.store.stats().documents == 0
