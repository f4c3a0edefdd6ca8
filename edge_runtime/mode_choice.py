"""How `auto` picks a mode for one question: a pure function of what was measured before the
answer (docs/usage.md#auto lists the rules; docs/benchmarks/auto.md the evaluation behind them).

The signals: how relevant the private passages are (the device's own search, its floor
applied), how relevant the public ones are (the passages the cloud retrieved for the bare
question, scored by the device itself, its floor applied; none when not asked:
`public_can_matter` says when asking can change the choice), whether the cloud answered,
whether the conversation's last turn is one the cloud never saw, whether the user consented
to this cloud taking part in answers shaped by private passages (edge_runtime.consent), and
the speeds measured so far. The policy: may the question leave the device at all, and may
private passages (or private turns) shape an answer the cloud takes part in (dragon; split,
whose drafts come from a prompt holding them).

The rules, in order (the first that applies decides):
1. the policy keeps questions on the device → local;
2. no cloud (none configured, still starting, or it did not answer the question's relevance
   query) → local;
3. private and public passages both relevant → dragon (local if the policy keeps private text
   out of cloud-backed answers, or the user has not consented for this cloud), unless one
   side would carry under DRAGON_MIN_SHARE of DRAGON's mixture: its weights come from the
   same scores (η = softmax of each side's logsumexp of 20 × cosine, collab.dragon), so
   dragon would follow the other side alone;
   that side's mode answers instead (rules 4 and 5), at a fraction of dragon's cost;
4. private passages relevant, or the conversation goes on from a turn the cloud never saw and
   no public passage is relevant → local;
5. public passages relevant → cloud (the device cannot know them);
6. nothing relevant on either side (chat): the cloud's larger model, through split (exact: the
   cloud model's own answer, drafted here) unless its measured costs predict no clear gain, or
   something private is in the device's prompt; then cloud; local when the cloud is measured
   far slower than the device. Split until measured: on the 60-question set's chat it answered
   as often as cloud mode at a tenth of its time (docs/benchmarks/auto.md), and its first
   answer measures its costs. (Split's device prompt holds the conversation: with private
   turns in it, split counts as shaped by them.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from collab.dragon.aggregation import side_etas, side_weight
from collab.dragon.ledger import relevance

CloudReach = Literal["ready", "off", "starting", "unreachable"]

NO_CLOUD = {
    "off": "no cloud",
    "starting": "the cloud is still starting",
    "unreachable": "the cloud did not answer",
}

DRAGON_MIN_SHARE = 0.01
"""Dragon only when each side would weigh at least this in DRAGON's mixture: under it the
other side decides every greedy token but where its top two are within ~2 % of each other
(with one passage a side: cosines more than 0.23 apart)."""

KEPT_OUT = "your notes answer this (your policy keeps them out of the cloud)"

SLOW_CLOUD = 0.25
"""Chat goes to the device when the cloud (its round trip, then its measured speed) would take
over 4× the device's time: not worth the larger model for a question no source matches."""


@dataclass(frozen=True)
class Policy:
    """The user's rules for auto (settings `auto_cloud_questions`, `auto_private_in_cloud`)."""

    questions_leave: bool = True  # the question may go to the cloud (to be answered, or scored)
    private_in_cloud: bool = True  # private passages and turns may shape a cloud-backed answer


@dataclass
class Speeds:
    """Decode speed (tokens/s, EWMA) per mode, as auto's answers measure it."""

    tokens_per_s: dict[str, float] = field(default_factory=dict)

    def observe(self, mode: str, tokens_per_s: float | None, weight: float = 0.3) -> None:
        if tokens_per_s is None or tokens_per_s <= 0:
            return
        old = self.tokens_per_s.get(mode)
        self.tokens_per_s[mode] = (
            tokens_per_s if old is None else ((1 - weight) * old + weight * tokens_per_s)
        )

    def cloud_far_slower(self, rtt_s: float | None, tokens: int) -> bool:
        """Whether an answer of `tokens` from the cloud (its round trip, then its measured
        speed) would take over 1/SLOW_CLOUD times the device's; False until both measured."""
        cloud, device = self.tokens_per_s.get("cloud"), self.tokens_per_s.get("local")
        if cloud is None or device is None:
            return False
        return (rtt_s or 0.0) + tokens / cloud > tokens / device / SLOW_CLOUD


@dataclass(frozen=True)
class Signals:
    private: Sequence[float] = ()  # each private passage's relevance that passed the floor
    public: Sequence[float] = ()  # each public one's (none: none passed, or not asked)
    cloud: CloudReach = "ready"
    private_turn: bool = False  # the last turn is one the cloud never saw (none of its answer)
    private_history: bool = False  # some earlier turn's answer the cloud did not see in full
    speeds: Speeds = field(default_factory=Speeds)
    rtt_s: float | None = None  # the cloud's measured round trip
    split_gain: float | None = None  # split's predicted tokens/s ÷ the cloud's alone (measured)
    tokens: int = 512  # the answer's length bound (what the speeds are weighed over)
    consulted: bool = False  # the public corpus was asked (`public` is its answer, checked)
    consent: bool = True  # this cloud may take part in answers shaped by private passages


@dataclass(frozen=True)
class Choice:
    mode: str
    reason: str  # a short sentence for the status line: "your notes answer this"


SPLIT_GAIN = 1.1
"""Once measured, split for chat only on a clear predicted gain (the AS² margin,
edge_runtime.split_costs)."""


NO_CONSENT = "your notes answer this (this cloud may not take part in answers shaped by them)"
CONSULTED = " · public sources consulted"
NOT_CONSULTED = " · public sources not consulted"


def choose(signals: Signals, policy: Policy) -> Choice:
    """The mode for this question and why (the module's rules, in order); once the cloud is
    reachable, the reason says whether the public corpus was asked."""
    s = signals
    if not policy.questions_leave:
        return Choice("local", "your policy keeps questions on this device")
    if s.cloud != "ready":
        return Choice("local", NO_CLOUD[s.cloud])
    choice = _choose(s, policy)
    said = CONSULTED if s.consulted else NOT_CONSULTED
    return Choice(choice.mode, choice.reason + said)


def _choose(s: Signals, policy: Policy) -> Choice:
    private, public = bool(s.private), bool(s.public)
    outweighs = ""
    if private and public:
        device_share, cloud_share = dragon_shares(s.private, s.public)
        if min(device_share, cloud_share) >= DRAGON_MIN_SHARE:
            if not policy.private_in_cloud:
                return Choice("local", KEPT_OUT)
            if not s.consent:
                return Choice("local", NO_CONSENT)
            return Choice("dragon", "needs both your notes and public sources")
        private, public = device_share > cloud_share, cloud_share > device_share
        outweighs = f" (the other side would weigh {min(device_share, cloud_share):.1%})"
    if private:
        return Choice("local", "your notes answer this" + outweighs)
    if s.private_turn and not public:
        return Choice("local", "follows an answer only this device has seen")
    if public:
        return Choice("cloud", "public sources answer this" + outweighs)
    if s.speeds.cloud_far_slower(s.rtt_s, s.tokens):
        return Choice("local", "no sources needed, and the cloud is slow right now")
    gain = s.split_gain
    unshaped = (policy.private_in_cloud and s.consent) or not s.private_history
    if unshaped and gain is None:
        return Choice("split", "no sources needed: the cloud's larger model, drafted here")
    if unshaped and gain is not None and gain >= SPLIT_GAIN:
        return Choice("split", f"no sources needed; drafting here makes it {gain:.1f}× faster")
    return Choice("cloud", "no sources needed: the cloud's larger model answers")


def dragon_shares(private: Sequence[float], public: Sequence[float]) -> tuple[float, float]:
    """(device, cloud) weights DRAGON would give the two sides for these passages' cosines
    (collab.dragon: η = softmax of h, h = logsumexp of the relevance R = 20 × cosine)."""
    h_device = side_weight(relevance(np.asarray(private, dtype=np.float64)))
    h_cloud = side_weight(relevance(np.asarray(public, dtype=np.float64)))
    return side_etas(h_device, h_cloud)


def public_can_matter(
    private: Sequence[float], private_turn: bool, policy: Policy, consent: bool, k: int
) -> bool:
    """Whether the public corpus's answer could change the choice, once the private search is
    done (rule 3 onwards): only then is the cloud asked, since whether a query follows tells it,
    question by question, how the private search went. With private passages relevant it
    matters if dragon may follow (policy and consent), or if `k` public passages as relevant
    as can be would outweigh them (rule 3's hand-over to the cloud); after an answer only
    this device has seen, only where the policy lets private turns shape cloud answers."""
    if private:
        if policy.private_in_cloud and consent:
            return True
        device_share, _ = dragon_shares(private, [1.0] * max(k, 1))
        return device_share < DRAGON_MIN_SHARE
    if private_turn:
        return policy.private_in_cloud
    return True
