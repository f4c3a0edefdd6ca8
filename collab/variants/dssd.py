"""DSSD (docs/math.md#split-verification; DSSD paper, with its p/q swap corrected): the device
sends ids and
q(x) only. The cloud accepts while r < min(1, p(x)/q(x)); at the first rejection j it sends
P_j and the device resamples the correction from norm(max(0, P_j − Q_j)) with its own Q_j.

`dssd-topk` sends only the top 64 of P_j (PicoSpec's downlink): **approximate**, its bias is
`collab.verification.picospec_topk_bias_tv`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from collab.protocol import Draft, DssdDraft, Verdict
from collab.sampling import sample_from, top_candidates
from collab.variants.base import DraftTarget, DraftToken, Judgement, SplitVariant
from collab.verification import dssd_cloud_verify, dssd_device_resample, picospec_residual_topk

P_TOPK = 64  # P_j entries sent back by dssd-topk


class Dssd(SplitVariant):
    name = "dssd"
    exact = True  # P_j travels in float32: float16 would zero every p below 6e-8 (a bias)
    summary = "ids + q(x); on a rejection the cloud sends dense P_j, the device resamples"
    frame = DssdDraft

    def draft(self, q: np.ndarray, rng: np.random.Generator) -> DraftToken:
        x = sample_from(q, rng)
        return DraftToken(x, q, float(q[x]))

    def payload(self, drafts: Sequence[DraftToken], vocab_size: int) -> tuple[Any, ...]:
        return np.asarray([d.row for d in drafts], dtype=np.float32), True  # q(x), in float32

    def verify(
        self, frame: DssdDraft, drafts: np.ndarray, P: np.ndarray, rng: np.random.Generator
    ) -> Judgement:
        q = np.asarray(frame.q, dtype=np.float64)
        n, bonus, rejected = dssd_cloud_verify(drafts, q, P, rng)
        if rejected is None:
            return Judgement(n, bonus)
        return self.rejection(n, P[n])

    def draft_targets(
        self, frame: Draft, drafts: np.ndarray, vocab_size: int, eta: float = 0.0
    ) -> list[DraftTarget]:
        """Only the accept coin: the correction needs the device's Q (P_j goes back)."""
        if not isinstance(frame, DssdDraft) or eta:
            return super().draft_targets(frame, drafts, vocab_size, eta)  # its ValueError
        q = np.asarray(frame.q, dtype=np.float64)
        if q.shape != drafts.shape or not np.all((q > 0.0) & (q <= 1.0)):
            raise ValueError("q(x) of a sampled draft must lie in (0, 1]")
        return [
            DraftTarget(int(x), np.asarray([x]), np.asarray([qx]), coin=True)
            for x, qx in zip(drafts.tolist(), q.tolist(), strict=True)
        ]

    def coin_rejection(
        self, n: int, p: np.ndarray, target: DraftTarget, rng: np.random.Generator
    ) -> Judgement:
        return self.rejection(n, p)

    def rejection(self, n: int, p_j: np.ndarray) -> Judgement:
        """What the cloud sends back at a rejection: dense P_j in float32 (608 KB at Qwen's
        vocabulary). In float16 every id with p below its smallest subnormal (6e-8) became
        impossible in the correction: a total-variation bias of ~2e-4 per position at T = 1
        on the real pair, decisively visible in a sampling test."""
        return Judgement(n, None, None, p_j.astype(np.float32))

    def correct(self, verdict: Verdict, q: np.ndarray, rng: np.random.Generator) -> int:
        """DSSD's resample: norm(max(0, P_j − Q_j)) on the device."""
        p_j = np.asarray(verdict.p_probs, dtype=np.float64)
        if p_j.shape != q.shape or not np.isfinite(p_j).all() or p_j.min() < 0 or p_j.sum() <= 0:
            raise ValueError("a dssd rejection carries P_j, a distribution over the vocabulary")
        return dssd_device_resample(p_j / p_j.sum(), q, rng)


class DssdTopK(Dssd):
    name = "dssd-topk"
    exact = False
    summary = "as dssd with only the top 64 of P_j sent back: approximate (PicoSpec)"

    def rejection(self, n: int, p_j: np.ndarray) -> Judgement:
        cand = top_candidates(p_j, need=min(P_TOPK, p_j.size))
        ids = cand[np.argsort(-p_j[cand], kind="stable")[:P_TOPK]]
        return Judgement(n, None, ids, p_j[ids].astype(np.float16))

    def correct(self, verdict: Verdict, q: np.ndarray, rng: np.random.Generator) -> int:
        if verdict.p_ids is None:
            raise ValueError("a dssd-topk rejection carries the ids of its P_j")
        p_j = np.asarray(verdict.p_probs, dtype=np.float64)
        return sample_from(picospec_residual_topk(verdict.p_ids, p_j, q), rng)
