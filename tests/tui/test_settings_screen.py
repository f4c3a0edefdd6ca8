"""SettingsScreen in a minimal host App: edit, save, cancel, refuse invalid values."""

from __future__ import annotations

import stat
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from textual.app import App
from textual.widgets import Input, Select, Static

from app.settings import Settings, config_path, load_settings, save_settings
from app.tui.settings_screen import SettingsScreen

MODES = ["local", "cloud", "rag", "split"]
THEMES = ["textual-dark", "textual-light", "nord"]


class Host(App[None]):
    """Waits for the screen's result in a worker (push_screen_wait), like a real app would."""

    def __init__(self, make_screen: Any) -> None:
        super().__init__()
        self._make_screen = make_screen
        self.results: list[Settings | None] = []

    def on_mount(self) -> None:
        self.run_worker(self._ask(), exclusive=True)

    async def _ask(self) -> None:
        self.results.append(await self.push_screen_wait(self._make_screen()))


def host(settings: Settings | None = None, modes: list[str] = MODES) -> Host:
    """A host whose screen edits `settings` (default: what is on disk now, as at start-up)."""

    def make() -> SettingsScreen:
        current = settings if settings is not None else load_settings()
        return SettingsScreen(current, config_path(), modes, THEMES)

    return Host(make)


def screen_of(app: Host) -> SettingsScreen:
    assert isinstance(app.screen, SettingsScreen)
    return app.screen


async def type_into(pilot: Any, screen: SettingsScreen, field_id: str, text: str) -> None:
    """Focus a field, clear it and type, as a user would."""
    field = screen.query_one(f"#{field_id}", Input)
    field.focus()
    await pilot.pause()
    field.value = ""
    await pilot.press(*text)


def error_text(screen: SettingsScreen) -> str:
    return str(screen.query_one("#error", Static).render())


async def test_edit_save_and_reload(isolated_dirs: SimpleNamespace) -> None:
    save_settings(Settings(keymap={"cycle_mode": "ctrl+o"}))
    app = host()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        screen = screen_of(app)
        assert f"Saved to {config_path()}" in str(screen.query_one("#path", Static).render())
        assert screen.query_one("#cloud_url", Input).has_focus
        await type_into(pilot, screen, "cloud_url", "wss://cloud.example:9000")
        await type_into(pilot, screen, "cloud_token", "tok-123")
        assert screen.query_one("#cloud_token", Input).password
        await type_into(pilot, screen, "device_model", "/models/dev")
        await type_into(pilot, screen, "k", "5")
        await type_into(pilot, screen, "max_tokens", "128")
        await type_into(pilot, screen, "temperature", "0.7")
        # A Select through the keyboard: open it, move down one option, choose.
        variant = screen.query_one("#variant", Select)
        variant.focus()
        await pilot.press("enter", "down", "enter")
        await pilot.pause()
        assert variant.value == "dssd"
        screen.query_one("#default_mode", Select).value = "split"
        screen.query_one("#cloud_engine", Select).value = "torch"
        screen.query_one("#theme", Select).value = "nord"
        assert screen.query_one("#aggregator", Select).value == "auto"
        screen.query_one("#aggregator", Select).value = "cloud"
        await pilot.press("ctrl+s")
        await pilot.pause()
    expected = Settings(
        cloud_url="wss://cloud.example:9000",
        cloud_token="tok-123",
        cloud_engine="torch",
        device_model="/models/dev",
        default_mode="split",
        variant="dssd",
        aggregator="cloud",
        k=5,
        max_tokens=128,
        temperature=0.7,
        theme="nord",
        keymap={"cycle_mode": "ctrl+o"},  # kept: the form does not edit it
    )
    assert app.results == [expected]
    assert load_settings() == expected
    if sys.platform != "win32":
        assert stat.S_IMODE(config_path().stat().st_mode) == 0o600

    # Settings persist across restarts: a fresh app loads and shows the saved values.
    again = host()
    async with again.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        screen = screen_of(again)
        assert screen.query_one("#cloud_url", Input).value == "wss://cloud.example:9000"
        assert screen.query_one("#k", Input).value == "5"
        assert screen.query_one("#variant", Select).value == "dssd"
        assert screen.query_one("#aggregator", Select).value == "cloud"
        assert screen.query_one("#theme", Select).value == "nord"
        await pilot.press("escape")
        await pilot.pause()
    assert again.results == [None]


async def test_escape_discards(isolated_dirs: SimpleNamespace) -> None:
    app = host()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await type_into(pilot, screen_of(app), "k", "9")
        await pilot.press("escape")
        await pilot.pause()
    assert app.results == [None]
    assert not config_path().exists()


@pytest.mark.parametrize(
    ("field_id", "text", "message"),
    [
        ("k", "0", "k must be at least 1"),
        ("k", "", "Retrieval k must be a whole number"),
        ("max_tokens", "-5", "max_tokens must be at least 1"),
        ("temperature", "-1", "temperature must be 0 (greedy) or a finite number"),
        ("cloud_url", "http://nope", "cloud_url must start with ws://"),
    ],
)
async def test_invalid_values_save_nothing(
    isolated_dirs: SimpleNamespace, field_id: str, text: str, message: str
) -> None:
    app = host()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        screen = screen_of(app)
        await type_into(pilot, screen, field_id, text)
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.screen is screen and app.results == []
        shown = error_text(screen)
        assert message in shown and shown.startswith("Not saved")
        assert screen.query_one("#error", Static).region.bottom <= 23, "visible above the footer"
        assert not config_path().exists()
        # Fixing the value and saving with Enter in the field works.
        await type_into(pilot, screen, field_id, {"cloud_url": ""}.get(field_id, "2"))
        await pilot.press("enter")
        await pilot.pause()
    assert len(app.results) == 1 and app.results[0] is not None
    assert config_path().exists()


async def test_save_button_and_unknown_current_values(isolated_dirs: SimpleNamespace) -> None:
    """A mode or theme the lists do not offer (e.g. from a newer config) survives a save."""
    custom = Settings(default_mode="experimental", theme="my-theme")
    app = host(custom)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.click("#save")
        await pilot.pause()
    assert app.results == [custom]
    assert load_settings() == custom


async def test_unwritable_path_shows_the_error(isolated_dirs: SimpleNamespace) -> None:
    blocker = isolated_dirs.config
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the config folder should be")
    app = host(Settings())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.results == []
        assert error_text(screen_of(app)).startswith("Not saved")


async def test_fits_80x24_and_bindings_have_ids(isolated_dirs: SimpleNamespace) -> None:
    ids = {b.id for b in SettingsScreen.BINDINGS}  # type: ignore[union-attr]
    assert ids == {"settings_save", "settings_cancel"}
    app = host(Settings())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        screen = screen_of(app)
        for selector in ("#path", "#cloud_url", "#theme", "#save", "#cancel"):
            region = screen.query_one(selector).region
            assert region.height > 0 and region.right <= 80 and region.bottom <= 23, selector


async def test_keymap_remaps_save(isolated_dirs: SimpleNamespace) -> None:
    app = host(Settings())
    async with app.run_test(size=(80, 24)) as pilot:
        app.set_keymap({"settings_save": "f2"})
        await pilot.pause()
        await pilot.press("f2")
        await pilot.pause()
    assert app.results == [Settings()]
    assert config_path().exists()
