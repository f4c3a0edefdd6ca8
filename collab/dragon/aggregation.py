"""DRAGON's aggregation math (DRAGON §3–§4; docs: the math, DRAGON), one function per equation:
a side's mixture of its per-document distributions, its weight, the two sides' interpolation
weights and Speculative Aggregation (Algorithm 1) with its fair coin."""

from __future__ import annotations

import math

import numpy as np

from collab.sampling import sample_from
from collab.verification import residual


def logsumexp(a: np.ndarray, axis: int | None = None) -> np.ndarray:
    """log Σ exp(a), stable, with all −∞ slices giving −∞ (not NaN)."""
    a = np.asarray(a, dtype=np.float64)
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        out: np.ndarray = np.log(np.sum(np.exp(a - m), axis=axis, keepdims=True)) + m
    return np.squeeze(out, axis=axis) if axis is not None else out.reshape(())


def local_mixture(p_per_doc: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """p^s = Σ_{d∈D_s} softmax_{d∈D_s}(R)_d · p(x | d, x_<t): one side's mixture of its
    per-document next-token distributions, weighted by the softmax of relevance scores.

    DRAGON eq. (2) restricted to D_s (§3); docs/math.md#dragon writes its log form
    log p^s = logsumexp_d [log softmax(R) + log p(x|d)], the same quantity. The weights are
    normalised in log space (stable for any scores); the sum itself is a [D]·[D, V] product, not
    D·|V| exponentials (≈ 20× faster at Qwen's vocabulary). p_per_doc is [D, V]; returns [V]."""
    p_per_doc = np.asarray(p_per_doc, dtype=np.float64)
    scores = np.asarray(scores, dtype=np.float64)
    if p_per_doc.ndim != 2 or scores.shape != (p_per_doc.shape[0],):
        raise ValueError("need p_per_doc [D, V] and scores [D]")
    mixture: np.ndarray = np.exp(scores - logsumexp(scores)) @ p_per_doc
    return mixture


def side_weight(scores: np.ndarray) -> float:
    """h^s = logsumexp_{d∈D_s} R(d, x_<t), the side's (log) aggregation weight.

    DRAGON §4.1 (h^s = Σ_d exp R) in the corrected log form of Appendix A.1; docs/math.md#dragon."""
    return float(logsumexp(np.asarray(scores, dtype=np.float64)))


def side_etas(h_l: float, h_r: float) -> tuple[float, float]:
    """(η^l, η^r) = softmax(h^l, h^r), the interpolation weights of p = η^l p^l + η^r p^r.

    DRAGON eq. (4) weights, computed as Appendix A.1's log softmax; docs/math.md#dragon. h = −∞ on
    both sides (neither retrieved anything) is no evidence either way: equal weights."""
    if not (h_l < math.inf and h_r < math.inf):  # NaN fails too
        raise ValueError(f"side weights must be finite or −∞, got {h_l}, {h_r}")
    if h_l == h_r == -math.inf:
        return 0.5, 0.5
    m = max(h_l, h_r)
    el, er = np.exp(h_l - m), np.exp(h_r - m)
    return float(el / (el + er)), float(er / (el + er))


def aggregate_sample(
    x: int, p_a: np.ndarray, p_b: np.ndarray, eta_b: float, rng: np.random.Generator
) -> int:
    """Algorithm 1's Sample(x, p_a, p_b, η_b): keep draft x ~ p_a unless p_a(x) > p_b(x) and
    u < η_b·(1 − p_b(x)/p_a(x)), in which case draw from norm(max(0, p_b − p_a)). The result is
    distributed as (1 − η_b)·p_a + η_b·p_b.

    DRAGON Algorithm 1 (function Sample) and §4.2; docs/math.md#dragon."""
    u = rng.random()
    pa_x, pb_x = float(p_a[x]), float(p_b[x])
    if pa_x > pb_x and u < eta_b * (1.0 - pb_x / pa_x):
        return sample_from(residual(p_b, p_a), rng)
    return int(x)


def speculative_aggregation(
    x_l: int,
    p_l: np.ndarray,
    x_r: int,
    p_r: np.ndarray,
    eta_l: float,
    eta_r: float,
    rng: np.random.Generator,
) -> tuple[int, bool, bool]:
    """Speculative Aggregation: x̃^l = Sample(x^l, p^l, p^r, η^r), x̃^r = Sample(x^r, p^r, p^l, η^l),
    then a fair coin picks x̃^l or x̃^r as the target (required: preferring the accepted draft is
    biased). A side's draft is accepted iff it equals the target. Target ~ η^l p^l + η^r p^r.

    DRAGON Algorithm 1 (SpeculativeAggregation) and eq. (4); docs/math.md#dragon.
    Returns (target, accepted_l, accepted_r)."""
    if not (eta_l >= 0.0 and eta_r >= 0.0 and abs(eta_l + eta_r - 1.0) < 1e-9):
        raise ValueError("η^l and η^r must be ≥ 0 and sum to 1")
    xt_l = aggregate_sample(x_l, p_l, p_r, eta_r, rng)
    xt_r = aggregate_sample(x_r, p_r, p_l, eta_l, rng)
    target = xt_l if rng.random() < 0.5 else xt_r
    return target, target == x_l, target == x_r
