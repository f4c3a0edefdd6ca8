"""The question asked once per cloud before it takes part in an answer shaped by private
passages (edge_runtime.consent): always, this time, or never. Escape declines for this answer
only, so the question comes back next time."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from app.tui.plain import plain

EXPLAINED = (
    "This answer would let the cloud take part in text shaped by your documents: dragon "
    "exchanges tokens, drafts and weights that come from your passages, and split's drafts "
    "come from a prompt that holds them. The documents' text, embeddings and cache never "
    "leave this device, but what the answer says can reveal what they say. Without your "
    "agreement the answer is made without the cloud seeing anything shaped by them."
)


class ConsentScreen(ModalScreen[str | None]):
    """Dismissed with "always", "once", "never", or None (Escape: not this time)."""

    CSS_PATH = "consent.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("a", "answer('always')", "Always", id="consent_always"),
        Binding("t", "answer('once')", "This time", id="consent_once"),
        Binding("n", "answer('never')", "Never", id="consent_never"),
        Binding("escape", "decline", "Not this time", id="consent_decline"),
    ]

    def __init__(self, identity: str) -> None:
        super().__init__()
        self.identity = identity

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog") as dialog:
            dialog.border_title = "Share with this cloud?"
            yield Static(plain(self.identity), id="identity")
            yield Static(EXPLAINED, id="explained", markup=False)
            with Horizontal(id="buttons"):
                yield Button("Always (a)", id="always", compact=True)
                yield Button("This time (t)", variant="primary", id="once", compact=True)
                yield Button("Never (n)", variant="error", id="never", compact=True)

    def on_mount(self) -> None:
        self.query_one("#once", Button).focus()

    @on(Button.Pressed)
    def _answered(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id)

    def action_answer(self, said: str) -> None:
        self.dismiss(said)

    def action_decline(self) -> None:
        self.dismiss(None)
