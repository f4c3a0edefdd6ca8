"""Confidence intervals for the benchmarks' comparisons, so that a difference inside the noise
is not called a pass: a paired bootstrap over prompts (or notes) and Fisher's exact test for
counts of right answers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")
RESAMPLES = 10_000


def bootstrap_ci(
    items: Sequence[T], statistic: Callable[[Sequence[T]], float], *, level: float = 0.95,
    resamples: int = RESAMPLES, seed: int = 0,
) -> tuple[float, float]:  # fmt: skip
    """Percentile interval of `statistic` over `items` resampled with replacement (each item
    one prompt or note, carrying every method's figures for it: the comparison is paired)."""
    if not items:
        raise ValueError("no items to resample")
    rng = np.random.default_rng(seed)
    n = len(items)
    values = np.array(
        [statistic([items[i] for i in rng.integers(0, n, n)]) for _ in range(resamples)]
    )
    values = values[np.isfinite(values)]
    tail = (1 - level) / 2 * 100
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))


def fisher_exact(a: int, n1: int, b: int, n2: int) -> float:
    """Two-sided p of Fisher's exact test: a of n1 right against b of n2 right."""
    if not (0 <= a <= n1 and 0 <= b <= n2):
        raise ValueError(f"counts out of range: {a}/{n1}, {b}/{n2}")
    right, total = a + b, n1 + n2

    def p(x: int) -> float:
        return math.comb(n1, x) * math.comb(n2, right - x) / math.comb(total, right)

    observed = p(a)
    support = range(max(0, right - n2), min(n1, right) + 1)
    return min(1.0, sum(q for x in support if (q := p(x)) <= observed * (1 + 1e-9)))


def verdict(interval: tuple[float, float], better_if: str = "below") -> str:
    """PASS or FAIL only when the interval excludes zero; `better_if` says which side of zero
    is the improvement ("below": a drop in time, "above": a rise in right answers)."""
    lo, hi = interval
    if lo <= 0 <= hi:
        return "within noise"
    improved = hi < 0 if better_if == "below" else lo > 0
    return "PASS" if improved else "FAIL"
