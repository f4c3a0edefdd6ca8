"""What was sent, in the TUI (issue 44, item 4): a key (F7) and a palette action show the
ledger of the selected answer (the one holding the focus, else the last), listed in F1 help;
the texts that left are shown as text, never markup. End to end: a cloud answer's ledger, and
a cancelled one's (what had left before Esc)."""

from __future__ import annotations

import time
from typing import Any

from app.assistant import Assistant
from app.settings import Settings
from app.tui.app import TandemApp
from app.tui.chat_view import AnswerView, CitationLine
from app.tui.help import HelpScreen
from app.tui.sent_screen import SentScreen
from app.tui.status import ModeBar
from edge_runtime.cloud_identity import cloud_identity
from edge_runtime.sent_kinds import NOT_RECORDED, NOTHING_SENT, QUESTION
from tests.cloud import TOKEN
from tests.tui.test_app import until

SIZE = (120, 36)
HOSTILE = "[b]bold[/b] [@click=app.quit]quit[/] :smile:"
CITATION = {
    "number": 1,
    "side": "cloud",
    "title": "Tandem",
    "location": "",
    "score": 0.5,
    "excerpt": "a bicycle for two",
    "text": "a bicycle for two",
}
LEDGER: list[dict[str, Any]] = [
    {
        "kind": QUESTION,
        "frames": 1,
        "bytes": 51,
        "items": 1,
        "messages": {"Generate": 1},
        "texts": [HOSTILE],
    },
    {
        "kind": "control",
        "frames": 2,
        "bytes": 160,
        "items": 2,
        "messages": {"Hello": 1, "Generate": 1},
    },
]


def make_app(tiny_device, url: str | None = None, **settings: Any) -> TandemApp:
    values: dict[str, Any] = {"k": 1, "max_tokens": 24, "default_mode": "local", **settings}
    if url:
        values.update(cloud_url=url, cloud_token=TOKEN)
        values.setdefault("cloud_consent", {cloud_identity(url, "tiny-cloud"): "always"})
    s = Settings(**values)
    return TandemApp(s, Assistant(s, device=tiny_device), connect_cloud=bool(url))


def shown(app: TandemApp) -> str:
    """Every line of text the screen on top shows."""
    return "\n".join(str(w.render()) for w in app.screen.query("Static"))


async def test_the_selected_answers_ledger_is_shown_as_text(isolated_dirs, tiny_device) -> None:
    app = make_app(tiny_device)
    store = app.store
    cid = store.create("Tandems").id
    store.add_message(cid, "user", HOSTILE, "cloud")
    store.add_message(
        cid,
        "assistant",
        "A bicycle for two.",
        "cloud",
        citations=[CITATION],
        stats={"sent": LEDGER},
    )
    store.add_message(cid, "user", "And mine?", "local")
    store.add_message(cid, "assistant", "Yours is green.", "local", stats={"sent": []})
    store.add_message(cid, "user", "Before the ledger?", "cloud")
    store.add_message(cid, "assistant", "An old answer.", "cloud", stats={"tokens": 3})
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: len(app.query(AnswerView)) == 3)
        await pilot.press("f7")  # the last answer: stored before Tandem kept a ledger
        await until(pilot, lambda: isinstance(app.screen, SentScreen))
        assert NOT_RECORDED in shown(app)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, SentScreen))

        app.query(AnswerView)[0].query_one(CitationLine).focus()  # select the first answer
        await pilot.press("f7")
        await until(pilot, lambda: isinstance(app.screen, SentScreen))
        text = shown(app)
        assert HOSTILE in text  # literally: neither bold, nor an action, nor an emoji
        assert "question text: 1 text, 51 bytes in 1 frame (Generate)" in text
        assert "2 frames, 211 bytes: question text and control" in text  # every frame: control
        assert app.is_running  # [@click=app.quit] was not obeyed
        await pilot.press("escape")

        # the palette's action, for the answer holding the focus (the first, still)
        await pilot.press("ctrl+p")
        await pilot.press(*"What was sent")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, SentScreen))
        assert HOSTILE in shown(app)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, SentScreen))

        await pilot.press("f1")  # listed in help, with its key and id
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        help_screen = app.screen
        assert isinstance(help_screen, HelpScreen)
        assert ("f7", "What was sent", "what_was_sent") in help_screen.bindings


async def test_a_local_answer_shows_that_nothing_was_sent(isolated_dirs, tiny_device) -> None:
    app = make_app(tiny_device)
    cid = app.store.create("Local").id
    app.store.add_message(cid, "user", "Hi", "local")
    app.store.add_message(cid, "assistant", "Hello.", "local", stats={"sent": []})
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: len(app.query(AnswerView)) == 1)
        await pilot.press("f7")
        await until(pilot, lambda: isinstance(app.screen, SentScreen))
        assert NOTHING_SENT in shown(app)


async def test_a_cloud_answer_and_a_cancelled_one_show_what_left(
    isolated_dirs, tiny_device, cloud_engine, cloud_url
) -> None:
    app = make_app(tiny_device, cloud_url, default_mode="cloud", max_tokens=120)
    async with app.run_test(size=SIZE) as pilot:
        await until(
            pilot,
            lambda: app.query_one(ModeBar).infos and app.assistant.cloud_status.state != "starting",
        )
        question = "What is a tandem bicycle?"
        await pilot.click("#prompt")
        await pilot.press(*question, "enter")
        await until(pilot, lambda: app.query(AnswerView) and app.query(AnswerView).last().finished)
        await pilot.press("f7")
        await until(pilot, lambda: isinstance(app.screen, SentScreen))
        text = shown(app)
        assert f"for: {question}" in text and "question text, as it left" in text
        assert text.count(question) >= 2  # the question it answers, and the text that left
        await pilot.press("escape")

        cloud_engine.on_step = lambda kind, n, seconds: time.sleep(0.04)  # long enough to cancel
        await pilot.click("#prompt")
        await pilot.press(*"Tell me a long story.", "enter")
        await until(
            pilot,
            lambda: (
                app.answering
                and len(app.query(AnswerView)) == 2
                and app.query(AnswerView).last().text
            ),
        )
        await pilot.press("f7")  # while it streams: what has left so far
        await until(pilot, lambda: isinstance(app.screen, SentScreen))
        assert "so far" in shown(app) and "Tell me a long story." in shown(app)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, SentScreen))
        await pilot.press("escape")  # cancel the answer
        await until(pilot, lambda: not app.answering)
        stored = app.store.messages(app.conversation_id)[-1]
        assert stored.status == "cancelled"
        rows = {r["kind"]: r for r in stored.stats["sent"]}
        assert rows[QUESTION]["texts"] == ["Tell me a long story."]
