"""Scheduling math: TK-SLT draft length, the numeric γ chooser, PicoSpec eq. 9, DRAGON's
scheduler and profiler (docs/math.md: split verification, PicoSpec, DRAGON)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from collab.dragon.schedule import (
    dragon_choose_aggregator,
    dragon_expected_acceptance,
    dragon_latency_difference,
    dragon_per_token_latency,
)
from collab.scheduling import (
    DecodeSlopeEstimator,
    OnlineProfiler,
    choose_draft_length,
    expected_tokens_per_round,
    fit_decode_latency,
    picospec_expected_round_time,
    speculative_round_time,
    tk_slt_gamma0,
    tk_slt_optimal_draft_length,
    tk_slt_relative_cost,
    tk_slt_speedup,
)

# ---------------------------------------------------------------------------------------------
# TK-SLT Table I, as printed in the paper (§VI-A): rows α, columns L; "1*" = S_inf < 1, use the
# standalone LLM.
# ---------------------------------------------------------------------------------------------
TABLE_I_L = (0.01, 0.1, 0.2, 0.4, 0.6)
TABLE_I = {
    0.4: ("4", "2", "1", "1", "1*"),
    0.6: ("7", "3", "2", "1", "1*"),
    0.8: ("14", "6", "4", "2", "1"),
}
TABLE_I_CELLS = [
    (alpha, L, cell)
    for alpha, row in TABLE_I.items()
    for L, cell in zip(TABLE_I_L, row, strict=True)
]


@pytest.mark.parametrize(("alpha", "L", "cell"), TABLE_I_CELLS)
def test_tk_slt_table_i_reproduced(alpha: float, L: float, cell: str) -> None:
    decision = tk_slt_optimal_draft_length(alpha, L)
    got = f"{decision.gamma}{'*' if decision.use_llm_only else ''}"
    assert got == cell


def test_design_spot_check_alpha_08_L_01() -> None:
    decision = tk_slt_optimal_draft_length(0.8, 0.1)
    assert decision.gamma == 6
    assert not decision.use_llm_only
    assert decision.speedup == pytest.approx((1 - 0.8**7) / (1.6 * 0.2))


@pytest.mark.parametrize(
    ("alpha", "L"), [(Fraction(2, 5), Fraction(2, 5)), (Fraction(3, 5), Fraction(3, 5))]
)
def test_table_i_one_star_boundary_is_an_exact_tie(alpha: Fraction, L: Fraction) -> None:
    """(0.4, 0.4) is printed "1" and (0.6, 0.6) "1*", yet S(1) = 1 exactly in both: the paper's
    marks come from float rounding of eq. (11) (1.0 vs 0.9999999999999998)."""
    assert (1 - alpha**2) / ((1 + L) * (1 - alpha)) == 1
    assert tk_slt_speedup(float(alpha), 1, float(L)) == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("L", [1e-4, 0.003, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 0.99])
def test_algorithm_1_is_the_integer_argmax(alpha: float, L: float) -> None:
    gammas = np.arange(1, 20001)
    s = tk_slt_speedup(alpha, gammas, L)
    decision = tk_slt_optimal_draft_length(alpha, L)
    assert decision.speedup == pytest.approx(s.max(), rel=1e-12)
    assert decision.gamma == gammas[np.argmax(s)] or s[decision.gamma - 1] == pytest.approx(s.max())


@pytest.mark.parametrize(("alpha", "L"), [(0.8, 0.1), (0.6, 0.01), (0.4, 0.2), (0.95, 0.05)])
def test_gamma0_is_the_stationary_point(alpha: float, L: float) -> None:
    g0 = tk_slt_gamma0(alpha, L)
    # eq. (24): −α^{γ+1}·ln α·(1 + Lγ) − L(1 − α^{γ+1}) = 0
    residual = -(alpha ** (g0 + 1)) * math.log(alpha) * (1 + L * g0) - L * (1 - alpha ** (g0 + 1))
    assert residual == pytest.approx(0.0, abs=1e-12)


def test_gamma0_tiny_L_does_not_underflow() -> None:
    # α^{1/L − 1} underflows to 0 for L = 1e-4: the log-space Newton branch takes over.
    g0 = tk_slt_gamma0(0.4, 1e-4)
    assert math.isfinite(g0)
    residual = -(0.4 ** (g0 + 1)) * math.log(0.4) * (1 + 1e-4 * g0) - 1e-4 * (1 - 0.4 ** (g0 + 1))
    assert residual == pytest.approx(0.0, abs=1e-12)


def test_L_at_or_above_one_always_uses_llm_only() -> None:
    decision = tk_slt_optimal_draft_length(0.9, 1.5)
    assert decision.gamma == 1 and decision.use_llm_only
    with pytest.raises(ValueError):
        tk_slt_gamma0(0.9, 1.5)
    with pytest.raises(ValueError):
        tk_slt_optimal_draft_length(1.0, 0.1)


def test_relative_cost_matches_paper_estimate() -> None:
    # TK-SLT §VI-B: b ≈ 0.07, c ≈ 0.23 for full logits → L = 0.3 (Table II, K = 32000).
    assert tk_slt_relative_cost(t_vocab=7.0, t_slm=23.0, t_llm=100.0) == pytest.approx(0.3)


# ---------------------------------------------------------------------------------------------
# Numeric γ chooser with a round trip (docs/math.md#split-verification)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alpha", "L"),
    [(a, L) for a, L, _ in TABLE_I_CELLS] + [(0.9, 0.05), (0.7, 0.15), (0.5, 0.02)],
)
def test_numeric_chooser_agrees_with_closed_form_without_rtt(alpha: float, L: float) -> None:
    t_llm = 0.05
    choice = choose_draft_length(
        alpha,
        t_draft=L * t_llm,
        t_rtt=0.0,
        t_verify=t_llm,
        t_cloud_step=t_llm,
        gamma_max=64,
    )
    closed = tk_slt_optimal_draft_length(alpha, L)
    assert choice.gamma == closed.gamma
    assert choice.speedup == pytest.approx(closed.speedup, rel=1e-12)
    if abs(closed.speedup - 1.0) > 1e-9:  # at the exact ties the flag is float rounding
        assert choice.use_cloud_only == closed.use_llm_only


def test_numeric_chooser_splits_draft_and_uplink_like_b_and_c() -> None:
    # c = T_SLM/T_LLM via t_draft, b = T_V/T_LLM via the uplink: same model as L = b + c.
    choice = choose_draft_length(
        0.8, t_draft=0.04, t_uplink_per_token=0.06, t_rtt=0.0, t_verify=1.0, t_cloud_step=1.0
    )
    assert choice.gamma == 6


def test_round_trip_makes_longer_drafts_worth_it() -> None:
    base = dict(t_draft=0.01, t_verify=0.05, t_cloud_step=0.05, gamma_max=64)
    gammas = [choose_draft_length(0.8, t_rtt=rtt, **base).gamma for rtt in (0.0, 0.05, 0.2, 1.0)]
    assert gammas == sorted(gammas) and gammas[-1] > gammas[0]


def test_slower_draft_picks_shorter_gamma_then_falls_back() -> None:
    common = dict(t_rtt=0.02, t_verify=(0.04, 0.002), t_cloud_step=0.04, t_cloud_network=0.001)
    choices = [choose_draft_length(0.8, t_draft=t, **common) for t in (0.001, 0.005, 0.01, 0.02)]
    gammas = [c.gamma for c in choices]
    assert gammas == sorted(gammas, reverse=True) and gammas[0] > gammas[-1]
    assert not choices[0].use_cloud_only
    too_slow = choose_draft_length(0.8, t_draft=0.05, **common)
    assert too_slow.use_cloud_only  # AS²: no γ beats cloud-only decoding
    assert too_slow.gamma == 1
    assert too_slow.speedup < 1


def test_verify_cost_forms_agree() -> None:
    kw = dict(t_draft=0.01, t_rtt=0.03, t_cloud_step=0.05)
    linear = choose_draft_length(0.7, t_verify=(0.05, 0.004), **kw)
    call = choose_draft_length(0.7, t_verify=lambda g: 0.05 + 0.004 * g, **kw)
    assert linear == call
    t = speculative_round_time(4, t_draft=0.01, t_rtt=0.03, t_verify=(0.05, 0.004))
    assert t == pytest.approx(4 * 0.01 + 0.03 + 0.05 + 0.016)


def test_perfect_and_useless_drafts() -> None:
    assert expected_tokens_per_round(1.0, 4) == 5
    assert expected_tokens_per_round(0.0, 4) == 1
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    # α = 1, free drafts: the longest allowed draft wins.
    assert (
        choose_draft_length(
            1.0, t_draft=0.0, t_rtt=0.1, t_verify=0.05, t_cloud_step=0.05, gamma_max=8
        ).gamma
        == 8
    )


# ---------------------------------------------------------------------------------------------
# PicoSpec eq. 9
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alpha", "gamma", "t_draft", "t_rtt", "t_verify", "expected"),
    [
        # α^γ = 0.25; max(0.1, 0.07) = 0.1; serial 0.17 → 0.025 + 0.1275
        (0.5, 2, 0.1, 0.05, 0.02, 0.1525),
        # α^γ = 0.512; max(0.03, 0.12) = 0.12; serial 0.15 → 0.06144 + 0.0732
        (0.8, 3, 0.03, 0.1, 0.02, 0.13464),
        # always accepted: fully overlapped
        (1.0, 5, 0.2, 0.1, 0.05, 0.2),
        # never accepted: fully serial
        (0.0, 5, 0.2, 0.1, 0.05, 0.35),
    ],
)
def test_picospec_expected_round_time(alpha, gamma, t_draft, t_rtt, t_verify, expected) -> None:
    assert picospec_expected_round_time(alpha, gamma, t_draft, t_rtt, t_verify) == pytest.approx(
        expected
    )


def test_picospec_vectorised() -> None:
    out = picospec_expected_round_time(np.array([0.0, 1.0]), 4, 0.2, 0.1, 0.05)
    np.testing.assert_allclose(out, [0.35, 0.2])


# ---------------------------------------------------------------------------------------------
# DRAGON scheduler (eq. 6–8) and the appendix A.3 continuous accept/reject cases
# ---------------------------------------------------------------------------------------------

# Appendix A.3, l aggregates. Each case repeats forever, so α^s ∈ {0, 1}. Costs are the ones
# of Figures 10–13; "paper_z_local" is the per-token latency the appendix derives for l;
# "side" is argmin of eq. (7) for l and for r (ties stay on l).
A3_CASES = [
    # id, α^l, α^r, c^l_trans, c^r_trans, c^l_dec, c^r_dec, paper z^l, z^r, side
    # i) reject x^l, accept x^r: z^l = max(c^l_dec, c^r_dec); moving to r would expose the
    #    round trip to the always-rejected l drafts.
    ("i_reject_l_accept_r", 0.0, 1.0, 1.2, 1.8, 1.0, 1.5, 1.5, 4.0, "local"),
    # ii) accept x^l, reject x^r: z^l = max(c^l_dec, c^l_trans + c^r_dec + c^r_trans) = 4.5;
    #     aggregating on r turns it into case i) seen from r: max(2, 2) = 2.
    ("ii_accept_l_reject_r", 1.0, 0.0, 1.5, 1.0, 2.0, 2.0, 4.5, 2.0, "remote"),
    # iii) accept both: max of the decode times on either side — a tie, so stay.
    ("iii_accept_both", 1.0, 1.0, 1.5, 1.8, 1.0, 1.5, 1.5, 1.5, "local"),
    # iv) reject both: z^l = max(c^l_dec, c^l_trans + c^r_dec + c^r_trans) = 4.3; on r it would
    #     be max(1, 2 + 3.3) = 5.3 — the slower decoder should aggregate.
    ("iv_reject_both", 0.0, 0.0, 1.5, 1.8, 2.0, 1.0, 4.3, 5.3, "local"),
    # Asymmetric variations: equal decoders, slow link → aggregate where the *other* side's
    # drafts are always accepted (§5.1: "favor the opposite side").
    ("remote_always_accepted", 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, "local"),
    ("remote_always_rejected", 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 3.0, 1.0, "remote"),
    # Bottleneck decoder aggregates whatever the acceptances (Δz signs in §5.1).
    ("local_bottleneck_all_rejected", 0.0, 0.0, 0.5, 0.5, 10.0, 1.0, 10.0, 11.0, "local"),
    ("remote_bottleneck_all_rejected", 0.0, 0.0, 0.5, 0.5, 1.0, 10.0, 11.0, 10.0, "remote"),
    ("remote_bottleneck_remote_accepted", 1.0, 1.0, 0.5, 0.5, 1.0, 10.0, 10.0, 10.0, "local"),
]


@pytest.mark.parametrize(
    ("alpha_l", "alpha_r", "t_l", "t_r", "d_l", "d_r", "z_l", "z_r", "side"),
    [c[1:] for c in A3_CASES],
    ids=[c[0] for c in A3_CASES],
)
def test_dragon_appendix_a3_cases(alpha_l, alpha_r, t_l, t_r, d_l, d_r, z_l, z_r, side) -> None:
    choice = dragon_choose_aggregator(alpha_l, alpha_r, d_l, d_r, t_l, t_r)
    assert choice.z_local == pytest.approx(z_l)
    assert choice.z_remote == pytest.approx(z_r)
    assert choice.side == side
    # eq. (8) gives the same difference
    diff = dragon_latency_difference(alpha_l, alpha_r, d_l, d_r, t_l + t_r)
    assert diff == pytest.approx(z_l - z_r)


def test_dragon_a3_case_formulas() -> None:
    # The per-token latencies the appendix states for each continuous pattern.
    d_l, d_r, t_l, t_r = 1.3, 0.7, 0.4, 0.9
    assert dragon_per_token_latency(1.0, d_l, d_r, t_l, t_r) == max(d_l, d_r)  # i, iii
    assert dragon_per_token_latency(0.0, d_l, d_r, t_l, t_r) == pytest.approx(
        max(d_l, t_l + d_r + t_r)
    )  # ii, iv


@pytest.mark.parametrize(
    ("alpha_l", "alpha_r", "d_l", "d_r", "t_l", "t_r", "z_l", "z_r", "side"),
    [
        # z^l = 0.5·max(1, 2) + 0.5·max(1, 2 + 1.2) = 2.6; z^r = 0.25·2 + 0.75·max(2, 2.2) = 2.15
        (0.25, 0.5, 1.0, 2.0, 0.5, 0.7, 2.6, 2.15, "remote"),
        # z^l = 0.9·max(0.02, 0.2) + 0.1·max(0.02, 0.2 + 0.3) = 0.23
        # z^r = 0.6·0.2 + 0.4·max(0.2, 0.02 + 0.3) = 0.248
        (0.6, 0.9, 0.02, 0.2, 0.1, 0.2, 0.23, 0.248, "local"),
        # device 50 ms, cloud 20 ms, rtt 300 ms, cloud drafts 80 %, device drafts 40 %:
        # z^l = 0.8·0.05 + 0.2·0.32 = 0.104; z^r = 0.4·0.05 + 0.6·0.35 = 0.23
        (0.4, 0.8, 0.05, 0.02, 0.15, 0.15, 0.104, 0.23, "local"),
    ],
)
def test_dragon_hand_computed(alpha_l, alpha_r, d_l, d_r, t_l, t_r, z_l, z_r, side) -> None:
    choice = dragon_choose_aggregator(alpha_l, alpha_r, d_l, d_r, t_l, t_r)
    assert (choice.z_local, choice.z_remote) == (pytest.approx(z_l), pytest.approx(z_r))
    assert choice.side == side


def test_dragon_eq8_matches_eq7_everywhere() -> None:
    rng = np.random.default_rng(7)
    for _ in range(2000):
        a_l, a_r = rng.random(2)
        d_l, d_r, t_l, t_r = rng.random(4) * np.array([3, 3, 1, 1])
        z_l = dragon_per_token_latency(a_r, d_l, d_r, t_l, t_r)
        z_r = dragon_per_token_latency(a_l, d_r, d_l, t_r, t_l)
        diff = dragon_latency_difference(a_l, a_r, d_l, d_r, t_l + t_r)
        assert diff == pytest.approx(z_l - z_r, abs=1e-12)


def test_dragon_symmetry() -> None:
    a = dragon_choose_aggregator(0.3, 0.7, 0.05, 0.08, 0.1, 0.12)
    b = dragon_choose_aggregator(0.7, 0.3, 0.08, 0.05, 0.12, 0.1)
    assert (a.z_local, a.z_remote) == (b.z_remote, b.z_local)


def _sample_step(x, p_a, p_b, eta_b, rng):
    """DRAGON Algorithm 1's Sample(x, p_a, p_b, η_b), vectorised over draws; returns (token,
    kept)."""
    pa, pb = p_a[x], p_b[x]
    u = rng.random(x.size)
    reject = (pa > pb) & (u < eta_b * (1 - pb / pa))
    residual = np.maximum(0.0, p_b - p_a)
    cdf = np.cumsum(residual / residual.sum())
    redraw = np.minimum(np.searchsorted(cdf, rng.random(x.size), side="right"), p_a.size - 1)
    return np.where(reject, redraw, x), ~reject


def test_dragon_eq5_acceptance_counts_the_coin() -> None:
    """Monte Carlo of Algorithm 1 with the coin: P(x^l is the target) is eq. (5), and the rate
    at which x^l merely survives its own Sample is higher (what the profiler must not use)."""
    rng = np.random.default_rng(0)
    p_l = np.array([0.5, 0.2, 0.2, 0.1, 0.0])
    p_r = np.array([0.1, 0.3, 0.1, 0.2, 0.3])
    eta_r = 0.6
    n = 400_000
    x_l = rng.choice(5, size=n, p=p_l)
    x_r = rng.choice(5, size=n, p=p_r)
    xt_l, kept_l = _sample_step(x_l, p_l, p_r, eta_r, rng)
    xt_r, _ = _sample_step(x_r, p_r, p_l, 1 - eta_r, rng)
    target = np.where(rng.random(n) < 0.5, xt_l, xt_r)
    accepted = (x_l == target).mean()
    expected = dragon_expected_acceptance(p_l, p_r, eta_r)
    assert accepted == pytest.approx(expected, abs=4 * math.sqrt(0.25 / n))
    assert kept_l.mean() > expected + 0.1
    # and the target itself follows η^l p^l + η^r p^r
    hist = np.bincount(target, minlength=5) / n
    np.testing.assert_allclose(hist, (1 - eta_r) * p_l + eta_r * p_r, atol=0.005)


def test_dragon_eq5_identical_sides_always_accept() -> None:
    p = np.array([0.25, 0.25, 0.5])
    # δ = 0: first term ½; second ½·Σp² — only the coin keeps it below 1 when tokens differ.
    assert dragon_expected_acceptance(p, p, 0.5) == pytest.approx(0.5 + 0.5 * np.dot(p, p))
    one_hot = np.array([0.0, 1.0, 0.0])
    assert dragon_expected_acceptance(one_hot, one_hot, 0.3) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
# Profiler
# ---------------------------------------------------------------------------------------------


def test_least_squares_recovers_decode_latency_line() -> None:
    rng = np.random.default_rng(3)
    t = np.arange(256, 4096, 16)
    c = 0.021 + 3.5e-6 * t + rng.normal(0, 2e-4, t.size)
    fit = fit_decode_latency(t, c)
    assert fit.intercept == pytest.approx(0.021, abs=2e-4)
    assert fit.slope == pytest.approx(3.5e-6, rel=0.02)
    assert fit.predict(1000) == pytest.approx(0.021 + 3.5e-3, abs=3e-4)
    exact = fit_decode_latency([1, 2, 3], [3.0, 5.0, 7.0])
    assert (exact.intercept, exact.slope) == (pytest.approx(1.0), pytest.approx(2.0))


def test_ewma_slope_tracks_a_changed_slope() -> None:
    rng = np.random.default_rng(4)
    grid = np.arange(100, 2000, 10)
    offline = fit_decode_latency(grid, 0.02 + 2e-6 * grid)
    est = DecodeSlopeEstimator.from_fit(offline, grid, weight=0.05)
    assert est.slope == pytest.approx(2e-6)
    assert est.predict(500) == pytest.approx(0.021)
    # at runtime the device is slower per context token (e.g. thermal throttling)
    for t in rng.integers(100, 2000, size=600):
        est.update(int(t), 0.02 + 5e-6 * t + rng.normal(0, 1e-4))
    assert est.slope == pytest.approx(5e-6, rel=0.03)
    assert est.intercept == offline.intercept  # frozen


def test_online_profiler_link_and_acceptance() -> None:
    rng = np.random.default_rng(5)
    prof = OnlineProfiler(weight=0.02)
    for _ in range(800):
        prof.update_rtt(0.08 + rng.normal(0, 0.005))
        nbytes = int(rng.integers(100, 10_000))
        prof.update_bandwidth("up", nbytes, nbytes / 1.25e6)  # 10 Mbit/s
        prof.update_bandwidth("down", nbytes, nbytes / 5e6)
        prof.update_acceptance("cloud", bool(rng.random() < 0.7))
    assert prof.rtt == pytest.approx(0.08, abs=0.003)
    assert prof.bandwidth["up"] == pytest.approx(1.25e6)
    assert prof.bandwidth["down"] == pytest.approx(5e6)
    assert prof.acceptance["cloud"] == pytest.approx(0.7, abs=0.08)
    delay = prof.transmission_delay({"up": 1250, "down": 5000})
    assert delay == pytest.approx(prof.rtt + 0.001 + 0.001)


def test_online_profiler_first_sample_initialises_and_decode_side() -> None:
    prof = OnlineProfiler(weight=0.5)
    assert prof.update_rtt(0.1) == 0.1
    assert prof.update_rtt(0.2) == pytest.approx(0.15)
    fit = fit_decode_latency([10, 20], [1.0, 2.0])
    prof.decode["device"] = DecodeSlopeEstimator.from_fit(fit, [10, 20], weight=0.5)
    assert prof.update_decode("device", 10, 1.0) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        OnlineProfiler().transmission_delay({})
