"""Comparisons carry an interval, and one inside the noise is not called a pass
(benchmarks/intervals.py), recomputed from the saved results where they hold per-item data."""

from __future__ import annotations

import json

import pytest

from benchmarks.dragon import trace_summary
from benchmarks.intervals import bootstrap_ci, fisher_exact, verdict
from benchmarks.private_facts import compare_right, comparisons, summarise
from benchmarks.report import result_file


def test_fisher_exact_matches_known_values() -> None:
    assert fisher_exact(3, 4, 1, 4) == pytest.approx(0.4857, abs=1e-4)  # the lady tasting tea
    assert fisher_exact(30, 32, 27, 32) == pytest.approx(0.4258, abs=1e-4)
    assert fisher_exact(10, 10, 0, 10) == pytest.approx(1.083e-5, rel=1e-3)
    with pytest.raises(ValueError, match="out of range"):
        fisher_exact(5, 4, 0, 4)


def test_a_verdict_is_within_noise_when_the_interval_holds_zero() -> None:
    assert verdict(-0.04, 0.03) == "within noise"
    assert verdict(-0.04, -0.01, down="PASS") == "PASS" and verdict(0.01, 0.04, up="FAIL") == "FAIL"
    assert verdict(0.01, 0.04, up="PASS") == "PASS"


def test_bootstrap_interval_brackets_the_statistic() -> None:
    lo, hi = bootstrap_ci([1.0, 2.0, 3.0, 4.0, 5.0] * 4, lambda xs: sum(xs) / len(xs))
    assert lo < 3.0 < hi and hi - lo < 2.0
    assert bootstrap_ci([2.0] * 5, lambda xs: sum(xs) / len(xs)) == (2.0, 2.0)


def test_right_answers_are_compared_note_by_note() -> None:
    a = [{"note": f"n{i}", "right": True} for i in range(20)]
    b = [{"note": f"n{i}", "right": i < 2} for i in range(20)]
    clear = compare_right(a, b)
    assert clear["right"] == [20, 2] and clear["verdict"] == "PASS" and clear["fisher_p"] < 1e-6
    close = compare_right(a, [{"note": f"n{i}", "right": i > 0} for i in range(20)])
    assert close["verdict"] == "within noise" and close["ci95"][0] <= 0


def test_the_saved_private_facts_comparison_is_within_noise() -> None:
    """30/32 (dragon) against 27/32 (split η 20), the README's "most reliable": noise."""
    rows = []
    for name in ("ort-32notes-eta0-1.json", "ort-32notes-large-eta.json"):
        rows += json.loads(result_file(f"private-facts/{name}").read_text())["rows"]
    found = comparisons(rows, summarise(rows))
    dragon = found["dragon vs split-eta-20"]
    assert dragon["right"] == [30, 27] and dragon["fisher_p"] == pytest.approx(0.43, abs=0.01)
    assert dragon["verdict"] == "within noise"
    assert found["split-eta-20 vs local"]["verdict"] == "within noise"


def test_the_saved_scheduler_trace_is_within_noise() -> None:
    """The live scheduler's −1.3 % over the whole trace (20 prompts): an interval over zero."""
    rows = json.loads(result_file("dragon/trace-ort-20prompts.json").read_text())["trace"]
    summary = trace_summary(rows)
    assert summary["whole_vs_better_pinned"] == pytest.approx(-0.0133, abs=5e-4)
    lo, hi = summary["whole_vs_better_pinned_ci"]
    assert lo < summary["whole_vs_better_pinned"] < hi
    assert verdict(lo, hi) == "within noise"
