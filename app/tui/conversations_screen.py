"""The conversations screen: find, open, start, rename, delete and export past conversations.

The search box (/) filters the list as you type to the conversations whose questions or
answers match (`ConversationStore.search`, the same FTS5 search as `tandem chats search`),
best match first, the highlighted one's matching line under the list; Enter opens it.

A modal that works with any host App: it takes the store, the current conversation and the export
folder, and reports the conversation to open by `dismiss(id)` (None: keep the current one).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.coordinate import Coordinate
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Input, Static

from app.conversations import (
    ConversationNotFound,
    ConversationRow,
    ConversationStore,
    export_paths,
)
from app.plain import strip_controls
from app.tui.plain import plain, plain_text

__all__ = ["ConversationTable", "ConversationsScreen", "export_paths", "format_updated"]

logger = logging.getLogger(__name__)

TITLE_WIDTH = 44


def format_updated(timestamp: float, now: float | None = None) -> str:
    """Time of day for today's conversations, the date for older ones."""
    moment = time.localtime(timestamp)
    today = time.localtime(time.time() if now is None else now)
    if moment[:3] == today[:3]:
        return time.strftime("today %H:%M", moment)
    return time.strftime("%Y-%m-%d", moment)


def _short(title: str, width: int = TITLE_WIDTH) -> str:
    return title if len(title) <= width else title[: width - 1] + "…"


class ConversationTable(DataTable[Text], inherit_bindings=False):
    """A DataTable without its own Enter binding, so the screen's remappable "open" binding
    receives Enter (and shows in the footer)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        *(
            b
            for b in DataTable.BINDINGS
            if not (isinstance(b, Binding) and b.action == "select_cursor")
        ),
        Binding("ctrl+pageup", "page_left", "Page left", show=False),
        Binding("ctrl+pagedown", "page_right", "Page right", show=False),
    ]


class ConversationsScreen(ModalScreen[int | None]):
    """Pick a conversation to open (dismiss(id)), or manage them in place."""

    CSS_PATH = "conversations_screen.tcss"

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "open", "Open", id="conversations_open"),
        Binding("n", "new", "New", id="conversations_new"),
        Binding("r", "rename", "Rename", id="conversations_rename"),
        Binding("d", "delete", "Delete", id="conversations_delete"),
        Binding("e", "export", "Export", id="conversations_export"),
        Binding("slash", "search", "Search", id="conversations_search"),
        Binding("escape", "close", "Close", id="conversations_close"),
    ]

    def __init__(
        self,
        store: ConversationStore,
        current_id: int | None,
        export_dir: Path,
        *,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.store = store
        self.current_id = current_id
        self.export_dir = Path(export_dir)
        self._pending_delete: int | None = None
        self._renaming: int | None = None
        self._snippets: dict[int, str] = {}  # conversation → its best match, while searching

    # -- layout -----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog") as dialog:
            dialog.border_title = "Conversations"
            yield Input(id="search", placeholder="Search questions and answers (/)", compact=True)
            with Vertical(id="below"):  # docked: stays visible however long the list
                yield Input(id="rename", placeholder="New title (Enter saves, Escape cancels)")
                yield Static("", id="status", markup=False)
                yield Static(f"Exports go to {self.export_dir}", id="export-dir", markup=False)
            yield ConversationTable(id="conversations", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(ConversationTable)
        table.add_column("Title", key="title")
        table.add_column("Msgs", key="messages")
        table.add_column("Updated", key="updated")
        self.refresh_rows(select_id=self.current_id)
        table.focus()

    # -- state ------------------------------------------------------------------------------

    @property
    def table(self) -> ConversationTable:
        return self.query_one(ConversationTable)

    @property
    def query_text(self) -> str:
        return self.query_one("#search", Input).value.strip()

    def _rows(self) -> list[ConversationRow]:
        """Every conversation, or while searching those that match, best first (each once,
        with its best match kept for the status line)."""
        rows = self.store.list()
        query = self.query_text
        self._snippets = {}
        if not query:
            return rows
        by_id = {row.id: row for row in rows}
        found: list[ConversationRow] = []
        if not self.query_one("#search", Input).value[-1:].isspace():
            query += "*"  # the word being typed matches as a prefix
        for hit in self.store.search(query):
            if hit.conversation_id in by_id and hit.conversation_id not in self._snippets:
                self._snippets[hit.conversation_id] = hit.snippet
                found.append(by_id[hit.conversation_id])
        return found

    def refresh_rows(self, select_id: int | None = None, index: int | None = None) -> None:
        """Reload the list from the store (filtered by the search box); put the cursor on
        `select_id`, else row `index`."""
        table = self.table
        rows = self._rows()
        table.clear()
        target = None
        for position, row in enumerate(rows):
            table.add_row(*self._cells(row), key=str(row.id))
            if row.id == select_id:
                target = position
        if target is None and index is not None and rows:
            target = min(max(index, 0), len(rows) - 1)
        if target is not None:
            table.move_cursor(row=target, animate=False)
        if not rows and self.query_text:
            self.set_status("No conversation matches.")
        elif not rows:
            self.set_status("No conversations yet. Press n to start one.")
        elif self.query_text:
            self._show_match()
        self.refresh_bindings()

    def _show_match(self) -> None:
        """The highlighted conversation's best matching line, while searching."""
        snippet = self._snippets.get(self.selected_id() or -1, "")
        self.set_status(" ".join(snippet.split()))

    def action_search(self) -> None:
        self._cancel_rename()
        self.query_one("#search", Input).focus()

    @on(Input.Changed, "#search")
    def _search_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._reset_pending()
        self.set_status("")
        self.refresh_rows(index=0)

    @on(Input.Submitted, "#search")
    def _search_submitted(self, event: Input.Submitted) -> None:
        """Enter in the search box opens the best match."""
        event.stop()
        self.action_open()

    def _cells(self, row: ConversationRow) -> tuple[Text, Text, Text]:
        """Text cells, not strings: DataTable reads strings as markup, and titles are free text."""
        marker = "● " if row.id == self.current_id else "  "
        return (
            plain_text(marker + _short(row.title), no_wrap=True),
            Text(str(row.messages), justify="right"),
            Text(format_updated(row.updated_at)),
        )

    def selected_id(self) -> int | None:
        """The conversation under the cursor (None when the list is empty)."""
        table = self.table
        if table.row_count == 0:
            return None
        row_key = table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0)).row_key
        return int(row_key.value) if row_key.value is not None else None

    def set_status(self, text: str, *, warning: bool = False) -> None:
        status = self.query_one("#status", Static)
        status.update(plain(text))  # may quote a title
        status.set_class(warning, "warning")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Grey out the actions that need a conversation while the list is empty."""
        needs_row = action in ("open", "rename", "delete", "export")
        if needs_row and self.is_mounted and not self._has_rows():
            return None
        return True

    def _has_rows(self) -> bool:
        tables = self.query(ConversationTable)
        return bool(tables) and tables.first().row_count > 0

    def _reset_pending(self) -> None:
        if self._pending_delete is not None:
            self._pending_delete = None
            self.set_status("")

    # -- actions ----------------------------------------------------------------------------

    def action_open(self) -> None:
        conversation_id = self.selected_id()
        if conversation_id is not None:
            self.dismiss(conversation_id)

    @on(DataTable.RowSelected)
    def _row_clicked(self, event: DataTable.RowSelected) -> None:
        """A click on the highlighted row opens it."""
        event.stop()
        self.action_open()

    @on(DataTable.RowHighlighted)
    def _row_moved(self, event: DataTable.RowHighlighted) -> None:
        if self._pending_delete is not None and self.selected_id() != self._pending_delete:
            self._reset_pending()
        if self.query_text and self._pending_delete is None and self._renaming is None:
            self._show_match()

    def action_new(self) -> None:
        self._cancel_rename()
        conversation = self.store.create()
        self.dismiss(conversation.id)

    def action_rename(self) -> None:
        conversation_id = self.selected_id()
        if conversation_id is None:
            return
        self._reset_pending()
        try:
            conversation = self.store.get(conversation_id)
        except ConversationNotFound:
            self.refresh_rows()
            return
        self._renaming = conversation_id
        field = self.query_one("#rename", Input)
        field.value = conversation.title
        field.add_class("visible")
        field.focus()
        self.set_status("Rename: Enter saves, Escape cancels.")

    @on(Input.Submitted, "#rename")
    def _rename_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if self._renaming is None:
            return
        renamed = self._renaming
        try:
            self.store.rename(renamed, event.value)
        except ValueError as exc:
            self.set_status(f"{str(exc).capitalize()}.", warning=True)
            return
        except ConversationNotFound:
            self._cancel_rename()
            self.refresh_rows()
            self.set_status("That conversation no longer exists.", warning=True)
            return
        self._cancel_rename()
        self.refresh_rows(select_id=renamed)

    def _cancel_rename(self) -> bool:
        """Hide the rename prompt; True when there was one to hide."""
        if self._renaming is None:
            return False
        self._renaming = None
        field = self.query_one("#rename", Input)
        field.remove_class("visible")
        field.value = ""
        self.set_status("")
        self.table.focus()
        return True

    def action_delete(self) -> None:
        """First press asks, a second press on the same conversation deletes it."""
        conversation_id = self.selected_id()
        if conversation_id is None:
            return
        self._cancel_rename()
        if self._pending_delete != conversation_id:
            try:
                title = self.store.get(conversation_id).title
            except ConversationNotFound:
                self.refresh_rows()
                return
            self._pending_delete = conversation_id
            key = self._key_for("delete")
            self.set_status(
                f"Delete “{_short(title)}” and its messages? Press {key} again to confirm.",
                warning=True,
            )
            return
        index = self.table.cursor_row
        self._pending_delete = None
        try:
            title = self.store.get(conversation_id).title
            self.store.delete(conversation_id)
        except ConversationNotFound:
            title = "conversation"
        self.set_status("")
        self.refresh_rows(index=index)
        self.notify(strip_controls(f"Deleted “{title}”."), markup=False)

    def action_export(self) -> None:
        conversation_id = self.selected_id()
        if conversation_id is None:
            return
        self._cancel_rename()
        self._reset_pending()
        try:
            md_path, json_path = self.store.export_files(conversation_id, self.export_dir)
        except (OSError, ConversationNotFound) as exc:
            logger.warning("export failed: %s", exc)
            self.notify(strip_controls(f"Export failed: {exc}"), severity="error", markup=False)
            return
        self.notify(
            strip_controls(f"Exported to\n{md_path}\n{json_path}"),
            title="Conversation exported",
            markup=False,
        )

    def action_close(self) -> None:
        """Escape closes the rename prompt first, then clears the search, then the screen."""
        if self._cancel_rename():
            return
        search = self.query_one("#search", Input)
        if search.value:
            search.value = ""  # the list comes back whole (Input.Changed)
            self.table.focus()
            return
        self.dismiss(None)

    def _key_for(self, action: str) -> str:
        """The key currently bound to an action (after the user's keymap), for messages."""
        for active in self.active_bindings.values():
            if active.binding.action == action and active.node is self:
                return self.app.get_key_display(active.binding)
        return action
