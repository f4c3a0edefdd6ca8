"""Turning logits into the exact distribution a token is sampled from.

Speculative decoding is exact only if the verifier uses *exactly* the distribution the draft
was sampled from (DESIGN.md §5.1), so every sampler here returns that distribution with the
token: after temperature, top-k and top-p, renormalised, as float64."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (a one-hot distribution); top_k 0 and top_p 1.0 = no truncation."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be ≥ 0")
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


def _top_p_keep(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of most likely tokens whose mass reaches top_p (nucleus).
    Sorts only a growing candidate set (argpartition), not the whole vocabulary."""
    k = min(256, probs.size)
    while True:
        cand = np.argpartition(probs, -k)[-k:] if k < probs.size else np.arange(probs.size)
        order = cand[np.argsort(-probs[cand], kind="stable")]
        cum = np.cumsum(probs[order])
        if cum[-1] >= top_p or k == probs.size:
            n = int(np.searchsorted(cum, top_p)) + 1
            return order[: min(n, order.size)]
        k = min(probs.size, k * 4)


def distribution(logits: np.ndarray, params: SamplingParams = SamplingParams()) -> np.ndarray:
    """The exact next-token distribution for one position (1-D logits), float64, sums to 1."""
    logits = np.asarray(logits)
    if logits.ndim != 1:
        raise ValueError("distribution() takes the logits of one position")
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


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from a distribution (inverse CDF; exact for float64 probabilities)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.size - 1))


def sample(
    logits: np.ndarray, rng: np.random.Generator, params: SamplingParams = SamplingParams()
) -> tuple[int, np.ndarray]:
    """Sample a token; return it with the exact distribution it was drawn from."""
    probs = distribution(logits, params)
    if params.temperature == 0.0:
        return int(np.argmax(probs)), probs
    return sample_from(probs, rng), probs
