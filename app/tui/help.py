"""F1: every binding with its id (remap it in the config's [keymap] table) and where things
live on disk."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from app.tui.plain import plain_text


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,f1,q", "dismiss", "Close", id="close_help")
    ]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 84; max-width: 95%; height: 90%;
        border: round $accent; background: $surface; padding: 0 1; }
    HelpScreen .heading { text-style: bold; margin-top: 1; }
    """

    def __init__(self, bindings: list[tuple[str, str, str]], paths: dict[str, str]) -> None:
        """`bindings`: (keys, description, id) as currently mapped."""
        super().__init__()
        self.bindings, self.paths = bindings, paths

    def compose(self) -> ComposeResult:
        keys = Table(box=None, show_header=True, header_style="bold", expand=True)
        for column in ("keys", "does", "id (for \\[keymap])"):
            keys.add_column(column)
        for key, description, binding_id in self.bindings:  # keys come from the config file
            keys.add_row(plain_text(key), plain_text(description), plain_text(binding_id))
        where = Table(box=None, show_header=False, expand=True)
        where.add_column(style="bold")
        where.add_column()
        for name, path in self.paths.items():  # a Rich table reads a str cell as markup
            where.add_row(plain_text(name), plain_text(path))
        with VerticalScroll():
            yield Static("Tandem: keys", classes="heading")
            yield Static(keys)
            yield Static(
                "Every action is also in the command palette (ctrl+p). Remap a key in the "
                'config file\'s [keymap] table, e.g.  cycle_mode = "ctrl+t".',
                markup=False,
            )
            yield Static("Where things live", classes="heading")
            yield Static(where)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
