"""The package arrows point down only and no module imports itself back, read from the source.

Every `.py` file of the tree is parsed with `ast` (nothing is imported), so the check sees all
imports: top-level ones, the lazy ones inside functions, and those under `if TYPE_CHECKING:`.

- Layers (docs/architecture.md#layers, README "Layout"): a package may import itself and any
package in a lower
  tier, never one in its own tier or above. Type-only imports count here: a lower layer that
  names a higher layer's type depends on it just the same.
- Cycles: no strongly connected component of more than one module (or a module importing
  itself), within a package too, and no circle at all: lazy imports count (moving an import
  into a function hides a circle from Python, not from the design) and so do type-only ones
  (a loop that names its caller's type under `if TYPE_CHECKING:` is tied to that caller just
  the same). A lower module that needs a back-reference names what it needs as a Protocol of
  its own; a loop takes a narrow object (the request's link), never the mode that runs it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from tests.import_graph import (
    REPO,
    TIER,
    a_cycle,
    all_imports,
    describe_cycles,
    imports,
    modules,
    package_of,
    strongly_connected,
)

# -- the cycle finder on planted graphs


def test_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": ["b"], "b": ["c", "d"], "c": ["a"], "d": [], "e": ["e"], "f": ["a"]}
    assert strongly_connected(graph) == [["a", "b", "c"], ["e"]]
    assert a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert a_cycle(graph, ["e"]) == ["e", "e"]
    assert describe_cycles(graph)[0] == "3 modules: a -> b -> c -> a  (all: a, b, c)"


def test_cycle_finder_passes_a_dag_and_prints_the_shortest_cycle() -> None:
    assert strongly_connected({"a": ["b", "c"], "b": ["c"], "c": []}) == []
    two = {"a": ["x", "b"], "x": ["y"], "y": ["a"], "b": ["a"]}
    assert a_cycle(two, strongly_connected(two)[0]) == ["a", "b", "a"]
    deep = {str(n): [str(n + 1)] for n in range(5000)} | {"5000": ["0"]}  # no recursion limit
    assert len(strongly_connected(deep)[0]) == 5001


def test_imports_are_resolved_from_every_kind_of_statement(tmp_path: Path) -> None:
    (tmp_path / "collab").mkdir()
    (tmp_path / "collab" / "__init__.py").write_text("")
    (tmp_path / "collab" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "if TYPE_CHECKING:\n    from collab.c import Thing\n"
        "def lazy():\n    import app.cli\n"
    )
    for name in ("b", "c"):
        (tmp_path / "collab" / f"{name}.py").write_text("")
    (tmp_path / "app" / "tui").mkdir(parents=True)
    (tmp_path / "app" / "cli.py").write_text("")
    (tmp_path / "app" / "tui" / "app.py").write_text("from .. import cli\nfrom ..cli import main\n")
    known = modules(tmp_path)
    assert sorted(known) == ["app.cli", "app.tui.app", "collab", "collab.a", "collab.b", "collab.c"]
    assert [(i.target, i.line, i.type_only) for i in imports("collab.a", known)] == [
        ("collab.b", 2, False),
        ("collab.c", 4, True),
        ("app.cli", 6, False),
    ]
    assert [i.target for i in imports("app.tui.app", known)] == ["app.cli", "app.cli"]


# -- the real tree


def test_the_tiers_name_every_package() -> None:
    """A new top-level package must be given its place here before it can pass the checks."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(setuptools["packages"]) | {"benchmarks", "fuzzing", "tests"} == set(TIER)
    assert setuptools["package-dir"] == {"tandem_packaging": "packaging"}
    assert len(modules()) > 50


def test_packages_import_only_lower_tiers() -> None:
    wrong = [
        f"{i.source}:{i.line} imports {i.target}{' (type only)' if i.type_only else ''}"
        for i in all_imports()
        if package_of(i.source) != package_of(i.target)
        and TIER[package_of(i.target)] <= TIER[package_of(i.source)]
    ]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_module_imports_itself_back() -> None:
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for i in all_imports():
        graph[i.source].add(i.target)  # type-only imports included
    circles = describe_cycles(graph)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_collab_shows_its_layers() -> None:
    """Inside collab: plumbing (files, paths, migrations) is the floor and imports nothing else
    of collab; DRAGON is one package that the rest of collab never imports (only the sides do)."""
    wrong = []
    for i in all_imports():
        src, dst = i.source, i.target
        if not (src.startswith("collab") and dst.startswith("collab.")):
            continue
        if src.startswith("collab.plumbing") and not dst.startswith("collab.plumbing"):
            wrong.append(f"{src}:{i.line} (plumbing) imports {dst}")
        if dst.startswith("collab.dragon") and not src.startswith("collab.dragon"):
            wrong.append(f"{src}:{i.line} imports DRAGON's {dst}")
    assert not wrong, "collab's layers:\n" + "\n".join(wrong)
