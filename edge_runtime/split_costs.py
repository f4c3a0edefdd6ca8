"""The measured cost model behind split decoding's draft length γ (docs/math.md#split-verification).

Fed by every round: device draft time per token, the cloud's compute time for verifying γ+1
positions (reported in each Verdict), the rest of the round time (the link), the cloud's
per-token time when it decodes alone, and acceptance. It outlives one answer, so a session
learns once. Before any measurement it drafts γ = 4 (acceptance ≈ 0.5 measured with this
pair, docs/models.md#models)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from collab.scheduling import GammaChoice, choose_draft_length, ewma_update, verify_line

INITIAL_GAMMA = 4
AS2_MARGIN = 1.1  # speculate only when predicted ≥ 10 % faster than the cloud decoding alone
EWMA = 0.3


@dataclass
class SplitCosts:
    gamma_max: int = 12
    t_draft: float | None = None  # device seconds per drafted token
    t_link: float | None = None  # round time not spent computing: RTT + transfer
    t_cloud_step: float | None = None  # cloud seconds per token when it decodes alone
    accepted: float = 1.0  # discounted counts for α = accepted / (accepted + rejections)
    rejected: float = 1.0  # prior α = 0.5
    verify: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=64))
    cloud_tokens_since_round: int = 0  # AS² decoding since the last speculative round
    as2: bool = True  # False: always speculate (to measure what AS² saves)

    @property
    def alpha(self) -> float:
        """Per-token acceptance: the truncated-geometric estimate Σn / Σ(n + [n < γ])."""
        return self.accepted / (self.accepted + self.rejected)

    def observe_round(
        self,
        gamma: int,
        n: int,
        draft_s: float,
        link_s: float | None,
        compute_s: float,
        scored: int = 0,
    ) -> None:
        """One verified batch: γ drafts, n accepted, the device's drafting time, the round's
        time on the link (None where it cannot be told apart: a pipelined batch that queued
        behind another at the cloud) and the cloud's compute time for the pass that scored
        `scored` drafts (0: all γ; fewer when the cloud verified the batch's first part early)."""
        self.accepted = 0.97 * self.accepted + n
        self.rejected = 0.97 * self.rejected + (1 if n < gamma else 0)
        self.t_draft = ewma_update(self.t_draft, draft_s / max(gamma, 1), EWMA)
        if link_s is not None:
            self.t_link = ewma_update(self.t_link, max(0.0, link_s), EWMA)
        self.verify.append(((scored or gamma) + 1, compute_s))
        self.cloud_tokens_since_round = 0

    def observe_cloud_tokens(self, n: int, seconds: float) -> None:
        if n > 0:
            self.t_cloud_step = ewma_update(self.t_cloud_step, seconds / n, EWMA)

    def verify_time(self, rows: int) -> float:
        return verify_line(self.verify, rows)

    def cloud_step(self) -> float:
        """The cloud's seconds per token decoding alone: as measured when it last did, but
        never above the verify line at one position, which every verdict refreshes from the
        cloud's own clock. A measurement taken while the cloud was cold or the device busy must
        not stick while the device speculates (benchmark, ORT: 84 ms believed for 14 answers,
        65 ms true, so it speculated and lost 5 %)."""
        line = self.verify_time(1)
        return line if self.t_cloud_step is None else min(self.t_cloud_step, line)

    def choose(self, remaining: int, pipelined: bool = False) -> GammaChoice | None:
        """γ and whether to let the cloud decode alone (AS²); None until measured.
        `pipelined`: rounds of PicoSpec's pipeline (its eq. 9), not stop-and-wait ones."""
        if self.t_draft is None or not self.verify:
            return None
        cloud_step = self.cloud_step()
        choice = choose_draft_length(
            min(self.alpha, 0.999),
            t_draft=self.t_draft,
            t_rtt=self.t_link or 0.0,
            t_verify=lambda g: self.verify_time(g + 1),
            t_cloud_step=cloud_step,
            gamma_max=max(1, min(self.gamma_max, remaining)),
            pipelined=pipelined,
        )
        if not self.as2:
            return replace(choice, use_cloud_only=False)
        # Speculate only on a clear predicted win: the estimates are good to ~5-10 %, and a
        # near tie lost in the benchmark (ORT int4 cloud, RTT 0: 0.94× at α ≈ 0.84).
        margin = choice.tokens_per_second < AS2_MARGIN * choice.cloud_only_tokens_per_second
        return replace(choice, use_cloud_only=choice.use_cloud_only or margin)
