"""The decoding math on the inputs that hid an audit's findings (issue 15): zeros, ties,
disjoint supports, one-hot and near-one-hot rows, rows below float16's range, models whose
rows depend on the prefix, several positions per round — run through the callers' path
(variant → frame → bytes → frame → judge → verdict → bytes → correction), not only the math
functions. Each regression test here failed before its fix; the multi-position tests and
their negative control hold the properties the old tests sampled too gently to see."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from scipy import stats

from collab.dragon.aggregation import side_etas
from collab.dragon.ledger import aggregate
from collab.protocol import (
    DragonDraft,
    DssdDraft,
    ProtocolError,
    TopKDraft,
    Verdict,
    decode,
    encode,
)
from collab.sampling import GREEDY, SamplingParams, distribution, sample_from
from collab.scheduling import tk_slt_optimal_draft_length, tk_slt_speedup
from collab.variants import get_variant
from collab.verification import (
    rapid_residual,
    rapid_round,
    rapid_shift,
    rapid_target,
    speculative_round,
    tkslt_cloud_verify,
    verify_one,
)

VOCAB = 151_936
EXACT = ["tk-slt", "dssd", "dsd"]


def wire(msg):
    """What the peer reads: the frame through the codec (which runs every check)."""
    return decode(encode(msg))


# ---- DSSD: P_j must not lose the ids below float16's range ----------------------------------


def below_float16_row() -> tuple[np.ndarray, np.ndarray]:
    """P and the device's Q at Qwen's vocabulary, so that half of the residual
    norm(max(0, P − Q)) sits on 151,934 ids of p ≈ 3e-8 each, which float16 rounds to 0."""
    tail = 0.0045 / (VOCAB - 2)
    p = np.full(VOCAB, tail)
    p[1] = 0.5 + 0.0045  # B: p − q = 0.0045 (the other half of the residual)
    p[0] = 1.0 - p[1:].sum()  # A
    q = np.zeros(VOCAB)
    q[:2] = 0.5
    assert np.float16(tail) == 0 and abs(p.sum() - 1) < 1e-12
    return p, q


def test_dssd_rejection_verdict_keeps_p_below_float16_through_the_judge():
    """The cloud's judge at a certain rejection (p(x) = 0): the verdict it sends carries the
    tail. In float16 it carried two nonzero ids of 151,936."""
    p, _ = below_float16_row()
    p_reject = p.copy()
    p_reject[0], p_reject[1] = 0.0, p[0] + p[1]
    dssd = get_variant("dssd")
    frame = wire(DssdDraft(np.array([0]), np.array([0.5], dtype=np.float32), f32=True))
    P = np.stack([p_reject, p_reject])
    verdict = wire(dssd.judge(frame, P, np.random.default_rng(0)).verdict())
    assert verdict.accepted == 0 and verdict.token is None
    assert np.count_nonzero(verdict.p_probs) == VOCAB - 1


def test_dssd_correction_follows_the_residual_below_float16():
    """Verdict → bytes → the device's correction: the tail holds half of the residual and
    must get half of the corrections (it got none in float16)."""
    p, q = below_float16_row()
    dssd = get_variant("dssd")
    verdict = wire(dssd.rejection(0, p).verdict())
    rng = np.random.default_rng(1)
    n = 400
    tail = sum(dssd.correct(verdict, q, rng) >= 2 for _ in range(n))
    assert stats.binomtest(tail, n, 0.5).pvalue > 1e-4, tail
    assert tail > n // 4


# ---- TK-SLT and DRAGON: a draft listed at probability 0 was not sampled from its row --------


def test_tkslt_refuses_a_draft_listed_at_probability_zero():
    """It used to be accepted every time (q(x) = 0 gives min(1, p/q) = 1)."""
    ids = np.array([[7, 3, 5]])
    probs = np.array([[0.6, 0.4, 0.0]])  # 5 is padding, as pad_rows writes it
    P = np.full((2, 10), 0.1)
    with pytest.raises(ValueError, match="probability is 0"):
        tkslt_cloud_verify(np.array([5]), ids, probs, P, np.random.default_rng(0))
    with pytest.raises(ProtocolError, match="listed at 0"):
        wire(TopKDraft(np.array([5]), ids, probs.astype(np.float16)))
    frame = TopKDraft(np.array([5]), ids, probs.astype(np.float16))
    with pytest.raises(ValueError):
        get_variant("tk-slt").judge(frame, P, np.random.default_rng(0))


def test_dragon_refuses_a_draft_listed_at_probability_zero():
    with pytest.raises(ProtocolError, match="at 0"):
        wire(DragonDraft(4, np.array([4, 9]), np.array([0.0, 1.0]), 0.0, 0.01))


@pytest.mark.parametrize(
    "q",
    [
        np.eye(1, 50, 7)[0],  # one-hot
        np.r_[np.full(4, 0.25), np.zeros(46)],  # ties
        np.r_[1 - 1e-9, np.full(49, 1e-9 / 49)],  # near one-hot: the rest rounds to 0 in float16
        np.r_[np.full(9, 0.999 / 9), 0.001 - 4e-8, np.full(40, 1e-9)],  # the cut falls in a tie
    ],
)
def test_tkslt_drafts_never_list_themselves_at_zero(q):
    """Drafts are sampled from the float16 row as sent, so the frame always passes."""
    tk = get_variant("tk-slt")
    rng = np.random.default_rng(2)
    for _ in range(200):
        drafts = [tk.draft(q, rng) for _ in range(3)]
        wire(tk.draft_frame(drafts, q.size, request_id=1, epoch=0, step=0))


# ---- the rest of the math refuses garbage instead of returning garbage ---------------------


@pytest.mark.parametrize(
    "probs",
    [
        [0.5, np.nan, 0.5],
        [0.5, np.inf, 0.5],
        [0.0, 0.0, 0.0],
        [0.7, -0.2, 0.5],
    ],
)
@pytest.mark.parametrize("size", [3, 5000])  # the one-level and the two-level walk
def test_sample_from_refuses_what_is_not_a_distribution(probs, size):
    """NaN/inf returned the last id; all zeros raised a bare IndexError."""
    row = np.zeros(size)
    row[:3] = probs
    with pytest.raises(ValueError, match="finite, ≥ 0 and not all 0"):
        sample_from(row, np.random.default_rng(0))


def test_verify_one_refuses_a_draft_with_q_zero_or_a_nan_target():
    """Both used to be accepted every time."""
    p, q = np.array([0.5, 0.5, 0.0]), np.array([0.0, 0.5, 0.5])
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="q\\(x\\)"):
        verify_one(0, p, q, rng)
    with pytest.raises(ValueError, match="p\\(x\\)"):
        verify_one(1, np.array([0.5, np.nan, 0.5]), q, rng)
    assert verify_one(2, p, q, rng) == (False, 0)  # p(x) = 0: always rejected, residual at 0


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(0.7)])
def test_distribution_refuses_nan_or_positive_infinite_logits(params):
    """Greedy picked the NaN logit (argmax of NaN is its index)."""
    for bad in ([1.0, np.nan, 0.5], [1.0, np.inf, 0.5], [-np.inf, -np.inf, -np.inf]):
        with pytest.raises(ValueError, match="NaN or \\+inf"):
            distribution(np.array(bad), params)
    masked = distribution(np.array([-np.inf, 2.0, 1.0]), params)  # −inf is a masked id
    assert masked[0] == 0 and masked.sum() == pytest.approx(1)


@pytest.mark.parametrize("t", [math.nan, 1e-320, -0.5, math.inf, 1e-4])
def test_sampling_params_refuse_temperatures_that_overflow(t):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(t)


def test_rapid_target_at_temperature_zero_is_greedy():
    """It was NaN (z/0). As T → 0, z/T outgrows the bounded shift η·(q − p)."""
    z, q = np.array([1.0, 3.0, 2.9]), np.array([0.0, 0.1, 0.9])
    np.testing.assert_array_equal(rapid_target(z, q, 2.0, 0.0), [0, 1, 0])
    np.testing.assert_allclose(rapid_target(z, q, 2.0, 1e-3), [0, 1, 0], atol=1e-30)
    with pytest.raises(ValueError):
        rapid_target(z, q, 2.0, -1.0)


def test_neither_side_retrieving_anything_weighs_them_equally():
    """side_etas(−inf, −inf) was NaN and aggregation then raised."""
    assert side_etas(-math.inf, -math.inf) == (0.5, 0.5)
    assert side_etas(-math.inf, 0.0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        side_etas(math.nan, 0.0)
    rng = np.random.default_rng(3)
    cloud = DragonDraft(2, np.array([2]), np.array([1.0]), -math.inf, 0.01)
    counts: Counter = Counter()
    for _ in range(2000):
        token = int(rng.choice([1, 2], p=[0.75, 0.25]))
        device = DragonDraft(token, np.array([1, 2]), np.array([0.75, 0.25]), -math.inf, 0.01)
        counts[aggregate(device, cloud, False, rng)[0]] += 1
    # ½·(0.75, 0.25) + ½·(0, 1) = (0.375, 0.625)
    assert stats.binomtest(counts[1], 2000, 0.375).pvalue > 1e-4, counts


def test_optimal_draft_length_holds_on_its_whole_valid_range():
    """(α, L) = (0.23, 0.002) raised a NaN-to-int ValueError (Lambert W of a subnormal)."""
    assert tk_slt_optimal_draft_length(0.23, 0.002).gamma == 4
    for a in np.linspace(0.01, 0.99, 40):
        for L in np.logspace(-12, -0.005, 40):
            d = tk_slt_optimal_draft_length(float(a), float(L))
            s = [tk_slt_speedup(float(a), g, float(L)) for g in (d.gamma - 1, d.gamma, d.gamma + 1)]
            assert d.gamma >= 1 and math.isfinite(d.speedup)
            assert s[1] >= s[2] - 1e-12 and (d.gamma == 1 or s[1] >= s[0] - 1e-12), (a, L)


# ---- several positions per round, context-dependent adversarial models, the wire path ------

V = 5
ROWS = np.array(
    [
        [1.0, 0.0, 0.0, 0.0, 0.0],  # one-hot
        [0.0, 0.0, 0.5, 0.5, 0.0],  # a tie, disjoint from the row above
        [0.2, 0.2, 0.2, 0.2, 0.2],  # uniform
        [0.0, 0.7, 0.0, 0.0, 0.3],  # zeros
        [1 - 1e-9, 0.0, 0.0, 0.0, 1e-9],  # near one-hot: the rest is lost in float16
        [0.05, 0.45, 0.05, 0.0, 0.45],  # ties among the likely ones
    ]
)


def toy_model(salt: int) -> Callable[[tuple[int, ...]], np.ndarray]:
    """A model whose next-token row depends on the whole prefix (a hash picks the row)."""

    def row(prefix: tuple[int, ...]) -> np.ndarray:
        return ROWS[hash((salt, *prefix)) % len(ROWS)]

    return row


P_MODEL, Q_MODEL = toy_model(11), toy_model(29)


def draft_round(variant, gamma: int, out: list[int], rng: np.random.Generator) -> tuple:
    """The device's γ drafts after `out` from the toy drafter: (drafts, the frame as the cloud
    reads it, the draft tokens)."""
    drafts = []
    for _ in range(gamma):
        drafts.append(variant.draft(Q_MODEL(tuple(out + [d.token for d in drafts])), rng))
    frame = wire(variant.draft_frame(drafts, V, request_id=1, epoch=0, step=len(out)))
    return drafts, frame, [d.token for d in drafts]


def split_answer(
    variant, gamma: int, length: int, rng: np.random.Generator, keep_after_rejection: bool = False
) -> tuple[int, ...]:
    """The first `length` tokens of a split answer, every frame through bytes both ways.
    `keep_after_rejection` is DSSD's published code (drafts kept after a rejection): a
    negative control."""
    out: list[int] = []
    while len(out) < length:
        drafts, frame, tokens = draft_round(variant, gamma, out, rng)
        P = np.stack([P_MODEL(tuple(out + tokens[:i])) for i in range(gamma + 1)])
        verdict: Verdict = wire(variant.judge(frame, P, rng).verdict())
        n = verdict.accepted
        token = verdict.token
        if token is None:
            token = variant.correct(verdict, drafts[n].q, rng)
        out += tokens[:n] + [token]
        if keep_after_rejection and n < gamma:
            out += tokens[n + 1 :]
    return tuple(out[:length])


def exact_answers(length: int) -> dict[tuple[int, ...], float]:
    """Every prefix of `length` tokens with its probability under the cloud model."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        probs = {
            (*s, x): w * P_MODEL(s)[x]
            for s, w in probs.items()
            for x in range(V)
            if w * P_MODEL(s)[x] > 0
        }
    return probs


def chi2_against(counts: Counter, expected: dict[tuple[int, ...], float]) -> float:
    """p-value of a χ² test, bins under 5 expected pooled; a sample in an impossible bin is
    p = 0."""
    n = sum(counts.values())
    if any(s not in expected for s in counts):
        return 0.0
    big = [s for s, w in expected.items() if w * n >= 5]
    obs = [counts[s] for s in big]
    exp = [expected[s] * n for s in big]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp >= 1:
        obs.append(rest_obs)
        exp.append(rest_exp)
    return float(stats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue)


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("name", EXACT)
def test_split_answers_follow_the_cloud_over_several_positions(name, gamma):
    """Three tokens of answer, so rejections, corrections and bonus tokens at every position
    of a round all count, with rows that change with the prefix."""
    variant, rng, length = get_variant(name), np.random.default_rng(gamma), 3
    counts = Counter(split_answer(variant, gamma, length, rng) for _ in range(3000))
    assert chi2_against(counts, exact_answers(length)) > 1e-3


def test_keeping_drafts_after_a_rejection_fails_the_same_test():
    variant, rng, length = get_variant("tk-slt"), np.random.default_rng(7), 3
    counts = Counter(
        split_answer(variant, 3, length, rng, keep_after_rejection=True) for _ in range(3000)
    )
    assert chi2_against(counts, exact_answers(length)) < 1e-6


# ---- RAPID (docs/math.md#rapid): the cloud verifies against p̂, through the same wire path
# ---------

P_CLOUD = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
Q_KNOWS = np.array([0.10, 0.05, 0.05, 0.70, 0.05, 0.05])  # the drafter read where token 3 is


def rapid_law(p: np.ndarray, q: np.ndarray, eta: float) -> tuple[np.ndarray, float]:
    """One RAPID verification's output for a draft x ~ q, exactly: min(q, p̂) kept, the rest
    from norm(max(0, p − q, p − p̂)); and its acceptance β = Σ min(q, p̂)."""
    p_hat = rapid_shift(p, q, eta)
    kept = np.minimum(q, p_hat)
    beta = float(kept.sum())
    return kept + (1 - beta) * rapid_residual(p, p_hat, q), beta


@pytest.mark.parametrize("name", ["tk-slt", "dsd"])
def test_rapid_round_follows_its_formula_through_the_wire(name):
    """Neither p nor q: the law docs/math.md#rapid writes, for the token a round decides."""
    variant, rng, eta = get_variant(name), np.random.default_rng(5), 4.0
    sent = variant.draft(Q_KNOWS, rng).q  # the distribution as the cloud will rebuild it
    law, _ = rapid_law(P_CLOUD, sent, eta)
    assert 0.5 * np.abs(law - P_CLOUD).sum() > 0.1
    out = []
    for _ in range(4000):
        frame = wire(
            variant.draft_frame([variant.draft(Q_KNOWS, rng)], V + 1, request_id=1, epoch=0, step=0)
        )
        P = np.stack([P_CLOUD, P_CLOUD])
        verdict = wire(variant.judge(frame, P, rng, eta=eta).verdict())
        out.append(int(frame.token_ids[0]) if verdict.accepted else verdict.token)
    counts = np.bincount(out, minlength=V + 1)
    assert stats.chisquare(counts, law * len(out)).pvalue > 1e-3
    assert stats.chisquare(counts, P_CLOUD * len(out)).pvalue < 1e-6


def test_rapid_at_eta_zero_is_the_standard_round_draw_for_draw():
    rng_rows = np.random.default_rng(8)
    P = rng_rows.dirichlet(np.ones(7) * 0.3, size=4)
    Q = rng_rows.dirichlet(np.ones(7) * 0.3, size=3)
    for seed in range(300):
        drafts = np.array([sample_from(q, np.random.default_rng(seed + 10_000)) for q in Q])
        a = speculative_round(drafts, P, Q, np.random.default_rng(seed))
        assert rapid_round(drafts, P, Q, 0.0, np.random.default_rng(seed)) == a


def test_acceptance_and_agreement_with_the_drafter_rise_with_eta():
    """…up to a point: past it p̂ overshoots q where the drafter is sure (p̂(3) > q(3) here)
    and shrinks below q elsewhere, so acceptance falls again — the best η is a real choice."""
    etas = [0.0, 0.5, 1.0, 2.0, 4.0, 8.0]
    laws = [rapid_law(P_CLOUD, Q_KNOWS, eta) for eta in etas]
    betas = [beta for _, beta in laws]
    agreement = [1 - 0.5 * np.abs(law - Q_KNOWS).sum() for law, _ in laws]
    assert all(b < c for b, c in itertools.pairwise(betas[:5])), betas
    assert all(a < b for a, b in itertools.pairwise(agreement[:5])), agreement
    assert betas[5] < betas[4] and rapid_shift(P_CLOUD, Q_KNOWS, 8.0)[3] > Q_KNOWS[3]
    np.testing.assert_allclose(laws[0][0], P_CLOUD, atol=1e-12)  # η = 0: exactly p


def test_rapid_needs_a_variant_whose_cloud_holds_q():
    frame = wire(DssdDraft(np.array([0]), np.array([0.5], dtype=np.float32), f32=True))
    with pytest.raises(ValueError, match="RAPID"):
        get_variant("dssd").judge(frame, np.full((2, 4), 0.25), np.random.default_rng(0), 1.0)
