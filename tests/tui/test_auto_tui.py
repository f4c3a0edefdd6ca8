"""auto in the TUI: the mode it chose and why on the status bar (from the `ModeChoice` event,
before the answer's text, until the next answer or another mode) and in the answer's header
(also when the conversation is reopened); F6 asks the last question again in the next
available mode without changing the selected one; the reason is shown literally."""

from __future__ import annotations

from rich.text import Text

from app.tui.app import TandemApp
from app.tui.chat_view import AnswerView
from app.tui.status import ModeBar, StatusBar
from edge_runtime.mode_choice import Choice
from edge_runtime.modes.auto import AutoMode
from tests.tui import test_app
from tests.tui.test_app import SIZE, ask, make_app, ready, status_text, until, url_of

engine, corpus, cloud, index = test_app.engine, test_app.corpus, test_app.cloud, test_app.index

NOTES_QUESTION = "Who owns the tandem bicycle?"


def header(answer: AnswerView) -> str:
    return str(answer.query_one(".answer-mode").render())


def toasts(app: TandemApp) -> list[str]:
    return [str(n.message) for n in app._notifications]


def next_mode(app: TandemApp, answered: str) -> str:
    """The mode F6 should use: the next available one after `answered`, never auto."""
    infos = app.assistant.modes()
    names = [i.name for i in infos]
    start = names.index(answered)
    for step in range(1, len(names)):
        info = infos[(start + step) % len(names)]
        if info.available and info.name != "auto":
            return info.name
    raise AssertionError(f"no mode other than {answered} is available")


async def reask(pilot) -> AnswerView:
    """Press F6 and wait for the answer it starts to finish."""
    app: TandemApp = pilot.app
    before = len(app.query(AnswerView))
    await pilot.press("f6")
    await until(pilot, lambda: len(app.query(AnswerView)) > before)
    await until(pilot, lambda: not app.answering and app.query(AnswerView).last().finished)
    return app.query(AnswerView).last()


async def test_auto_says_which_mode_and_why_before_the_answer_and_in_its_header(tiny_device, index):
    app = make_app(tiny_device, index, default_mode="auto")
    seen: list[tuple[str, str]] = []  # (status line, answer header) at each delta
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await ready(pilot)
        assert app.mode_name == "auto"
        await pilot.press("f6")  # nothing asked yet
        await pilot.pause()
        assert any("nothing to ask again" in t for t in toasts(app))
        original = AnswerView.append

        async def spy(self, text):
            seen.append((status_text(app), header(self)))
            await original(self, text)

        AnswerView.append = spy  # type: ignore[method-assign]
        try:
            answer = await ask(pilot, NOTES_QUESTION)
        finally:
            AnswerView.append = original  # type: ignore[method-assign]
        stored = app.store.messages(app.conversation_id)[-1]
        assert stored.mode == "auto" and stored.stats["auto_mode"] == "local"
        reason = stored.stats["auto_reason"]
        assert reason  # no cloud here: "no cloud"
        shown = f"● auto → local ({reason})"
        # from the first text on (the choice comes before any), and after the answer
        assert seen and all(shown in line and "auto → local" in head for line, head in seen)
        assert shown in status_text(app)
        assert shown in str(app.query_one(StatusBar).render())  # on the screen
        assert "auto → local" in header(answer)
        assert str(answer.query_one(".answer-mode").tooltip) == reason
        assert app.query_one(ModeBar).active == "auto"
        # a scrolled-back (reopened) conversation still says which mode answered
        app.show_conversation(app.conversation_id)
        await pilot.pause(0.2)
        restored = app.query(AnswerView).last()
        assert restored.finished and "auto → local" in header(restored)
        # no cloud: no mode other than local can answer, so F6 only says so
        await pilot.press("f6")
        await pilot.pause()
        assert any("no mode other than local" in t for t in toasts(app))
        assert not app.answering and len(app.store.messages(app.conversation_id)) == 2
        # another mode picked: the choice is no longer shown
        await pilot.press("ctrl+o")
        assert app.mode_name == "local"
        assert "→" not in status_text(app) and reason not in status_text(app)


async def test_f6_asks_again_in_the_next_mode_and_the_picked_mode_stays(tiny_device, index, cloud):
    app = make_app(tiny_device, index, url_of(cloud), default_mode="auto", max_tokens=12)
    async with app.run_test(size=(160, 36), notifications=True) as pilot:
        await ready(pilot)
        assert app.assistant.cloud_status.state == "ready"
        await ask(pilot, NOTES_QUESTION)
        chosen = app.store.messages(app.conversation_id)[-1].stats["auto_mode"]
        assert chosen in ("local", "cloud", "split", "dragon")
        expected = next_mode(app, chosen)
        assert expected != chosen
        seen: list[str] = []
        original = AnswerView.append

        async def spy(self, text):
            seen.append(status_text(app))
            await original(self, text)

        AnswerView.append = spy  # type: ignore[method-assign]
        try:
            answer = await reask(pilot)
        finally:
            AnswerView.append = original  # type: ignore[method-assign]
        assert any(f"asking again in {expected}" in t for t in toasts(app))
        assert answer.mode == expected and answer.status == "complete"
        again = f"● auto → {expected} (asked again in another mode)"
        assert seen and all(again in line for line in seen)
        stored = app.store.messages(app.conversation_id)
        assert [(m.role, m.text) for m in stored if m.role == "user"] == [
            ("user", NOTES_QUESTION),
            ("user", NOTES_QUESTION),
        ]
        assert [m.mode for m in stored] == ["auto", "auto", expected, expected]
        # the selected mode stays selected
        assert app.mode_name == "auto" and app.query_one(ModeBar).active == "auto"
        assert app.query_one("#mode-auto").has_class("-active")
        # each press goes one mode further
        further = next_mode(app, expected)
        answer = await reask(pilot)
        assert answer.mode == further
        assert app.store.messages(app.conversation_id)[-1].mode == further
        assert app.mode_name == "auto"
        # the next typed question goes to the selected mode, auto
        answer = await ask(pilot, "What is the capital of France?")
        stored = app.store.messages(app.conversation_id)
        assert stored[-1].mode == "auto" and stored[-1].stats["auto_mode"]
        assert f"auto → {stored[-1].stats['auto_mode']}" in header(answer)
        assert "asked again" not in status_text(app)


MARKUP = "[/] [bold]loud[/bold] [@click=app.quit]quit[/] :smile:"


async def test_the_reason_and_the_mode_are_shown_literally(tiny_device, index, monkeypatch):
    async def choose(self, question, history, options):
        return Choice("local", MARKUP)

    monkeypatch.setattr(AutoMode, "choose", choose)
    app = make_app(tiny_device, index, default_mode="auto")
    async with app.run_test(size=(200, 36)) as pilot:
        await ready(pilot)
        answer = await ask(pilot, NOTES_QUESTION)  # markup would raise in the worker
        assert answer.status == "complete"
        bar = app.query_one(StatusBar)
        assert f"● auto → local ({MARKUP})" in status_text(app)
        rendered = bar.render()
        assert MARKUP in (rendered.plain if isinstance(rendered, Text) else str(rendered))
        assert str(answer.query_one(".answer-mode").tooltip) == MARKUP
        # a mode name with markup, fed to the bar directly
        bar.set_state(choice=("[red]x[/]", MARKUP))
        await pilot.pause()
        assert f"● auto → [red]x[/] ({MARKUP})" in str(bar.line_text())
        answer.choose("[b]y[/]", MARKUP)
        await pilot.pause()
        assert "auto → [b]y[/]" in header(answer)
        assert app.is_running  # nothing was read as an action (app.quit)
