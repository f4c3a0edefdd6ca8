"""DSD (docs/math.md#split-verification, the baseline): the device sends every draft's dense Q row
(float16) and
samples the draft from exactly those rounded numbers; the cloud runs a standard speculative
round (5.1) and resamples any rejection itself. Exact, and heavy on the uplink."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from collab.protocol import DsdDraft
from collab.sampling import sample_from
from collab.split import wire_probs
from collab.variants.base import DraftToken, Judgement, SplitVariant
from collab.verification import dsd_round


class Dsd(SplitVariant):
    name = "dsd"
    exact = True
    summary = "ids + the dense Q row of every draft (float16, ~300 KB each): the baseline"
    frame = DsdDraft
    rapid = True

    def draft(self, q: np.ndarray, rng: np.random.Generator) -> DraftToken:
        q16 = wire_probs(q, f32=False)  # exactly what the cloud will read
        q = q16 / q16.sum()
        return DraftToken(sample_from(q, rng), q, q16)

    def payload(self, drafts: Sequence[DraftToken], vocab_size: int) -> tuple[Any, ...]:
        return (np.stack([d.row for d in drafts]).astype(np.float16),)

    def verify(
        self, frame: DsdDraft, drafts: np.ndarray, P: np.ndarray, rng: np.random.Generator
    ) -> Judgement:
        """DSD's round, after checking the rows could have produced the drafts."""
        n, token = dsd_round(drafts, P, self.draft_rows(frame, drafts, P.shape[1]), rng)
        return Judgement(n, token)

    def draft_rows(self, frame: DsdDraft, drafts: np.ndarray, vocab_size: int) -> np.ndarray:
        Q = np.asarray(frame.probs, dtype=np.float64)
        if Q.shape[1] != vocab_size:
            raise ValueError(f"dense drafts must cover the {vocab_size}-token vocabulary")
        total = Q.sum(axis=1, keepdims=True)
        if not np.all(total > 0):
            raise ValueError("a dense draft distribution is all zeros")
        rows: np.ndarray = Q / total
        if not np.all(rows[np.arange(drafts.size), drafts] > 0):
            raise ValueError("a draft has probability 0 in its own distribution")
        return rows
