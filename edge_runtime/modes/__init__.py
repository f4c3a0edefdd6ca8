"""The answer modes behind one interface: `answer(question, history, options)` streams events.

One module per mode (`local`, `cloud`, `split`, `dragon`), the parts they share in
`base` (types, the history policy, the answer skeleton) and `cloud_link` (the cloud session),
and the registry below: every mode the user can pick (CLI `--mode`, the TUI's mode bar and
palette) comes from it, so a new mode is one module and one line in `_BUILT_IN` (or
`register_mode` from outside). A mode's figures and settings are its class's `declared`
(`edge_runtime.declared`); `register_mode` adds them where the answer's figures, the status
bar, `tandem ask` and the settings are assembled. The table names classes rather than
importing them, so the CLI can list the modes without loading the model code."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from edge_runtime import declared

if TYPE_CHECKING:
    from edge_runtime.modes.base import ModeContext, Orchestrator

_BUILT_IN: dict[str, str] = {  # name → module:class
    "local": "edge_runtime.modes.local:LocalMode",
    "cloud": "edge_runtime.modes.cloud:CloudMode",
    "split": "edge_runtime.modes.split:SplitMode",
    "dragon": "edge_runtime.modes.dragon:DragonMode",
    "auto": "edge_runtime.modes.auto:AutoMode",
}
_registered: dict[str, type[Orchestrator]] = {}


def mode_names() -> list[str]:
    """Every mode's name, built-in ones first."""
    return [*_BUILT_IN, *(n for n in _registered if n not in _BUILT_IN)]


def get_mode(name: str) -> type[Orchestrator]:
    if name not in _registered:
        if name not in _BUILT_IN:
            choices = ", ".join(mode_names())
            raise ValueError(f"unknown mode {name!r}; choose one of {choices}")
        module, cls = _BUILT_IN[name].split(":")
        _registered[name] = getattr(import_module(module), cls)
    return _registered[name]


def modes() -> dict[str, type[Orchestrator]]:
    """Every mode by name (local, cloud, split, and any added later), loaded."""
    return {name: get_mode(name) for name in mode_names()}


def register_mode(mode: type[Orchestrator]) -> type[Orchestrator]:
    """Add a mode and its declared figures and settings; usable as a class decorator."""
    declared.declare(mode.name, mode.declared)
    _registered[mode.name] = mode
    return mode


def unregister_mode(name: str) -> None:
    """Forget a mode added with `register_mode` (tests)."""
    if name not in _BUILT_IN:
        _registered.pop(name, None)
        declared.withdraw(name)


def build_mode(name: str, ctx: ModeContext) -> Orchestrator:
    return get_mode(name)(ctx)
