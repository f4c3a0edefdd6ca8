"""A test's own waits (`timeout=` on a subprocess, a receive, a thread) stay below the limit
pytest-timeout puts on the whole test, or the test is killed by the harness with a stack dump
instead of failing on its own wait with a clear message. Read from the sources (ast)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def default_limit() -> float:
    """The per-test limit pyproject.toml gives pytest-timeout."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return float(config["tool"]["pytest"]["ini_options"]["timeout"])


def _mark_timeout(decorators: list[ast.expr]) -> float | None:
    """N from a `@pytest.mark.timeout(N)` among the decorators, else None."""
    for deco in decorators:
        if (
            isinstance(deco, ast.Call)
            and isinstance(deco.func, ast.Attribute)
            and deco.func.attr == "timeout"
            and deco.args
            and isinstance(deco.args[0], ast.Constant)
            and isinstance(deco.args[0].value, int | float)
        ):
            return float(deco.args[0].value)
    return None


def _waits(node: ast.AST) -> list[tuple[int, float]]:
    """(line, seconds) of every `timeout=<number>` keyword inside `node`."""
    return [
        (kw.value.lineno, float(kw.value.value))
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
        for kw in call.keywords
        if kw.arg == "timeout"
        and isinstance(kw.value, ast.Constant)
        and isinstance(kw.value.value, int | float)
    ]


def violations(source: str, default: float) -> list[str]:
    """Each wait in a function that is not below the pytest limit of that function (its own
    mark, else the default; a helper that is not a test gets the default)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            limit = _mark_timeout(node.decorator_list) or default
            for line, seconds in _waits(node):
                if seconds >= limit:
                    found.append(f"line {line}: timeout={seconds:g} s, test limit {limit:g} s")
    return found


def test_the_checker_finds_a_wait_longer_than_its_test() -> None:
    source = (
        "import pytest, subprocess\n"
        "def test_a():\n    subprocess.run(['x'], timeout=1200)\n"
        "@pytest.mark.timeout(60)\n"
        "def test_b():\n    subprocess.run(['x'], timeout=60)\n"
        "@pytest.mark.timeout(1500)\n"
        "def test_c():\n    subprocess.run(['x'], timeout=1200)\n"
        "def test_d():\n    subprocess.run(['x'], timeout=300)\n"
    )
    assert violations(source, 900.0) == [
        "line 3: timeout=1200 s, test limit 900 s",
        "line 6: timeout=60 s, test limit 60 s",
    ]


def test_no_test_waits_longer_than_pytest_lets_it_run() -> None:
    default = default_limit()
    found = [
        f"{path.relative_to(REPO)} {v}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        for v in violations(path.read_text(encoding="utf-8"), default)
    ]
    assert not found, found
