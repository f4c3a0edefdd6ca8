"""What a mode declares beside its code: its figures (what an answer in that mode measures,
how each is shown, which appear in the status bar) and its settings (name, type, default,
check, label for the settings screen). The answer's `Stats`, the status bar, `tandem ask`
(its line and `--json`) and the settings (file, screen, checks) are assembled from these
declarations, so a new mode adds figures or settings without editing any of them.

Light on purpose (no numpy, no model code): the settings are read at start-up. Tandem's own
modes keep their declarations in small modules named in `_BUILT_IN` (loaded on first use);
`edge_runtime.modes.register_mode` adds a mode's `declared` from outside."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import Any


@dataclass(frozen=True)
class Figure:
    """One figure of an answer: stored in `Stats` under `name` (and `--json` and the
    conversation history under that key), `default` until the mode sets it. `status`: shown in
    the status bar and `tandem ask`'s line as `label` + the value in `fmt` (when it is not the
    default), unless the declaration shows its figures itself (`Declaration.parts`).
    `compute`: a figure derived from the others (not stored), e.g. a rate."""

    name: str
    default: Any = 0
    label: str = ""
    fmt: str = "{}"
    status: bool = False
    compute: Callable[[Mapping[str, Any]], Any] | None = None

    def shown(self, value: Any) -> str:
        return f"{self.label} {self.fmt.format(value)}".strip()


@dataclass(frozen=True)
class Setting:
    """One user setting: a key of config.toml, a field of the settings screen (`label`,
    `help` as its tooltip; a choice when `choices` is given, a checkbox for bool, else a text
    field), checked by `check` (a plain sentence, or None when the value is fine). `after`:
    the field it follows on the screen (None: at the end, before the theme). `kind` is one of
    str, int, float, bool."""

    name: str
    kind: type
    default: Any
    label: str
    help: str = ""
    choices: Callable[[], Sequence[str]] | None = None
    check: Callable[[Any], str | None] | None = None
    after: str | None = None
    caption: str = ""  # a checkbox's text, a text field's placeholder

    def problem(self, value: Any) -> str | None:
        if self.choices is not None and value not in (names := list(self.choices())):
            return f"{self.name} must be one of {', '.join(names)} (got {value!r})"
        return self.check(value) if self.check is not None else None


@dataclass(frozen=True)
class Declaration:
    """A mode's figures and settings. `parts`: how its figures read in the status bar and
    `tandem ask`'s line, when that is more than one `label value` per status figure."""

    figures: tuple[Figure, ...] = ()
    settings: tuple[Setting, ...] = ()
    parts: Callable[[Mapping[str, Any]], list[str]] | None = None

    def show(self, stats: Mapping[str, Any]) -> list[str]:
        if self.parts is not None:
            return self.parts(stats)
        shown = []
        for f in self.figures:
            value = stats.get(f.name, f.default)
            if f.status and value is not None and value != f.default:
                shown.append(f.shown(value))
        return shown


_BUILT_IN: dict[str, str] = {  # mode name → module:declaration (light modules)
    "split": "edge_runtime.modes.split_declared:DECLARED",
    "dragon": "edge_runtime.modes.dragon_declared:DECLARED",
    "auto": "edge_runtime.modes.auto_declared:DECLARED",
}
_loaded: dict[str, Declaration] = {}
_registered: dict[str, Declaration] = {}


def declarations() -> dict[str, Declaration]:
    """Every mode's declaration by mode name, Tandem's own first."""
    for name, target in _BUILT_IN.items():
        if name not in _loaded:
            module, attr = target.split(":")
            _loaded[name] = getattr(import_module(module), attr)
    return {**_loaded, **_registered}


def declare(mode: str, declaration: Declaration) -> None:
    """Add a mode's declaration (`register_mode` does it for a mode class with `declared`).
    A figure or setting name another mode (or the core) already uses is refused."""
    taken = {f.name for d in declarations().values() for f in d.figures} | set(CORE_FIGURES)
    taken_settings = {s.name for d in declarations().values() for s in d.settings}
    if clash := taken & {f.name for f in declaration.figures}:
        raise ValueError(f"mode {mode!r}: figure names already taken: {sorted(clash)}")
    if clash := taken_settings & {s.name for s in declaration.settings}:
        raise ValueError(f"mode {mode!r}: setting names already taken: {sorted(clash)}")
    _registered[mode] = declaration


def withdraw(mode: str) -> None:
    """Forget a mode's declaration (tests)."""
    _registered.pop(mode, None)


def figures() -> dict[str, Figure]:
    """Every declared figure by name."""
    return {f.name: f for d in declarations().values() for f in d.figures}


def settings() -> dict[str, Setting]:
    """Every declared setting by name."""
    return {s.name: s for d in declarations().values() for s in d.settings}


def figure_parts(stats: Mapping[str, Any]) -> list[str]:
    """Every mode's figures as the status bar and `tandem ask` show them (a mode's figures
    keep their defaults in another mode's answer, so only the answering mode's show)."""
    return [part for d in declarations().values() for part in d.show(stats)]


CORE_FIGURES = (
    "mode",
    "variant",
    "tokens",
    "ttft_s",
    "elapsed_s",
    "rounds",
    "drafted",
    "accepted",
    "bytes_up",
    "bytes_down",
    "finish",
    "acceptance",
    "tokens_per_s",
)
"""What every answer measures (`edge_runtime.events.Stats`'s own fields)."""
