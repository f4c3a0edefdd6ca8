"""The DRAGON study's figures (PNG, matplotlib) from saved results, after the paper's Figures 5–8.

    python -m benchmarks.dragon_figures --grid benchmarks/results/dragon/latency-*.json \\
        --ppl benchmarks/results/dragon/ppl-*.json \\
        --schedule benchmarks/results/dragon/schedule-*.json

Figure 5 perplexity by documents per side (one panel per model setting); 6 per-token latency
and 7 time to first token by extra network latency (every method of the grid's runs, pooled);
8 the scheduling study (simulated totals by extra latency, per policy). Written to
benchmarks/results/dragon/figures/."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root is the import root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dragon import METHODS, pooled_rows, summarise

OUT = Path(__file__).resolve().parent / "results" / "dragon" / "figures"
LABELS = {
    "dragon-auto": "DRAGON",
    "dragon-device": "DRAGON (device aggregates)",
    "dragon-cloud": "DRAGON (cloud aggregates)",
    "drdg-tw": "DRDG/TW",
    "drdg-sw": "DRDG/SW",
    "local-rag": "CRCG/Device",
    "crcg-cloud": "CRCG/Cloud",
    "drcg-text": "DRCG/Text",
    "no-retrieval": "w/o retrieval",
    "cloud-alone": "w/o retrieval (cloud model)",
    "crcg-device": "CRCG/Device",
    "drcg": "DRCG",
    "dragon": "DRAGON",
    "dragon-rerank": "DRAGON, re-ranked every 8 tokens",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """Lay out, write at the figures' one resolution, and free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def latency_figures(rows: Sequence[dict], out: Path) -> list[Path]:
    """Figures 6 and 7 from grid rows: one line per method, pooled over engines/samplings."""
    plt = _pyplot()
    summary = summarise(rows)
    group = summary.get("all/all") or next(iter(summary.values()))
    written = []
    for key, name, ylabel in (
        ("per_token_ms", "fig6-per-token-latency", "ms per token"),
        ("ttft_ms", "fig7-ttft", "time to first token (ms)"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for method in METHODS:
            cells = sorted(
                (c["latency_ms"], c[key])
                for c in group["cells"]
                if c["method"] == method and c[key] is not None
            )
            if cells:
                ax.plot(*zip(*cells, strict=True), marker="o", label=LABELS[method])
        ax.set_xlabel("extra network latency (ms, jitter a fifth of it)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(_save(fig, out / f"{name}.png"))
    return written


def perplexity_figure(data: dict, out: Path) -> Path:
    """Figure 5: perplexity by documents per side, one panel per model setting."""
    plt = _pyplot()
    settings = [s for s in ("same", "pair") if s in data]
    fig, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 3.8), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        for method, row in data[setting]["perplexity"].items():
            points = sorted((int(k), v) for k, v in row.items())
            ax.plot(*zip(*points, strict=True), marker="o", label=LABELS[method])
        ax.set_title({"same": "same model both sides (0.5B)", "pair": "Tandem's pair"}[setting])
        ax.set_xlabel("documents per side")
        ax.set_ylabel("perplexity")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out / "fig5-perplexity.png")


def schedule_figure(data: dict, out: Path) -> Path:
    """Figure 8: simulated total time by extra latency, one line per policy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for policy in ("device", "cloud", "random", "auto"):
        points = sorted(
            (r["extra_ms"], r["total_s"]) for r in data["rows"] if r["policy"] == policy
        )
        label = "DRAGON (live scheduler)" if policy == "auto" else policy.capitalize()
        ax.plot(*zip(*points, strict=True), marker="o", label=label)
    tokens = data["rows"][0]["tokens"]
    ax.set_xlabel("extra network latency (ms, sinusoidal jitter a fifth of it)")
    ax.set_ylabel(f"total time for {tokens} tokens (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "fig8-scheduling.png")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--grid", nargs="*", type=Path, default=[], metavar="JSON")
    parser.add_argument("--ppl", type=Path, metavar="JSON")
    parser.add_argument("--schedule", type=Path, metavar="JSON")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    rows, _ = pooled_rows(args.grid)
    if rows:
        written += latency_figures(rows, args.out)
    if args.ppl:
        written.append(perplexity_figure(json.loads(args.ppl.read_text()), args.out))
    if args.schedule:
        written.append(schedule_figure(json.loads(args.schedule.read_text()), args.out))
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
