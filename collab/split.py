"""Bookkeeping both sides of split decoding must do identically: committing tokens (stop
token, length limit) and the exact draft distributions that travel in float16.

The device and the cloud each run this code on the same verdicts, so they agree on the answer
without sending it twice."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from collab.protocol import FinishReason


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
