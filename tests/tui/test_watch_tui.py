"""Watched folders in the Documents screen (issue 44, item 6): `w` stops watching a folder,
watching the home folder asks first, a document removed from a watched folder is listed as
excluded and `i` brings it back; the screen's keys are in the footer and in F1 help."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import DataTable, OptionList, Static

from app.tui.documents import (
    EXCLUDED_KEY,
    ConfirmRemove,
    ConfirmWatch,
    DocumentsScreen,
    StopWatching,
)
from app.tui.help import HelpScreen
from tests.tui.test_app import SIZE, make_app, ready, until
from tests.tui.test_documents import Host, document_keys, settle, type_path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Alpha notes: the quarterly garden plan and tomato seedlings.\n")
    (docs / "b.md").write_text("# Beta\n\nMarkdown about sourdough starters and hydration.\n")
    return docs


def folders_text(screen: DocumentsScreen) -> str:
    return str(screen.query_one("#documents-folders", Static).render())


async def test_stop_watching_a_folder_keeps_its_documents(private_index, folder: Path) -> None:
    private_index.watch(folder)
    private_index.sync_folder(folder)
    host = Host(lambda: private_index, folder)
    async with host.run_test(size=(100, 40)) as pilot:
        await settle(pilot)
        screen = host.screen
        assert isinstance(screen, DocumentsScreen)
        assert "Watching" in folders_text(screen) and "w stops" in folders_text(screen)
        shown = {b.binding.description for b in screen.active_bindings.values()}
        assert {"Stop watching", "Include"} <= shown  # in the footer
        screen.query_one("#documents-list", DataTable).focus()

        await pilot.press("w")
        assert isinstance(host.screen, StopWatching)
        assert host.screen.query_one(OptionList).option_count == 1
        await pilot.press("escape")  # keeps watching
        await settle(pilot)
        assert host.screen is screen and [f.path for f in private_index.folders()] == [str(folder)]

        await pilot.press("w")
        await pilot.press("enter")
        await settle(pilot)
        assert host.screen is screen
        assert private_index.folders() == []
        assert screen.message_text.startswith("Stopped watching")
        assert "No watched folders" in folders_text(screen)
        assert len(private_index.documents()) == 2  # the documents stay
        await pilot.press("w")
        assert host.screen is screen and "No folder is watched" in screen.message_text


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "home"
    folder.mkdir()
    (folder / "todo.txt").write_text("Call the plumber about the kitchen tap.\n")
    monkeypatch.setenv("HOME", str(folder))
    return folder


async def test_watching_the_home_folder_asks_first(private_index, home: Path) -> None:
    host = Host(lambda: private_index, home)
    async with host.run_test(size=(100, 40)) as pilot:
        await settle(pilot)
        screen = host.screen
        assert isinstance(screen, DocumentsScreen)
        await type_path(pilot, screen, home)
        await settle(pilot)
        assert isinstance(host.screen, ConfirmWatch)
        assert "whole home folder" in str(host.screen.query_one("#confirm-question").render())
        await pilot.press("n")
        await settle(pilot)
        assert host.screen is screen and screen.message_text.startswith("Not watched")
        assert private_index.folders() == [] and private_index.documents() == []

        await type_path(pilot, screen, home)
        await settle(pilot)
        assert isinstance(host.screen, ConfirmWatch)
        await pilot.press("y")
        await settle(pilot)
        assert host.screen is screen
        assert [f.path for f in private_index.folders()] == [str(home)]
        assert [d.path for d in private_index.documents()] == [str(home / "todo.txt")]
        assert host.changed == 1


async def test_a_removed_document_is_listed_as_excluded_and_included_again(
    private_index, folder: Path
) -> None:
    private_index.watch(folder)
    private_index.sync_folder(folder)
    a = str(folder / "a.txt")
    host = Host(lambda: private_index, folder)
    async with host.run_test(size=(100, 40)) as pilot:
        await settle(pilot)
        screen = host.screen
        assert isinstance(screen, DocumentsScreen)
        table = screen.query_one("#documents-list", DataTable)
        table.focus()
        table.move_cursor(row=table.get_row_index(a))
        await pilot.press("d")
        assert isinstance(host.screen, ConfirmRemove)
        await pilot.press("y")
        await settle(pilot)
        assert "stays out of" in screen.message_text
        assert EXCLUDED_KEY + a in document_keys(screen) and a not in document_keys(screen)
        row = [str(c) for c in table.get_row(EXCLUDED_KEY + a)]
        assert "excluded" in row[3]

        private_index.sync_folder(folder)  # a sync leaves it out
        assert a not in {d.path for d in private_index.documents()}

        table.move_cursor(row=table.get_row_index(EXCLUDED_KEY + a))
        await pilot.press("d")  # already out: nothing to confirm
        assert host.screen is screen and "i includes" in screen.message_text
        await pilot.press("i")
        await settle(pilot)
        assert screen.message_text.startswith("Included")
        assert a in document_keys(screen) and EXCLUDED_KEY + a not in document_keys(screen)
        assert a in {d.path for d in private_index.documents()}
        assert private_index.watches.exclusions() == []


async def test_f1_on_the_documents_screen_lists_its_keys(
    tiny_device, isolated_dirs, private_index
) -> None:
    app = make_app(tiny_device, private_index)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f2")
        await until(pilot, lambda: isinstance(app.screen, DocumentsScreen))
        app.screen.query_one("#documents-list", DataTable).focus()
        await pilot.press("f1")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        rows = app.screen.bindings
        assert ("w", "Stop watching (this screen)", "documents_unwatch") in rows
        assert ("i", "Include (this screen)", "documents_include") in rows
