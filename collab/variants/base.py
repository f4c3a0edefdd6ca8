"""What a split variant is: how the device drafts and encodes, how the cloud judges, how a
rejection is corrected (docs/math.md#split-verification). One subclass per variant, one module
each; both sides
read them from the registry in `collab.variants`, so a variant is one file and one line."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np

from collab.protocol import Draft, Verdict
from collab.sampling import sample_from
from collab.verification import rapid_residual, rapid_round, rapid_shift


@dataclass(frozen=True)
class DraftToken:
    """One drafted position on the device: the token, the distribution it was sampled from
    exactly as the cloud will read it (kept for a device-side correction), and what this
    position adds to the draft frame."""

    token: int
    q: np.ndarray
    row: Any


class DraftTarget(NamedTuple):
    """What an engine that samples tokens itself needs to verify one draft in a single draw
    (`collab.verification.draw_distribution`): the draft, its q (sparse; DSSD: the draft and
    q(x) alone), RAPID's η and whether the engine draws only the accept coin."""

    draft: int
    q_ids: np.ndarray
    q_probs: np.ndarray
    eta: float = 0.0
    coin: bool = False


class Judgement(NamedTuple):
    """The cloud's verdict on one draft frame: drafts accepted, the token that follows them
    (None when the device must sample the correction itself) and P_j for that correction."""

    accepted: int
    token: int | None
    p_ids: np.ndarray | None = None
    p_probs: np.ndarray | None = None

    def verdict(self, compute_s: float = 0.0, scored: int = 0, **header: int) -> Verdict:
        """The frame that carries this judgement, P_j in the precision the variant chose."""
        f32 = self.p_probs is not None and self.p_probs.dtype == np.float32
        return Verdict(
            self.accepted,
            self.token,
            self.p_ids,
            self.p_probs,
            f32=f32,
            compute_s=compute_s,
            scored=scored,
            **header,
        )


class SplitVariant(ABC):
    """A split speculative-decoding scheme, both sides of it."""

    name: ClassVar[str]
    exact: ClassVar[bool]  # the output follows the cloud's P exactly (up to float16 noted)
    summary: ClassVar[str]  # one line for help texts and the settings screen
    frame: ClassVar[type[Draft]]  # the draft frame the cloud expects
    # The cloud holds each draft's whole distribution, so it can verify against RAPID's p̂
    # (docs/math.md#rapid); such a variant implements `draft_rows`.
    rapid: ClassVar[bool] = False

    # ---- device ---------------------------------------------------------------------------
    @abstractmethod
    def draft(self, q: np.ndarray, rng: np.random.Generator) -> DraftToken:
        """Sample one draft from the device's distribution q (over the vocabulary)."""

    @abstractmethod
    def payload(self, drafts: Sequence[DraftToken], vocab_size: int) -> tuple[Any, ...]:
        """What the frame carries beside the token ids (its fields after `token_ids`)."""

    def draft_frame(
        self,
        drafts: Sequence[DraftToken],
        vocab_size: int,
        *,
        request_id: int,
        epoch: int,
        step: int,
        more: int = 0,
        ahead: bool = False,
    ) -> Draft:
        """The frame that carries a round's drafts (or a part of them: `Draft`) to the cloud."""
        tokens = np.asarray([d.token for d in drafts], dtype=np.int64)
        return self.frame(
            tokens,
            *self.payload(drafts, vocab_size),
            more=more,
            ahead=ahead,
            request_id=request_id,
            epoch=epoch,
            step=step,
        )

    def correct(self, verdict: Verdict, q: np.ndarray, rng: np.random.Generator) -> int:
        """The token after a rejection, when the cloud left it to the device (`verdict.token`
        is None): only variants whose cloud cannot resample (it does not know Q) do."""
        raise ValueError(f"{self.name}: the cloud resamples rejections itself")

    # ---- cloud ----------------------------------------------------------------------------
    def judge(
        self, frame: Draft, P: np.ndarray, rng: np.random.Generator, eta: float = 0.0
    ) -> Judgement:
        """Verify a draft frame against the cloud's P (γ+1 rows), or with η > 0 against
        RAPID's target p̂ (deliberately neither p nor p̂: docs/math.md#rapid). Raises ValueError for
        a frame that cannot have been sampled as it claims, or η > 0 where the cloud does
        not hold the drafts' distributions."""
        if not isinstance(frame, self.frame):
            raise ValueError(f"{self.name} drafts come as {self.frame.__name__}")
        drafts = np.asarray(frame.token_ids, dtype=np.int64)
        if eta == 0.0:
            return self.verify(frame, drafts, P, rng)
        if not self.rapid:
            raise ValueError(
                f"{self.name} cannot verify against RAPID's target (η > 0): its "
                "cloud never holds the drafts' distributions"
            )
        Q = self.draft_rows(frame, drafts, P.shape[1])
        return Judgement(*rapid_round(drafts, P, Q, eta, rng))

    def draft_targets(
        self, frame: Draft, drafts: np.ndarray, vocab_size: int, eta: float = 0.0
    ) -> list[DraftTarget]:
        """Each draft's verification as one draw inside the engine (vLLM), after the same
        checks as `judge`: a ValueError for a frame that cannot have been sampled as it
        claims. With η > 0 the engine draws only the accept coin (the rejection's residual
        is drawn here, from one row)."""
        if not isinstance(frame, self.frame):
            raise ValueError(f"{self.name} drafts come as {self.frame.__name__}")
        if eta and not self.rapid:
            raise ValueError(
                f"{self.name} cannot verify against RAPID's target (η > 0): its "
                "cloud never holds the drafts' distributions"
            )
        Q = self.draft_rows(frame, drafts, vocab_size)
        targets = []
        for x, q in zip(drafts.tolist(), Q, strict=True):
            ids = np.flatnonzero(q)
            targets.append(DraftTarget(int(x), ids, q[ids], eta, coin=eta > 0))
        return targets

    def coin_rejection(
        self, n: int, p: np.ndarray, target: DraftTarget, rng: np.random.Generator
    ) -> Judgement:
        """Draft n rejected by a coin the engine drew (`DraftTarget.coin`), P_n = p: RAPID's
        correction from norm(max(0, p − q, p − p̂)), drawn here."""
        q = np.zeros_like(p)
        q[target.q_ids] = target.q_probs
        p_hat = rapid_shift(p, q, target.eta)
        return Judgement(n, sample_from(rapid_residual(p, p_hat, q), rng))

    def draft_rows(self, frame: Any, drafts: np.ndarray, vocab_size: int) -> np.ndarray:
        """The drafts' distributions [γ, V] as the cloud rebuilds them from `frame`; ValueError
        if they could not have produced the drafts. Only variants with `rapid` have them."""
        raise NotImplementedError(f"{self.name} does not send its drafts' distributions")

    @abstractmethod
    def verify(
        self, frame: Any, drafts: np.ndarray, P: np.ndarray, rng: np.random.Generator
    ) -> Judgement:
        """The variant's verification of `drafts` (as ids) with what `frame` carries."""

    def __repr__(self) -> str:
        return f"<split variant {self.name}>"
