"""The DRAGON study's figures draw from the shapes the benchmarks write."""

from __future__ import annotations

import json

from benchmarks.dragon_figures import main
from tests.test_bench_dragon import _cells


def test_every_figure_is_drawn_from_saved_results(tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"rows": _cells(50, 100, 48, 80, 105, 100)}))
    ppl = tmp_path / "ppl.json"
    row = {"0": 30.0, "1": 25.0, "2": 20.0}
    ppl.write_text(
        json.dumps({s: {"perplexity": {"dragon": row, "drcg": row}} for s in ("same", "pair")})
    )
    schedule = tmp_path / "schedule.json"
    schedule.write_text(
        json.dumps(
            {
                "rows": [
                    {"extra_ms": e, "policy": p, "tokens": 100, "total_s": 10.0 + e / 100}
                    for e in (0, 300)
                    for p in ("device", "cloud", "random", "auto")
                ]
            }
        )
    )
    out = tmp_path / "figures"
    main(["--grid", str(grid), "--ppl", str(ppl), "--schedule", str(schedule), "--out", str(out)])
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "fig5-perplexity.png",
        "fig6-per-token-latency.png",
        "fig7-ttft.png",
        "fig8-scheduling.png",
    ]
    assert all((out / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
