"""DRAGON's greedy aggregator scheduler (DRAGON eq. 5–8; docs: the math, DRAGON): the expected
time per target token on each side, the side that should aggregate, and the acceptance the
scheduler needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Side = Literal["local", "remote"]


def dragon_per_token_latency(
    alpha_remote: float,
    c_dec_local: float,
    c_dec_remote: float,
    c_trans_local: float,
    c_trans_remote: float,
) -> float:
    """z^l = α^r·max(c^l_dec, c^r_dec) + (1 − α^r)·max(c^l_dec, c^r_dec + c^l_trans + c^r_trans)
    — DRAGON eq. (7).

    Expected time per target token while side l ("local") keeps aggregating. Only the remote
    side's acceptance α^r matters: an accepted remote draft means r decoded its next draft in
    parallel (appendix A.3 cases i, iii: max of the decode times); a rejected one makes r wait
    for the target token, re-decode and send back (cases ii, iv). c^s_trans is the one-way
    transmission delay of a message from s; their sum is the round trip."""
    sync = max(c_dec_local, c_dec_remote)
    serial = max(c_dec_local, c_dec_remote + c_trans_local + c_trans_remote)
    return alpha_remote * sync + (1 - alpha_remote) * serial


@dataclass(frozen=True)
class AggregatorChoice:
    """Which side should aggregate next, and the per-token latencies that decided it."""

    side: Side
    z_local: float
    z_remote: float


def dragon_choose_aggregator(
    alpha_local: float,
    alpha_remote: float,
    c_dec_local: float,
    c_dec_remote: float,
    c_trans_local: float,
    c_trans_remote: float,
) -> AggregatorChoice:
    """s* = argmin_{s ∈ {l, r}} z^s — DRAGON eq. (6) with z^s from eq. (7).

    "local" is the side that aggregates now (l), "remote" the other (r); z^r is eq. (7) with l
    and r exchanged. alpha_s is the probability that side s's draft becomes the target token
    (see `dragon_expected_acceptance`). On a tie the aggregator stays where it is, as DRAGON
    switches to r only when Δz = z^l − z^r > 0 (§5.1)."""
    z_l = dragon_per_token_latency(
        alpha_remote, c_dec_local, c_dec_remote, c_trans_local, c_trans_remote
    )
    z_r = dragon_per_token_latency(
        alpha_local, c_dec_remote, c_dec_local, c_trans_remote, c_trans_local
    )
    return AggregatorChoice(side="remote" if z_l > z_r else "local", z_local=z_l, z_remote=z_r)


def dragon_latency_difference(
    alpha_local: float,
    alpha_remote: float,
    c_dec_local: float,
    c_dec_remote: float,
    rtt: float,
) -> float:
    """Reference only (tests, benchmarks).

    Δz = z^l − z^r as DRAGON's piecewise eq. (8), with rtt = c^l_trans + c^r_trans and
    j = c^r_dec − c^l_dec:

    (1 − α^r)·rtt                        if c^l_dec ≤ c^r_dec − rtt
    (1 − α^l)·j + (α^l − α^r)·rtt        if c^r_dec − rtt < c^l_dec ≤ c^r_dec
    (1 − α^r)·j + (α^l − α^r)·rtt        if c^r_dec < c^l_dec ≤ c^r_dec + rtt
    (α^l − 1)·rtt                        if c^r_dec + rtt < c^l_dec

    (The last case's coefficient is garbled in the paper text; α^l − 1 follows from eq. 7.)
    Positive means "switch to r"."""
    c_l, c_r = c_dec_local, c_dec_remote
    j = c_r - c_l
    if c_l <= c_r - rtt:
        return (1 - alpha_remote) * rtt
    if c_l <= c_r:
        return (1 - alpha_local) * j + (alpha_local - alpha_remote) * rtt
    if c_l <= c_r + rtt:
        return (1 - alpha_remote) * j + (alpha_local - alpha_remote) * rtt
    return (alpha_local - 1) * rtt


def dragon_expected_acceptance(
    p_self: np.ndarray, p_other: np.ndarray, eta_other: float, coin: float = 0.5
) -> float:
    """Reference only (tests, benchmarks).

    α^l = γ^l·(1 − η^r·δ) + γ^r·Σ_x p^l(x)·p(x) — DRAGON eq. (5).

    Probability that side l's draft x^l ~ p^l *becomes the target token*, with
    δ = 1 − Σ min(p^l, p^r), target p = η^l p^l + η^r p^r, and coin weights γ^l = coin,
    γ^r = 1 − coin (½ each in Algorithm 1). First term: the coin picks x̃^l and x^l survives its
    own Sample (probability 1 − η^r δ). Second: the coin picks x̃^r, which is distributed as p and
    independent of x^l. So even a draft that always survives is the target only about half the
    time when the other side's draft differs — the coin halves it. This, not the survival rate,
    is the α that eq. (7) needs (an accepted side keeps decoding, a rejected one rolls back)."""
    p_l = np.asarray(p_self, dtype=np.float64)
    p_r = np.asarray(p_other, dtype=np.float64)
    delta = 1.0 - np.minimum(p_l, p_r).sum()
    target = (1 - eta_other) * p_l + eta_other * p_r
    return float(coin * (1 - eta_other * delta) + (1 - coin) * np.dot(p_l, target))
