"""A toy split variant: the device drafts the argmax of Q and says so with one (id, 1.0)
pair; the cloud verifies the one-hot draft distribution exactly (accept with p(x), resample
from norm(max(0, p − δx)) on a rejection). Exact with respect to P, like TK-SLT with K = 1."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from collab.protocol import Message, TopKDraft
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

    def draft_frame(
        self, drafts: Sequence[DraftToken], vocab_size: int, *, request_id: int, epoch: int,
        step: int,
    ) -> Message:  # fmt: skip
        ids = np.asarray([[d.token] for d in drafts], dtype=np.int64)
        return TopKDraft([d.token for d in drafts], ids, np.ones(ids.shape, dtype=np.float16),
                         request_id=request_id, epoch=epoch, step=step)  # fmt: skip

    def judge(self, frame: Message, P: np.ndarray, rng: np.random.Generator) -> Judgement:
        assert isinstance(frame, TopKDraft)
        drafts = np.asarray(frame.token_ids, dtype=np.int64)
        return Judgement(*tkslt_cloud_verify(drafts, frame.topk_ids, frame.topk_probs, P, rng))
