"""Bookkeeping both sides of split decoding must do identically: committing tokens (stop
token, length limit) and the exact draft distributions that travel in float16.

The device and the cloud each run this code on the same verdicts, so they agree on the answer
without sending it twice."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from collab.protocol import FinishReason
from collab.sampling import top_candidates


@dataclass
class Transcript:
    """The answer's committed token ids; ends at the first stop id (not kept) or at
    `max_new_tokens`."""

    max_new_tokens: int
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None

    def commit(self, new: Iterable[int]) -> list[int]:
        """Append tokens in order until the answer ends; return the ones kept."""
        kept: list[int] = []
        for t in new:
            if self.finish is not None:
                break
            if int(t) in self.stop_ids:
                self.finish = FinishReason.STOP
                break
            self.tokens.append(int(t))
            kept.append(int(t))
            if len(self.tokens) >= self.max_new_tokens:
                self.finish = FinishReason.LENGTH
        if self.max_new_tokens == 0 and self.finish is None:
            self.finish = FinishReason.LENGTH
        return kept

    @property
    def remaining(self) -> int:
        return max(0, self.max_new_tokens - len(self.tokens))


def wire_probs(probs: np.ndarray, f32: bool) -> np.ndarray:
    """Probabilities exactly as the receiver will read them (float16 unless f32), as float64.
    A sender samples from *these* numbers, so the receiver's q is the draft distribution."""
    return np.asarray(probs, dtype=np.float32 if f32 else np.float16).astype(np.float64)


def topk_draft_row(
    q: np.ndarray, k_max: int, mass: float = 0.999, f32: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """TK-SLT's transmitted draft distribution for one position: the fewest most likely tokens
    that cover `mass` of q, at most `k_max`, renormalised and rounded for the wire. Sampling
    the draft from the returned probabilities (not from q) keeps verification exact
    (DESIGN §5.1); fewer pairs where q is peaked keeps the uplink small."""
    q = np.asarray(q, dtype=np.float64)
    cand = top_candidates(q, need=1, mass=mass)
    order = cand[np.argsort(-q[cand], kind="stable")]
    cum = np.cumsum(q[order])
    k = min(int(np.searchsorted(cum, mass * cum[-1])) + 1, k_max, order.size)
    ids = order[:k]
    return ids, wire_probs(q[ids] / q[ids].sum(), f32)


def pad_rows(
    rows: list[tuple[np.ndarray, np.ndarray]], vocab_size: int
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
