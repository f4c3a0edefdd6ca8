"""The whole TUI driven by Pilot: tiny models, a private index and a real cloud backend
(aiohttp on loopback, with a small public corpus) in an isolated data dir."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from app.assistant import Assistant
from app.settings import Settings, load_settings
from app.tui.app import TandemApp
from app.tui.chat_view import AnswerView
from app.tui.sources import SourceScreen, SourcesPanel
from app.tui.status import ModeBar, StatusBar
from cloud_backend.config import ServerConfig
from cloud_backend.engine import LLMEngine
from cloud_backend.server import create_app
from edge_runtime.cloud_identity import cloud_identity
from model_runtime.torch_runtime import TorchCausalLM

TOKEN = "tui-test-token-0123456789"
SIZE = (120, 36)
NOTES = "The tandem bicycle in the garage belongs to Ada. It was painted green in May 2024.\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, embedder_dir):
    """100 public summaries in small chunks (the tiny model's context is 256 tokens)."""
    from cloud_backend.corpus import PublicCorpus

    root = tmp_path_factory.mktemp("public")
    c = PublicCorpus.open(
        root, embedder_dir, limit=100, progress=False, chunk_tokens=48, overlap_tokens=8
    )
    yield c
    c.close()


@pytest.fixture(scope="module")
def engine(tiny, tiny_tokenizer) -> LLMEngine:
    return LLMEngine(TorchCausalLM(tiny["hf"]), tiny_tokenizer, "tiny-cloud")


@pytest.fixture
def slow_cloud(engine):
    """Each cloud step takes 40 ms more: answers stream long enough to cancel or to cut."""
    engine.on_step = lambda kind, n, seconds: time.sleep(0.04)
    yield
    engine.on_step = None


@pytest.fixture
async def cloud(engine, corpus):
    config = ServerConfig(token=TOKEN, corpus_k=1)
    server = TestServer(create_app(config, engine, corpus), host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


@pytest.fixture
def index(isolated_dirs, embedder_dir, tmp_path):
    from personal_index.index import PersonalIndex

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "garage.txt").write_text(NOTES, encoding="utf-8")
    idx = PersonalIndex(
        isolated_dirs.data / "index", embedder_dir, chunk_tokens=48, overlap_tokens=8
    )
    idx.ingest([docs])
    yield idx
    idx.close()


def make_app(tiny_device, index, url: str | None = None, **settings) -> TandemApp:
    """The app on these parts; a cloud at `url` is one the user has let take part in answers
    shaped by their documents ("always"), unless `cloud_consent` says otherwise."""
    values = {"k": 1, "max_tokens": 40, "default_mode": "local", **settings}
    if url:
        values.update(cloud_url=url, cloud_token=TOKEN)
        values.setdefault("cloud_consent", {cloud_identity(url, "tiny-cloud"): "always"})
    s = Settings(**values)
    return TandemApp(s, Assistant(s, device=tiny_device, index=index), connect_cloud=bool(url))


def url_of(server: TestServer) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/session"


async def until(pilot, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.05)


async def ready(pilot) -> None:
    """The registry, the device and (if configured) the cloud have reported."""
    app: TandemApp = pilot.app
    await until(
        pilot,
        lambda: app.query_one(ModeBar).infos and app.assistant.cloud_status.state != "starting",
    )


async def ask(pilot, question: str) -> AnswerView:
    app: TandemApp = pilot.app
    before = len(app.query(AnswerView))
    await pilot.click("#prompt")
    await pilot.press(*question)
    await pilot.press("enter")
    await until(pilot, lambda: len(app.query(AnswerView)) > before)
    await until(pilot, lambda: not app.answering and app.query(AnswerView).last().finished)
    return app.query(AnswerView).last()


def status_text(app: TandemApp) -> str:
    return str(app.query_one(StatusBar).line_text())


async def test_local_answer_streams_with_device_sources_and_figures(tiny_device, index):
    app = make_app(tiny_device, index)
    deltas: list[str] = []
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        original = AnswerView.append

        async def spy(self, text):
            deltas.append(text)
            await original(self, text)

        AnswerView.append = spy
        try:
            answer = await ask(pilot, "Who owns the tandem bicycle?")
        finally:
            AnswerView.append = original
        assert len(deltas) > 3 and answer.text == "".join(deltas)  # streamed, delta by delta
        sources = app.sources
        assert sources and sources[0]["side"] == "device" and "garage" in sources[0]["title"]
        assert "TTFT" in status_text(app) and "tok/s" in status_text(app)
        panel = app.query_one(SourcesPanel)
        assert "device" in str(panel.query("Label").first().render())
        # the conversation is stored: question, then the complete answer with its sources
        messages = app.store.messages(app.conversation_id)
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[1].status == "complete" and messages[1].text == answer.text
        assert messages[1].citations[0]["side"] == "device"
        # opening a source shows the whole chunk
        panel.query_one("#sources-list").focus()
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, SourceScreen))
        assert "painted green" in str(app.screen.query_one("#source-text").render())
        await pilot.press("escape")


async def test_cloud_and_split_answers_with_cloud_sources(tiny_device, index, cloud):
    app = make_app(tiny_device, index, url_of(cloud))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        # local mode sends nothing: the cloud is connected on first use by a mode needing it
        assert app.assistant.cloud_status.state == "idle" and not app.assistant.link_alive()
        await pilot.press("ctrl+o")  # local → cloud
        assert app.mode_name == "cloud"
        await until(pilot, lambda: app.assistant.cloud_status.state == "ready")
        # a question the summaries answer above the public floor (collab.sources.PUBLIC_FLOOR)
        answer = await ask(pilot, "In which city was the pop group ABBA formed?")
        assert answer.text
        assert app.sources and all(s["side"] == "cloud" for s in app.sources)
        assert "↑" in status_text(app) and "↓" in status_text(app)
        # the palette switches too
        await pilot.press("ctrl+p")
        await pilot.press(*"Mode: split")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, lambda: app.mode_name == "split")
        answer = await ask(pilot, "Who owns the tandem bicycle?")
        assert answer.text
        assert "accept" in status_text(app) and "γ" in status_text(app)
        stored = app.store.messages(app.conversation_id)
        assert [m.mode for m in stored] == ["cloud", "cloud", "split", "split"]


async def test_dragon_answer_with_both_sides_sources_and_its_figures(tiny_device, index, cloud):
    """dragon through the TUI, the real pair on loopback: the sources of both sides, in number
    order (the cloud's 1..k, the device's after), and dragon's figures on the status bar."""
    app = make_app(tiny_device, index, url_of(cloud), default_mode="dragon", max_tokens=12)
    async with app.run_test(size=(200, 36)) as pilot:
        await ready(pilot)
        assert app.mode_name == "dragon"
        answer = await ask(
            pilot, "Who owns the tandem bicycle, and what was the 1755 Lisbon earthquake?"
        )
        assert answer.text and answer.status == "complete"
        sides = [(s["number"], s["side"]) for s in app.sources]
        assert sides == sorted(sides) and {side for _, side in sides} == {"device", "cloud"}
        assert [n for n, _ in sides] == [r["number"] for r in answer.sources]
        line = status_text(app)
        assert "aggregator " in line and "switch" in line and "accept device" in line
        assert "TTFT" in line and "↑" in line and "↓" in line
        assert app.store.messages(app.conversation_id)[-1].mode == "dragon"


async def test_escape_cancels_and_keeps_the_partial_answer(tiny_device, index, cloud, slow_cloud):
    app = make_app(tiny_device, index, url_of(cloud), default_mode="cloud", max_tokens=120)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.click("#prompt")
        await pilot.press(*"Tell me a long story.")
        await pilot.press("enter")
        await until(
            pilot,
            lambda: (
                app.answering
                and list(app.query(AnswerView))
                and list(app.query(AnswerView))[-1].text
            ),
        )
        await pilot.press("escape")
        await until(pilot, lambda: not app.answering)
        answer = list(app.query(AnswerView))[-1]
        assert answer.text
        stored = app.store.messages(app.conversation_id)[-1]
        assert stored.status == "cancelled" and stored.text == answer.text
        # the session is usable at once: the next answer completes
        answer = await ask(pilot, "And a short one?")
        assert app.store.messages(app.conversation_id)[-1].status == "complete"


async def test_cloud_going_away_mid_answer_keeps_the_conversation(
    tiny_device, index, cloud, slow_cloud
):
    app = make_app(tiny_device, index, url_of(cloud), default_mode="cloud", max_tokens=120)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await ready(pilot)
        await pilot.click("#prompt")
        await pilot.press(*"Tell me a long story.")
        await pilot.press("enter")
        await until(
            pilot,
            lambda: list(app.query(AnswerView)) and len(list(app.query(AnswerView))[-1].text) > 5,
        )
        await cloud.close()
        await until(pilot, lambda: not app.answering)
        answer = list(app.query(AnswerView))[-1]
        assert app.assistant.cloud_status.state == "unavailable"
        notes = [n.message for n in app._notifications]
        assert any(
            "finishing the answer on the device" in str(n) or "cloud" in str(n).lower()
            for n in notes
        )
        stored = app.store.messages(app.conversation_id)
        assert [m.role for m in stored] == ["user", "assistant"]
        assert stored[1].text == answer.text and stored[1].text
        # cloud modes are shown unavailable; local still answers, in the same conversation
        bar = app.query_one(ModeBar)
        assert bar.query_one("#mode-cloud").has_class("-unavailable")
        await pilot.press("ctrl+o")  # split and dragon are unavailable: auto, then local
        assert app.mode_name == "auto"
        await pilot.press("ctrl+o")
        assert app.mode_name == "local"
        await ask(pilot, "Who owns the tandem bicycle?")
        assert len(app.store.messages(app.conversation_id)) == 4


async def test_unreachable_cloud_leaves_local_working(tiny_device, index):
    app = make_app(tiny_device, index, "ws://127.0.0.1:9/v1/session", default_mode="split")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        status = app.assistant.cloud_status
        assert status.state == "unavailable" and status.detail
        infos = {i.name: i for i in app.assistant.modes()}
        assert not infos["split"].available and infos["split"].reason
        assert infos["local"].available
        assert app.query_one("#mode-split").has_class("-unavailable")
        await pilot.press("ctrl+o")  # skips the unavailable modes (dragon): auto answers here
        assert app.mode_name == "auto"
        await pilot.press("ctrl+o")
        assert app.mode_name == "local"
        answer = await ask(pilot, "Who owns the tandem bicycle?")
        assert answer.text


async def test_conversations_new_and_reopen(tiny_device, index):
    app = make_app(tiny_device, index)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await ask(pilot, "Who owns the tandem bicycle?")
        first = app.conversation_id
        await pilot.press("ctrl+n")
        assert app.conversation_id is None and not list(app.query(AnswerView))
        await ask(pilot, "What colour is it?")
        assert app.conversation_id != first
        await pilot.press("f3")
        await pilot.pause(0.2)
        assert len(app.store.list()) == 2
        await pilot.press("escape")
    # a restart opens the latest conversation with its answers
    app2 = make_app(tiny_device, index)
    async with app2.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app2.conversation_id == app.conversation_id
        assert len(list(app2.query(AnswerView))) == 1


async def test_theme_and_keymap_persist_across_restarts(isolated_dirs, tiny_device, index):
    app = make_app(tiny_device, index)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.theme = "nord"
        await pilot.pause()
    assert load_settings().theme == "nord"
    saved = load_settings()
    saved.keymap = {"cycle_mode": "ctrl+t"}
    from app.settings import save_settings

    save_settings(saved)
    restarted = TandemApp(
        load_settings(),
        Assistant(load_settings(), device=tiny_device, index=index),
        connect_cloud=False,
    )
    async with restarted.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert restarted.theme == "nord"
        calls = []
        restarted.action_cycle_mode = lambda: calls.append("cycle")  # type: ignore[method-assign]
        await pilot.press("ctrl+t")
        await pilot.press("ctrl+o")  # no longer bound
        assert calls == ["cycle"]
        await pilot.press("f1")
        await pilot.pause(0.2)
        assert ("ctrl+t", "Mode", "cycle_mode") in restarted.screen.bindings


def test_tui_module_starts_light():
    """The window must appear within a second (that it pulls in no model code: test_imports)."""
    code = "import time; t = time.perf_counter(); import app.tui.app; print(time.perf_counter()-t)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    assert float(out.stdout) < 2.0


async def test_documents_screen_ingest_is_used_by_the_next_answer(
    isolated_dirs, tiny_device, embedder_dir, tmp_path
):
    from personal_index.index import PersonalIndex

    docs = tmp_path / "new-docs"
    docs.mkdir()
    (docs / "boat.md").write_text("# Boat\n\nThe boat is called Wren and sleeps four.\n")
    idx = PersonalIndex(
        isolated_dirs.data / "index", embedder_dir, chunk_tokens=48, overlap_tokens=8
    )
    app = make_app(tiny_device, idx)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f2")
        await pilot.pause(0.2)
        box = app.screen.query_one("#documents-path")
        box.focus()
        box.value = ""
        await pilot.press(*str(docs))
        await pilot.press("enter")
        screen = app.screen
        await until(pilot, lambda: idx.stats().chunks > 0 and not screen.ingest_running())
        await pilot.press("escape")
        await pilot.pause(0.1)
        await ask(pilot, "What is the boat called?")
        assert app.sources and app.sources[0]["side"] == "device"
        assert "boat" in app.sources[0]["title"].lower()
    idx.close()
