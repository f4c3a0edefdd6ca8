"""The conversation widgets in a small host app: streaming into Markdown, finishing, following
the scroll, citations, the prompt history, and the render benchmark's entry point."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Input, Static
from textual.widgets.markdown import MarkdownFence

from app.tui.chat_view import (
    CANCELLED_MARK,
    AnswerView,
    CitationLine,
    ConversationView,
    PromptInput,
    QuestionView,
)


class Host(App[None]):
    """A conversation above a prompt line; records the messages the app would handle."""

    def __init__(self) -> None:
        super().__init__()
        self.selected: list[tuple[int, AnswerView | None]] = []
        self.submitted: list[str] = []

    def compose(self) -> ComposeResult:
        yield ConversationView()
        yield PromptInput(id="prompt")

    def on_answer_view_source_selected(self, message: AnswerView.SourceSelected) -> None:
        self.selected.append((message.number, message.answer))

    def on_input_submitted(self, message: Input.Submitted) -> None:
        self.submitted.append(message.value)


def lines(n: int, start: int = 0) -> list[str]:
    """Tokens that make `n` paragraphs of one line each (so the answer grows row by row)."""
    tokens: list[str] = []
    for i in range(start, start + n):
        tokens += [f"Line {i}", " of the", " answer.", "\n\n"]
    return tokens


async def stream(answer: AnswerView, tokens: list[str], pilot) -> None:
    for token in tokens:
        await answer.append(token)
    await answer.flush()
    await settle(answer, pilot)


async def settle(answer: AnswerView, pilot) -> None:
    """Wait until the body shows everything written so far (the stream renders in a task)."""
    for _ in range(50):
        await pilot.pause()
        if answer.finished or answer.body.source == answer.text:
            break
    await pilot.pause()
    assert answer.finished or answer.body.source == answer.text


async def test_deltas_stream_into_markdown_and_finish_renders_once() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        question = view.add_question("Show me [b]code[/b]")
        assert isinstance(question, QuestionView)
        assert "[b]code[/b]" in str(question.render())  # shown verbatim, not as markup
        answer = view.add_answer("split")
        await pilot.pause()  # mounted: the body exists
        body = answer.body
        calls = {"update": 0, "append": 0}
        update, append = body.update, body.append

        def counting_update(markdown: str):
            calls["update"] += 1
            return update(markdown)

        def counting_append(markdown: str):
            calls["append"] += 1
            return append(markdown)

        body.update, body.append = counting_update, counting_append
        tokens = ["Here", " is", " **bold**", " text.", "\n\n", "```py", "thon\n", "x = ", "1\n"]
        tokens += ["```", "\n\n", "Done", "."]
        await stream(answer, tokens, pilot)
        text = "".join(tokens)
        assert answer.text == text
        assert body.source == text
        assert calls["update"] == 0  # never a full re-render while streaming
        assert 1 <= calls["append"] < len(tokens)  # deltas are batched into few appends
        assert answer.has_class("-streaming") and answer.status is None

        await answer.finish("complete", "14 tokens · 3.2 s")
        await pilot.pause()
        assert calls["update"] == 1
        assert body.source == text
        fences = list(body.query(MarkdownFence))
        assert len(fences) == 1 and fences[0].code == "x = 1"
        assert answer.has_class("-complete") and not answer.has_class("-streaming")
        footer = answer.query_one(".answer-footer", Static)
        assert footer.display and "14 tokens" in str(footer.render())
        header = " ".join(str(label.render()) for label in answer.query(".answer-header Label"))
        assert "Tandem" in header and "split" in header
        await answer.append("late token")  # e.g. one in flight when the user cancelled
        await pilot.pause()
        assert answer.text == text and body.source == text


async def test_an_answer_can_be_used_before_its_mount_completes() -> None:
    """The app adds an answer and feeds it at once, without waiting for the mount."""
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        view.add_question("Where are my notes?")
        answer = view.add_answer("split")
        line = answer.add_citation(1, "device", "notes.md", "lines 1–2", 0.9)
        notice = answer.add_notice("searching your notes")
        await answer.append("In ")
        await answer.append("**notes.md** [1].")
        await settle(answer, pilot)  # streamed once each: nothing rendered twice
        await answer.finish("complete", "2 tokens")
        await pilot.pause()
        assert answer.body.source == "In **notes.md** [1]."
        assert answer.query_one(CitationLine) is line and line.has_class("-device")
        assert notice in answer.query(".answer-notice")
        assert "2 tokens" in str(answer.query_one(".answer-footer", Static).render())
        assert [type(w).__name__ for w in view.children] == ["QuestionView", "AnswerView"]


async def test_cancelled_keeps_the_partial_text_and_repairs_an_open_fence() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        answer = view.add_answer("device")
        partial = ["Start", " of it.", "\n\n", "```python\n", "def f():\n", "    return 1\n"]
        await stream(answer, partial, pilot)
        await answer.finish("cancelled")
        await pilot.pause()
        assert answer.text == "".join(partial)
        assert answer.body.source == "".join(partial)
        assert answer.has_class("-cancelled") and answer.status == "cancelled"
        footer = answer.query_one(".answer-footer", Static)
        assert footer.display and footer.has_class("-cancelled")
        assert CANCELLED_MARK in str(footer.render())
        fence = answer.body.query_one(MarkdownFence)
        assert "return 1" in fence.code


@pytest.mark.parametrize("stream_for", [0.0, 0.3])
async def test_finish_cancelled_from_the_cancelled_streaming_task(stream_for: float) -> None:
    """What the app does on Esc: cancel the worker, which finishes the answer as cancelled (a
    zero wait cancels it before the stream's own task has even started)."""
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        answer = view.add_answer("split")
        started = asyncio.Event()

        async def worker() -> None:
            try:
                for token in itertools.cycle(["word ", "more ", "\n\n"]):
                    await answer.append(token)
                    started.set()
                    await asyncio.sleep(0.002)
            except asyncio.CancelledError:
                await answer.finish("cancelled")
                raise

        task = asyncio.create_task(worker())
        await started.wait()
        await asyncio.sleep(stream_for)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await pilot.pause()
        assert answer.status == "cancelled" and answer.text
        assert answer.body.source == answer.text


async def test_failed_shows_the_error_and_finish_twice_only_changes_the_footer() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        answer = view.add_answer("cloud")
        await answer.append("Partial")
        await answer.finish("failed", "cloud unreachable")
        await pilot.pause()
        footer = answer.query_one(".answer-footer", Static)
        assert footer.has_class("-failed") and "cloud unreachable" in str(footer.render())
        assert answer.body.source == "Partial"
        await answer.finish("complete")
        await pilot.pause()
        assert not footer.display and answer.has_class("-complete")
        with pytest.raises(ValueError):
            await answer.finish("done")


async def test_follows_the_end_while_the_user_is_at_the_bottom() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        view.add_question("Tell me a long story")
        answer = view.add_answer("split")
        for chunk in range(8):
            await stream(answer, lines(5, start=chunk * 5), pilot)
            assert view.scroll_y >= 0
            assert view.scroll_y == view.max_scroll_y, f"chunk {chunk}"
        assert view.max_scroll_y > 20  # the answer is much taller than the view
        await answer.finish("complete", "done")
        await pilot.pause()
        assert view.scroll_y == view.max_scroll_y and view.at_bottom and view.following


async def test_short_content_stays_at_the_top() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        question = view.add_question("Hi")
        answer = view.add_answer("device")
        await stream(answer, ["Hello", "!"], pilot)
        await answer.finish()
        await pilot.pause()
        assert view.scroll_y == 0 and view.max_scroll_y == 0
        assert question.region.y <= view.region.y + 1  # not pushed down to the bottom edge


async def test_does_not_pull_down_a_user_who_scrolled_up() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        view.add_question("First question")
        first = view.add_answer("device")
        await stream(first, lines(30), pilot)
        await first.finish()
        await pilot.pause()
        assert view.scroll_y == view.max_scroll_y > 0

        view.scroll_to(y=3, animate=False)  # the user scrolls up to read
        await pilot.pause()
        assert view.scroll_y == 3 and not view.at_bottom and not view.following
        second = view.add_answer("split")
        before = view.max_scroll_y
        for chunk in range(3):
            await stream(second, lines(5, start=chunk * 5), pilot)
            assert view.scroll_y == 3
        assert view.max_scroll_y > before + 10

        view.scroll_to(y=view.max_scroll_y - 1, animate=False)  # back within FOLLOW_ROWS
        await pilot.pause()
        await stream(second, lines(5, start=100), pilot)
        assert view.scroll_y == view.max_scroll_y and view.following


async def test_a_new_question_always_scrolls_to_the_end() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        answer = view.add_answer("device")
        await stream(answer, lines(30), pilot)
        await answer.finish()
        view.scroll_home(animate=False)
        await pilot.pause()
        assert view.scroll_y == 0
        view.add_question("Next question")
        await pilot.pause()
        assert view.scroll_y == view.max_scroll_y > 0


async def test_citations_have_side_classes_and_clicks_post_source_selected() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        answer = view.add_answer("split")
        await answer.append("Answer with sources [1][2].")
        await answer.finish()
        device = answer.add_citation(1, "device", "notes.md", "lines 3–9", 0.82, "private text")
        cloud = answer.add_citation(2, "cloud", "handbook.pdf", "page 4", 0.5)
        await pilot.pause()
        assert device.has_class("-device") and not device.has_class("-cloud")
        assert cloud.has_class("-cloud") and not cloud.has_class("-device")
        assert device.plain == "[1] device · notes.md (lines 3–9) · 0.82"
        assert device.tooltip == "private text"
        assert [line.number for line in answer.query(CitationLine)] == [1, 2]

        await pilot.click(cloud)
        await pilot.pause()
        assert app.selected == [(2, answer)]
        device.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert app.selected == [(2, answer), (1, answer)]


async def test_notice_is_a_dim_line_under_the_body() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        answer = view.add_answer("split")
        await answer.append("Thinking")
        notice = answer.add_notice("finishing the answer on the device")
        await pilot.pause()
        assert notice.has_class("answer-notice")
        assert "finishing the answer on the device" in str(notice.render())
        await answer.finish()


async def test_load_shows_a_stored_conversation_and_clear_empties_it() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        cite = {"number": 1, "side": "device", "title": "a.md", "location": "lines 1–2"}
        cite |= {"score": 0.9, "excerpt": "alpha"}
        messages = [
            {"role": "user", "text": "Q1"},
            {"role": "assistant", "text": "A1 with `code`", "mode": "device", "status": None},
            SimpleNamespace(role="user", text="Q2", mode=None, status=None, citations=[]),
            SimpleNamespace(
                role="assistant", text="A2", mode="split", status="cancelled", citations=[cite]
            ),
            {"role": "system", "text": "hidden"},
            {"role": "assistant", "text": "Half", "status": "streaming"},
            {"role": "assistant", "text": "", "status": "failed", "error": "cloud down"},
        ]
        await view.load(messages)
        await pilot.pause()
        kinds = [type(child).__name__ for child in view.children]
        assert kinds == ["QuestionView", "AnswerView", "QuestionView"] + ["AnswerView"] * 3
        first, second, interrupted, failed = view.query(AnswerView)
        assert interrupted.status == "cancelled"  # never finished: shown as partial
        assert failed.status == "failed"
        assert "cloud down" in str(failed.query_one(".answer-footer", Static).render())
        assert first.status == "complete" and first.body.source == "A1 with `code`"
        assert second.status == "cancelled" and second.has_class("-cancelled")
        assert CANCELLED_MARK in str(second.query_one(".answer-footer", Static).render())
        line = second.query_one(CitationLine)
        assert line.has_class("-device") and line.plain.startswith("[1] device · a.md")

        await view.clear()
        await pilot.pause()
        assert not view.children and view.scroll_y == 0


async def test_load_shows_the_end_first_and_older_messages_on_scrolling_up() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(ConversationView)
        batch = ConversationView.LOAD_BATCH
        messages = []
        for i in range(20):
            answer = "\n\n".join(f"Answer {i}, paragraph {j}." for j in range(4))
            messages += [{"role": "user", "text": f"Q{i}"}, {"role": "assistant", "text": answer}]
        await view.load(messages)
        await pilot.pause()
        assert view.unloaded == 40 - batch
        questions = [str(q.render()) for q in view.query(QuestionView)]
        assert questions == [f"Q{i}" for i in range(20 - batch // 2, 20)]
        assert view.scroll_y == view.max_scroll_y > 0
        assert "earlier messages" in str(view.query_one(".older-marker", Static).render())

        top = view.query(QuestionView).first()
        view.scroll_home(animate=False)  # the user reaches the top: the previous batch comes in
        for _ in range(5):
            await pilot.pause()
        assert view.unloaded == 40 - 2 * batch
        assert view.scroll_y > 0  # kept on what the user was reading...
        assert view.region.y <= top.region.y <= view.region.y + 3  # ...which is still in view

        for _ in range(10):
            if not view.unloaded:
                break
            view.scroll_home(animate=False)
            for _ in range(5):
                await pilot.pause()
        assert not view.unloaded and not view.query(".older-marker")
        questions = [str(q.render()) for q in view.query(QuestionView)]
        assert questions == [f"Q{i}" for i in range(20)]


async def test_prompt_history_up_and_down() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        prompt = app.query_one(PromptInput)
        prompt.set_history(["first", "second"])
        prompt.focus()
        await pilot.press(*"draft")
        await pilot.press("up")
        assert prompt.value == "second" and prompt.cursor_position == len("second")
        await pilot.press("up")
        assert prompt.value == "first"
        await pilot.press("up")  # oldest: stays
        assert prompt.value == "first"
        await pilot.press("down")
        assert prompt.value == "second"
        await pilot.press("down")  # past the newest: what was being typed
        assert prompt.value == "draft"
        await pilot.press("down")
        assert prompt.value == "draft"

        await pilot.press("enter")
        await pilot.pause()
        assert app.submitted == ["draft"]
        assert prompt.history == ["first", "second", "draft"]
        prompt.value = ""
        await pilot.press("up")
        assert prompt.value == "draft"
        await pilot.press("enter")  # an immediate repeat is not recorded twice
        await pilot.pause()
        assert prompt.history == ["first", "second", "draft"]


def test_render_benchmark_measures_a_per_token_cost() -> None:
    from benchmarks.tui_render import fake_tokens, measure

    tokens = fake_tokens(200)
    assert len(tokens) == 200 and tokens == fake_tokens(200)  # deterministic
    assert "```" in "".join(fake_tokens(1000))
    result = measure(200)
    assert result["tokens"] == 200
    assert result["ms_per_token"] > 0 and result["cpu_ms_per_token"] > 0
    assert result["p95_append_ms"] >= 0 and result["frames"] >= 1
