"""Consent in the TUI (edge_runtime.consent): before a cloud that is not this device's own takes
part in an answer shaped by the user's documents, the app asks once: always, this time, or
never. "always" and "never" are remembered per cloud in the settings file (and editable in
the settings screen); "this time" and Escape are not. With the policy "questions stay on this
device" the app opens no connection at all; an install from before auto was the default
keeps local mode, with one notice."""

from __future__ import annotations

from app.assistant import Assistant
from app.settings import Settings, load_settings
from app.tui.app import TandemApp
from app.tui.chat_view import AnswerView
from app.tui.consent import ConsentScreen
from app.tui.settings_screen import SettingsScreen
from benchmarks.auto import counting_sockets
from collab.plumbing.paths import config_path
from edge_runtime.cloud_identity import cloud_identity
from tests.tui import test_app
from tests.tui.test_app import SIZE, ask, make_app, ready, until, url_of

engine, corpus, cloud, index = test_app.engine, test_app.corpus, test_app.cloud, test_app.index

NOTES_QUESTION = "Who owns the tandem bicycle?"


async def submit(pilot, question: str) -> None:
    await pilot.click("#prompt")
    await pilot.press(*question)
    await pilot.press("enter")


def notices(answer: AnswerView) -> list[str]:
    return [str(n.render()) for n in answer.query(".answer-notice")]


async def answered(pilot) -> AnswerView:
    app: TandemApp = pilot.app
    await until(pilot, lambda: not app.answering and app.query(AnswerView).last().finished)
    return app.query(AnswerView).last()


def dragon_app(tiny_device, index, server) -> TandemApp:
    """Dragon over a loopback cloud standing in for a remote one the user never answered for."""
    return make_app(
        tiny_device, index, url_of(server), default_mode="dragon", max_tokens=8, cloud_consent={}
    )


async def test_always_is_asked_once_and_remembered_per_cloud(
    isolated_dirs, tiny_device, index, cloud
):
    app = dragon_app(tiny_device, index, cloud)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await submit(pilot, NOTES_QUESTION)
        await until(pilot, lambda: isinstance(app.screen, ConsentScreen))
        identity = cloud_identity(url_of(cloud), "tiny-cloud")
        assert app.screen.identity == identity
        await pilot.click("#always")
        answer = await answered(pilot)
        stored = app.store.messages(app.conversation_id)[-1]
        assert answer.status == "complete" and stored.stats.get("aggregator")  # dragon ran
        assert not any("answered on this device alone" in n for n in notices(answer))
        assert load_settings().cloud_consent == {identity: "always"}
        # the next such answer does not ask again
        await submit(pilot, NOTES_QUESTION)
        answer = await answered(pilot)
        assert not isinstance(app.screen, ConsentScreen) and answer.status == "complete"
        assert app.store.messages(app.conversation_id)[-1].stats.get("aggregator")


async def test_never_answers_on_the_device_and_is_remembered(
    isolated_dirs, tiny_device, index, cloud
):
    app = dragon_app(tiny_device, index, cloud)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await submit(pilot, NOTES_QUESTION)
        await until(pilot, lambda: isinstance(app.screen, ConsentScreen))
        await pilot.press("n")  # the key, as the button says
        answer = await answered(pilot)
        assert any("answered on this device alone" in n for n in notices(answer))
        stats = app.store.messages(app.conversation_id)[-1].stats
        assert stats["bytes_up"] == 0 and not stats.get("aggregator")
        identity = cloud_identity(url_of(cloud), "tiny-cloud")
        assert load_settings().cloud_consent == {identity: "never"}
        # the settings screen shows the answer and can forget it ("ask")
        await pilot.press("f4")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen))
        from textual.widgets import Select

        choice = app.screen.query_one("#consent-0", Select)
        assert choice.value == "never"
        choice.value = "ask"
        await pilot.press("ctrl+s")
        await until(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        assert load_settings().cloud_consent == {}


async def test_escape_declines_this_time_and_asks_again(isolated_dirs, tiny_device, index, cloud):
    app = dragon_app(tiny_device, index, cloud)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await submit(pilot, NOTES_QUESTION)
        await until(pilot, lambda: isinstance(app.screen, ConsentScreen))
        await pilot.press("escape")
        answer = await answered(pilot)
        assert any("answered on this device alone" in n for n in notices(answer))
        assert load_settings().cloud_consent == {}
        await submit(pilot, NOTES_QUESTION)
        await until(pilot, lambda: isinstance(app.screen, ConsentScreen))
        await pilot.click("#once")
        answer = await answered(pilot)
        assert app.store.messages(app.conversation_id)[-1].stats.get("aggregator")
        assert load_settings().cloud_consent == {}  # "this time" is not remembered


async def test_questions_kept_on_the_device_open_no_connection(
    isolated_dirs, tiny_device, index, cloud
):
    """The policy "questions stay on this device" with auto: the app never connects, not at
    start and not to answer (a socket counter sees every connect of this process)."""
    port = cloud.port
    with counting_sockets() as opened:
        app = make_app(
            tiny_device,
            index,
            url_of(cloud),
            default_mode="auto",
            auto_cloud_questions=False,
            max_tokens=8,
        )
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            assert app.assistant.cloud_status.state == "idle"
            answer = await ask(pilot, NOTES_QUESTION)
            assert answer.status == "complete" and answer.mode == "auto"
            assert app.assistant.cloud_status.state == "idle"
    assert not [a for a in opened if isinstance(a, tuple) and port in a], opened


async def test_an_upgraded_install_with_a_remote_cloud_stays_local(isolated_dirs, tiny_device):
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('cloud_url = "wss://cloud.example/v1/session"\n', encoding="utf-8")
    app = TandemApp(assistant=Assistant(Settings(), device=tiny_device), connect_cloud=False)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        assert app.mode_name == "local"
        assert any("local mode" in str(n.message) for n in app._notifications)
    assert load_settings().default_mode == "local"
    again = TandemApp(assistant=Assistant(Settings(), device=tiny_device), connect_cloud=False)
    async with again.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        assert again.mode_name == "local"
        assert not any("local mode" in str(n.message) for n in again._notifications)  # once
