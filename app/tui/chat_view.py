"""The conversation widgets: questions, streamed answers with sources, and the prompt line.

Imports Textual only (never the model stack) so the TUI starts fast. Streaming follows oterm
(docs/extending.md#conventions): each answer is a `Markdown` fed through `Markdown.get_stream()`
(deltas joined
into at most ten writes a second), re-rendered once in full when the stream ends, and the view
follows the scroll only while the user is at the bottom.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from textual import events
from textual.app import ComposeResult
from textual.await_complete import AwaitComplete
from textual.await_remove import AwaitRemove
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Input, Label, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from app.plain import strip_controls
from app.tui.plain import plain
from app.tui.sources import by_number, position
from collab.sources import Source

FOLLOW_ROWS = 2
"""The view follows new content while fewer than this many rows lie below what it shows. One
mouse-wheel notch scrolls 2 rows, so a single notch up is enough to stop following."""

STATUSES = ("complete", "cancelled", "failed")
CANCELLED_MARK = "⏹ cancelled — partial answer kept"

# Streams being stopped after their answer was removed: kept referenced until they finish.
_stopping: set[asyncio.Future[None]] = set()


def _css_token(value: str) -> str:
    """A string made safe for use inside a CSS class name."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", value.strip().lower()) or "none"


def _field(record: Any, name: str, default: Any = None) -> Any:
    """A record's field, whether the record is a mapping or an object with attributes."""
    if isinstance(record, Mapping):
        return record.get(name, default)
    return getattr(record, name, default)


async def _stop(stream: MarkdownStream) -> None:
    """`MarkdownStream.stop()`, tolerating Textual 8.2.8's race: a stream stopped before its task
    ever ran re-raises that task's cancellation into the caller (nothing was drawn by then).
    A cancellation of the caller itself during the wait still propagates; one that was already
    under way (finish("cancelled") called from the cancelled worker) does not count."""
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0
    try:
        await stream.stop()
    except asyncio.CancelledError:
        if task is not None and task.cancelling() > before:
            raise


class QuestionView(Static):
    """The user's message, shown verbatim (no markup: prompts often contain brackets and
    pasted text)."""

    DEFAULT_CSS = """
    QuestionView {
        width: 1fr;
        height: auto;
        margin: 1 0 0 0;
        padding: 0 1;
        border-left: outer $primary;
        background: $primary 10%;
        color: $text;
    }
    """

    def __init__(
        self,
        text: str,
        *,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(plain(text), name=name, id=id, classes=classes)
        self.text = text


class CitationLine(Horizontal, can_focus=True):
    """One numbered source under an answer: `[1] device · notes.md (lines 3–9) · 0.82`.

    Carries `-device` or `-cloud` (the side that holds the chunk) so the badge colour says
    whether the source stayed private. Click it, or focus it and press Enter, to open the chunk.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select", "Open source", show=False, id="citation_open")
    ]

    DEFAULT_CSS = """
    CitationLine {
        width: 1fr;
        height: 1;
        padding: 0 1;
        color: $text-muted;
        &:hover { background: $boost; color: $text; }
        &:focus { background: $accent 20%; color: $text; }
        & > .cite-number { width: auto; color: $text; text-style: bold; margin: 0 1 0 0; }
        & > .cite-badge { width: auto; padding: 0 1; margin: 0 1 0 0; text-style: bold; }
        & > .cite-text { width: 1fr; text-wrap: nowrap; text-overflow: ellipsis; }
        &.-device > .cite-badge { background: $success 25%; color: $text-success; }
        &.-cloud > .cite-badge { background: $warning 25%; color: $text-warning; }
    }
    """

    def __init__(self, source: Source) -> None:
        super().__init__(classes=f"-{_css_token(source.side)}")
        self.source = source
        if source.excerpt:
            self.tooltip = plain(source.excerpt)  # a str tooltip is read as markup

    @property
    def number(self) -> int:
        return self.source.number

    @property
    def plain(self) -> str:
        """The line as plain text: `[1] device · notes.md (lines 3–9) · 0.82`."""
        return self.source.line()

    def compose(self) -> ComposeResult:
        yield Label(plain(f"[{self.number}]"), classes="cite-number")
        yield Label(plain(self.source.side), classes="cite-badge")
        yield Label(plain(self.source.detail), classes="cite-text")

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.action_select()

    def action_select(self) -> None:
        """Ask the app to open this chunk."""
        answer = next((a for a in self.ancestors if isinstance(a, AnswerView)), None)
        self.post_message(AnswerView.SourceSelected(self.number, answer))


class AnswerView(Widget):
    """One reply from Tandem: header with the mode (and for `auto`, the mode it chose:
    `auto → local`, the reason as the tooltip), streamed Markdown body, notices, a status
    footer and the numbered sources.

    Deltas go to the body through one `MarkdownStream`, at most `STREAM_INTERVAL` apart: the
    deltas that arrive in between are joined into one write. Whatever its size, a write costs a
    parse of the last block plus one or two re-layouts and frames (10-35 ms of CPU at 100x40 in
    benchmarks/tui_render.py, more as the answer grows), so pacing the writes bounds the CPU the
    TUI takes from the device model however fast tokens come: at 50 tokens/s about a quarter of
    a core, against half when writing on every event-loop tick. A slow stream is not delayed: a
    delta arriving after a quiet interval is written at once. At the end the body is rendered
    once in full, which repairs what the incremental parse can get wrong (a code fence still
    open).
    """

    STREAM_INTERVAL = 0.1
    """Seconds between two writes to the Markdown body while streaming (10 updates a second)."""

    DEFAULT_CSS = """
    AnswerView {
        width: 1fr;
        height: auto;
        layout: vertical;
        margin: 1 0 0 0;
        & > .answer-header {
            height: 1;
            width: 1fr;
            padding: 0 1;
        }
        & > .answer-header > .answer-who { width: auto; color: $accent; text-style: bold; }
        & > .answer-header > .answer-mode { width: auto; color: $text-muted; }
        & > .answer-header > .answer-live { width: auto; color: $text-muted; display: none; }
        &.-streaming > .answer-header > .answer-live { display: block; }
        & > Markdown.answer-body {
            padding: 0 1;
            margin: 0;
        }
        & > .answer-notices { height: auto; width: 1fr; }
        & > .answer-notices > .answer-notice {
            padding: 0 1;
            color: $text-muted;
            text-style: italic;
        }
        & > .answer-footer {
            padding: 0 1;
            color: $text-muted;
            display: none;
        }
        & > .answer-footer.-cancelled { color: $text-warning; text-style: dim; }
        & > .answer-footer.-failed { color: $text-error; text-style: bold; }
        & > .answer-sources { height: auto; width: 1fr; }
    }
    """

    class SourceSelected(Message):
        """A citation line was clicked: the app opens chunk `number` of `answer`'s sources."""

        def __init__(self, number: int, answer: AnswerView | None = None) -> None:
            super().__init__()
            self.number = number
            self.answer = answer

        @property
        def control(self) -> AnswerView | None:
            """The answer whose source was selected (for `@on(..., selector)`)."""
            return self.answer

    def __init__(
        self,
        mode: str = "",
        text: str = "",
        *,
        status: str | None = None,
        note: str = "",
        citations: Iterable[Mapping[str, Any]] = (),
        chosen: str = "",
        reason: str = "",
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        """A live answer by default; pass `status` to show a stored, finished one at once.
        `chosen` and `reason`: the mode `auto` picked for it and why (`choose()` sets them
        on a live one)."""
        if status is not None and status not in STATUSES:
            raise ValueError(f"unknown answer status {status!r}; expected one of {STATUSES}")
        super().__init__(name=name, id=id, classes=classes)
        self.mode = mode
        self.chosen = chosen
        self.reason = reason
        text = strip_controls(text)  # model output: no escape sequence reaches the terminal
        self._parts: list[str] = [text] if text else []
        self._initial = bool(text)  # _parts[0] is the stored text, rendered by compose
        self._text: str | None = text
        self._stream: MarkdownStream | None = None
        self._pending: list[str] = []  # deltas not yet written to the stream
        self._flush: asyncio.Task[None] | None = None
        self._next_write = 0.0  # loop time before which no write is due
        self._conversation: ConversationView | None = None
        self._ready = asyncio.Event()  # set once mounted (children exist), or once gone
        self._gone = False
        self._queued: list[tuple[str, Widget]] = []  # extras added before mounting
        self._status = status
        self._note = note
        self._initial_citations = by_number(dict(c) for c in citations)
        self.sources: list[dict[str, Any]] = list(self._initial_citations)
        """Every source of this answer, by number (the app opens them by number)."""
        self.add_class(f"-mode-{_css_token(mode)}" if mode else "-mode-none")
        self.add_class(f"-{status}" if status else "-streaming")

    # -- content -------------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """The full Markdown received so far (control characters stripped)."""
        if self._text is None:
            self._text = "".join(self._parts)
        return self._text

    @property
    def status(self) -> str | None:
        """`None` while streaming, then "complete", "cancelled" or "failed"."""
        return self._status

    @property
    def finished(self) -> bool:
        """True once `finish()` was called (or the answer was loaded finished)."""
        return self._status is not None

    @property
    def body(self) -> Markdown:
        """The Markdown widget that shows the answer."""
        return self.query_one(".answer-body", Markdown)

    def compose(self) -> ComposeResult:
        with Horizontal(classes="answer-header"):
            yield Label("Tandem", classes="answer-who")
            yield Label(plain(self._mode_line()), classes="answer-mode")
            yield Label(" …", classes="answer-live")
        # Only the text given to the constructor: deltas appended before the mount are still
        # queued for the stream.
        initial = self._parts[0] if self._initial else None
        yield Markdown(initial, classes="answer-body", open_links=False)
        yield Vertical(classes="answer-notices")
        yield Static("", markup=False, classes="answer-footer")
        with Vertical(classes="answer-sources"):
            for c in self._initial_citations:
                yield CitationLine(Source.from_dict(c))

    def _mode_line(self) -> str:
        """` · auto → local`, ` · local`, or nothing."""
        if not self.mode:
            return f" · {self.chosen}" if self.chosen else ""
        return f" · {self.mode} → {self.chosen}" if self.chosen else f" · {self.mode}"

    def choose(self, mode: str, reason: str = "") -> None:
        """Say in the header which mode answers (what `auto` picked) and, as its tooltip,
        why; works before the answer is mounted, too. Both are shown literally."""
        self.chosen, self.reason = mode, reason
        if self._ready.is_set() and not self._gone:
            self._show_mode()

    def _show_mode(self) -> None:
        label = self.query_one(".answer-mode", Label)
        label.update(plain(self._mode_line()))
        label.tooltip = plain(self.reason) if self.reason else None  # a str would be markup

    def on_mount(self) -> None:
        self._conversation = next(
            (a for a in self.ancestors if isinstance(a, ConversationView)), None
        )
        self._ready.set()
        if self.reason:
            self._show_mode()
        for selector, widget in self._queued:
            self._add(selector, widget)
        self._queued.clear()
        if self._status is not None:
            self._show_status(self._status, self._note)

    def on_unmount(self) -> None:
        """Stop a stream left running (answer removed mid-stream, app closing)."""
        self._gone = True
        self._ready.set()  # wake anything waiting for the mount: it returns
        self._pending.clear()  # nothing left to draw: the widget is gone
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        stream, self._stream = self._stream, None
        if stream is not None:
            stream._pending.clear()
            stopping = asyncio.ensure_future(_stop(stream))
            _stopping.add(stopping)
            stopping.add_done_callback(_stopping.discard)

    async def append(self, text: str) -> None:
        """Stream a delta into the body.

        Cheap per call: the delta is queued, and written to the `MarkdownStream` with the others
        that arrive within the same `STREAM_INTERVAL` (see the class docstring). Deltas after
        `finish()` are dropped: a token in flight when the user cancels must not crash the
        worker or reopen the answer. Control characters are dropped too: the Markdown widget
        never reads console markup, but it would pass an escape sequence to the terminal.
        """
        text = strip_controls(text)
        if not text or self._status is not None:
            return
        self._parts.append(text)
        self._text = None
        self._pending.append(text)
        if self._flush is None:
            self._flush = asyncio.create_task(self._write_later())
        await asyncio.sleep(0)  # let the app breathe between tokens, as MarkdownStream.write does

    async def flush(self) -> None:
        """Write the queued deltas now rather than at the next interval (e.g. before the stream
        pauses for a while, or in tests)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        await self._ready.wait()
        await self._write_pending()

    async def _write_later(self) -> None:
        await self._ready.wait()  # add_answer() mounts without waiting
        delay = self._next_write - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)
        self._flush = None
        await self._write_pending()

    async def _write_pending(self) -> None:
        """Write the queued deltas to the stream in one go."""
        if not self._pending or self._status is not None or self._gone:
            return
        batch = "".join(self._pending)
        self._pending.clear()
        self._next_write = asyncio.get_running_loop().time() + self.STREAM_INTERVAL
        if self._conversation is not None:
            self._conversation.follow()  # before the content grows: was the user at the end?
        if self._stream is None:
            self._stream = Markdown.get_stream(self.body)
        await self._stream.write(batch)

    async def finish(self, status: str = "complete", note: str = "") -> None:
        """End the stream and render the whole answer once.

        "cancelled" keeps the partial text and marks it; "failed" shows `note` as the error;
        "complete" shows `note` (a stats summary) dimmed. Calling it again only changes the
        footer.
        """
        if status not in STATUSES:
            raise ValueError(f"unknown answer status {status!r}; expected one of {STATUSES}")
        first = self._status is None
        self._status = status
        self.remove_class("-streaming", *(f"-{s}" for s in STATUSES))
        self.add_class(f"-{status}")
        if first:
            self._pending.clear()  # the full render below covers them
            if self._flush is not None:
                self._flush.cancel()
                self._flush = None
            stream, self._stream = self._stream, None
            if stream is not None:
                await _stop(stream)
            await self._ready.wait()
            if self._gone:
                return
            if self._conversation is not None:
                self._conversation.follow()
            # The incremental parse can be wrong at the edges (a fence still open when the
            # stream stopped); one full parse of the final text fixes it.
            await self.body.update(self.text)
        self._show_status(status, note)

    def _show_status(self, status: str, note: str) -> None:
        if not self._ready.is_set() or self._gone:
            self._note = note  # on_mount shows it
            return
        footer = self.query_one(".answer-footer", Static)
        footer.remove_class(*(f"-{s}" for s in STATUSES))
        footer.add_class(f"-{status}")
        if status == "cancelled":
            line = f"{CANCELLED_MARK} · {note}" if note not in CANCELLED_MARK else CANCELLED_MARK
        elif status == "failed":
            line = f"✗ {note}" if note else "✗ failed"
        else:
            line = note
        self._note = note
        footer.update(plain(line))
        footer.display = bool(line)

    # -- extras --------------------------------------------------------------------------------

    def add_citation(
        self,
        number: int,
        side: str,
        title: str,
        location: str = "",
        score: float = 0.0,
        excerpt: str = "",
        **extra: Any,
    ) -> CitationLine:
        """Add a numbered source line (works before the answer is mounted, too). `extra`
        (path, the chunk's text…) is kept in `sources` for the app to open."""
        row = dict(
            number=number,
            side=side,
            title=title,
            location=location,
            score=score,
            excerpt=excerpt,
            **extra,
        )
        self.sources.insert(position((r["number"] for r in self.sources), number), row)
        line = CitationLine(Source.from_dict(row))
        self._add(".answer-sources", line)
        return line

    def add_notice(self, text: str) -> Static:
        """Add a dim italic line under the body, e.g. "finishing the answer on the device"."""
        notice = Static(plain(text), classes="answer-notice")
        self._add(".answer-notices", notice)
        return notice

    def _add(self, selector: str, widget: Widget) -> None:
        """Mount `widget` at the end of `selector`; a citation line goes in number order."""
        if self._ready.is_set():
            if not self._gone:
                box = self.query_one(selector, Vertical)
                later = None
                if isinstance(widget, CitationLine):
                    later = next(
                        (c for c in box.query_children(CitationLine) if c.number > widget.number),
                        None,
                    )
                box.mount(widget, before=later)
        else:
            self._queued.append((selector, widget))


class ConversationView(VerticalScroll):
    """The scrolling list of questions and answers.

    Follow-the-scroll (oterm): while following, every re-layout keeps the view at the bottom,
    however much a batch of tokens added (Textual's anchor, applied inside the layout pass, so no
    frame shows stale scroll). Any scroll up by the user stops following; new content re-engages
    it only if the user is back within `FOLLOW_ROWS` of the bottom, so someone reading earlier
    text is never pulled down. Textual 8.2.8's anchor misplaces content shorter than the view
    (negative scroll, Textual issue #6652), so the anchor is only set while content overflows.

    A stored conversation is shown from its end: `load()` mounts the last `LOAD_BATCH` messages
    and the earlier ones, a batch at a time, when the user scrolls up to the top (a rendered
    answer costs Textual tens of widgets, and 50 of them take seconds to mount).
    """

    LOAD_BATCH = 6
    """Stored messages mounted at once by `load()`, and by each scroll to the top."""

    DEFAULT_CSS = """
    ConversationView {
        height: 1fr;
        width: 1fr;
        padding: 0 1 1 1;
        scrollbar-size-vertical: 1;
        & > .older-marker {
            width: 1fr;
            content-align-horizontal: center;
            color: $text-muted;
            text-style: italic;
        }
    }
    """

    def __init__(
        self,
        *children: Widget,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(*children, name=name, id=id, classes=classes)
        self._follow = True  # wanted while the content still fits (not anchored then)
        self._older: list[Any] = []  # stored records not mounted yet, oldest first
        self._marker: Static | None = None  # "↑ N earlier messages" above the mounted ones
        self._loading_older = False

    @property
    def at_bottom(self) -> bool:
        """True while fewer than `FOLLOW_ROWS` rows of content lie below the visible part."""
        return self.max_scroll_y - max(0.0, self.scroll_y) < FOLLOW_ROWS

    @property
    def following(self) -> bool:
        """True while new content will keep the view at the bottom."""
        if self.is_anchored:
            return not self._anchor_released  # released by any user scroll
        return self._follow

    @property
    def unloaded(self) -> int:
        """Stored messages above the mounted ones, still waiting for the user to scroll up."""
        return len(self._older)

    def follow(self) -> None:
        """Called just before new content arrives: resume following if the user is near the end.

        Two attribute reads while already following, so it can run per token.
        """
        if not self.following and self.at_bottom:
            self._engage()

    def _engage(self) -> None:
        self._follow = True
        if self.max_scroll_y > 0:
            self.anchor()  # also scrolls to the end now

    def _check_overflow(self) -> None:
        """Anchor only while the content overflows (see the class docstring)."""
        overflowing = self.max_scroll_y > 0
        if self.is_anchored and not overflowing:
            self._follow = not self._anchor_released
            self.anchor(False)
            self.scroll_target_y = self.scroll_y = 0
        elif overflowing and not self.is_anchored and self._follow:
            self.anchor()
        if not overflowing and self._older:
            self.call_later(self.load_older)  # nothing to scroll: fill the view

    def watch_virtual_size(self) -> None:
        self._check_overflow()

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if new_value < 1 and self._older and not self._loading_older:
            self.call_later(self.load_older)

    def on_resize(self) -> None:
        self._check_overflow()

    def add_question(self, text: str) -> QuestionView:
        """Show the user's message (mounted on the next turn of the message loop); always
        scrolls to it: the user just asked."""
        question = QuestionView(text)
        self.mount(question)
        self._engage()
        return question

    def add_answer(self, mode: str) -> AnswerView:
        """Mount a live answer to stream into and return it at once (its methods wait for the
        mount themselves); follows only if the user is at the bottom."""
        self.follow()
        answer = AnswerView(mode)
        self.mount(answer)
        return answer

    def clear(self) -> AwaitRemove:
        """Remove every message (optionally awaitable)."""
        self._older = []
        self._marker = None
        self._engage()
        return self.remove_children()

    def load(self, messages: Iterable[Any]) -> AwaitComplete:
        """Replace the view with a stored conversation, showing its end at once (optionally
        awaitable).

        Each record (mapping or object) has `role` ("user" or "assistant"; others are skipped),
        `text`, and for answers `mode`, `status` ("complete", "cancelled", "failed"; None means
        complete, anything else such as "streaming" was interrupted and shows as cancelled),
        `note` or `error` (optional), `citations` (dicts with number, side, title, location,
        score, excerpt) and `stats` (optional: an `auto` answer's `auto_mode` and `auto_reason`
        show in its header). Only the last `LOAD_BATCH` are mounted now; `load_older()` (run on
        scrolling to the top) adds the rest.
        """
        records = [r for r in messages if _field(r, "role") in ("user", "assistant")]
        split = max(0, len(records) - self.LOAD_BATCH)
        self._older = records[:split]
        self._marker = Static("", classes="older-marker") if self._older else None
        widgets: list[Widget] = [self._marker] if self._marker else []
        widgets += [self._widget_for(r) for r in records[split:]]
        removing = self.remove_children()  # the children now, not the new ones
        mounting = self.mount_all(widgets)
        self._update_marker()
        self._engage()

        async def done() -> None:
            await removing
            await mounting

        return AwaitComplete(done())

    async def load_older(self) -> int:
        """Mount the previous `LOAD_BATCH` stored messages above the shown ones, keeping the
        view on what the user was reading. Returns how many were added."""
        if not self._older or self._loading_older or self._marker is None:
            return 0
        self._loading_older = True
        try:
            batch = self._older[-self.LOAD_BATCH :]
            del self._older[-self.LOAD_BATCH :]
            height = self.virtual_size.height
            await self.mount_all([self._widget_for(r) for r in batch], after=self._marker)
            self._update_marker()
            if not self.following:
                # Content grew above the view: move down by as much, once it is laid out.
                def keep_place() -> None:
                    grown = self.virtual_size.height - height
                    self.scroll_to(y=self.scroll_y + grown, animate=False)

                self.call_after_refresh(keep_place)
            return len(batch)
        finally:
            self._loading_older = False

    def _update_marker(self) -> None:
        if self._marker is None:
            return
        if self._older:
            n = len(self._older)
            self._marker.update(f"↑ {n} earlier message{'s' if n > 1 else ''}")
        else:
            self._marker.remove()
            self._marker = None

    @staticmethod
    def _widget_for(record: Any) -> Widget:
        text = _field(record, "text", "") or ""
        if _field(record, "role") == "user":
            return QuestionView(text)
        status = _field(record, "status") or "complete"
        status = status if status in STATUSES else "cancelled"  # never finished
        note = _field(record, "note", "") or (
            _field(record, "error", "") if status == "failed" else ""
        )
        stats = _field(record, "stats", None)
        stats = stats if isinstance(stats, Mapping) else {}
        return AnswerView(
            _field(record, "mode", "") or "",
            text,
            status=status,
            note=note or "",
            citations=_field(record, "citations", None) or (),
            chosen=str(stats.get("auto_mode") or ""),  # what auto picked, stored in its figures
            reason=str(stats.get("auto_reason") or ""),
        )


class PromptInput(Input):
    """The prompt line, with shell-like history: Up recalls older prompts (most recent first),
    Down goes back toward newer ones and, past the newest, restores what was being typed."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "history_previous", "Previous prompt", show=False, id="prompt_history_prev"),
        Binding("down", "history_next", "Next prompt", show=False, id="prompt_history_next"),
    ]

    DEFAULT_CSS = """
    PromptInput {
        width: 1fr;
        margin: 0;
    }
    """

    MAX_HISTORY = 1000

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._history: list[str] = []
        self._index: int | None = None  # position in _history while browsing, else None
        self._draft = ""

    @property
    def history(self) -> list[str]:
        """Submitted prompts, oldest first (a copy)."""
        return list(self._history)

    def set_history(self, prompts: Iterable[str]) -> None:
        """Seed the history with stored prompts, oldest first."""
        self._history = [p for p in prompts if p.strip()][-self.MAX_HISTORY :]
        self._index = None

    def record(self, prompt: str) -> None:
        """Add a prompt to the history (blank ones and immediate repeats are skipped)."""
        self._index = None
        self._draft = ""
        if not prompt.strip() or (self._history and self._history[-1] == prompt):
            return
        self._history.append(prompt)
        del self._history[: -self.MAX_HISTORY]

    def _show(self, value: str) -> None:
        self.value = value
        self.cursor_position = len(value)

    def action_history_previous(self) -> None:
        if not self._history:
            return
        if self._index is None:
            self._draft = self.value
            self._index = len(self._history) - 1
        elif self._index > 0:
            self._index -= 1
        else:
            return
        self._show(self._history[self._index])

    def action_history_next(self) -> None:
        if self._index is None:
            return
        if self._index < len(self._history) - 1:
            self._index += 1
            self._show(self._history[self._index])
        else:
            self._index = None
            self._show(self._draft)

    async def action_submit(self) -> None:
        """Record the prompt, then post the usual `Input.Submitted` for the app."""
        self.record(self.value)
        await super().action_submit()
