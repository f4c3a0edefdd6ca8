"""Copy (issue 47, item 3): the selected answer, its last code block and a citation go to the
clipboard through the terminal (OSC 52) and, where one is installed, the desktop's own tool;
each is a key and a palette action, listed in F1 help, with a toast that says what was copied.
Control characters a hostile document carries are not copied."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from app.assistant import Assistant
from app.settings import Settings
from app.tui.app import TandemApp
from app.tui.chat_view import AnswerView, CitationLine
from app.tui.clipboard import code_blocks, desktop_tool
from app.tui.help import HelpScreen
from app.tui.sources import SourceScreen
from tests.tui.test_app import until

SIZE = (120, 36)
CODE_ANSWER = (
    "Use this:\n\n```python\nprint('one')\n```\n\nor, shorter:\n\n~~~\nprint('two')\n~~~\n"
)
PLAIN_ANSWER = "Your tandem is green."
HOSTILE = "the key is under the mat\x1b[2J\x1b]52;c;ZXZpbA==\x07 (really)"
CITATION = {
    "number": 1,
    "side": "device",
    "title": "notes.md",
    "location": "lines 1-2",
    "score": 0.7,
    "excerpt": HOSTILE,
    "text": HOSTILE,
    "path": "/home/u/notes.md",
}


def make_app(tiny_device) -> TandemApp:
    s = Settings(k=1, max_tokens=24, default_mode="local")
    app = TandemApp(s, Assistant(s, device=tiny_device), connect_cloud=False)
    cid = app.store.create("Bicycles").id
    app.store.add_message(cid, "user", "How do I print?", "local")
    app.store.add_message(cid, "assistant", CODE_ANSWER, "local", citations=[CITATION])
    app.store.add_message(cid, "user", "And my tandem?", "local")
    app.store.add_message(cid, "assistant", PLAIN_ANSWER, "local")
    return app


def toasts(app: TandemApp) -> list[str]:
    return [str(n.message) for n in app._notifications]


@pytest.fixture
def no_desktop(monkeypatch) -> None:
    for name in ("WAYLAND_DISPLAY", "DISPLAY"):
        monkeypatch.delenv(name, raising=False)


async def test_keys_copy_the_selected_answer_and_its_last_code_block(
    isolated_dirs, tiny_device, no_desktop
) -> None:
    app = make_app(tiny_device)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: len(app.query(AnswerView)) == 2)
        await pilot.press("ctrl+y")  # nothing selected: the last answer
        await until(pilot, lambda: app.clipboard == PLAIN_ANSWER)
        copied = f"Copied the answer ({len(PLAIN_ANSWER)} characters) with the terminal (OSC 52)."
        assert copied in toasts(app)
        await pilot.press("ctrl+b")  # the last answer has no code
        await until(pilot, lambda: any("no code block" in t for t in toasts(app)))
        assert app.clipboard == PLAIN_ANSWER

        app.query(AnswerView)[0].query_one(CitationLine).focus()  # select the first answer
        await pilot.press("ctrl+b")
        await until(pilot, lambda: app.clipboard == "print('two')")
        assert any("the last of its 2 code blocks" in t for t in toasts(app))
        await pilot.press("ctrl+y")
        await until(pilot, lambda: app.clipboard == CODE_ANSWER)


async def test_the_palette_and_help_offer_copy(isolated_dirs, tiny_device, no_desktop) -> None:
    app = make_app(tiny_device)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: len(app.query(AnswerView)) == 2)
        await pilot.press("ctrl+p")
        await pilot.press(*"Copy code block")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, lambda: any("no code block" in t for t in toasts(app)))
        await pilot.press("ctrl+p")
        await pilot.press(*"Copy answer")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, lambda: app.clipboard == PLAIN_ANSWER)

        await pilot.press("f1")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        listed = app.screen.bindings  # type: ignore[attr-defined]
        assert ("ctrl+y", "Copy answer", "copy_answer") in listed
        assert ("ctrl+b", "Copy code", "copy_code") in listed


async def test_a_citation_is_copied_from_its_source_screen_without_control_characters(
    isolated_dirs, tiny_device, no_desktop
) -> None:
    app = make_app(tiny_device)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: len(app.query(AnswerView)) == 2)
        app.query(AnswerView)[0].query_one(CitationLine).focus()
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, SourceScreen))
        await pilot.press("c")
        await until(pilot, lambda: app.clipboard.startswith("[1] device"))
        copied = app.clipboard
        assert "the key is under the mat[2J]52;c;ZXZpbA== (really)" in copied
        assert not any(ord(ch) < 32 and ch not in "\n\t" for ch in copied)
        assert any("Copied the citation" in t for t in toasts(app))

        await pilot.press("f1")  # this screen's key is listed too
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        listed = app.screen.bindings  # type: ignore[attr-defined]
        assert ("c", "Copy citation (this screen)", "copy_citation") in listed


def fake_tool(folder: Path, name: str) -> Path:
    """A stand-in for a desktop clipboard tool on PATH: it writes what it reads to a file."""
    out = folder / f"{name}.out"
    script = folder / name
    script.write_text(f"#!/bin/sh\ncat > '{out}'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return out


async def test_the_desktop_tool_takes_the_text_too_where_installed(
    isolated_dirs, tiny_device, tmp_path, monkeypatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    out = fake_tool(bin_dir, "wl-copy")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("WAYLAND_DISPLAY", "wayland-0")
    monkeypatch.delenv("DISPLAY", raising=False)
    app = make_app(tiny_device)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: len(app.query(AnswerView)) == 2)
        await pilot.press("ctrl+y")
        await until(pilot, lambda: any("and wl-copy" in t for t in toasts(app)))
    assert out.read_text(encoding="utf-8") == PLAIN_ANSWER
    assert app.clipboard == PLAIN_ANSWER  # and through the terminal as well


def test_the_desktop_tool_is_the_one_this_desktop_has():
    have = {"wl-copy", "xclip", "pbcopy"}.__contains__

    def which(name: str) -> Any:
        return f"/usr/bin/{name}" if have(name) else None

    assert desktop_tool({"WAYLAND_DISPLAY": "wayland-0"}, which) == ("wl-copy",)
    assert desktop_tool({"DISPLAY": ":0"}, which) == ("xclip", "-selection", "clipboard")
    assert desktop_tool({}, which) == ("pbcopy",)
    assert desktop_tool({}, lambda name: None) is None  # a server: the terminal only


def test_code_blocks_are_found_whatever_their_fence():
    assert code_blocks(CODE_ANSWER) == ["print('one')", "print('two')"]
    assert code_blocks("```sh\nls -la\n\nwc -l\n```") == ["ls -la\n\nwc -l"]
    assert code_blocks("an answer cut mid-block:\n```py\nx = 1\ny =") == ["x = 1\ny ="]
    assert code_blocks("inline `code` is not a block") == []
