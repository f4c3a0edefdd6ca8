"""Sources: the panel beside the conversation and the screen that shows one chunk.

Each is a `collab.sources.Source` (given as one, or as the row the conversation store keeps):
private ones are marked **device** (they never left), public ones **cloud**."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

from rich.text import Text
from textual.app import ComposeResult, SuspendNotSupported
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Label, ListItem, ListView, Static

from app.tui.clipboard import copy_and_tell
from app.tui.open_source import (
    Pager,
    editor_command,
    pager_text,
    place_of,
    start_viewer,
    viewer_command,
)
from app.tui.plain import plain, plain_text
from collab.sources import Source

log = logging.getLogger(__name__)

S = TypeVar("S", bound=Source | Mapping[str, Any])


def as_source(src: Source | Mapping[str, Any]) -> Source:
    """The source itself, or the one a stored row describes."""
    return src if isinstance(src, Source) else Source.from_dict(src)


def by_number(sources: Iterable[S]) -> list[S]:
    """Sources in citation order. They arrive by side (dragon: the device's own, numbered after
    the cloud's, come first), but an answer cites them by number."""
    return sorted(sources, key=lambda s: as_source(s).number)


def position(numbers: Iterable[int], number: int) -> int:
    """Where a source numbered `number` goes among sources numbered `numbers` (in order)."""
    return sum(n <= number for n in numbers)


def badge(side: str) -> Text:
    return plain_text(
        f" {side} ", style="bold black on green" if side == "device" else "bold black on cyan"
    )


def source_line(src: Source) -> Text:
    """`[1] device · notes.md (lines 3–9) · 0.82`, the side as a coloured badge. Literal:
    titles and locations come from documents and from the cloud."""
    text = Text(f"[{src.number}] ")
    text.append_text(badge(src.side))
    text.append_text(plain_text(f" {src.title}"))
    if src.location:
        text.append_text(plain_text(f" ({src.location})", style="dim"))
    text.append_text(plain_text(f" · {src.score_label}", style="dim"))
    return text


class SourceItem(ListItem):
    def __init__(self, src: Source | Mapping[str, Any]) -> None:
        super().__init__()
        self.src = as_source(src)

    def compose(self) -> ComposeResult:
        yield Label(source_line(self.src), classes="source-title")
        excerpt = " ".join(self.src.excerpt.split())
        yield Label(plain(excerpt[:160] + ("…" if len(excerpt) > 160 else "")), classes="excerpt")


class SourcesPanel(VerticalScroll):
    """The sources of the answer in focus; Enter (or a click) opens one."""

    DEFAULT_CSS = """
    SourcesPanel { width: 42; border-left: vkey $panel-lighten-2; padding: 0 1; }
    SourcesPanel > #sources-title { text-style: bold; margin-bottom: 1; }
    SourcesPanel ListView { height: auto; background: transparent; }
    SourcesPanel ListItem { padding-bottom: 1; background: transparent; }
    SourcesPanel .excerpt { color: $text-muted; }
    SourcesPanel #sources-empty { color: $text-muted; }
    """

    class Open(Message):
        def __init__(self, src: Source) -> None:
            super().__init__()
            self.src = src

    def compose(self) -> ComposeResult:
        yield Static("Sources", id="sources-title")
        yield Static("No sources yet: answers list theirs here.", id="sources-empty")
        yield ListView(id="sources-list")

    def show(self, sources: Sequence[Source | Mapping[str, Any]]) -> None:
        listing = self.query_one("#sources-list", ListView)
        listing.clear()
        listing.extend(SourceItem(s) for s in by_number(sources))
        listing.index = 0 if sources else None
        self.query_one("#sources-empty").display = not sources

    def add(self, src: Source | Mapping[str, Any]) -> None:
        listing = self.query_one("#sources-list", ListView)
        item = SourceItem(src)
        numbers = [i.src.number for i in listing.query_children(SourceItem)]
        listing.insert(position(numbers, item.src.number), [item])
        if listing.index is None:
            listing.index = 0
        self.query_one("#sources-empty").display = False

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        if isinstance(event.item, SourceItem):
            self.post_message(self.Open(event.item.src))


class SourceScreen(ModalScreen[None]):
    """One source's chunk, in full, with where it lives."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "dismiss", "Close", id="close_source"),
        Binding("c", "copy", "Copy citation", id="copy_citation"),
        Binding("o", "open_file", "Open file", id="open_source"),
        Binding("f1", "app.help", "Help", show=False),  # a modal screen: the app's F1 is not
    ]
    DEFAULT_CSS = """
    SourceScreen { align: center middle; }
    SourceScreen > VerticalScroll { width: 90%; max-width: 110; height: 80%;
        border: round $accent; background: $surface; padding: 0 1; }
    SourceScreen #source-where { color: $text-muted; margin-bottom: 1; }
    """

    def __init__(
        self,
        src: Source | Mapping[str, Any],
        indexed: Callable[[str], Sequence[Any]] = lambda path: (),
    ) -> None:
        """`indexed(path)`: a document's stored chunks, for the pager's view of a file that is
        not text (the private index's `document_chunks`)."""
        super().__init__()
        self.src = as_source(src)
        self.indexed = indexed

    def compose(self) -> ComposeResult:
        src = self.src
        where = "this device (never sent)" if src.side == "device" else "the cloud's public corpus"
        found = f"found by {src.found_by.replace('both', 'keyword and meaning')}"
        relevance = f"relevance {src.score:.3f}" + (f", {found}" if src.found_by else "")
        detail = " · ".join(p for p in (src.path or "", src.location, relevance, where) if p)
        with VerticalScroll():
            yield Static(source_line(src), id="source-title")
            yield Static(plain(detail), id="source-where")
            yield Static(plain(src.text), id="source-text")

    async def action_copy(self) -> None:
        """The citation's line and its passage, to the clipboard."""
        await copy_and_tell(self.app, f"{self.src.line()}\n\n{self.src.text}", "the citation")

    async def action_open_file(self) -> None:
        """The cited file at the cited place: editor, else viewer, else the built-in pager."""
        place = place_of(self.src)
        if place is None:
            self.app.notify(
                "A public source has no file on this device: its passage is here.",
                severity="warning",
                markup=False,
            )
            return
        exists = await asyncio.to_thread(place.path.exists)
        editor = editor_command(place) if exists else None
        if editor is not None:
            try:
                with self.app.suspend():  # the terminal is the editor's until it exits
                    await asyncio.to_thread(subprocess.run, editor, check=False)
            except (SuspendNotSupported, OSError) as exc:
                log.info("cannot open %s in %s (%s); trying a viewer", place, editor[0], exc)
            else:
                self.app.notify(f"Opened {place} in {editor[0]}.", markup=False)
                return
        viewer = viewer_command(place) if exists else None
        if viewer is not None:
            try:
                start_viewer(viewer)
            except OSError as exc:
                log.info("cannot start %s (%s); showing the pager", viewer[0], exc)
            else:
                pageless = place.page and viewer[0] in ("xdg-open", "open")
                tail = " (it takes no page: go to the cited one)." if pageless else "."
                self.app.notify(f"Opened {place.path} with {viewer[0]}{tail}", markup=False)
                return
        text, row = await asyncio.to_thread(pager_text, place, self.indexed)
        self.app.push_screen(Pager(str(place), text, row))

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
