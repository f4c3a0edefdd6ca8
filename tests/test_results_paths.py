"""Committed results name no machine's directories: a result file or log under
benchmarks/results holds paths relative to the repository, never a home or work directory."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from benchmarks.common import repo_relative

REPO = Path(__file__).resolve().parents[1]
ABSOLUTE_HOME = re.compile(r"/(home|root|work)/")


def committed_results() -> list[Path]:
    """The files git tracks under benchmarks/results (every file there outside a checkout)."""
    try:
        done = subprocess.run(
            ["git", "ls-files", "-z", "benchmarks/results"],
            cwd=REPO,
            capture_output=True,
            check=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return [p for p in (REPO / "benchmarks/results").rglob("*") if p.is_file()]
    return [REPO / name for name in done.stdout.decode().split("\0") if name]


def test_no_committed_result_holds_an_absolute_home_path() -> None:
    found = []
    for path in committed_results():
        if path.suffix in (".png", ".svg", ".pdf"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [
            f"{path.relative_to(REPO)}:{n}: {line.strip()[:120]}"
            for n, line in enumerate(text.splitlines(), 1)
            if ABSOLUTE_HOME.search(line)
        ]
    assert committed_results() and not found, found


def test_a_result_records_paths_inside_the_repository_relative_to_it(tmp_path: Path) -> None:
    assert repo_relative(REPO / "benchmarks" / "results" / "x.json") == "benchmarks/results/x.json"
    assert repo_relative(tmp_path / "x.json") == str(tmp_path / "x.json")  # outside: as given
