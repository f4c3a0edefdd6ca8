"""TK-SLT (docs/math.md#split-verification; TK-SLT paper): exact and cheap. The device samples each
draft from
the top-K truncation of Q as sent (float16), so the cloud knows the draft distribution
exactly, verifies with min(1, p/q) and resamples any rejection itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from collab.protocol import TopKDraft
from collab.sampling import sample_from, top_candidates
from collab.split import wire_probs
from collab.variants.base import DraftToken, Judgement, SplitVariant
from collab.verification import tkslt_cloud_verify, tkslt_draft_rows

TOPK_MAX = 8  # at most 8 (id, prob) pairs per drafted position (≤ 56 B)
TOPK_MASS = 0.999  # ... and only as many as cover this much of q


def truncate(
    q: np.ndarray, k_max: int, mass: float = TOPK_MASS, f32: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """TK-SLT's truncation: the fewest most likely tokens that cover `mass` of q, at most
    `k_max`, renormalised and rounded for the wire. Sampling the draft from the returned
    probabilities (not from q) keeps verification exact (docs/math.md#speculative-verification);
    fewer pairs where q is
    peaked keeps the uplink small."""
    q = np.asarray(q, dtype=np.float64)
    cand = top_candidates(q, need=1, mass=mass)
    order = cand[np.argsort(-q[cand], kind="stable")]
    cum = np.cumsum(q[order])
    k = min(int(np.searchsorted(cum, mass * cum[-1])) + 1, k_max, order.size)
    ids = order[:k]
    return ids, wire_probs(q[ids] / q[ids].sum(), f32)


def pad_rows(
    rows: Sequence[tuple[np.ndarray, np.ndarray]], vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Stack per-position (ids, probs) of different lengths into [γ, K] arrays by padding with
    unused ids at probability 0 (never sampled, so the distributions are unchanged)."""
    k = max(ids.size for ids, _ in rows)
    out_ids = np.zeros((len(rows), k), dtype=np.int64)
    out_probs = np.zeros((len(rows), k), dtype=np.float64)
    for i, (ids, probs) in enumerate(rows):
        out_ids[i, : ids.size], out_probs[i, : ids.size] = ids, probs
        free = np.setdiff1d(np.arange(k + ids.size), ids)[: k - ids.size]
        out_ids[i, ids.size :] = free
    return out_ids, out_probs


class TkSlt(SplitVariant):
    name = "tk-slt"
    exact = True
    summary = "ids + the top-K of Q they were sampled from; the cloud resamples (exact)"
    frame = TopKDraft
    rapid = True

    def __init__(self, k_max: int = TOPK_MAX) -> None:
        self.k_max = k_max

    def draft(self, q: np.ndarray, rng: np.random.Generator) -> DraftToken:
        ids, probs = truncate(q, self.k_max)
        return DraftToken(int(ids[sample_from(probs, rng)]), q, (ids, probs))

    def payload(self, drafts: Sequence[DraftToken], vocab_size: int) -> tuple[Any, ...]:
        ids, probs = pad_rows([d.row for d in drafts], vocab_size)
        return ids, probs.astype(np.float16)

    def verify(
        self, frame: TopKDraft, drafts: np.ndarray, P: np.ndarray, rng: np.random.Generator
    ) -> Judgement:
        return Judgement(*tkslt_cloud_verify(drafts, frame.topk_ids, frame.topk_probs, P, rng))

    def draft_rows(self, frame: TopKDraft, drafts: np.ndarray, vocab_size: int) -> np.ndarray:
        return tkslt_draft_rows(drafts, frame.topk_ids, frame.topk_probs, vocab_size)
