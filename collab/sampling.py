"""Turning logits into the exact distribution a token is sampled from.

Speculative decoding is exact only if the verifier uses *exactly* the distribution the draft
was sampled from (docs/math.md#speculative-verification), so every sampler here returns that
distribution with the
token: after temperature, top-k and top-p, renormalised, as float64."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from collab.temperature import temperature_problem


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (a one-hot distribution); top_k 0 and top_p 1.0 = no truncation."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        problem = temperature_problem(self.temperature)
        if problem:
            raise ValueError(problem)
        if self.top_k < 0:
            raise ValueError("top_k must be ≥ 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")


GREEDY = SamplingParams(temperature=0.0)


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """softmax(z / T) in float64 over the last axis."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    z -= z.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    return z


def top_candidates(probs: np.ndarray, need: int = 1, mass: float = 0.0) -> np.ndarray:
    """Indices of every token with p ≥ t, for the largest t in 1e-4, 1e-6, … that keeps at
    least `need` tokens and at least `mass` probability. Everything above a threshold is kept,
    so the top-k or nucleus of `probs` lies inside the result: sorting it instead of the whole
    vocabulary is exact and ~20× cheaper (a comparison pass instead of a 151,936-way sort)."""
    threshold = 1e-4
    while threshold > 1e-12:
        cand = np.flatnonzero(probs >= threshold)
        if cand.size >= need and probs[cand].sum() >= mass:
            return cand
        threshold *= 1e-2
    return np.arange(probs.size)


def _top_p_keep(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of most likely tokens whose mass reaches top_p (nucleus)."""
    cand = top_candidates(probs, mass=top_p)
    order = cand[np.argsort(-probs[cand], kind="stable")]
    cum = np.cumsum(probs[order])
    n = int(np.searchsorted(cum, top_p)) + 1
    return order[: min(n, order.size)]


def distribution(logits: np.ndarray, params: SamplingParams = SamplingParams()) -> np.ndarray:
    """The exact next-token distribution for one position (1-D logits), float64, sums to 1."""
    logits = np.asarray(logits)
    if logits.ndim != 1:
        raise ValueError("distribution() takes the logits of one position")
    if not np.isfinite(logits.max()):  # NaN propagates through max; −inf alone is a masked id
        raise ValueError("logits contain NaN or +inf, or every logit is −inf")
    if params.temperature == 0.0:
        out = np.zeros(logits.size, dtype=np.float64)
        out[int(np.argmax(logits))] = 1.0
        return out
    if params.top_k and params.top_k < logits.size:
        keep = np.argpartition(logits, -params.top_k)[-params.top_k :]
        probs = np.zeros(logits.size, dtype=np.float64)
        probs[keep] = softmax(logits[keep], params.temperature)
    else:
        probs = softmax(logits, params.temperature)
    if params.top_p < 1.0:
        keep = _top_p_keep(probs, params.top_p)
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    return probs


_BLOCK = 256


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from a distribution by inverse CDF, exact for float64 probabilities.

    Over a large vocabulary the CDF is walked in two levels (block sums, then one block), which
    is the same inverse CDF without a 151,936-long cumulative sum. Zero-probability tokens are
    never drawn. Raises ValueError unless the weights are finite, ≥ 0 and not all 0."""
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 1 or probs.size == 0:
        raise ValueError("sample_from() takes one non-empty vector of probabilities")
    u = rng.random()
    if probs.size <= 16 * _BLOCK:
        cdf = np.cumsum(probs)
        _check_weights(probs, float(cdf[-1]))
        return _first_above(probs, cdf, u * cdf[-1], 0)
    block_cdf = np.cumsum(np.add.reduceat(probs, np.arange(0, probs.size, _BLOCK)))
    _check_weights(probs, float(block_cdf[-1]))
    target = u * block_cdf[-1]
    b = min(int(np.searchsorted(block_cdf, target, side="right")), block_cdf.size - 1)
    start = b * _BLOCK
    block = probs[start : start + _BLOCK]
    before = block_cdf[b - 1] if b else 0.0
    return _first_above(block, np.cumsum(block), target - before, start)


def _check_weights(probs: np.ndarray, total: float) -> None:
    """A NaN or ±inf anywhere makes the total non-finite; one more pass rules out a negative
    weight (which the total can hide)."""
    if not (math.isfinite(total) and total > 0.0) or probs.min() < 0.0:
        raise ValueError("probabilities must be finite, ≥ 0 and not all 0")


def _first_above(probs: np.ndarray, cdf: np.ndarray, target: float, offset: int) -> int:
    """First index whose CDF exceeds target; rounding can never land on a zero-probability
    token (it steps back to the last token with mass)."""
    i = min(int(np.searchsorted(cdf, target, side="right")), probs.size - 1)
    if probs[i] <= 0.0:
        i = int(np.flatnonzero(probs[: i + 1] > 0.0)[-1])
    return offset + i


def sample(
    logits: np.ndarray, rng: np.random.Generator, params: SamplingParams = SamplingParams()
) -> tuple[int, np.ndarray]:
    """Sample a token; return it with the exact distribution it was drawn from."""
    probs = distribution(logits, params)
    if params.temperature == 0.0:
        return int(np.argmax(probs)), probs
    return sample_from(probs, rng), probs
