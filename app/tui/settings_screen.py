"""The settings screen: edit config.toml through a form.

A modal that works with any host App: it takes the current settings, the file to save to and the
choices for mode and theme, saves on Save / ctrl+s and reports the new settings by
`dismiss(settings)` (None: cancelled, nothing written).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Footer, Input, Label, Select, Static

from app.settings import (
    CLOUD_ENGINES,
    Settings,
    SettingsError,
    save_settings,
    settings_problems,
)
from app.tui.plain import plain
from edge_runtime.declared import Setting
from edge_runtime.declared import settings as declared_settings

logger = logging.getLogger(__name__)

CONSENT_CHOICES = ("always", "never", "ask")


def _options(values: Iterable[str], current: str) -> list[tuple[str, str]]:
    """Select options from `values`, keeping `current` even when it is not among them (a value
    from the file must survive a save that did not touch it)."""
    names = list(dict.fromkeys(values))
    if current and current not in names:
        names.append(current)
    return [(name, name) for name in names]


def numeric_settings() -> list[Setting]:
    """The declared settings typed in as numbers (checked on Save)."""
    return [s for s in declared_settings().values() if s.choices is None and s.kind in (int, float)]


def _setting_field(setting: Setting, value: Any) -> ComposeResult:
    """A declared setting's label and field: a choice, a checkbox, or a text field."""
    yield Label(setting.label)
    widget: Select[str] | Checkbox | Input
    if setting.choices is not None:
        widget = _select(setting.choices(), value, setting.name)
    elif setting.kind is bool:
        widget = Checkbox(setting.caption, bool(value), id=setting.name, compact=True)
    else:
        kind: Literal["integer", "number", "text"] = (
            "integer" if setting.kind is int else "number" if setting.kind is float else "text"
        )
        widget = Input(
            str(value), type=kind, placeholder=setting.caption, id=setting.name, compact=True
        )
    if setting.help:
        widget.tooltip = setting.help
    yield widget


def _select(values: Iterable[str], current: str, field: str) -> Select[str]:
    """A compact, never-blank Select for one setting."""
    return Select(
        _options(values, current), value=current, allow_blank=False, id=field, compact=True
    )


class SettingsScreen(ModalScreen[Settings | None]):
    """A form over `Settings`; saves to `path` and dismisses with what was saved."""

    CSS_PATH = "settings_screen.tcss"

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+s", "save", "Save", id="settings_save"),
        Binding("escape", "cancel", "Cancel", id="settings_cancel"),
    ]

    def __init__(
        self,
        settings: Settings,
        path: Path,
        modes: list[str],
        themes: list[str],
        *,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.settings = settings
        self.path = Path(path)
        self.modes = list(modes)
        self.themes = list(themes)

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(id="dialog") as dialog:
            dialog.border_title = "Settings"
            yield Static(plain(f"Saved to {self.path}"), id="path")
            with Vertical(id="below"):  # docked: visible even when the form must scroll
                yield Static("", id="error", markup=False)
                with Horizontal(id="buttons"):
                    yield Button("Save", variant="primary", id="save", compact=True)
                    yield Button("Cancel", id="cancel", compact=True)
            with VerticalScroll(id="form"), Grid(id="fields"):
                yield Label("Cloud URL")
                yield Input(
                    s.cloud_url,
                    placeholder="empty: embedded backend; or ws://host:port",
                    id="cloud_url",
                    compact=True,
                )
                yield Label("Cloud token")
                yield Input(
                    s.cloud_token,
                    placeholder="for a remote cloud",
                    password=True,
                    id="cloud_token",
                    compact=True,
                )
                yield from self._consent_fields()
                yield Label("Cloud engine")
                yield _select(CLOUD_ENGINES, s.cloud_engine, "cloud_engine")
                yield Label("Device model")
                yield Input(
                    s.device_model,
                    placeholder="empty: the prepared default; or an ONNX folder",
                    id="device_model",
                    compact=True,
                )
                yield Label("Cloud model")
                yield Input(
                    s.cloud_model,
                    placeholder="empty: the prepared default; or a folder",
                    id="cloud_model",
                    compact=True,
                )
                yield Label("Default mode")
                yield _select(self.modes, s.default_mode, "default_mode")
                yield from self._mode_fields("default_mode")
                yield Label("Retrieval k")
                yield Input(str(s.k), type="integer", id="k", compact=True)
                yield Label("Relevance floor")
                floor = Input(
                    str(s.relevance_floor), type="number", id="relevance_floor", compact=True
                )
                floor.tooltip = (
                    "a passage less relevant than this (0-1, the score its citation shows) is "
                    "neither given to the model nor cited; higher = fewer, surer sources"
                )
                yield floor
                yield Label("Max tokens")
                yield Input(str(s.max_tokens), type="integer", id="max_tokens", compact=True)
                yield Label("Temperature")
                yield Input(str(s.temperature), type="number", id="temperature", compact=True)
                yield from self._mode_fields("temperature")
                yield from self._mode_fields(None)
                yield Label("Theme")
                yield _select(self.themes, s.theme, "theme")
        yield Footer()

    def _mode_fields(self, after: str | None) -> ComposeResult:
        """The modes' declared settings placed after `after` on the form (each one's own
        `after`, followed in chain: split's pipeline after its variant); None: those whose
        anchor is no field of the form, at the end."""
        declared = declared_settings()
        core = {
            "cloud_url",
            "cloud_token",
            "cloud_engine",
            "device_model",
            "cloud_model",
            "default_mode",
            "k",
            "relevance_floor",
            "max_tokens",
            "temperature",
            "theme",
        }
        placed = core | set(declared)
        for setting in declared.values():
            anchored = setting.after if setting.after in placed else None
            if anchored == after:
                yield from _setting_field(setting, getattr(self.settings, setting.name))
                yield from self._mode_fields(setting.name)

    def _consent_fields(self) -> ComposeResult:
        """One choice per cloud the user answered about: may it take part in answers shaped
        by private passages ("ask" forgets the answer: the next such answer asks again)."""
        for n, (identity, said) in enumerate(sorted(self.settings.cloud_consent.items())):
            label = Label(plain(f"Private context: {identity}"))
            label.tooltip = (
                "may this cloud take part in answers shaped by your documents (dragon, split's "
                "drafts)? Their text never leaves either way"
            )
            yield label
            yield _select(CONSENT_CHOICES, said, f"consent-{n}")

    def _consent_values(self) -> dict[str, str]:
        identities = sorted(self.settings.cloud_consent)
        chosen = {identity: self._choice(f"consent-{n}") for n, identity in enumerate(identities)}
        return {identity: said for identity, said in chosen.items() if said != "ask"}

    def on_mount(self) -> None:
        self.query_one("#cloud_url", Input).focus()

    def _text(self, field_id: str) -> str:
        return self.query_one(f"#{field_id}", Input).value.strip()

    def _choice(self, field_id: str) -> str:
        value = self.query_one(f"#{field_id}", Select).value
        return value if isinstance(value, str) else ""

    def form_settings(self) -> tuple[Settings | None, list[str]]:
        """The settings the form describes, or the plain reasons it cannot be used."""
        problems: list[str] = []
        numbers: dict[str, int | float] = {}
        for field_id, label, kind in (
            ("k", "Retrieval k", int),
            ("relevance_floor", "Relevance floor", float),
            ("max_tokens", "Max tokens", int),
            ("temperature", "Temperature", float),
            *((s.name, s.label, s.kind) for s in numeric_settings()),
        ):
            raw = self._text(field_id)
            try:
                numbers[field_id] = kind(raw)
            except ValueError:
                noun = "a whole number" if kind is int else "a number"
                problems.append(f"{label} must be {noun} (got {raw!r})")
        if problems:
            return None, problems
        settings = dataclasses.replace(
            self.settings,
            cloud_url=self._text("cloud_url"),
            cloud_token=self._text("cloud_token"),
            cloud_engine=self._choice("cloud_engine"),
            device_model=self._text("device_model"),
            cloud_model=self._text("cloud_model"),
            default_mode=self._choice("default_mode"),
            k=int(numbers["k"]),
            relevance_floor=float(numbers["relevance_floor"]),
            max_tokens=int(numbers["max_tokens"]),
            temperature=float(numbers["temperature"]),
            theme=self._choice("theme"),
            keymap=dict(self.settings.keymap),
            cloud_consent=self._consent_values(),
            **self._mode_values(numbers),
        )
        problems = settings_problems(settings)
        return (None, problems) if problems else (settings, [])

    def _mode_values(self, numbers: dict[str, int | float]) -> dict[str, Any]:
        """Each declared setting as the form has it."""
        values: dict[str, Any] = {}
        for name, setting in declared_settings().items():
            if setting.choices is not None:
                values[name] = self._choice(name)
            elif setting.kind is bool:
                values[name] = self.query_one(f"#{name}", Checkbox).value
            elif setting.kind in (int, float):
                values[name] = setting.kind(numbers[name])
            else:
                values[name] = self._text(name)
        return values

    def show_error(self, text: str) -> None:
        error = self.query_one("#error", Static)
        error.update(plain(text))  # problems quote what was typed
        error.set_class(bool(text), "visible")

    def action_save(self) -> None:
        """Validate, write the file, then dismiss with what was written; on a problem, say so
        under the form and write nothing."""
        settings, problems = self.form_settings()
        if settings is None:
            self.show_error("Not saved: " + "; ".join(problems) + ".")
            return
        try:
            save_settings(settings, self.path)
        except (OSError, SettingsError) as exc:
            logger.warning("could not save settings to %s: %s", self.path, exc)
            self.show_error(f"Not saved: {exc}")
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#save")
    def _save_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.action_save()

    @on(Input.Submitted)
    def _field_submitted(self, event: Input.Submitted) -> None:
        """Enter in any field saves, like a form in a browser."""
        event.stop()
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def _cancel_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.action_cancel()
