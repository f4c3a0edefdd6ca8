"""A toy split variant: the device drafts the argmax of Q and says so with one (id, 1.0)
pair; the cloud verifies the one-hot draft distribution exactly (accept with p(x), resample
from norm(max(0, p − δx)) on a rejection). Exact with respect to P, like TK-SLT with K = 1."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from collab.protocol import TopKDraft
from collab.variants.base import DraftToken, Judgement, SplitVariant
from collab.verification import tkslt_cloud_verify


class ArgmaxDraft(SplitVariant):
    name = "toy-argmax"
    exact = True
    summary = "argmax drafts with a one-hot Q (a test of the variant registry)"
    frame = TopKDraft

    def draft(self, q: np.ndarray, rng: np.random.Generator) -> DraftToken:
        x = int(np.argmax(q))
        return DraftToken(x, np.eye(1, q.size, x)[0], x)

    def payload(self, drafts: Sequence[DraftToken], vocab_size: int) -> tuple[Any, ...]:
        ids = np.asarray([[d.token] for d in drafts], dtype=np.int64)
        return ids, np.ones(ids.shape, dtype=np.float16)

    def verify(
        self, frame: TopKDraft, drafts: np.ndarray, P: np.ndarray, rng: np.random.Generator
    ) -> Judgement:
        return Judgement(*tkslt_cloud_verify(drafts, frame.topk_ids, frame.topk_probs, P, rng))
