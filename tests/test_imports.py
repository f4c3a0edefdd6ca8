"""What each deployable piece pulls in when it is imported, seen in a fresh interpreter.

The layers test (`test_layers.py`) reads the source; this one imports for real, so it also
catches a forbidden package that arrives through a third-party library or a lazy import that a
command runs. Each case imports its modules one by one in a new `python`, then names, for each
forbidden top-level package in `sys.modules`, the first of its modules that brought it in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.import_graph import REPO, TIER, modules

OURS = frozenset(TIER)
MODEL_STACK = frozenset({"torch", "transformers", "onnxruntime", "numpy"})
VLLM_WORKER_ONLY = "cloud_backend.vllm_processor"

# Runs in the child: argv[1] is a JSON case; prints {forbidden package: first module that
# imported it} as the last line.
PROBE = """
import importlib, json, sys
case = json.loads(sys.argv[1])
forbidden, blamed = set(case["forbidden"]), {}
def blame(culprit):
    for name in sorted({m.split(".")[0] for m in sys.modules} & forbidden - blamed.keys()):
        blamed[name] = culprit
for module in case["modules"]:
    importlib.import_module(module)
    blame(module)
if case["then"]:
    exec(case["then"])
    blame("then: " + case["then"])
print(json.dumps(blamed))
"""


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def modules_under(package: str, *, skip: str = "") -> list[str]:
    """Every module of a (sub)package, read from its folder, so a new module is checked at once."""
    return [n for n in modules() if _within(n, package) and not (skip and _within(n, skip))]


@dataclass(frozen=True)
class Case:
    id: str
    modules: list[str]
    forbidden: frozenset[str]
    then: str = ""  # code run after the imports (a command that imports lazily)


CASES = [
    # the cloud deploys without the device side and without the terminal app; the logits
    # processor runs only inside vLLM's worker (it subclasses vLLM's class, so it cannot import
    # where vLLM is not installed): the vLLM tier loads it, `test_layers` reads its imports
    Case(
        "cloud",
        [m for m in modules_under("cloud_backend") if m != VLLM_WORKER_ONLY],
        frozenset({"edge_runtime", "personal_index", "app", "textual"}),
    ),
    # the public corpus builds and searches without model preparation
    Case("cloud corpus", ["cloud_backend.corpus"], frozenset({"tandem_packaging"})),
    # every headless command (all of `app` outside `app.tui`) runs without Textual
    Case(
        "headless cli",
        modules_under("app", skip="app.tui"),
        frozenset({"textual"}),
        then="from app.cli import main; main(['models', 'list']); main(['docs', 'list']); "
        "main(['paths'])",
    ),
    # imported at start-up by the TUI and the CLI alike
    Case("settings", ["app.settings", "app.conversations"], frozenset({"textual"}) | MODEL_STACK),
    # shared by both sides: imports nothing of ours
    Case("collab", modules_under("collab"), OURS - {"collab"}),
    # the window must appear within a second: the TUI pulls in no model code
    Case("tui", modules_under("app.tui"), MODEL_STACK),
    Case("chat view", ["app.tui.chat_view"], MODEL_STACK | {"edge_runtime"}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_imports_stay_within_bounds(case: Case, tmp_path: Path) -> None:
    assert case.modules, f"{case.id}: no modules found"
    spec = {"modules": case.modules, "forbidden": sorted(case.forbidden), "then": case.then}
    env = {**os.environ, "TANDEM_DATA_DIR": str(tmp_path), "TANDEM_CONFIG_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    blamed = json.loads(out.stdout.strip().splitlines()[-1])
    assert not blamed, f"{case.id} imports what it must not ({{package: imported by}}): {blamed}"
