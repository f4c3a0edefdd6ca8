"""The χ² the statistical split tests share: does each answer's second token follow the cloud's
distribution given that answer's own first token?"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats as scipy_stats


def stratified_chi_square_p(
    pairs: Sequence[tuple[int, int]], target: Callable[[int], np.ndarray]
) -> float:
    """p-value that each pair's second token follows `target(first)`: one χ² per first token
    (bins with expected < 5 pooled), summed with their degrees of freedom."""
    total = dof = 0.0
    for first in {f for f, _ in pairs}:
        seconds = [s for f, s in pairs if f == first]
        probs = target(first)
        support = np.flatnonzero(probs > 0)
        if any(probs[s] == 0 for s in seconds):
            return 0.0  # a token the target cannot produce
        counts = np.array([seconds.count(int(t)) for t in support], dtype=np.float64)
        expected = probs[support] * len(seconds)
        big = expected >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        keep = exp > 0
        if keep.sum() < 2:
            continue
        total += float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        dof += keep.sum() - 1
    return float(scipy_stats.chi2.sf(total, dof)) if dof else 1.0
