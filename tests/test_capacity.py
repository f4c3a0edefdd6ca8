"""The capacity benchmark's --quick run (issue 17): the tiny model in this process, 1 and 4
sessions in every mode, with the engine batching and not. Shapes and completeness only: every
session answers in full with no error, each mode has its ratios (timings are not asserted;
the real run's figures are in the README)."""

from __future__ import annotations

import json

from benchmarks import capacity


def test_quick_capacity_run_answers_every_session_in_every_setting(tiny, tmp_path):
    out = tmp_path / "capacity.json"
    summary = capacity.main(["--quick", "--out", str(out), "--tiny-root", str(tiny["hf"].parent)])
    assert json.loads(out.read_text())["ratios"] == summary["ratios"]
    rows = summary["rows"]
    assert {(r["max_batch"], r["mode"], r["sessions"]) for r in rows} == {
        (b, m, n) for b in (1, 64) for m in capacity.MODES for n in (1, 4)
    }
    for row in rows:
        assert row["errors"] == [] and row["tokens"] == 8 * row["sessions"], row
        assert row["tokens_per_s"] > 0 and row["per_token_p50_s"] is not None
    split = [r for r in rows if r["mode"] == "split"]
    assert all(0 < r["acceptance"] < 1 for r in split)  # drafts from the recorded answers
    assert summary["ratios"]["split max_batch=64 N=4"]["vs_cloud_only"] is not None
