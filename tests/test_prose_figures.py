"""A measured figure in the docs' prose comes from a generated table (issue 48): prose that
quotes "22.8 ms" beside a table that now says 16.2 is the contradiction this test prevents.

A figure is a number with a unit of time, speed, ratio, share or size ("12.3 ms", "1.8×",
"84 %", "3.7 MB"). In prose (not code, not a table row, not a generated snippet) each one
must appear in a generated table the page includes (`--8<-- "tables/…"`, or the README's
report snippet), or be listed in `docs/prose-figures.toml` as what it is when it is not a
measurement: a setting, a target, a constant, an example, or a figure quoted from a paper."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LISTED = DOCS / "prose-figures.toml"
KINDS = {"setting", "target", "constant", "example", "paper"}
PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "tables" not in p.parts)]

UNITS = r"ms|µs|s|×|%|tokens/s|chunks/s|pages/s|min|minutes|GB|MB|GiB|MiB|KB"
FIGURE = re.compile(rf"(?<![\w.,])(\d+(?:[.,]\d+)*)\s?(?:{UNITS})(?![\w])")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.MULTILINE)
REPORT = re.compile(r"<!-- report:.*?<!-- /report:[^>]*-->", re.DOTALL)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")


@dataclass(frozen=True)
class Figure:
    page: str
    figure: str
    line: str


def generated_text(page: Path, docs: Path = DOCS) -> str:
    """The generated tables a page shows: its included snippets and report blocks."""
    raw = page.read_text(encoding="utf-8")
    parts = [m.group(0) for m in REPORT.finditer(raw)]
    for name in SNIPPET.findall(raw):
        path = docs / name
        if path.is_file():
            parts.append(path.read_text(encoding="utf-8"))
    return "\n".join(parts)


def prose_figures(page: Path, root: Path = ROOT) -> list[Figure]:
    """Every figure in the page's prose that its generated tables do not hold."""
    raw = page.read_text(encoding="utf-8")
    tables = generated_text(page, root / "docs")
    prose = CODE.sub("", FENCE.sub("", REPORT.sub("", raw)))
    found = []
    for line in prose.splitlines():
        if line.lstrip().startswith("|") or line.startswith("--8<--"):
            continue
        for match in FIGURE.finditer(line):
            number = re.escape(match.group(1))
            if not re.search(rf"(?<![\d.,]){number}(?![\d]|[.,]\d)", tables):
                rel = page.relative_to(root).as_posix()
                found.append(Figure(rel, match.group(0), line.strip()))
    return found


def listed() -> list[dict[str, str]]:
    return tomllib.loads(LISTED.read_text(encoding="utf-8"))["figure"]


def test_every_measured_figure_in_the_prose_comes_from_a_generated_table() -> None:
    known = {(f["page"], f["figure"]) for f in listed()}
    loose = [f for page in PAGES for f in prose_figures(page) if (f.page, f.figure) not in known]
    assert not loose, "figures in prose with no generated source (generate, cut, or list them "
    "in docs/prose-figures.toml if they are not measurements):\n" + "\n".join(
        f"  {f.page}: {f.figure!r} in {f.line[:100]!r}" for f in loose
    )


def test_the_list_names_only_what_is_not_a_measurement_and_is_still_there() -> None:
    present = {(f.page, f.figure) for page in PAGES for f in prose_figures(page)}
    for entry in listed():
        assert entry["kind"] in KINDS, entry
        assert entry.get("why"), f"say why it is not a measurement: {entry}"
        assert (entry["page"], entry["figure"]) in present, f"stale entry: {entry}"


def test_the_check_sees_a_figure_the_table_beside_it_does_not_hold(tmp_path: Path) -> None:
    """The negative control: the same sentence passes only while the table holds its figure."""
    (tmp_path / "docs" / "tables").mkdir(parents=True)
    table = tmp_path / "docs" / "tables" / "t.md"
    page = tmp_path / "docs" / "p.md"
    page.write_text('Decoding takes 22.8 ms a token (`--threads 2`).\n\n--8<-- "tables/t.md"\n')
    table.write_text("| decode (ms) |\n|---|\n| 16.2 |\n")
    assert [f.figure for f in prose_figures(page, tmp_path)] == ["22.8 ms"]
    table.write_text("| decode (ms) |\n|---|\n| 22.8 |\n")
    assert prose_figures(page, tmp_path) == []
    table.write_text("| decode (ms) |\n|---|\n| 122.85 |\n")  # not the same number
    assert [f.figure for f in prose_figures(page, tmp_path)] == ["22.8 ms"]
