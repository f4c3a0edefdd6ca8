"""Exactness of the decoding math (docs/math.md: speculative verification, split, RAPID, DRAGON).

Each sampler is run ≥ 100,000 times at a fixed seed and its output histogram is compared with the
exact target by a χ² test at significance ALPHA; negative controls (the errors of
docs/math.md#errors-in-the-papers) must
be rejected by the same test, which proves the test can fail."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from collab.dragon.aggregation import (
    aggregate_sample,
    local_mixture,
    side_etas,
    side_weight,
    speculative_aggregation,
)
from collab.sampling import GREEDY, distribution, sample_from, softmax
from collab.verification import (
    accept_probability,
    dense_from_top_k,
    dsd_round,
    dssd_cloud_verify,
    dssd_device_resample,
    picospec_residual_topk,
    picospec_topk_bias_tv,
    picospec_topk_output,
    rapid_residual,
    rapid_target,
    rapid_verify_one,
    residual,
    sample_draft_top_k,
    speculative_round,
    tkslt_cloud_verify,
    top_k_truncate,
    verify_one,
)

ALPHA = 1e-3  # significance of every χ² test in this file
N = 100_000  # draws per histogram
MIN_EXPECTED = 5.0  # χ² bins with a smaller expected count are merged
VOCABS = (8, 50)
GAMMA = 2
K = 4  # top-K of the TK-SLT / PicoSpec tests (< both vocabularies)


# --- helpers ---------------------------------------------------------------------------------


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """χ² goodness of fit of counts against probs. Bins with expected < MIN_EXPECTED are merged
    into one; a count where probs == 0 (impossible under the target) gives p-value 0."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = probs * n
    order = np.argsort(expected)
    expected, counts = expected[order], counts[order]
    cut = int(np.count_nonzero(expected < MIN_EXPECTED))  # the smallest bins, merged into one
    if cut:
        while expected[:cut].sum() < MIN_EXPECTED and cut < expected.size:
            cut += 1
        expected = np.concatenate([[expected[:cut].sum()], expected[cut:]])
        counts = np.concatenate([[counts[:cut].sum()], counts[cut:]])
    keep = expected > 0
    return float(stats.chisquare(counts[keep], expected[keep]).pvalue)


def hist(tokens, size: int) -> np.ndarray:
    return np.bincount(np.asarray(tokens, dtype=np.int64), minlength=size)


def draw_many(probs: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n independent draws from probs at once (inverse CDF, as collab.sampling.sample_from)."""
    cdf = np.cumsum(probs)
    out = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
    return np.minimum(out, probs.size - 1)


def random_pq(v: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.ones(v)), rng.dirichlet(np.ones(v))


def rows(v: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).dirichlet(np.ones(v), size=n)


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.asarray(a, float) - np.asarray(b, float)).sum())


# --- 5.1 single position ---------------------------------------------------------------------


def test_residual_is_normalised_positive_part_and_robust_when_p_equals_q():
    p, q = random_pq(8, 0)
    r = residual(p, q)
    expected = np.maximum(p - q, 0)
    np.testing.assert_allclose(r, expected / expected.sum())
    np.testing.assert_allclose(residual(p, p), p, rtol=1e-12)  # empty residual: p, no NaN
    assert np.isfinite(residual(p, p.copy())).all()


def test_accept_probability_is_p_over_q():
    assert accept_probability(0.2, 0.4) == pytest.approx(0.5)
    assert accept_probability(0.4, 0.2) == 1.0
    assert accept_probability(0.0, 0.3) == 0.0


@pytest.mark.parametrize(
    ("p_x", "q_x"),
    [(0.3, 0.0), (0.0, 0.0), (0.3, -0.1), (np.nan, 0.5), (0.5, np.nan), (-0.1, 0.5), (np.inf, 0.5)],
)
def test_accept_probability_refuses_what_no_sampler_produces(p_x, q_x):
    """q(x) = 0 used to give 1 (any token through) and a NaN p(x) gave min(1, NaN) = 1."""
    with pytest.raises(ValueError):
        accept_probability(p_x, q_x)


@pytest.mark.parametrize("v", VOCABS)
def test_single_position_output_is_p(v):
    p, q = random_pq(v, 10 + v)
    rng = np.random.default_rng(1)
    drafts = draw_many(q, N, rng)
    out = [verify_one(x, p, q, rng)[1] for x in drafts]
    assert chi2_pvalue(hist(out, v), p) >= ALPHA


def _verify_one_swapped(x, p, q, rng):
    """The DSSD paper's acceptance min(1, q/p) (docs/math.md#errors-in-the-papers) — a negative
    control only."""
    if rng.random() < min(1.0, q[x] / p[x]):
        return True, int(x)
    return False, int(rng.choice(p.size, p=residual(p, q)))


def test_negative_control_swapped_acceptance_single_position_is_rejected():
    p, q = random_pq(8, 18)
    rng = np.random.default_rng(2)
    out = [_verify_one_swapped(x, p, q, rng)[1] for x in draw_many(q, N, rng)]
    assert chi2_pvalue(hist(out, 8), p) < ALPHA


def test_greedy_target_always_outputs_argmax():
    v = 50
    rng = np.random.default_rng(3)
    logits = rng.normal(size=v)
    p = distribution(logits, GREEDY)  # temperature 0: one-hot
    q = rows(v, 1, 4)[0]
    best = int(np.argmax(logits))
    assert {verify_one(x, p, q, rng)[1] for x in draw_many(q, 5_000, rng)} == {best}
    # a greedy round: every output token is the argmax of its (one-hot) row
    P = np.stack([distribution(rng.normal(size=v), GREEDY) for _ in range(GAMMA + 1)])
    Q = rows(v, GAMMA, 5)
    for _ in range(2_000):
        drafts = np.array([draw_many(Q[i], 1, rng)[0] for i in range(GAMMA)])
        n, tok = speculative_round(drafts, P, Q, rng)
        assert all(P[i, drafts[i]] == 1.0 for i in range(n))
        assert P[n, tok] == 1.0
        j, bonus, rej = dssd_cloud_verify(drafts, Q[np.arange(GAMMA), drafts], P, rng)
        tok2 = bonus if rej is None else dssd_device_resample(P[j], Q[j], rng)
        assert P[j, tok2] == 1.0


# --- 5.1 / 5.2 multi-token rounds: standard, DSD, DSSD, TK-SLT --------------------------------


class Mode:
    """A way to run one speculative round from absolute position t, for position-independent
    rows P_rows[t] (target) and D_rows[t] (the distribution drafts are sampled from)."""

    def __init__(self, name: str, P_rows: np.ndarray, Q_rows: np.ndarray):
        self.name, self.P_rows = name, P_rows
        v = P_rows.shape[1]
        if name == "tkslt":
            topk = [top_k_truncate(q, K) for q in Q_rows]
            self.D_rows = np.stack([dense_from_top_k(i, pr, v) for i, pr in topk])
            self.ids = np.stack([i for i, _ in topk])  # [positions, K], what is uplinked
            self.probs = np.stack([pr for _, pr in topk])
        else:
            self.D_rows = Q_rows

    def round(self, drafts: np.ndarray, t: int, rng: np.random.Generator) -> tuple[int, int]:
        P = self.P_rows[t : t + GAMMA + 1]
        Q = self.D_rows[t : t + GAMMA]
        if self.name == "standard":
            return speculative_round(drafts, P, Q, rng)
        if self.name == "dsd":
            return dsd_round(drafts, P, Q, rng)
        if self.name == "dssd":
            q_x = Q[np.arange(GAMMA), drafts]
            n, bonus, rejected = dssd_cloud_verify(drafts, q_x, P, rng)
            if rejected is None:
                return n, bonus
            return n, dssd_device_resample(P[rejected], Q[rejected], rng)
        if self.name == "tkslt":
            window = slice(t, t + GAMMA)
            return tkslt_cloud_verify(drafts, self.ids[window], self.probs[window], P, rng)
        raise AssertionError(self.name)


def first_two_tokens(mode: Mode, n: int, seed: int) -> np.ndarray:
    """Run rounds until two tokens are out, n times; returns [n, 2] output tokens."""
    rng = np.random.default_rng(seed)
    # drafts for a round starting at position 0 and at position 1, drawn in bulk
    drafts = {
        t: np.stack([draw_many(mode.D_rows[t + i], n, rng) for i in range(GAMMA)], axis=1)
        for t in (0, 1)
    }
    out = np.empty((n, 2), dtype=np.int64)
    for k in range(n):
        d = drafts[0][k]
        acc, tok = mode.round(d, 0, rng)
        if acc >= 1:
            out[k] = d[0], (d[1] if acc >= 2 else tok)
        else:
            out[k, 0] = tok
            acc2, tok2 = mode.round(drafts[1][k], 1, rng)
            out[k, 1] = drafts[1][k][0] if acc2 >= 1 else tok2
    return out


MODES = ("standard", "dsd", "dssd", "tkslt")


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("name", MODES)
def test_round_output_is_p(name, v):
    """First output token ~ p_1; for |V| = 8 the first two tokens ~ p_1(x_1)·p_2(x_2)."""
    P_rows = rows(v, GAMMA + 2, 100 + v)
    Q_rows = rows(v, GAMMA + 2, 200 + v)
    out = first_two_tokens(Mode(name, P_rows, Q_rows), N, seed=7)
    assert chi2_pvalue(hist(out[:, 0], v), P_rows[0]) >= ALPHA
    if v == 8:
        joint = np.outer(P_rows[0], P_rows[1])
        assert chi2_pvalue(hist(out[:, 0] * v + out[:, 1], v * v), joint) >= ALPHA


@pytest.mark.parametrize("v", VOCABS)
def test_bonus_token_is_drawn_from_the_last_row(v):
    P = rows(v, GAMMA + 1, 300 + v)
    Q = P[:GAMMA] * 0.7 + rows(v, GAMMA, 301) * 0.3  # close to P: many full acceptances
    rng = np.random.default_rng(8)
    drafts = np.stack([draw_many(Q[i], N, rng) for i in range(GAMMA)], axis=1)
    bonus = [t for d in drafts for n, t in [speculative_round(d, P, Q, rng)] if n == GAMMA]
    assert len(bonus) > N // 3
    assert chi2_pvalue(hist(bonus, v), P[GAMMA]) >= ALPHA


def _dssd_cloud_verify_swapped(drafts, q_of_drafts, P, rng):
    """DSSD Algorithm 2 as printed: r_j < min(1, q_j(x_j)/p_j(x_j)) — a negative control only."""
    for j in range(len(drafts)):
        if not rng.random() < min(1.0, q_of_drafts[j] / P[j, drafts[j]]):
            return j, None, j
    return len(drafts), int(rng.choice(P.shape[1], p=P[-1])), None


def test_negative_control_dssd_swapped_acceptance_is_rejected():
    v = 8
    P, Q = rows(v, GAMMA + 1, 400), rows(v, GAMMA, 401)
    rng = np.random.default_rng(9)
    drafts = np.stack([draw_many(Q[i], N, rng) for i in range(GAMMA)], axis=1)
    first = np.empty(N, dtype=np.int64)
    for k, d in enumerate(drafts):
        j, _, _ = _dssd_cloud_verify_swapped(d, Q[np.arange(GAMMA), d], P, rng)
        first[k] = d[0] if j > 0 else dssd_device_resample(P[0], Q[0], rng)
    assert chi2_pvalue(hist(first, v), P[0]) < ALPHA


def test_dssd_cloud_verify_refuses_impossible_q():
    P = rows(8, GAMMA + 1, 1)
    rng = np.random.default_rng(0)
    for bad in ([0.0, 0.5], [0.5, 1.5], [np.nan, 0.5]):
        with pytest.raises(ValueError):
            dssd_cloud_verify(np.array([1, 2]), np.array(bad), P, rng)


# --- TK-SLT ----------------------------------------------------------------------------------


def test_top_k_truncate_and_draft_sampling():
    v = 50
    q = rows(v, 1, 500)[0]
    ids, probs = top_k_truncate(q, K)
    assert set(ids) == set(np.argsort(q)[-K:]) and probs.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(probs, q[ids] / q[ids].sum())
    assert list(probs) == sorted(probs, reverse=True)
    rng = np.random.default_rng(10)
    draws = [sample_draft_top_k(ids, probs, rng) for _ in range(N)]
    assert chi2_pvalue(hist(draws, v), dense_from_top_k(ids, probs, v)) >= ALPHA
    full_ids, full_probs = top_k_truncate(q, v + 3)
    assert full_ids.size == v and np.allclose(dense_from_top_k(full_ids, full_probs, v), q)


def test_tkslt_refuses_draft_outside_transmitted_top_k():
    v = 50
    P, Q = rows(v, GAMMA + 1, 600), rows(v, GAMMA, 601)
    topk = [top_k_truncate(q, K) for q in Q]
    ids = np.stack([t[0] for t in topk])
    probs = np.stack([t[1] for t in topk])
    outside = int(np.setdiff1d(np.arange(v), ids[0])[0])
    with pytest.raises(ValueError, match="outside"):
        tkslt_cloud_verify(np.array([outside, ids[1, 0]]), ids, probs, P, np.random.default_rng())


@pytest.mark.parametrize("v", VOCABS)
def test_negative_control_draft_outside_transmitted_top_k_is_rejected(v):
    """Drafts sampled from the full Q, verified against the top-K-truncated Q the cloud
    rebuilt: a draft outside the support has q = 0. The old rule accepted it (min(1, p/0)
    taken as 1) — biased, as this test shows; the verifiers now refuse it."""
    P_rows = rows(v, GAMMA + 2, 700 + v)
    Q_rows = rows(v, GAMMA + 2, 800 + v)
    truncated = np.stack([dense_from_top_k(*top_k_truncate(q, K), v) for q in Q_rows])
    rng = np.random.default_rng(11)
    drafts = draw_many(Q_rows[0], N, rng)
    outside = next(int(x) for x in drafts if truncated[0, x] == 0)
    with pytest.raises(ValueError, match="q\\(x\\)"):
        verify_one(outside, P_rows[0], truncated[0], rng)

    def old_accept(p_x: float, q_x: float) -> float:
        return 1.0 if q_x <= 0 else min(1.0, p_x / q_x)

    first = [
        x
        if rng.random() < old_accept(P_rows[0, x], truncated[0, x])
        else sample_from(residual(P_rows[0], truncated[0]), rng)
        for x in drafts
    ]
    assert chi2_pvalue(hist(first, v), P_rows[0]) < ALPHA


# --- PicoSpec top-K P downlink (approximate) --------------------------------------------------


def test_picospec_bias_is_zero_for_full_vocabulary_and_positive_for_small_k():
    for v in VOCABS:
        p, q = random_pq(v, 900 + v)
        assert picospec_topk_bias_tv(p, q, v) < 1e-12
        np.testing.assert_allclose(picospec_topk_output(p, q, v), p, atol=1e-12)
        assert picospec_topk_bias_tv(p, q, 2) > 1e-3
        out = picospec_topk_output(p, q, 2)
        assert out.sum() == pytest.approx(1.0) and (out >= 0).all()


def test_picospec_bias_matches_empirical_histogram():
    v, k = 8, 2
    p, q = random_pq(v, 950)
    ids = np.argsort(p)[-k:]
    rng = np.random.default_rng(12)
    out = np.empty(N, dtype=np.int64)
    for n, x in enumerate(draw_many(q, N, rng)):
        accepted, _ = verify_one(x, p, q, rng)
        if accepted:
            out[n] = x
        else:  # the device resamples from the top-K of P it received
            r = picospec_residual_topk(ids, p[ids], q)
            out[n] = draw_many(r, 1, rng)[0]
    counts = hist(out, v)
    predicted = picospec_topk_output(p, q, k)
    assert chi2_pvalue(counts, predicted) >= ALPHA
    assert chi2_pvalue(counts, p) < ALPHA  # and it really is biased
    assert tv(counts / N, p) == pytest.approx(picospec_topk_bias_tv(p, q, k), abs=0.01)


# --- RAPID -----------------------------------------------------------------------------------


def test_rapid_target_mask_and_eta_zero():
    rng = np.random.default_rng(13)
    z, q = rng.normal(size=50) * 2, rows(50, 1, 14)[0]
    np.testing.assert_array_equal(rapid_target(z, q, 0.0, T=0.7), softmax(z, 0.7))
    p, p_hat = softmax(z), rapid_target(z, q, 3.0)
    mask = q >= 0.1 * q.max()
    # outside the mask the logits are p's: the ratio p̂/p is one constant there
    ratio = p_hat[~mask] / p[~mask]
    np.testing.assert_allclose(ratio, ratio[0])
    expected = softmax(np.log(p) + np.where(mask, 3.0 * (q - p), 0.0))
    np.testing.assert_allclose(p_hat, expected)
    r = rapid_residual(p, p_hat, q)
    m = np.maximum(np.maximum(p - q, p - p_hat), 0)
    np.testing.assert_allclose(r, m / m.sum())


@pytest.mark.parametrize("v", VOCABS)
def test_rapid_eta_zero_is_exact(v):
    rng = np.random.default_rng(15)
    z, q = rng.normal(size=v) * 2, rows(v, 1, 16 + v)[0]
    p = softmax(z)
    p_hat = rapid_target(z, q, 0.0)
    out = [rapid_verify_one(x, p, p_hat, q, rng)[1] for x in draw_many(q, N, rng)]
    assert chi2_pvalue(hist(out, v), p) >= ALPHA


def test_rapid_acceptance_and_agreement_with_draft_rise_with_eta():
    v = 8
    rng = np.random.default_rng(17)
    z, q = rng.normal(size=v) * 2, rng.dirichlet(np.ones(v))
    p = softmax(z)
    accept_rates, agreement, tv_to_q = [], [], []
    for eta in (0.0, 0.5, 1.0, 2.0):
        p_hat = rapid_target(z, q, eta)
        drafts = draw_many(q, N, rng)
        res = [rapid_verify_one(x, p, p_hat, q, rng) for x in drafts]
        acc = np.array([a for a, _ in res])
        out = np.array([t for _, t in res])
        accept_rates.append(acc.mean())
        agreement.append((out == drafts).mean())
        tv_to_q.append(tv(hist(out, v) / N, q))
    assert np.all(np.diff(accept_rates) > 0), accept_rates
    assert np.all(np.diff(agreement) > 0), agreement
    assert np.all(np.diff(tv_to_q) < 0), tv_to_q  # the output leans toward the drafter


# --- DRAGON ----------------------------------------------------------------------------------


def test_local_mixture_side_weights_and_union_of_documents():
    rng = np.random.default_rng(18)
    v = 50
    docs_l, docs_r = rows(v, 3, 19), rows(v, 5, 20)
    r_l, r_r = rng.normal(size=3) * 3 + 500, rng.normal(size=5) * 3 + 500  # large: stability
    pl, pr = local_mixture(docs_l, r_l), local_mixture(docs_r, r_r)
    w = np.exp(r_l - r_l.max())
    np.testing.assert_allclose(pl, (w / w.sum()) @ docs_l)
    # the log form of docs/math.md#dragon: logsumexp_d [log softmax(R) + log p(x|d)]
    log_form = np.logaddexp.reduce(
        (r_l - np.logaddexp.reduce(r_l))[:, None] + np.log(docs_l), axis=0
    )
    np.testing.assert_allclose(np.log(pl), log_form)
    h_l, h_r = side_weight(r_l), side_weight(r_r)
    assert np.isfinite(h_l) and h_l == pytest.approx(r_l.max() + np.log(w.sum()))
    eta_l, eta_r = side_etas(h_l, h_r)
    assert eta_l + eta_r == pytest.approx(1.0)
    # η^l p^l + η^r p^r = mixture over all documents of both sides (DRAGON eq. (2), (4))
    all_scores = np.concatenate([r_l, r_r])
    w_all = np.exp(all_scores - all_scores.max())
    both = (w_all / w_all.sum()) @ np.vstack([docs_l, docs_r])
    np.testing.assert_allclose(eta_l * pl + eta_r * pr, both)
    # a token every document gives probability 0 keeps probability 0, no NaN
    docs = docs_l.copy()
    docs[:, 0] = 0.0
    mixed = local_mixture(docs, r_l)
    assert mixed[0] == 0.0 and np.isfinite(mixed).all()


@pytest.mark.parametrize("v", [8])
def test_aggregate_sample_gives_interpolation(v):
    pa, pb = random_pq(v, 21)
    rng = np.random.default_rng(22)
    eta_b = 0.3
    out = [aggregate_sample(x, pa, pb, eta_b, rng) for x in draw_many(pa, N, rng)]
    assert chi2_pvalue(hist(out, v), (1 - eta_b) * pa + eta_b * pb) >= ALPHA


def _aggregation_prefer_accepted(x_l, p_l, x_r, p_r, eta_l, eta_r, rng):
    """DRAGON without the coin: prefer a draft that survived Sample — a negative control only."""
    xt_l = aggregate_sample(x_l, p_l, p_r, eta_r, rng)
    xt_r = aggregate_sample(x_r, p_r, p_l, eta_l, rng)
    if xt_l == x_l:
        target = xt_l
    elif xt_r == x_r:
        target = xt_r
    else:
        target = xt_l if rng.random() <= 0.5 else xt_r
    return target, target == x_l, target == x_r


def run_aggregation(fn, v: int, eta_l: float, seed: int):
    p_l, p_r = random_pq(v, seed)
    rng = np.random.default_rng(seed + 1)
    xs_l, xs_r = draw_many(p_l, N, rng), draw_many(p_r, N, rng)
    res = [fn(a, p_l, b, p_r, eta_l, 1.0 - eta_l, rng) for a, b in zip(xs_l, xs_r, strict=True)]
    target = np.array([r[0] for r in res])
    acc_l = np.array([r[1] for r in res])
    acc_r = np.array([r[2] for r in res])
    assert np.array_equal(acc_l, target == xs_l) and np.array_equal(acc_r, target == xs_r)
    return target, eta_l * p_l + (1.0 - eta_l) * p_r


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("eta_l", [0.2, 0.5, 0.9])
def test_speculative_aggregation_output_is_mixture(v, eta_l):
    target, mixture = run_aggregation(speculative_aggregation, v, eta_l, seed=23 + v)
    assert chi2_pvalue(hist(target, v), mixture) >= ALPHA


def test_negative_control_aggregation_without_coin_is_rejected():
    target, mixture = run_aggregation(_aggregation_prefer_accepted, 8, 0.5, seed=31)
    assert chi2_pvalue(hist(target, 8), mixture) < ALPHA


def test_speculative_aggregation_refuses_weights_not_summing_to_one():
    p_l, p_r = random_pq(8, 0)
    with pytest.raises(ValueError):
        speculative_aggregation(0, p_l, 1, p_r, 0.7, 0.7, np.random.default_rng())


def test_dense_from_top_k_refuses_malformed_lists():
    ok = dense_from_top_k(np.array([[3, 1], [0, 2]]), np.array([[0.5, 0.25], [1.0, 1.0]]), 5)
    np.testing.assert_allclose(ok, [[0, 1 / 3, 0, 2 / 3, 0], [0.5, 0, 0.5, 0, 0]])
    for ids, probs in (
        ([5, 1], [0.5, 0.5]),  # id outside the vocabulary
        ([-1, 1], [0.5, 0.5]),
        ([1, 1], [0.5, 0.5]),  # duplicate
        ([0, 1], [0.5, -0.1]),  # negative
        ([0, 1], [np.nan, 0.5]),
        ([0, 1], [0.0, 0.0]),
        ([0, 1], [0.5]),  # shape mismatch
    ):
        with pytest.raises(ValueError):
            dense_from_top_k(np.array(ids), np.array(probs), 5)
