"""MkDocs hook: the benchmark figures are served from where the benchmarks write them.

`benchmarks/results/dragon/figures/*.png` appear in the site as `assets/figures/*.png`, so a
page links `../assets/figures/fig6-per-token-latency.png` and `mkdocs build --strict` checks the
link, with no copy of the PNGs under docs/ to drift from the results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# site folder -> source folder (relative to the repository root)
FIGURE_DIRS = {"assets/figures": "benchmarks/results/dragon/figures"}
ROOT = Path(__file__).resolve().parents[1]


def on_files(files: Any, config: Any) -> Any:
    """Add every figure as a generated file of the site."""
    from mkdocs.structure.files import File

    for site_dir, source_dir in FIGURE_DIRS.items():
        for png in sorted((ROOT / source_dir).glob("*.png")):
            files.append(File.generated(config, f"{site_dir}/{png.name}", abs_src_path=str(png)))
    return files
