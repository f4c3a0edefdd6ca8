"""Confidence intervals for the benchmarks' comparisons, so that a difference inside the noise
is not called a pass: a paired bootstrap over prompts (or notes) and Fisher's exact test for
counts of right answers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")
RESAMPLES = 10_000


def bootstrap_ci(
    items: Sequence[T],
    statistic: Callable[[Sequence[T]], float],
    *,
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
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


def bootstrap_ratio(
    a: Mapping[str, float], b: Mapping[str, float], seed: int = 0, resamples: int = RESAMPLES
) -> tuple[float, float, float] | None:
    """mean(a) / mean(b) over the prompts both have, with a 95 % paired bootstrap interval
    (prompts resampled); None where no prompt is shared."""
    ids = sorted(set(a) & set(b))
    if not ids:
        return None
    x, y = np.array([a[i] for i in ids]), np.array([b[i] for i in ids])
    pick = np.random.default_rng(seed).integers(0, len(ids), size=(resamples, len(ids)))
    ratios = x[pick].mean(axis=1) / y[pick].mean(axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(x.mean() / y.mean()), float(low), float(high)


def verdict(
    low: float, high: float, null: float = 0.0, up: str = "higher", down: str = "lower"
) -> str:
    """The word for a difference from its 95 % interval: `up` or `down` only when the whole
    interval lies on one side of `null` (0 for a difference, 1 for a ratio); otherwise
    "within noise". Never a pass for a difference the interval cannot tell from none."""
    if low > null:
        return up
    if high < null:
        return down
    return "within noise"
