"""DRAGON's per-token bookkeeping, which the device and the cloud run identically
(docs/math.md#dragon).

- `side_distribution`: a side's local mixture p^s of its per-document next-token
  distributions, truncated for the wire (top-p with a cap) and rounded to float16 *before*
  the draft is sampled from it, so the draft follows exactly the p^s the aggregator reads.
- `aggregate`: Algorithm 1 (Speculative Aggregation) on two transmitted drafts; at
  temperature 0 the argmax of η^l p^l + η^r p^r.
- `Ledger`: the committed answer, each side's queue of unresolved drafts and draft epoch, and
  who aggregates. Both sides apply the same targets to it, so they agree without a second
  message; a draft from an older epoch than its side's current one is stale and dropped.
- `Scheduler`: the aggregator's choice of the next aggregator (DRAGON eq. 6–7) from what both
  sides see on the wire (decode times, acceptance) and the measured round trip.

numpy only; the asyncio loop that drives this over a link is `collab.dragon.peer`."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from collab.dragon.aggregation import (
    local_mixture,
    logsumexp,
    side_etas,
    side_weight,
    speculative_aggregation,
)
from collab.dragon.schedule import dragon_choose_aggregator
from collab.dragon.top import TopDocuments
from collab.protocol import AggregatorPolicy, DragonDraft, DragonTarget, Side
from collab.sampling import SamplingParams, sample_from, softmax, top_candidates
from collab.scheduling import DecodeSlopeEstimator, ewma_update, fit_decode_latency
from collab.split import Transcript, wire_probs

# Relevance R(d, x) = RELEVANCE_SCALE · cosine(d, query): the bi-encoder's cosines (≈ 0.1–0.7
# for MiniLM) would give nearly uniform softmax weights; scaled by 1/τ with τ = 0.05 a document
# 0.1 more similar weighs e² ≈ 7× more, the spread DPR's inner products give in DRAGON.
RELEVANCE_SCALE = 20.0
# A side with no document above the score floor decodes the bare question with this cosine:
# its weight is then small next to a side that found something relevant.
NO_DOCUMENT_COSINE = 0.0
# The wire truncation of p^s: top-p 0.8 as the paper sends it, at most 32 (id, prob) pairs
# (≤ 192 B a draft); a side drafts at most 4 tokens ahead of the last target.
DRAGON_TOP_P = 0.8
DRAGON_MAX_SPARSE = 32
DRAGON_LOOKAHEAD = 4


def relevance(cosines: np.ndarray) -> np.ndarray:
    """R(d, x) for the DRAGON weights, from bi-encoder cosine similarities."""
    return RELEVANCE_SCALE * np.asarray(cosines, dtype=np.float64)


# ---------------------------------------------------------------------------- one side


def side_distribution(
    logits: np.ndarray | TopDocuments,
    scores: np.ndarray,
    params: SamplingParams,
    top_p: float,
    max_sparse: int,
    f32: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, probs) of p^s as it travels: the mixture Σ_d softmax(R)_d · softmax(z_d / T) of the
    per-document logits [D, V], cut to the fewest most likely tokens that reach `top_p` of its
    mass (at most `max_sparse`), renormalised and rounded to the wire dtype (float16 unless
    f32). Temperature 0 mixes the T = 1 distributions (the draft is then the argmax).
    Ids are sorted by probability, most likely first. From the documents' top tokens
    (`TopDocuments`, vLLM) the same, or `Unsettled` where they cannot tell."""
    if isinstance(logits, TopDocuments):
        ids, kept = logits.settle(scores, top_p, max_sparse)
    else:
        temperature = params.temperature or 1.0
        per_doc = softmax(np.atleast_2d(logits), temperature)
        mix = local_mixture(per_doc, np.asarray(scores, dtype=np.float64))
        cand = top_candidates(mix, need=1, mass=top_p)
        order = cand[np.argsort(-mix[cand], kind="stable")]
        cum = np.cumsum(mix[order])  # of all the mass: the candidates may hold less than 1
        n = min(int(np.searchsorted(cum, min(top_p, cum[-1]))) + 1, max_sparse, order.size)
        ids, kept = order[:n], mix[order[:n]]
    probs = wire_probs(kept / kept.sum(), f32)
    keep = probs > 0  # float16 underflow: a token the wire says is impossible is never drawn
    return ids[keep].astype(np.int64), probs[keep].astype(np.float32 if f32 else np.float16)


def side_logprobs(
    logits: np.ndarray, scores: np.ndarray, tokens: np.ndarray, temperature: float = 1.0
) -> np.ndarray:
    """log p^s(tokens[t]) at every position t under the side's whole mixture (not cut for the
    wire): logits [D, T, V] of each document's sequence at the T positions, scores [D]. What a
    side scores an answer with (DRDG/SW, teacher-forced perplexity). Temperature 0 scores the
    T = 1 distributions, as `side_distribution` mixes them."""
    z = np.asarray(logits, dtype=np.float64) / (temperature or 1.0)
    if z.ndim != 3 or z.shape[1] != len(tokens):
        raise ValueError(f"need logits [D, T, V] for {len(tokens)} tokens, got {z.shape}")
    picked = np.take_along_axis(z, np.asarray(tokens, dtype=np.int64)[None, :, None], axis=2)
    per_doc = picked[:, :, 0] - logsumexp(z, axis=2)  # log softmax at the tokens, [D, T]
    log_w = np.asarray(scores, dtype=np.float64) - logsumexp(np.asarray(scores, np.float64))
    out: np.ndarray = logsumexp(per_doc + log_w[:, None], axis=0)
    return out


def sequence_choice(
    device: tuple[float, float],
    cloud: tuple[float, float],
    h: tuple[float, float],
    greedy: bool,
    rng: np.random.Generator,
) -> Side:
    """Reference only (tests, benchmarks).

    DRDG/SW's one aggregation (RAG-Sequence): each side's whole answer y^s is scored under
    both mixtures, P(y) = η^device P^device(y) + η^cloud P^cloud(y), with (η) = softmax(h); the
    answer is the likelier one (greedy; the device's on a tie) or drawn in proportion to P.
    `device` and `cloud` are (log P^device(y), log P^cloud(y)) of that side's answer."""
    eta_d, eta_c = side_etas(*h)
    with np.errstate(divide="ignore"):
        log_eta = np.log([eta_d, eta_c])
    score = [float(logsumexp(log_eta + np.array(pair))) for pair in (device, cloud)]
    if greedy or not np.isfinite(max(score)):
        return Side.DEVICE if score[0] >= score[1] else Side.CLOUD
    p_cloud = 1.0 / (1.0 + np.exp(score[0] - score[1]))
    return Side.CLOUD if rng.random() < p_cloud else Side.DEVICE


def transmitted(probs: np.ndarray) -> np.ndarray:
    """The distribution a draft's (float16 or float32) probabilities stand for, float64, sums
    to 1: what the aggregator mixes, and what the draft was sampled from."""
    p: np.ndarray = np.asarray(probs, dtype=np.float64)
    out: np.ndarray = p / p.sum()
    return out


def draft_token(ids: np.ndarray, probs: np.ndarray, greedy: bool, rng: np.random.Generator) -> int:
    """The side's draft: sampled from exactly the transmitted p^s, or its argmax (greedy; the
    lowest id on a tie, as the aggregator breaks ties)."""
    if greedy:
        p = np.asarray(probs, dtype=np.float64)
        best = np.flatnonzero(p == p.max())
        return int(np.min(np.asarray(ids)[best]))
    return int(ids[sample_from(transmitted(probs), rng)])


def make_draft(
    logits: np.ndarray | TopDocuments,
    scores: np.ndarray,
    params: SamplingParams,
    top_p: float,
    max_sparse: int,
    rng: np.random.Generator,
    *,
    decode_time: float,
    epoch: int,
    step: int,
    request_id: int,
) -> DragonDraft:
    """One side's draft frame for answer position `step`; the decode time it reports is the
    model step's (`decode_time`) plus this mixture's."""
    t0 = time.perf_counter()
    ids, probs = side_distribution(logits, scores, params, top_p, max_sparse)
    token = draft_token(ids, probs, params.temperature == 0.0, rng)
    h = side_weight(np.asarray(scores, dtype=np.float64))
    decode_time += time.perf_counter() - t0
    return DragonDraft(
        token, ids, probs, h, decode_time, request_id=request_id, epoch=epoch, step=step
    )


# ---------------------------------------------------------------------------- aggregation


def dense_pair(
    device: DragonDraft, cloud: DragonDraft
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Both transmitted distributions over the union of their supports (ascending ids)."""
    support = np.union1d(device.ids.astype(np.int64), cloud.ids.astype(np.int64))
    p_d = np.zeros(support.size)
    p_c = np.zeros(support.size)
    p_d[np.searchsorted(support, device.ids)] = transmitted(device.probs)
    p_c[np.searchsorted(support, cloud.ids)] = transmitted(cloud.probs)
    return support, p_d, p_c


def target_distribution(device: DragonDraft, cloud: DragonDraft) -> tuple[np.ndarray, np.ndarray]:
    """Reference only (tests, benchmarks).

    (support, η^device p^device + η^cloud p^cloud): what the target token follows."""
    support, p_d, p_c = dense_pair(device, cloud)
    eta_d, eta_c = side_etas(device.h, cloud.h)
    return support, eta_d * p_d + eta_c * p_c


def aggregate(
    device: DragonDraft, cloud: DragonDraft, greedy: bool, rng: np.random.Generator
) -> tuple[int, bool, bool]:
    """(target, device draft accepted, cloud draft accepted) — DRAGON Algorithm 1 over the two
    transmitted distributions (device as l, cloud as r, whichever side runs it: the fair coin
    makes the order irrelevant to the output). Greedy: the mixture's argmax, lowest id on a
    tie."""
    for draft in (device, cloud):
        if not np.any((draft.ids == draft.token) & (draft.probs > 0)):  # the codec too
            raise ValueError(f"draft {draft.token} was not sampled from the distribution sent")
    support, p_d, p_c = dense_pair(device, cloud)
    eta_d, eta_c = side_etas(device.h, cloud.h)
    if greedy:
        target = int(support[int(np.argmax(eta_d * p_d + eta_c * p_c))])
    else:
        x_d = int(np.searchsorted(support, device.token))
        x_c = int(np.searchsorted(support, cloud.token))
        i, _, _ = speculative_aggregation(x_d, p_d, x_c, p_c, eta_d, eta_c, rng)
        target = int(support[i])
    return target, target == device.token, target == cloud.token


# ---------------------------------------------------------------------------- the ledger


@dataclass
class Applied:
    """What one target changed, from one side's point of view."""

    kept: list[int]  # tokens committed to the answer (empty for a stop token)
    own_rejected: bool  # this side must roll back and re-decode from the target
    switched: bool  # the aggregator moved


@dataclass
class Ledger:
    """The answer both sides agree on and the drafts still in play (DRAGON §4.2 steps 1–5).

    `step` is the next answer position to aggregate. queues[s] holds side s's drafts for
    steps step, step+1, … of its current epoch; epochs[s] is s's draft epoch (bumped on each
    rejection of s). Every side keeps both queues (drafts are broadcast), so the aggregator can
    move to either side at any target."""

    me: Side
    transcript: Transcript
    aggregator: Side = Side.DEVICE
    step: int = 0
    epochs: dict[Side, int] = field(default_factory=lambda: {Side.DEVICE: 0, Side.CLOUD: 0})
    queues: dict[Side, deque[DragonDraft]] = field(
        default_factory=lambda: {Side.DEVICE: deque(), Side.CLOUD: deque()}
    )
    # drafts judged by a target (one per side per step), and those that became the target:
    # acceptance as DRAGON eq. (5) means it. Drafts made ahead and dropped by a rejection
    # are counted in `made` only.
    drafted: dict[Side, int] = field(default_factory=lambda: {Side.DEVICE: 0, Side.CLOUD: 0})
    made: dict[Side, int] = field(default_factory=lambda: {Side.DEVICE: 0, Side.CLOUD: 0})
    accepted: dict[Side, int] = field(default_factory=lambda: {Side.DEVICE: 0, Side.CLOUD: 0})
    switches: int = 0
    stale: int = 0  # drafts dropped for an old epoch or a step already resolved

    @property
    def finished(self) -> bool:
        return self.transcript.finish is not None

    @property
    def aggregating(self) -> bool:
        return self.aggregator == self.me

    def next_draft_step(self, side: Side) -> int:
        """The answer position side's next draft is for."""
        queue = self.queues[side]
        return queue[-1].step + 1 if queue else self.step

    def own_ended(self) -> bool:
        """This side has drafted up to a stop token or the length limit: nothing more to
        draft until a target says otherwise."""
        queue = self.queues[self.me]
        if queue and queue[-1].token in self.transcript.stop_ids:
            return True
        return self.next_draft_step(self.me) >= self.transcript.max_new_tokens

    def add_own(self, draft: DragonDraft) -> None:
        self.queues[self.me].append(draft)
        self.made[self.me] += 1

    def receive(self, draft: DragonDraft, limit: int | None = None) -> bool:
        """File the other side's draft; False (and counted) if it is stale or out of order.
        ValueError if `limit` of its drafts are already unresolved: an honest side stops
        drafting at its lookahead (the link keeps order, so it never sees fewer resolved)."""
        side = self.me.other
        if draft.epoch != self.epochs[side] or draft.step != self.next_draft_step(side):
            self.stale += 1
            return False
        if limit is not None and len(self.queues[side]) >= limit:
            raise ValueError(f"a draft past the lookahead of {limit} unresolved drafts")
        self.queues[side].append(draft)
        self.made[side] += 1
        return True

    def ready(self) -> bool:
        """Both sides' drafts for the current step are here (and the answer goes on)."""
        return not self.finished and all(q and q[0].step == self.step for q in self.queues.values())

    def fronts(self) -> tuple[DragonDraft, DragonDraft]:
        return self.queues[Side.DEVICE][0], self.queues[Side.CLOUD][0]

    def apply(self, target: DragonTarget) -> Applied:
        """Commit a target token (its step must be the current one) and resolve both drafts."""
        if target.step != self.step:
            raise ValueError(f"target for step {target.step}, expected step {self.step}")
        kept = self.transcript.commit([target.token])
        own_rejected = False
        for side, ok in _verdicts(target):
            queue = self.queues[side]
            self.drafted[side] += 1
            if ok and queue and queue[0].step == self.step:
                queue.popleft()
                self.accepted[side] += 1
            else:
                queue.clear()
                self.epochs[side] += 1
                own_rejected |= side == self.me
        self.step += 1
        switched = target.next_aggregator != self.aggregator
        if switched:
            self.switches += 1
            self.aggregator = target.next_aggregator
        return Applied(kept, own_rejected, switched)

    def acceptance(self, side: Side) -> float | None:
        return self.accepted[side] / self.drafted[side] if self.drafted[side] else None


# ---------------------------------------------------------------------------- the scheduler

FIT_AFTER = 4  # decode times of a side before its latency line is fitted (DRAGON §5.2)


@dataclass
class SideProfile:
    """One side's decode latency against answer position and its acceptance (EWMA)."""

    samples: list[tuple[int, float]] = field(default_factory=list)
    slope: DecodeSlopeEstimator | None = None
    mean: float | None = None
    acceptance: float | None = None

    def observe_decode(self, step: int, seconds: float, weight: float) -> None:
        self.mean = ewma_update(self.mean, seconds, weight)
        if self.slope is not None:
            self.slope.update(step + 1, seconds)
            return
        self.samples.append((step + 1, seconds))
        if len(self.samples) >= FIT_AFTER:
            t, c = np.array(self.samples, dtype=np.float64).T
            self.slope = DecodeSlopeEstimator.from_fit(fit_decode_latency(t, c), t, weight)

    def decode_at(self, step: int) -> float:
        if self.slope is not None:
            return max(self.slope.predict(step + 1), 0.0)
        return self.mean or 0.0


@dataclass
class Scheduler:
    """Who aggregates the next token. Pinned policies never move; AUTO takes argmin_s z^s of
    DRAGON eq. (7) before every target, fed by the profiler: each side's decode time (carried
    by its drafts, fitted against the answer position), each side's acceptance (draft became
    the target, EWMA: the coin is in it), and the round trip (pings). Until a round trip and
    both sides' decode times are known it stays where it is."""

    policy: AggregatorPolicy = AggregatorPolicy.AUTO
    weight: float = 0.1
    rtt: float | None = None
    bandwidth: float | None = None  # bytes/s, if measured; frames are ~0.1–0.3 KB
    profiles: dict[Side, SideProfile] = field(
        default_factory=lambda: {Side.DEVICE: SideProfile(), Side.CLOUD: SideProfile()}
    )

    def observe_draft(self, side: Side, draft: DragonDraft) -> None:
        if draft.step == 0:  # the first draft comes from the prefill: its time is no decode
            return
        self.observe_decode(side, draft.step, draft.decode_time)

    def observe_decode(self, side: Side, step: int, seconds: float) -> None:
        self.profiles[side].observe_decode(step, seconds, self.weight)

    def observe_target(self, target: DragonTarget) -> None:
        for side, ok in _verdicts(target):
            profile = self.profiles[side]
            profile.acceptance = ewma_update(profile.acceptance, float(ok), self.weight)

    def observe_rtt(self, seconds: float) -> None:
        self.rtt = ewma_update(self.rtt, seconds, self.weight)

    def choose(self, current: Side, step: int, frame_bytes: int = 200) -> Side:
        if self.policy != AggregatorPolicy.AUTO:
            return Side.DEVICE if self.policy == AggregatorPolicy.DEVICE else Side.CLOUD
        mine, other = self.profiles[current], self.profiles[current.other]
        if self.rtt is None or mine.mean is None or other.mean is None:
            return current
        one_way = self.rtt / 2 + (frame_bytes / self.bandwidth if self.bandwidth else 0.0)
        choice = dragon_choose_aggregator(
            alpha_local=mine.acceptance if mine.acceptance is not None else 0.5,
            alpha_remote=other.acceptance if other.acceptance is not None else 0.5,
            c_dec_local=mine.decode_at(step),
            c_dec_remote=other.decode_at(step),
            c_trans_local=one_way,
            c_trans_remote=one_way,
        )
        return current if choice.side == "local" else current.other


def _verdicts(target: DragonTarget) -> tuple[tuple[Side, bool], tuple[Side, bool]]:
    return (Side.DEVICE, target.device_accepted), (Side.CLOUD, target.cloud_accepted)
