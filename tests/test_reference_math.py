"""collab marks its reference-only math: a function whose docstring starts "Reference only" is
an equation in its textbook form that tests and benchmarks check the shipped paths against, and
that neither side calls. Read from the source with `ast`, both ways: shipped code never calls a
reference function, and every collab function that shipped code never calls is marked (or it is
dead code, which this finds too)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.import_graph import REPO

SHIPPED = (
    "app",
    "edge_runtime",
    "cloud_backend",
    "model_runtime",
    "retrieval",
    "personal_index",
    "collab",
    "packaging",
)
MARK = "Reference only"
# collab's math: the modules both sides decode with (plumbing, protocol and sources are not math)
MATH = ("verification", "sampling", "scheduling", "split", "dragon", "variants")


def _trees() -> dict[Path, ast.Module]:
    files = [f for pkg in SHIPPED for f in sorted((REPO / pkg).rglob("*.py"))]
    return {f: ast.parse(f.read_text(), str(f)) for f in files}


def _is_reference(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and (
        ast.get_docstring(node) or ""
    ).startswith(MARK)


def _names_used(tree: ast.Module) -> set[str]:
    """Every name and attribute read in a module, outside the bodies of reference functions."""
    used: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_reference(node):
            return
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used.add(node.value.rpartition(":")[2])  # a registry's "module:Name" is a use
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return used


def _collab_definitions(trees: dict[Path, ast.Module]) -> dict[str, bool]:
    """Public top-level functions and classes of collab's math, and whether each is marked."""
    defs: dict[str, bool] = {}
    for file, tree in trees.items():
        parts = file.relative_to(REPO).with_suffix("").parts
        if (
            parts[0] != "collab"
            or len(parts) < 2
            or parts[1] not in MATH
            or parts[-1] == "__init__"
        ):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                defs[node.name] = _is_reference(node)
    return defs


def test_shipped_code_never_calls_reference_math_and_calls_everything_else() -> None:
    trees = _trees()
    used = set().union(*(_names_used(t) for t in trees.values()))
    defs = _collab_definitions(trees)
    called_reference = sorted(n for n, ref in defs.items() if ref and n in used)
    unmarked_unused = sorted(n for n, ref in defs.items() if not ref and n not in used)
    assert not called_reference, f"shipped code calls reference-only math: {called_reference}"
    assert not unmarked_unused, f"never called by shipped code, not marked: {unmarked_unused}"
    assert sum(defs.values()) >= 3  # the check has something to check


def test_the_check_sees_a_call_and_a_mark() -> None:
    tree = ast.parse(f'def f():\n    """{MARK} x"""\ndef g():\n    return f() + h.k\n')
    assert _is_reference(tree.body[0]) and not _is_reference(tree.body[1])
    assert {"f", "h", "k"} <= _names_used(tree) and "g" not in _names_used(tree)
