"""The answer modes behind one interface: `answer(question, history, options)` streams events.

One module per mode (`local`, `cloud`, `split`), the parts they share in `base` (types, the
history policy, the answer skeleton) and `cloud_link` (the cloud session), and the registry
below: every mode the user can pick (CLI `--mode`, the TUI's mode bar and palette) comes from
`modes()`, so a new mode is one module and one line in `_BUILT_IN` (or `register_mode`)."""

from __future__ import annotations

from edge_runtime.modes.base import (
    STOP_IDS,
    AnswerOptions,
    CloudSettings,
    ModeContext,
    Orchestrator,
    Turn,
)
from edge_runtime.modes.cloud import CloudMode
from edge_runtime.modes.local import LocalMode
from edge_runtime.modes.split import SplitMode

__all__ = ["STOP_IDS", "AnswerOptions", "CloudSettings", "ModeContext", "Orchestrator", "Turn",
           "build_mode", "modes", "register_mode"]  # fmt: skip

_BUILT_IN: tuple[type[Orchestrator], ...] = (LocalMode, CloudMode, SplitMode)
MODES: dict[str, type[Orchestrator]] = {m.name: m for m in _BUILT_IN}


def modes() -> dict[str, type[Orchestrator]]:
    """Every mode by name (local, cloud, split, and any added later)."""
    return MODES


def register_mode(mode: type[Orchestrator]) -> type[Orchestrator]:
    """Add a mode; usable as a class decorator."""
    MODES[mode.name] = mode
    return mode


def build_mode(name: str, ctx: ModeContext) -> Orchestrator:
    try:
        return MODES[name](ctx)
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; choose one of {', '.join(MODES)}") from None
