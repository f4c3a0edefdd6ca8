"""What was sent: the ledger of one answer (`edge_runtime.sent`, written where frames left the
device) shown by kind, with the texts that left as they left. Everything in it (the question,
earlier turns, answer text) is shown as plain text, never markup."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from app.tui.plain import plain, plain_text
from edge_runtime.sent_kinds import TEXT_KINDS, label, row_line, summary, texts

NOT_COUNTED = (
    "Counted frame by frame as each left, here on the device. Not listed: the connection's "
    "opening request (it carries the access token, never a question) and the websocket's "
    "empty keep-alive pings."
)


class SentScreen(ModalScreen[None]):
    """One answer's ledger: `sent` as stored (None: not recorded), `question` the answer's."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "dismiss", "Close", id="close_sent")
    ]
    DEFAULT_CSS = """
    SentScreen { align: center middle; }
    SentScreen > VerticalScroll { width: 96; max-width: 95%; height: 90%;
        border: round $accent; background: $surface; padding: 0 1; }
    SentScreen .heading { text-style: bold; margin-top: 1; }
    SentScreen .sent-text { margin: 0 0 0 2; color: $text; }
    SentScreen .note { color: $text-muted; margin-top: 1; }
    """

    def __init__(
        self, sent: Sequence[Mapping[str, Any]] | None, question: str = "", *, live: bool = False
    ) -> None:
        super().__init__()
        self.sent = None if sent is None else [dict(row) for row in sent]
        self.question, self.live = question, live

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            title = "What was sent" + (" so far (the answer is streaming)" if self.live else "")
            yield Static(title, classes="heading", markup=False)
            if self.question:
                yield Static(plain(f"for: {self.question}"), id="sent-question")
            yield Static(plain(summary(self.sent)), id="sent-summary")
            if self.sent:
                table = Table(box=None, show_header=True, header_style="bold", expand=True)
                for column in ("what", "items", "frames", "bytes"):
                    table.add_column(column, justify="left" if column == "what" else "right")
                for row in self.sent:
                    table.add_row(
                        plain_text(label(row)),
                        f"{int(row.get('items', 0)):,}",
                        f"{int(row.get('frames', 0)):,}",
                        f"{int(row.get('bytes', 0)):,}",
                    )
                yield Static(table, id="sent-table")
                for row in self.sent:
                    yield Static(plain(row_line(row)), classes="sent-line")
                for row in self.sent:
                    if row.get("kind") in TEXT_KINDS and texts(row):
                        yield Static(plain(f"{label(row)}, as it left"), classes="heading")
                        for text in texts(row):
                            yield Static(plain(text), classes="sent-text")
            yield Static(NOT_COUNTED, classes="note", markup=False)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
