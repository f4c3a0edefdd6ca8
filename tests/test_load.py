"""The load benchmark's --quick run (issue 16): 12 scripted devices against a cloud that
admits 10, in cloud, split and DRAGON modes at once. The 2 past capacity are refused with 503
and Retry-After; every admitted session ends with its answer, no error, the KV cache within
its budget. With a budget below what the sessions hold, the least recently used lose their
cache (EVICTED), the others finish, and the cache never holds more than the budget. (The
figures of the 100-session runs are in the README; timings are not asserted.)"""

from __future__ import annotations

import json

from benchmarks import load


def test_quick_load_admits_to_capacity_and_serves_every_admitted_session(tiny, tmp_path):
    out = tmp_path / "load.json"
    summary = load.main(["--quick", "--out", str(out), "--tiny-root", str(tiny["hf"].parent)])
    assert json.loads(out.read_text())["admitted"] == summary["admitted"]
    assert summary["refused"] == 2 and summary["admitted"] == 10
    assert summary["errors"] == [] and summary["server_errors"] == []
    assert sum(summary["by_mode"].values()) == 10 and all(summary["by_mode"].values())
    assert all(o["tokens"] == 8 for o in summary["outcomes"] if not o["refused"])
    assert 0 < summary["peak_kv_bytes"] <= summary["kv_budget_bytes"]


def test_a_budget_smaller_than_the_load_evicts_and_holds(tiny, tmp_path):
    budget_mib = 0.05  # ~52 KB: about half of what 10 tiny sessions of 8 tokens hold at once
    out, root = tmp_path / "load.json", tiny["hf"].parent
    summary = load.main(
        ["--quick", "--kv-budget-mib", str(budget_mib), "--out", str(out), "--tiny-root", str(root)]
    )
    assert summary["errors"] == [] and summary["server_errors"] == []
    assert summary["admitted"] == 10 and 0 < summary["evicted"] < 10
    finished = [o for o in summary["outcomes"] if not (o["refused"] or o["evicted"])]
    assert len(finished) == 10 - summary["evicted"]
    assert all(o["tokens"] == 8 for o in finished)
    assert 0 < summary["peak_kv_bytes"] <= summary["kv_budget_bytes"] == int(budget_mib * 2**20)
