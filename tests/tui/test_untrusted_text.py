"""Untrusted text is text (issue 28): document text, titles, paths, reasons, cloud text and
model output show literally in every widget, never as markup, and no control character of
theirs reaches the terminal. An unhandled exception restores the terminal, names the log file
and exits non-zero."""

from __future__ import annotations

import html
import logging
from typing import Any

import pytest
from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.content import Content
from textual.geometry import Region
from textual.widget import Widget
from textual.widgets import DataTable, Label, Static

from app.assistant import Assistant
from app.plain import strip_controls
from app.settings import Settings
from app.tui.app import TandemApp, run
from app.tui.chat_view import AnswerView, CitationLine, ConversationView, QuestionView
from app.tui.documents import DocumentsScreen
from app.tui.help import HelpScreen
from app.tui.plain import markup_escaped, plain, plain_text
from app.tui.sources import SourceItem, SourceScreen, SourcesPanel
from app.tui.status import StatusBar
from collab.plumbing.paths import log_path
from tests.tui.test_app import SIZE, ask, ready, until

MARKUP = (
    "Cabin rules [/] and [bold]not bold[/bold] and [@click=app.quit]quit[/] and "
    "[link=https://example.com]a link[/link] and \x1b[31mred\x1b[0m and "
    "\x1b]8;;https://evil.example\x1b\\hyperlink\x1b]8;;\x1b\\ and :smile: and \x9b2J end"
)
"""Markup-like text: Rich/Textual tags, an action, a link, ANSI colours, an OSC 8 hyperlink,
an emoji code and a C1 CSI (clear screen)."""
SHOWN = strip_controls(MARKUP)
"""What the user sees: the same characters, less the control ones."""
LITERALS = (
    "[/]",
    "[bold]not bold[/bold]",
    "[@click=app.quit]quit[/]",
    "[link=https://example.com]a link[/link]",
    "[31mred[0m",
    ":smile:",
    "]8;;https://evil.example\\hyperlink",
)
CABIN = "Cabin [/] notes"
BUDGET = "[@click=app.quit]budget.md"


def shown(widget: Widget) -> str:
    """What a widget draws, as plain text."""
    return str(widget.render())


def assert_literal(text: str) -> None:
    for literal in LITERALS:
        assert literal in text, (literal, text)
    assert strip_controls(text) == text, f"a control character reaches the terminal: {text!r}"


def no_controls_anywhere(app: App[Any]) -> None:
    """Nothing drawn on the screen, tooltips and toasts included, holds a control character
    (what the compositor would write to the terminal)."""
    for strip in app.screen._compositor.render_strips():
        assert strip_controls(strip.text) == strip.text, strip.text


# -- the helpers -------------------------------------------------------------------------------


def test_plain_content_and_text_are_literal_and_without_controls() -> None:
    assert plain(MARKUP).plain == SHOWN and isinstance(plain(MARKUP), Content)
    assert plain_text(MARKUP).plain == SHOWN and isinstance(plain_text(MARKUP), Text)
    assert "\x1b" not in SHOWN and "\x9b" not in SHOWN and "\t" in strip_controls("a\tb\nc")
    assert strip_controls("a\tb\nc\r\x00\x07\x7f\x85") == "a\tb\nc"


@pytest.mark.parametrize("text", [MARKUP, CABIN, BUDGET, "a\\[b] c\\", "[$accent]x[/]", "\\"])
def test_markup_escaped_reads_back_as_itself(text: str) -> None:
    """For the palette's help lines, the one place Textual takes markup only."""
    assert Content.from_markup(markup_escaped(text)).plain == strip_controls(text)


# -- one widget at a time ----------------------------------------------------------------------


class Host(App[None]):
    def __init__(self, *widgets: Widget) -> None:
        super().__init__()
        self.widgets = widgets

    def compose(self) -> ComposeResult:
        yield from self.widgets


def cited(number: int = 1, **row: Any) -> dict[str, Any]:
    return {
        "number": number,
        "side": "device",
        "title": CABIN,
        "location": "line 1",
        "score": 0.5,
        "excerpt": MARKUP,
        "path": f"/docs/{BUDGET}",
        "text": MARKUP,
        **row,
    }


async def test_model_output_streams_as_markdown_but_never_as_markup_or_escapes() -> None:
    """The answer stays Markdown (**bold** is bold), but console markup in it is text and its
    escape sequences never reach the terminal, streamed or stored."""
    view = ConversationView()
    app = Host(view)
    async with app.run_test(size=SIZE) as pilot:
        answer = view.add_answer("local")
        await answer.append("**Strong** " + MARKUP[:40])
        await answer.append(MARKUP[40:])
        await answer.flush()
        await pilot.pause()
        assert_literal(" ".join(shown(b) for b in answer.body.query("MarkdownBlock")))
        await answer.finish("complete", "3 tok")
        await pilot.pause()
        body = " ".join(shown(b) for b in answer.body.query("MarkdownBlock"))
        assert_literal(body)
        assert "Strong" in body and "**" not in body  # Markdown still applies
        assert answer.text == "**Strong** " + SHOWN
        stored = AnswerView("local", MARKUP, status="failed", note=MARKUP, citations=[cited()])
        await view.mount(stored)
        await pilot.pause()
        assert_literal(" ".join(shown(b) for b in stored.body.query("MarkdownBlock")))
        assert_literal(shown(stored.query_one(".answer-footer", Static)))
        line = stored.query_one(CitationLine)
        assert CABIN in shown(line.query(Label).last())
        assert isinstance(line.tooltip, Content) and line.tooltip.plain == SHOWN
        notice = answer.add_notice(MARKUP)
        await pilot.pause()
        assert_literal(shown(notice))
        view.add_question(MARKUP)
        await pilot.pause()
        assert_literal(shown(app.query(QuestionView).last()))
        no_controls_anywhere(app)


async def test_sources_panel_and_source_screen_show_titles_and_text_literally() -> None:
    panel = SourcesPanel()
    app = Host(panel)
    async with app.run_test(size=SIZE) as pilot:
        panel.show([cited(1), cited(2, title=BUDGET, side="cloud")])
        await pilot.pause()
        items = list(app.query(SourceItem))
        assert CABIN in shown(items[0].query(Label).first())
        assert BUDGET in shown(items[1].query(Label).first())
        assert "[/] and [bold]not bold[/bold]" in shown(items[0].query(Label).last())
        no_controls_anywhere(app)
        await app.push_screen(SourceScreen(cited(1)))
        await pilot.pause()
        assert CABIN in shown(app.screen.query_one("#source-title", Static))
        assert BUDGET in shown(app.screen.query_one("#source-where", Static))
        assert_literal(shown(app.screen.query_one("#source-text", Static)))
        no_controls_anywhere(app)


async def test_status_bar_and_help_show_error_text_and_paths_literally() -> None:
    bar = StatusBar()
    app = Host(bar)
    async with app.run_test(size=SIZE) as pilot:
        bar.set_state(mode="local", device=f"device model unavailable: {MARKUP}")
        await pilot.pause()
        assert_literal(shown(bar))
        await app.push_screen(
            HelpScreen([("ctrl+o", "Mode", "cycle_mode")], {"data": f"/home/[bold]me[/]/{BUDGET}"})
        )
        await pilot.pause()
        where = app.screen.query(Static).last().content
        assert isinstance(where, Table)
        cells = [str(c) for column in where.columns for c in column.cells]
        assert f"/home/[bold]me[/]/{BUDGET}" in cells


# -- documents ---------------------------------------------------------------------------------


async def test_a_file_named_like_markup_is_listed_by_its_name(private_index, tmp_path) -> None:
    """`[@click=app.quit]budget.md` was listed as `budget.md`, its markup read as an action."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / BUDGET).write_text(f"Budget for the cabin.\n{MARKUP}\n", encoding="utf-8")
    (docs / "[bold]broken.pdf").write_bytes(b"not a pdf [/] at all")

    class Docs(App[None]):
        def on_mount(self) -> None:
            self.push_screen(DocumentsScreen(lambda: private_index, start_path=docs))

    app = Docs()
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        assert isinstance(screen, DocumentsScreen)
        screen.add_path(str(docs))
        await until(pilot, lambda: screen.last_results and not screen.ingest_running())
        await until(pilot, lambda: screen.query_one("#documents-list", DataTable).row_count == 2)
        await pilot.pause()
        table = screen.query_one("#documents-files", DataTable)  # a str cell is read as markup
        drawn = "\n".join(s.text for s in table.render_lines(Region(0, 0, *table.size)))
        assert BUDGET in drawn and "[bold]broken.pdf" in drawn, drawn
        no_controls_anywhere(app)


# -- the whole app -----------------------------------------------------------------------------


@pytest.fixture
def markup_index(isolated_dirs, embedder_dir, tmp_path):
    """A real private index in the isolated data dir holding an HTML page titled "Cabin [/]
    notes" and a file named `[@click=app.quit]budget.md`, both full of markup-like text."""
    from personal_index.index import PersonalIndex

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "cabin.html").write_text(
        f"<html><head><title>{html.escape(CABIN)}</title></head>"
        f"<body><p>{html.escape(MARKUP)}</p></body></html>",
        encoding="utf-8",
    )
    (docs / BUDGET).write_text(f"{MARKUP}\n", encoding="utf-8")
    idx = PersonalIndex(
        isolated_dirs.data / "index", embedder_dir, chunk_tokens=200, overlap_tokens=8
    )
    idx.ingest([docs])
    yield idx
    idx.close()


def local_app(tiny_device, index) -> TandemApp:
    s = Settings(k=2, max_tokens=8, default_mode="local")
    return TandemApp(s, Assistant(s, device=tiny_device, index=index), connect_cloud=False)


async def test_an_answer_citing_markup_shows_it_literally_and_the_app_starts_again(
    tiny_device, markup_index
) -> None:
    """The user's report: a page titled "Cabin [/] notes" crashed the TUI the moment an answer
    cited it, and every later start (the conversation is restored) crashed the same way."""
    question = "What do the [bold]cabin[/] rules say? :smile:"
    app = local_app(tiny_device, markup_index)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        answer = await ask(pilot, question)
        titles = {s["title"] for s in app.sources}
        assert titles == {CABIN, BUDGET}, titles
        panel_text = " ".join(shown(label) for label in app.query_one(SourcesPanel).query(Label))
        assert CABIN in panel_text and BUDGET in panel_text and "[/] and [bold]" in panel_text
        lines = " ".join(
            shown(label) for line in answer.query(CitationLine) for label in line.query(Label)
        )
        assert CABIN in lines and BUDGET in lines
        assert shown(app.query(QuestionView).last()) == question
        assert question in shown(app.query_one("#conversation-title", Static))
        no_controls_anywhere(app)
        app.query_one(SourcesPanel).query_one("#sources-list").focus()
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, SourceScreen))
        assert_literal(shown(app.screen.query_one("#source-text", Static)))
        no_controls_anywhere(app)
        await pilot.press("escape")
        conversation = app.conversation_id
    assert app.return_code in (None, 0) and app.crash is None

    again = local_app(tiny_device, markup_index)
    async with again.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert again.conversation_id == conversation
        assert shown(again.query_one(QuestionView)) == question
        panel_text = " ".join(shown(label) for label in again.query_one(SourcesPanel).query(Label))
        assert CABIN in panel_text and BUDGET in panel_text
        assert {s.source.title for s in again.query(CitationLine)} == {CABIN, BUDGET}
        no_controls_anywhere(again)
    assert again.return_code in (None, 0) and again.crash is None


# -- the crash handler -------------------------------------------------------------------------


class Crashing(TandemApp):
    """The app with a bug: a handler raises once the screen is up."""

    def on_ready(self) -> None:
        raise RuntimeError(f"a bug with {MARKUP}")


class Quitting(TandemApp):
    def on_ready(self) -> None:
        self.exit()


def test_an_unhandled_exception_names_the_log_and_exits_non_zero(
    isolated_dirs, tiny_device, markup_index, capsys, caplog
) -> None:
    s = Settings(default_mode="local")
    app = Crashing(s, Assistant(s, device=tiny_device, index=markup_index), connect_cloud=False)
    with caplog.at_level(logging.INFO, logger="tandem.tui"):
        code = run(app, headless=True)
    assert code != 0 and app.return_code == 1 and isinstance(app.crash, RuntimeError)
    err = capsys.readouterr().err
    assert str(log_path()) in err and "RuntimeError: a bug with" in err
    assert strip_controls(err.split("tandem stopped")[-1]) == err.split("tandem stopped")[-1]
    logged = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert logged and logged[0].exc_info and logged[0].exc_info[1] is app.crash


def test_a_clean_quit_exits_zero(isolated_dirs, tiny_device, markup_index, capsys) -> None:
    s = Settings(default_mode="local")
    app = Quitting(s, Assistant(s, device=tiny_device, index=markup_index), connect_cloud=False)
    assert run(app, headless=True) == 0
    assert "tandem stopped" not in capsys.readouterr().err
