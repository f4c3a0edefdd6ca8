"""ConversationsScreen through key presses, in a minimal host App (any App must work)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from textual.app import App
from textual.widgets import Input, Static

from app.conversations import ConversationStore
from app.tui.conversations_screen import ConversationsScreen, ConversationTable, format_updated
from collab.plumbing.paths import conversations_path


class Host(App[None]):
    """Pushes the screen on mount and records what it dismissed with and what it notified."""

    def __init__(self, screen: ConversationsScreen) -> None:
        super().__init__()
        self._screen = screen
        self.results: list[Any] = []
        self.notes: list[str] = []

    def on_mount(self) -> None:
        self.push_screen(self._screen, self.results.append)

    def notify(self, message: str, **kwargs: Any) -> None:  # type: ignore[override]
        self.notes.append(message)
        super().notify(message, **kwargs)


@pytest.fixture
def store(isolated_dirs: SimpleNamespace):
    with ConversationStore(conversations_path()) as s:
        yield s


def seed(store: ConversationStore) -> list[int]:
    """Three conversations; the list shows them newest first: C, B, A."""
    ids = []
    for title in ("A trip", "B recipes", "C thesis"):
        cid = store.create(title).id
        store.add_message(cid, "user", f"question about {title}", "local")
        store.add_message(cid, "assistant", f"answer about {title}", "local")
        ids.append(cid)
    return ids


def make_app(
    store: ConversationStore, current: int | None, export_dir: Path
) -> tuple[Host, ConversationsScreen]:
    screen = ConversationsScreen(store, current, export_dir)
    return Host(screen), screen


def status_text(screen: ConversationsScreen) -> str:
    return str(screen.query_one("#status", Static).render())


async def test_lists_newest_first_with_cursor_on_current(
    store: ConversationStore, tmp_path: Path
) -> None:
    a, b, _ = seed(store)
    app, screen = make_app(store, b, tmp_path / "exports")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        table = screen.query_one(ConversationTable)
        assert table.row_count == 3
        titles = [str(table.get_row_at(i)[0]).strip() for i in range(3)]
        assert titles == ["C thesis", "● B recipes", "A trip"]
        assert str(table.get_row_at(0)[1]) == "2"
        assert screen.selected_id() == b
        assert str(tmp_path / "exports") in str(screen.query_one("#export-dir", Static).render())
        await pilot.press("down", "enter")
        await pilot.pause()
    assert app.results == [a]


async def test_new_creates_and_opens(store: ConversationStore, tmp_path: Path) -> None:
    seed(store)
    app, _ = make_app(store, None, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("n")
        await pilot.pause()
    assert len(app.results) == 1
    new_id = app.results[0]
    assert store.get(new_id).title == "New conversation"
    assert len(store.list()) == 4


async def test_rename_with_enter_and_cancel_with_escape(
    store: ConversationStore, tmp_path: Path
) -> None:
    _, _, c = seed(store)
    app, screen = make_app(store, c, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("r")
        await pilot.pause()
        field = screen.query_one("#rename", Input)
        assert field.has_focus and field.value == "C thesis"
        field.value = ""
        await pilot.press(*"Thesis: draft two", "enter")
        await pilot.pause()
        assert store.get(c).title == "Thesis: draft two"
        assert not field.display
        assert screen.query_one(ConversationTable).has_focus
        # Escape in the prompt cancels the rename but keeps the screen open.
        await pilot.press("r")
        await pilot.pause()
        field.value = ""
        await pilot.press(*"discarded", "escape")
        await pilot.pause()
        assert store.get(c).title == "Thesis: draft two"
        assert app.screen is screen
        # An empty title is refused with a message; the prompt stays open.
        await pilot.press("r")
        await pilot.pause()
        field.value = ""
        await pilot.press("space", "enter")
        await pilot.pause()
        assert field.display and "cannot be empty" in status_text(screen)
        assert store.get(c).title == "Thesis: draft two"
        await pilot.press("escape", "escape")
        await pilot.pause()
    assert app.results == [None]


async def test_delete_needs_a_second_press(store: ConversationStore, tmp_path: Path) -> None:
    a, b, c = seed(store)
    app, screen = make_app(store, c, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("d")
        await pilot.pause()
        assert "again to confirm" in status_text(screen)
        assert len(store.list()) == 3
        # Moving away forgets the pending delete.
        await pilot.press("down")
        await pilot.pause()
        assert "confirm" not in status_text(screen)
        await pilot.press("d")
        await pilot.pause()
        assert len(store.list()) == 3
        await pilot.press("d")
        await pilot.pause()
        assert [r.id for r in store.list()] == [c, a]
        table = screen.query_one(ConversationTable)
        assert table.row_count == 2 and screen.selected_id() == a
        # Deleting the current conversation is allowed; the screen stays open.
        await pilot.press("up", "d", "d")
        await pilot.pause()
        assert [r.id for r in store.list()] == [a]
        assert app.screen is screen and app.results == []
        assert any("Deleted" in note for note in app.notes)
        assert store.conn.execute(
            "SELECT COUNT(*) FROM messages WHERE conversation_id IN (?, ?)", (b, c)
        ).fetchone() == (0,)


async def test_export_writes_markdown_and_json(store: ConversationStore, tmp_path: Path) -> None:
    _, b, _ = seed(store)
    export_dir = tmp_path / "exports"
    app, _ = make_app(store, b, export_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("e")
        await pilot.pause()
    md = export_dir / f"b-recipes-{b}.md"
    js = export_dir / f"b-recipes-{b}.json"
    assert md.read_text(encoding="utf-8").startswith("# B recipes")
    assert json.loads(js.read_text(encoding="utf-8"))["title"] == "B recipes"
    assert any(str(md) in note and str(js) in note for note in app.notes)


async def test_export_failure_is_reported(store: ConversationStore, tmp_path: Path) -> None:
    seed(store)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    app, _ = make_app(store, None, blocker)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("e")
        await pilot.pause()
    assert any(note.startswith("Export failed") for note in app.notes)


async def test_empty_list(store: ConversationStore, tmp_path: Path) -> None:
    app, screen = make_app(store, None, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert "No conversations yet" in status_text(screen)
        await pilot.press("enter", "r", "d", "e")
        await pilot.pause()
        assert app.screen is screen and app.results == []
        await pilot.press("n")
        await pilot.pause()
    assert len(app.results) == 1 and store.get(app.results[0])


async def test_click_on_highlighted_row_opens(store: ConversationStore, tmp_path: Path) -> None:
    _, _, c = seed(store)
    app, screen = make_app(store, c, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        table = screen.query_one(ConversationTable)
        await pilot.click(table, offset=(4, 1))  # first data row, under the header
        await pilot.pause()
    assert app.results == [c]


async def test_bindings_have_ids_and_follow_the_keymap(
    store: ConversationStore, tmp_path: Path
) -> None:
    seed(store)
    ids = {b.id for b in ConversationsScreen.BINDINGS}  # type: ignore[union-attr]
    assert ids == {
        "conversations_open",
        "conversations_new",
        "conversations_rename",
        "conversations_delete",
        "conversations_export",
        "conversations_search",
        "conversations_close",
    }
    app, _ = make_app(store, None, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        app.set_keymap({"conversations_new": "ctrl+n"})
        await pilot.pause()
        await pilot.press("n")
        await pilot.pause()
        assert app.results == []
        await pilot.press("ctrl+n")
        await pilot.pause()
    assert len(app.results) == 1 and len(store.list()) == 4


async def test_fits_80x24(store: ConversationStore, tmp_path: Path) -> None:
    for i in range(30):
        store.create(f"Conversation number {i} with a rather long title to truncate")
    app, screen = make_app(store, None, tmp_path / "exports")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("d")  # a two-line confirmation must stay visible too
        await pilot.pause()
        for selector in ("#dialog", "#conversations", "#status", "#export-dir"):
            region = screen.query_one(selector).region
            assert region.height > 0 and region.right <= 80 and region.bottom <= 23, selector
        table = screen.query_one(ConversationTable)
        assert table.size.height >= 10
        await pilot.press(*["down"] * 29)
        await pilot.pause()
        assert table.cursor_row == 29 and table.scroll_offset.y > 0, "the list scrolls"


def test_format_updated() -> None:
    import time

    now = time.mktime((2024, 5, 1, 15, 0, 0, 0, 0, -1))
    assert format_updated(now - 3600, now) == "today 14:00"
    assert format_updated(now - 3 * 86400, now) == "2024-04-28"


async def test_titles_are_not_markup(store: ConversationStore, tmp_path: Path) -> None:
    title = "Notes [1] [b]draft[/b] [/]"
    cid = store.create(title).id
    app, screen = make_app(store, cid, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert str(screen.query_one(ConversationTable).get_row_at(0)[0]).strip() == f"● {title}"
        await pilot.press("d")
        await pilot.pause()
        assert title in status_text(screen)
        await pilot.press("d")
        await pilot.pause()
    assert any(title in note for note in app.notes)


async def test_the_search_box_filters_by_what_was_said_and_opens_the_best_match(
    store: ConversationStore, tmp_path: Path
) -> None:
    """/ focuses the search; typing filters to the conversations whose questions or answers
    match (the same search as `tandem chats search`), the match shown literally under the
    list; Enter opens the best one; Escape clears the search, then closes."""
    a, b, c = seed(store)
    store.add_message(a, "assistant", "The crème brûlée at [b]Casa Azul[/b] cost 8 euros.", "local")
    app, screen = make_app(store, None, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("slash")
        await pilot.press(*"creme")  # accents folded
        await pilot.pause()
        table = screen.query_one(ConversationTable)
        assert table.row_count == 1 and screen.selected_id() == a
        assert "[b]Casa Azul[/b]" in status_text(screen)  # literal, not markup
        await pilot.press("escape")  # clears the search: every conversation again
        await pilot.pause()
        assert table.row_count == 3 and screen.query_one("#search", Input).value == ""
        await pilot.press("slash", *'"* reci')  # stray FTS5 syntax; a word being typed
        await pilot.pause()
        assert table.row_count == 1 and screen.selected_id() == b
        await pilot.press(*" zebra", "enter")  # every word must match: none does
        await pilot.pause()
        assert app.results == [] and "No conversation matches" in status_text(screen)
        await pilot.press(*["backspace"] * 6, "enter")
        await pilot.pause()
    assert app.results == [b]
    assert c not in app.results
