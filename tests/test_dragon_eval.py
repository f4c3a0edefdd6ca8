"""`python -m benchmarks.dragon_eval --quick` (issue 14), as CI runs it: every part of the
DRAGON study ends with the real models and writes its shapes — the latency grid with every
baseline, the scheduling study fed the grid's own measurements, perplexity with the cloud's
half over a real server equal to this process's, and the four figures. Not timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.dragon import METHODS
from benchmarks.dragon_ppl import METHODS as PPL_METHODS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # above the study's own 1,500 s limit: it fails on that, with output
def test_quick_study_with_the_real_models(tmp_path):
    command = [
        sys.executable,
        "-m",
        "benchmarks.dragon_eval",
        "--quick",
        "--name",
        "q",
        "--out-dir",
        str(tmp_path),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    grid = json.loads((tmp_path / "q-grid.json").read_text())
    assert {(r["method"], r["latency_ms"]) for r in grid["rows"]} == {
        (m, 100.0) for m in METHODS
    }  # one latency: the link emulator is in the path; the grid's shape is the point
    assert not any(r["failures"] for r in grid["rows"])
    assert "per-token latency reduction vs DRDG/TW" in done.stdout
    schedule = json.loads((tmp_path / "schedule-q.json").read_text())
    assert schedule["config"]["sources"] == [str(tmp_path / "q-grid.json")]  # measured costs
    assert {r["policy"] for r in schedule["rows"]} == {"device", "cloud", "random", "auto"}
    ppl = json.loads((tmp_path / "ppl-q.json").read_text())
    table = ppl["same"]["perplexity"]
    assert set(table) == set(PPL_METHODS) and all(set(v) == {"0", "1", "2"} for v in table.values())
    assert all(1 < p < 1e4 for row in table.values() for p in row.values())
    assert ppl["network_check"] and max(ppl["network_check"]) < 2e-3
    kv = json.loads((tmp_path / "drcg-kv-q.json").read_text())
    assert kv["ort (float32 cache)"]["bytes_per_token"] == 57_344  # 2·28·2·128·4
    figures = sorted(p.name for p in (tmp_path / "figures" / "q").iterdir())
    assert figures == [
        "fig5-perplexity.png",
        "fig6-per-token-latency.png",
        "fig7-ttft.png",
        "fig8-scheduling.png",
    ]


def test_drcg_kv_is_priced_from_the_cache_layout_and_the_link():
    from benchmarks.dragon_kv import kv_bytes_per_token, price

    qwen_15b = {
        "num_hidden_layers": 28,
        "num_key_value_heads": 2,
        "hidden_size": 1536,
        "num_attention_heads": 12,
    }
    assert kv_bytes_per_token(qwen_15b, 2) == 2 * 28 * 2 * 128 * 2 == 28_672
    p = price([700, 900], 28_672, [100.0], [0, 300])
    assert p["mean_bytes"] == 800 * 28_672
    fetch = p["fetch_s"]["100 Mbit/s"]
    assert fetch["0"] == pytest.approx(800 * 28_672 * 8 / 1e8)
    assert fetch["300"] == pytest.approx(fetch["0"] + 0.3)
