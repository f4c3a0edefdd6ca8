"""The module graph of the tree, read from the source with `ast` (nothing is imported).

Used by `test_layers.py` (layers and import circles) and `test_imports.py` (module lists).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Top to bottom (docs/architecture.md#layers, README "Layout"): a package may import itself and any
# package of a
# lower tier, never a sibling of its own tier nor anything above.
TIERS: tuple[tuple[str, ...], ...] = (
    ("tests",),  # may import anything below
    ("fuzzing",),  # the fuzzers drive a real server with the tiny model (benchmarks' helpers)
    ("benchmarks",),  # measurements, the link emulator, the tiny test models, a server thread
    ("app",),  # the TUI and CLI: the only composition of device and (embedded) cloud
    ("edge_runtime", "personal_index", "cloud_backend"),  # the two sides never meet
    ("tandem_packaging",),  # model preparation: the device app and the cloud find models here
    ("model_runtime", "retrieval"),  # runtime and store used by both sides
    ("collab",),  # protocol and math: imports nothing of ours
)
TIER = {package: depth for depth, names in enumerate(TIERS) for package in names}
FOLDERS = {name: name for name in TIER if name != "tests"} | {"tandem_packaging": "packaging"}


@dataclass(frozen=True)
class Import:
    """One import statement's first-party target, resolved to a module of the tree."""

    source: str
    target: str
    line: int
    type_only: bool


def modules(repo: Path = REPO) -> dict[str, Path]:
    """Every first-party module (tests excluded) by dotted name."""
    found: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        for path in sorted((repo / folder).rglob("*.py")):
            parts = path.relative_to(repo / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST, type_only: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    """Every import statement under `tree`, with whether an `if TYPE_CHECKING:` guards it."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, type_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _statements(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from _statements(ast.Module(body=[child], type_ignores=[]), type_only)
        else:
            yield from _statements(node, type_only)


def _resolve(name: str, known: Mapping[str, Path]) -> str | None:
    """The longest known module that `name` starts with (`a.b.Thing` -> `a.b`), or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def imports(source: str, known: Mapping[str, Path]) -> list[Import]:
    """The first-party imports of module `source`; `from pkg import sub` targets `pkg.sub`."""
    path = known[source]
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node, type_only in _statements(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            assert isinstance(node, ast.ImportFrom)
            base = node.module or ""
            if node.level:
                package = source.split(".")
                package = package if is_package else package[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            names = [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
        for name in names:
            target = _resolve(name, known)
            if target is None and name.split(".")[0] in TIER:
                target = name.split(".")[0]  # e.g. `tests`: not scanned, but a layer all the same
            if target is not None and target != source:
                found.append(Import(source, target, node.lineno, type_only))
    return found


def all_imports(repo: Path = REPO) -> list[Import]:
    known = modules(repo)
    return [edge for source in known for edge in imports(source, known)]


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's components (iterative) that hold a cycle: two or more nodes, or a self-loop."""
    edges = {node: sorted(set(targets)) for node, targets in graph.items()}
    for targets in list(edges.values()):
        for target in targets:
            edges.setdefault(target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, int]] = [(root, 0)]
        while work:
            node, next_child = work.pop()
            if next_child == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            children = edges[node]
            if next_child < len(children):
                work.append((node, next_child + 1))
                child = children[next_child]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(found)


def a_cycle(graph: Mapping[str, Iterable[str]], component: list[str]) -> list[str]:
    """One shortest cycle through the component's first node, as `[a, b, ..., a]`."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(set(graph.get(node, ()))):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise ValueError(f"{component} holds no cycle")


def describe_cycles(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """A line per import circle: its members and one concrete cycle through them."""
    return [
        f"{len(c)} modules: {' -> '.join(a_cycle(graph, c))}  (all: {', '.join(c)})"
        for c in strongly_connected(graph)
    ]


def package_of(module: str) -> str:
    return module.split(".")[0]
