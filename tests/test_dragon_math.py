"""Exactness of DRAGON's math and of its protocol state machine, with no model and no server
(docs/math.md#dragon; issue 13, "Done when" → Exactness).

Sampled outputs are compared with the exact target η^d p^d + η^c p^c of the *transmitted*
distributions by a χ² test at significance ALPHA; negative controls (prefer the accepted draft,
a draft not sampled from what was sent) must be rejected by the same test, which proves it can
fail. Part 4 drives the real `DragonPeer` on both sides, joined by in-memory links that carry
every frame through the real codec, with toy "models" whose logits depend on the prefix."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import pytest
from scipy import stats

import collab.dragon.peer
from collab.dragon.aggregation import aggregate_sample, side_etas, side_weight
from collab.dragon.ledger import (
    DRAGON_MAX_SPARSE,
    DRAGON_TOP_P,
    Ledger,
    Scheduler,
    aggregate,
    dense_pair,
    draft_token,
    side_distribution,
    target_distribution,
    transmitted,
)
from collab.dragon.peer import DragonPeer, first_aggregator
from collab.protocol import (
    AggregatorPolicy,
    DragonDraft,
    DragonSetup,
    DragonTarget,
    Message,
    Side,
    decode,
    encode,
)
from collab.sampling import GREEDY, SamplingParams
from collab.split import Transcript
from tests.test_verification import ALPHA, chi2_pvalue, hist

N = 10_000  # aggregations per histogram (small vocabularies: the differences tested are large)
SAMPLED = SamplingParams(temperature=1.0)


# ---------------------------------------------------------------------------- helpers


def frame(
    token: int,
    ids: Iterable[int],
    probs: Iterable[float],
    h: float = 0.0,
    *,
    step: int = 0,
    epoch: int = 0,
) -> DragonDraft:
    """A draft as it travels (float16 probabilities)."""
    return DragonDraft(
        token,
        np.asarray(list(ids)),
        np.asarray(list(probs), dtype=np.float16),
        h,
        0.0,
        step=step,
        epoch=epoch,
    )


def dense(ids: np.ndarray, probs: np.ndarray, v: int) -> np.ndarray:
    """The transmitted distribution of (ids, probs) over a vocabulary of v."""
    out = np.zeros(v)
    out[np.asarray(ids, dtype=np.int64)] = transmitted(probs)
    return out


def exact_target(device: DragonDraft, cloud: DragonDraft, v: int) -> np.ndarray:
    """η^d p^d + η^c p^c over the whole (small) vocabulary, computed independently of
    collab.dragon: softmax of the two h, dense float64 vectors."""
    h = np.array([device.h, cloud.h])
    w = np.exp(h - h.max())
    w /= w.sum()
    return w[0] * dense(device.ids, device.probs, v) + w[1] * dense(cloud.ids, cloud.probs, v)


Aggregate = Callable[[DragonDraft, DragonDraft, bool, np.random.Generator], tuple[int, bool, bool]]
Drafter = Callable[[DragonDraft, np.random.Generator], int]


def wire_drafter(template: DragonDraft, rng: np.random.Generator) -> int:
    """The real drafting rule: a draw from exactly the transmitted p^s."""
    return draft_token(template.ids, template.probs, False, rng)


def run_aggregate(
    device: DragonDraft,
    cloud: DragonDraft,
    n: int,
    seed: int,
    fn: Aggregate = aggregate,
    drafter: Drafter = wire_drafter,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n independent rounds: each side drafts, `fn` aggregates. Returns (targets, device
    accepted, cloud accepted); checks that 'accepted' means 'the draft became the target'."""
    rng = np.random.default_rng(seed)
    coin = np.random.default_rng([seed, 1])
    frames: dict[tuple[int, int], DragonDraft] = {}

    def with_token(side: int, template: DragonDraft, token: int) -> DragonDraft:
        key = (side, token)
        if key not in frames:
            frames[key] = dataclasses.replace(template, token=token)
        return frames[key]

    out = np.empty((n, 5), dtype=np.int64)
    for i in range(n):
        x_d, x_c = drafter(device, rng), drafter(cloud, rng)
        target, ok_d, ok_c = fn(with_token(0, device, x_d), with_token(1, cloud, x_c), False, coin)
        out[i] = target, ok_d, ok_c, x_d, x_c
    targets, acc_d, acc_c, drafts_d, drafts_c = out.T
    assert np.array_equal(acc_d, targets == drafts_d)
    assert np.array_equal(acc_c, targets == drafts_c)
    return targets, acc_d.astype(bool), acc_c.astype(bool)


def fisher_pvalue(pvalues: list[float]) -> float:
    """Fisher's combination of independent tests (−2 Σ ln p ~ χ²_2k); one p of 0 gives 0."""
    if not pvalues:
        raise ValueError("no groups to test")
    if min(pvalues) <= 0.0:
        return 0.0
    statistic = -2.0 * float(np.sum(np.log(pvalues)))
    return float(stats.chi2.sf(statistic, 2 * len(pvalues)))


# ---- negative controls (never used outside this file)


def aggregate_prefer_accepted(
    device: DragonDraft, cloud: DragonDraft, greedy: bool, rng: np.random.Generator
) -> tuple[int, bool, bool]:
    """Algorithm 1 with the coin replaced by 'prefer the draft that survived Sample': biased."""
    support, p_d, p_c = dense_pair(device, cloud)
    eta_d, eta_c = side_etas(device.h, cloud.h)
    x_d = int(np.searchsorted(support, device.token))
    x_c = int(np.searchsorted(support, cloud.token))
    xt_d = aggregate_sample(x_d, p_d, p_c, eta_c, rng)
    xt_c = aggregate_sample(x_c, p_c, p_d, eta_d, rng)
    if xt_d == x_d:
        i = xt_d
    elif xt_c == x_c:
        i = xt_c
    else:
        i = xt_d if rng.random() < 0.5 else xt_c
    target = int(support[i])
    return target, target == device.token, target == cloud.token


def aggregate_device_only(
    device: DragonDraft, cloud: DragonDraft, greedy: bool, rng: np.random.Generator
) -> tuple[int, bool, bool]:
    """Algorithm 1 without the coin: always the device's x̃ = Sample(x^d, p^d, p^c, η^c)."""
    support, p_d, p_c = dense_pair(device, cloud)
    _, eta_c = side_etas(device.h, cloud.h)
    i = aggregate_sample(int(np.searchsorted(support, device.token)), p_d, p_c, eta_c, rng)
    target = int(support[i])
    return target, target == device.token, target == cloud.token


def clamped_full_mixture_drafter(full: np.ndarray) -> Drafter:
    """A draft sampled from the *untruncated* float64 mixture `full` (as DRAGON's own code
    does), moved to the most likely transmitted token when it falls outside the ids sent."""

    def draw(template: DragonDraft, rng: np.random.Generator) -> int:
        token = int(rng.choice(full.size, p=full))
        return token if token in template.ids else int(template.ids[0])

    return draw


# ---------------------------------------------------------------------------- 1. side_distribution


def reference_side(
    logits: np.ndarray, scores: np.ndarray, temperature: float, top_p: float, max_sparse: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, renormalised float64 probs, full mixture) by the definition: Σ_d softmax(R)_d ·
    softmax(z_d / T), then the fewest most likely tokens (lowest id first on a tie) whose mass
    reaches top_p, at most max_sparse."""
    z = np.atleast_2d(logits) / temperature
    per_doc = np.exp(z - z.max(axis=1, keepdims=True))
    per_doc /= per_doc.sum(axis=1, keepdims=True)
    w = np.exp(scores - scores.max())
    mix = (w / w.sum()) @ per_doc
    order = np.lexsort((np.arange(mix.size), -mix))
    n = 1 + int(np.argmax(np.cumsum(mix[order]) >= top_p))
    ids = order[: min(n, max_sparse)]
    return ids, mix[ids] / mix[ids].sum(), mix


def test_side_distribution_hand_computed_mixture():
    """Two documents with weights softmax(R) = (¾, ¼): the mixture, its 0.8-nucleus, float16."""
    doc0 = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    doc1 = np.array([0.05, 0.1, 0.6, 0.2, 0.05])
    scores = np.array([np.log(3.0), 0.0]) + 400.0  # large scores: the weights are still ¾, ¼
    ids, probs = side_distribution(np.log([doc0, doc1]), scores, SAMPLED, 0.8, 32)
    # mixture = [0.3875, 0.175, 0.2625, 0.125, 0.05]; 0.3875 + 0.2625 = 0.65 < 0.8 ≤ 0.825
    assert ids.tolist() == [0, 2, 1]
    assert probs.dtype == np.float16
    kept = np.array([0.3875, 0.2625, 0.175])
    np.testing.assert_allclose(probs.astype(np.float64), kept / kept.sum(), rtol=1e-3)
    assert np.array_equal(probs, (kept / kept.sum()).astype(np.float16))
    # the cap wins over top-p; a single document is its own mixture
    ids, _ = side_distribution(np.log([doc0, doc1]), scores, SAMPLED, 0.8, 2)
    assert ids.tolist() == [0, 2]
    ids, probs = side_distribution(np.log(doc1), np.array([0.0]), SAMPLED, 0.8, 32)
    assert ids.tolist() == [2, 3, 1]
    # f32 keeps float32 on the wire
    _, probs32 = side_distribution(np.log([doc0, doc1]), scores, SAMPLED, 0.8, 32, f32=True)
    assert probs32.dtype == np.float32


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_side_distribution_matches_the_definition(temperature):
    """Random per-document logits and scores: ids, order, cap and values as the definition."""
    rng = np.random.default_rng(int(temperature * 10))
    params = SamplingParams(temperature=temperature)
    checked = 0
    for _ in range(300):
        d, v = int(rng.integers(1, 5)), int(rng.integers(2, 60))
        logits = rng.normal(scale=rng.uniform(0.3, 4.0), size=(d, v))
        scores = rng.normal(scale=3.0, size=d)
        top_p = float(rng.uniform(0.3, 0.99))
        cap = int(rng.integers(1, 40))
        ref_ids, ref_probs, mix = reference_side(logits, scores, temperature, top_p, cap)
        cum = np.cumsum(np.sort(mix)[::-1])
        if np.min(np.abs(cum - top_p)) < 1e-9 or np.min(np.abs(np.diff(np.sort(mix)))) < 1e-9:
            continue  # a boundary or a near-tie: rounding may decide either way
        ids, probs = side_distribution(logits, scores, params, top_p, cap)
        keep = ref_probs.astype(np.float16) > 0
        assert ids.tolist() == ref_ids[keep].tolist()
        assert ids.size <= cap and probs.dtype == np.float16 and np.all(probs > 0)
        assert np.all(np.diff(probs.astype(np.float64)) <= 0)  # most likely first
        np.testing.assert_allclose(
            transmitted(probs), ref_probs[keep] / ref_probs[keep].sum(), rtol=2e-3, atol=1e-4
        )
        checked += 1
    assert checked > 250


def test_side_distribution_reaches_top_p_of_the_whole_mass():
    """A long tail below the candidate threshold (3000 tokens at 5e-5, 15 % of the mass) must
    not shrink the nucleus: the kept tokens reach top_p of *all* the mass, not of the
    candidates'. Ten head tokens hold 0.85: the 0.8-nucleus is all ten."""
    head = np.linspace(0.09, 0.08, 10)
    p = np.concatenate([head, np.full(3000, 0.15 / 3000)])
    ids, _ = side_distribution(np.log(p)[None], np.zeros(1), SAMPLED, 0.8, 32)
    assert p[ids].sum() >= 0.8
    assert ids.tolist() == list(range(10))


def test_side_distribution_ties_and_float16_underflow():
    """Ties sort lowest id first; a token whose probability rounds to 0 in float16 is left
    out, so the wire never carries an impossible token a draft could be drawn as."""
    p = np.array([0.1, 0.3, 0.1, 0.3, 0.2])
    ids, probs = side_distribution(np.log(p)[None], np.zeros(1), SAMPLED, 1.0, 32)
    assert ids.tolist() == [1, 3, 4, 0, 2]
    p = np.array([0.6, 0.4 - 1e-9, 1e-9])
    ids, probs = side_distribution(np.log(p)[None], np.zeros(1), SAMPLED, 1.0, 32)
    assert ids.tolist() == [0, 1] and np.all(probs > 0)
    # …while float32 keeps it
    ids, probs = side_distribution(np.log(p)[None], np.zeros(1), SAMPLED, 1.0, 32, f32=True)
    assert ids.tolist() == [0, 1, 2] and np.all(probs > 0)


def test_side_distribution_greedy_mixes_the_temperature_one_distributions():
    rng = np.random.default_rng(3)
    logits, scores = rng.normal(size=(3, 20)), rng.normal(size=3)
    greedy = side_distribution(logits, scores, GREEDY, 0.8, 32)
    t1 = side_distribution(logits, scores, SamplingParams(temperature=1.0), 0.8, 32)
    t_half = side_distribution(logits, scores, SamplingParams(temperature=0.5), 0.8, 32)
    assert np.array_equal(greedy[0], t1[0]) and np.array_equal(greedy[1], t1[1])
    assert not (np.array_equal(greedy[0], t_half[0]) and np.array_equal(greedy[1], t_half[1]))


# ---------------------------------------------------------------------------- 2. draft_token


def test_sampled_draft_follows_exactly_the_transmitted_distribution():
    rng = np.random.default_rng(5)
    logits, scores = rng.normal(scale=1.5, size=(2, 12)), np.array([0.5, -0.5])
    ids, probs = side_distribution(logits, scores, SAMPLED, 0.8, 32)
    _, _, full = reference_side(logits, scores, 1.0, 0.8, 32)
    assert ids.size < 12  # truncation matters here
    drafts = [draft_token(ids, probs, False, rng) for _ in range(N)]
    counts = hist(drafts, 12)
    assert chi2_pvalue(counts, dense(ids, probs, 12)) >= ALPHA
    assert chi2_pvalue(counts, full) < ALPHA  # the untruncated mixture is told apart


def test_greedy_draft_is_the_argmax_lowest_id_on_a_tie():
    rng = np.random.default_rng(0)
    assert draft_token(np.array([5, 2, 9]), np.array([0.2, 0.5, 0.3], np.float16), True, rng) == 2
    tie = np.array([0.4, 0.4, 0.2], np.float16)
    assert draft_token(np.array([5, 2, 9]), tie, True, rng) == 2
    assert draft_token(np.array([2, 5, 9]), tie, True, rng) == 2


def test_greedy_ties_are_broken_on_the_wire_values():
    """0.50001 vs 0.49999 after renormalisation: equal in float16. The draft and the greedy
    aggregator both see the tie and both take the lowest id, so the draft is accepted."""
    p = np.full(8, 0.1 / 6)
    p[7], p[3] = 0.45001, 0.44999
    ids, probs = side_distribution(np.log(p)[None], np.zeros(1), GREEDY, 0.8, 32)
    assert ids.tolist() == [7, 3] and probs[0] == probs[1]
    token = draft_token(ids, probs, True, np.random.default_rng())
    assert token == 3
    draft = DragonDraft(token, ids, probs, 0.0, 0.0)
    assert aggregate(draft, draft, True, np.random.default_rng()) == (3, True, True)
    ids32, probs32 = side_distribution(np.log(p)[None], np.zeros(1), GREEDY, 0.8, 32, f32=True)
    assert draft_token(ids32, probs32, True, np.random.default_rng()) == 7  # float32: no tie


# ---------------------------------------------------------------------------- 3. aggregate


def random_side(seed: int, v: int = 10) -> DragonDraft:
    rng = np.random.default_rng(seed)
    ids, probs = side_distribution(
        rng.normal(scale=1.5, size=(2, v)),
        rng.normal(size=2),
        SAMPLED,
        DRAGON_TOP_P,
        DRAGON_MAX_SPARSE,
    )
    return DragonDraft(int(ids[0]), ids, probs, 0.0, 0.0)


V_AGG = 10
# (name, device frame, cloud frame, whether the target differs from each side's own p^s)
CASES: list[tuple[str, DragonDraft, DragonDraft, bool, bool]] = [
    (
        "random",
        dataclasses.replace(random_side(1), h=0.3),
        dataclasses.replace(random_side(2), h=-0.2),
        True,
        True,
    ),
    ("disjoint", frame(0, [0, 1, 2], [0.5, 0.3, 0.2]), frame(5, [5, 6], [0.7, 0.3]), True, True),
    (
        "identical",
        frame(1, [1, 4, 2], [0.5, 0.3, 0.2], 1.0),
        frame(1, [1, 4, 2], [0.5, 0.3, 0.2], -2.0),
        False,
        False,
    ),
    ("one-hot", frame(3, [3], [1.0], np.log(0.3)), frame(4, [4], [1.0], np.log(0.7)), True, True),
    (
        "one-hot vs spread",
        frame(2, [2], [1.0], 0.0),
        frame(2, [2, 3, 8, 9], [0.25, 0.25, 0.25, 0.25], 0.5),
        True,
        True,
    ),
    (
        "ties",
        frame(0, [0, 1, 2, 3], [0.25] * 4, 0.0),
        frame(3, [3, 2], [0.5, 0.5], 0.0),
        True,
        True,
    ),
    (
        "zeros on the wire",
        frame(0, [0, 1, 7], [0.6, 0.4, 0.0], 0.0),
        frame(7, [7, 1, 0], [0.5, 0.5, 0.0], 0.0),
        True,
        True,
    ),
    ("η^d ≈ 0", frame(0, [0, 1], [0.9, 0.1], 0.0), frame(1, [1, 2], [0.5, 0.5], 12.0), True, False),
    ("η^d ≈ 1", frame(0, [0, 1], [0.9, 0.1], 12.0), frame(1, [1, 2], [0.5, 0.5], 0.0), False, True),
    (
        "h^d = −inf",
        frame(0, [0, 1], [0.9, 0.1], -np.inf),
        frame(1, [1, 2], [0.5, 0.5], 0.0),
        True,
        False,
    ),
    (
        "h^c = −inf",
        frame(0, [0, 1], [0.9, 0.1], 0.0),
        frame(1, [1, 2], [0.5, 0.5], -np.inf),
        False,
        True,
    ),
]


@pytest.mark.parametrize(
    ("name", "device", "cloud", "vs_device", "vs_cloud"), CASES, ids=[c[0] for c in CASES]
)
def test_sampled_target_follows_the_exact_mixture(name, device, cloud, vs_device, vs_cloud):
    expected = exact_target(device, cloud, V_AGG)
    support, mix = target_distribution(device, cloud)
    np.testing.assert_allclose(mix, expected[support])
    seed = 300 + [c[0] for c in CASES].index(name)
    targets, _, _ = run_aggregate(device, cloud, N, seed=seed)
    counts = hist(targets, V_AGG)
    assert chi2_pvalue(counts, expected) >= ALPHA
    if vs_device:
        assert chi2_pvalue(counts, dense(device.ids, device.probs, V_AGG)) < ALPHA
    if vs_cloud:
        assert chi2_pvalue(counts, dense(cloud.ids, cloud.probs, V_AGG)) < ALPHA


def test_disjoint_supports_acceptance_rates():
    """Disjoint supports, η = ½: x̃^d keeps x^d with probability η^d, else it is redrawn from
    p^c (and x̃^c alike), so P(device accepted) = ½·η^d + ½·η^d·Σ p^d(x)² (the coin picked
    x̃^d and it was kept, or it picked a redrawn x̃^c that hit x^d); never both."""
    device, cloud = CASES[1][1], CASES[1][2]
    _, ok_d, ok_c = run_aggregate(device, cloud, N, seed=11)
    assert not np.any(ok_d & ok_c)
    for ok, own in ((ok_d, device), (ok_c, cloud)):
        p = transmitted(own.probs)
        rate = 0.25 * (1.0 + float(np.sum(p**2)))
        assert stats.binomtest(int(ok.sum()), N, rate).pvalue >= ALPHA
    assert stats.binomtest(int(ok_d.sum()), N, 0.5).pvalue < ALPHA  # not simply η^d


def test_h_minus_inf_side_is_never_the_source():
    """η^d = 0: the device's draft is the target only when the cloud could have drawn it."""
    device = frame(0, [0, 3], [0.9, 0.1], -np.inf)
    cloud = frame(1, [1, 2], [0.5, 0.5], 0.0)
    targets, ok_d, _ = run_aggregate(device, cloud, 2_000, seed=12)
    assert set(targets.tolist()) <= {1, 2} and not ok_d.any()


def test_negative_control_prefer_the_accepted_draft_is_rejected():
    """Disjoint supports, η = ½: preferring the survivor gives the device's support
    ½ + ⅛ of the mass instead of ½."""
    device, cloud = CASES[1][1], CASES[1][2]
    targets, _, _ = run_aggregate(device, cloud, N, seed=13, fn=aggregate_prefer_accepted)
    assert chi2_pvalue(hist(targets, V_AGG), exact_target(device, cloud, V_AGG)) < ALPHA
    # and on random distributions
    device, cloud = CASES[0][1], CASES[0][2]
    targets, _, _ = run_aggregate(device, cloud, N, seed=14, fn=aggregate_prefer_accepted)
    assert chi2_pvalue(hist(targets, V_AGG), exact_target(device, cloud, V_AGG)) < ALPHA


def test_no_coin_is_still_exact_but_starves_the_other_side():
    """Why "no coin" cannot be a distribution negative control: x̃^d = Sample(x^d, p^d, p^c, η^c)
    alone already follows η^d p^d + η^c p^c (Algorithm 1's Sample is exact), so always taking
    it passes the χ² test. What the coin buys is shared acceptance: without it the cloud's
    draft is accepted less often, so the cloud rolls back more."""
    device, cloud = CASES[0][1], CASES[0][2]
    targets, ok_d, ok_c = run_aggregate(device, cloud, N, seed=15, fn=aggregate_device_only)
    assert chi2_pvalue(hist(targets, V_AGG), exact_target(device, cloud, V_AGG)) >= ALPHA
    _, ok_d_coin, ok_c_coin = run_aggregate(device, cloud, N, seed=15)
    assert ok_c.mean() < ok_c_coin.mean() - 0.03 and ok_d.mean() > ok_d_coin.mean() + 0.03


def test_negative_control_draft_not_from_the_transmitted_distribution_is_rejected():
    """The device samples its draft from the untruncated float64 mixture (DRAGON's code) and
    moves it to the top transmitted token when it falls outside the ids: the tail's mass lands
    on that token, and the same test rejects the result."""
    rng = np.random.default_rng(16)
    logits, scores = rng.normal(scale=1.5, size=(2, V_AGG)), rng.normal(size=2)
    ids, probs = side_distribution(logits, scores, SAMPLED, DRAGON_TOP_P, DRAGON_MAX_SPARSE)
    _, _, full = reference_side(logits, scores, 1.0, DRAGON_TOP_P, DRAGON_MAX_SPARSE)
    assert 1.0 - full[ids].sum() > 0.1  # the truncated tail is large enough to matter
    device = DragonDraft(int(ids[0]), ids, probs, 0.0, 0.0)
    cloud = CASES[0][2]
    expected = exact_target(device, cloud, V_AGG)
    targets, _, _ = run_aggregate(device, cloud, N, seed=17)
    assert chi2_pvalue(hist(targets, V_AGG), expected) >= ALPHA  # the positive control
    bad = clamped_full_mixture_drafter(full)

    def drafter(template: DragonDraft, g: np.random.Generator) -> int:
        return bad(template, g) if template is device else wire_drafter(template, g)

    targets, _, _ = run_aggregate(device, cloud, N, seed=17, drafter=drafter)
    assert chi2_pvalue(hist(targets, V_AGG), expected) < ALPHA


@pytest.mark.parametrize("seed", range(40))
def test_greedy_target_is_the_argmax_of_the_weighted_mixture(seed):
    rng = np.random.default_rng(seed)
    device = dataclasses.replace(random_side(100 + seed), h=float(rng.normal(scale=2)))
    cloud = dataclasses.replace(random_side(200 + seed), h=float(rng.normal(scale=2)))
    expected = exact_target(device, cloud, V_AGG)
    best = int(np.flatnonzero(expected == expected.max())[0])
    target, ok_d, ok_c = aggregate(device, cloud, True, rng)
    assert target == best and ok_d == (device.token == best) and ok_c == (cloud.token == best)


def test_greedy_tie_takes_the_lowest_id_whichever_side_has_it():
    pairs = [
        (frame(7, [7], [1.0]), frame(2, [2], [1.0])),
        (frame(2, [2], [1.0]), frame(7, [7], [1.0])),
        (frame(4, [4, 1], [0.5, 0.5]), frame(4, [4, 1], [0.5, 0.5])),
    ]
    for device, cloud in pairs:
        target, _, _ = aggregate(device, cloud, True, np.random.default_rng())
        assert target == min(int(device.ids.min()), int(cloud.ids.min()))


# ---------------------------------------------------------------------------- 4. the real loop

V_TOY = 6
TOY_SCORES = {Side.DEVICE: np.array([2.0, 0.5]), Side.CLOUD: np.array([1.5, 1.0, -0.5])}


@dataclass
class ToyModel:
    """A side's per-document "model": next-token logits [D, V] as a fixed random function of
    (question, side, document, answer prefix), read by both the peers and the references."""

    question: int
    side: Side
    docs: int
    cache: dict[tuple[int, ...], np.ndarray] = field(default_factory=dict)

    def logits(self, prefix: Iterable[int]) -> np.ndarray:
        key = tuple(prefix)
        if key not in self.cache:
            rng = np.random.default_rng([self.question, int(self.side), len(key), *key])
            self.cache[key] = rng.normal(scale=2.0, size=(self.docs, V_TOY))
        return self.cache[key]


_MODELS: dict[tuple[int, Side], ToyModel] = {}


def toy(question: int, side: Side) -> ToyModel:
    key = (question, side)
    if key not in _MODELS:
        _MODELS[key] = ToyModel(question, side, TOY_SCORES[side].size)
    return _MODELS[key]


class ToyCancelled(Exception):
    pass


class ToyDecoder:
    """The `Decoder` protocol over a toy model: a step takes 0..max_delay event-loop turns (so
    the sides run ahead and fall behind), can be cancelled, and a rewind must keep exactly the
    committed answer."""

    def __init__(
        self, model: ToyModel, transcript: Transcript, rng: np.random.Generator, max_delay: int
    ) -> None:
        self.model, self.transcript, self.rng, self.max_delay = model, transcript, rng, max_delay
        self.fed: list[int] = []
        self.answer_tokens = 0
        self._running = False
        self._cancel = False

    async def advance(self, token: int) -> np.ndarray:
        self._running, self._cancel = True, False
        try:
            for _ in range(int(self.rng.integers(0, self.max_delay + 1))):
                await asyncio.sleep(0)
                if self._cancel:
                    raise ToyCancelled
            self.fed.append(token)
            self.answer_tokens = len(self.fed)
            return self.model.logits(self.fed)
        finally:
            self._running = False

    async def rewind(self, answer_tokens: int) -> None:
        assert answer_tokens <= len(self.fed), "rewind past the tokens fed"
        del self.fed[answer_tokens:]
        self.answer_tokens = answer_tokens
        assert self.fed == self.transcript.tokens[:answer_tokens], "kept a rejected token"

    def cancel(self) -> None:
        if self._running:
            self._cancel = True


class Pipe:
    """One direction of the link: frames are encoded, delayed 0..max_delay loop turns (in
    order), decoded and checked by the real codec."""

    def __init__(self, rng: np.random.Generator, max_delay: int) -> None:
        self.rng, self.max_delay = rng, max_delay
        self.wire: asyncio.Queue[bytes] = asyncio.Queue()
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        while True:
            data = await self.wire.get()
            for _ in range(int(self.rng.integers(0, self.max_delay + 1))):
                await asyncio.sleep(0)
            await self.inbox.put(decode(data))


@dataclass
class MemoryLink:
    """A `PeerLink` over two pipes; every target sent is logged with its sender."""

    out: Pipe
    into: Pipe
    me: Side
    targets: list[tuple[Side, DragonTarget]]

    async def send(self, msg: Message) -> None:
        if isinstance(msg, DragonTarget):
            self.targets.append((self.me, msg))
        self.out.wire.put_nowait(encode(msg))

    async def recv(self, *kinds: type[Message]) -> Message:
        msg = await self.into.inbox.get()
        assert isinstance(msg, kinds)
        return msg

    def ended(self, msg: Message) -> bool:
        return False  # the toy request ends with the answer

    def rtt(self) -> float | None:
        return 0.01


class Alternating(Scheduler):
    """The aggregator moves every two tokens: device for steps 0–1, cloud for 2–3, …"""

    def choose(self, current: Side, step: int, frame_bytes: int = 200) -> Side:
        return Side.DEVICE if (step + 1) // 2 % 2 == 0 else Side.CLOUD


@dataclass
class Run:
    tokens: list[int]
    targets: list[tuple[Side, DragonTarget]]
    ledgers: dict[Side, Ledger]


async def dragon_pair(
    question: int,
    policy: AggregatorPolicy,
    params: SamplingParams,
    *,
    seed: int,
    max_new: int,
    lookahead: int = 4,
    stop_ids: frozenset[int] = frozenset(),
    alternate: bool = False,
    max_delay: int = 3,
) -> Run:
    """One answer by two real DragonPeers (device and cloud) over in-memory links."""
    setup = DragonSetup(2, policy, Side.DEVICE, DRAGON_TOP_P, DRAGON_MAX_SPARSE, lookahead, 0)
    delays = np.random.default_rng([seed, 7])
    to_cloud, to_device = Pipe(delays, max_delay), Pipe(delays, max_delay)
    targets: list[tuple[Side, DragonTarget]] = []
    peers, ledgers = {}, {}
    for side, out, into in ((Side.DEVICE, to_cloud, to_device), (Side.CLOUD, to_device, to_cloud)):
        ledger = Ledger(side, Transcript(max_new, stop_ids), aggregator=first_aggregator(setup))
        decoder = ToyDecoder(toy(question, side), ledger.transcript, delays, max_delay)
        peers[side] = DragonPeer(
            ledger,
            decoder,
            MemoryLink(out, into, side, targets),
            setup,
            params,
            TOY_SCORES[side],
            request_id=1,
            rng=np.random.default_rng([seed, int(side)]),
            coin=np.random.default_rng([seed, int(side), 99]),
            scheduler=(Alternating if alternate else Scheduler)(setup.policy),
        )
        ledgers[side] = ledger

    async def drive(side: Side) -> list[int]:
        out: list[int] = []
        async for kept in peers[side].run(toy(question, side).logits(()), 0.001):
            out += kept
        return out

    try:
        device, cloud = await asyncio.gather(drive(Side.DEVICE), drive(Side.CLOUD))
    finally:
        for pipe in (to_cloud, to_device):
            pipe.task.cancel()
    assert device == cloud == ledgers[Side.DEVICE].transcript.tokens
    assert ledgers[Side.CLOUD].transcript.tokens == device
    assert [t.step for _, t in targets] == list(range(len(targets)))
    return Run(device, targets, ledgers)


def side_dense(question: int, side: Side, prefix: Iterable[int], params: SamplingParams):
    ids, probs = side_distribution(
        toy(question, side).logits(prefix),
        TOY_SCORES[side],
        params,
        DRAGON_TOP_P,
        DRAGON_MAX_SPARSE,
    )
    return dense(ids, probs, V_TOY)


def toy_mixture(question: int, prefix: Iterable[int], params: SamplingParams) -> np.ndarray:
    """The single-process reference: η^d p^d + η^c p^c from both sides' side_distribution."""
    prefix = list(prefix)
    eta_d, eta_c = side_etas(
        side_weight(TOY_SCORES[Side.DEVICE]), side_weight(TOY_SCORES[Side.CLOUD])
    )
    return eta_d * side_dense(question, Side.DEVICE, prefix, params) + eta_c * side_dense(
        question, Side.CLOUD, prefix, params
    )


def reference_greedy(question: int, max_new: int, stop_ids: frozenset[int]) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < max_new:
        token = int(np.argmax(toy_mixture(question, tokens, GREEDY)))  # first max: lowest id
        if token in stop_ids:
            break
        tokens.append(token)
    return tokens


POLICIES = {
    "device": (AggregatorPolicy.DEVICE, False),
    "cloud": (AggregatorPolicy.CLOUD, False),
    "switching": (AggregatorPolicy.AUTO, True),
}


@pytest.mark.parametrize("lookahead", [0, 1, 4])
@pytest.mark.parametrize("policy", list(POLICIES))
async def test_greedy_loop_equals_the_single_process_reference(policy, lookahead):
    pol, alternate = POLICIES[policy]
    rejected = 0
    for question in range(6):
        stop = frozenset({5}) if question % 2 else frozenset()
        expected = reference_greedy(question, 12, stop)
        for seed in range(3):
            run = await dragon_pair(
                question,
                pol,
                GREEDY,
                seed=seed,
                max_new=12,
                lookahead=lookahead,
                stop_ids=stop,
                alternate=alternate,
            )
            assert run.tokens == expected, (question, seed)
            ledger = run.ledgers[Side.DEVICE]
            rejected += sum(ledger.epochs.values())
            senders = [s for s, _ in run.targets]
            if policy == "switching":
                assert senders == [
                    Side.DEVICE if i // 2 % 2 == 0 else Side.CLOUD for i in range(len(senders))
                ]
                assert ledger.switches == run.ledgers[Side.CLOUD].switches > 0
            else:
                assert set(senders) == {Side.CLOUD if policy == "cloud" else Side.DEVICE}
    assert rejected > 20  # rollbacks really happened


N_LOOP = 800  # two-token generations per sampled configuration
# the toy question of the sampled tests: its sides differ (total variation ≥ 0.4 from the
# mixture) and preferring the accepted draft moves ≈ 0.15 of the mass, at both positions
Q_SAMPLED = 2


async def sampled_runs(policy: AggregatorPolicy) -> list[Run]:
    return list(
        await asyncio.gather(
            *[
                dragon_pair(Q_SAMPLED, policy, SAMPLED, seed=1000 + i, max_new=2)
                for i in range(N_LOOP)
            ]
        )
    )


def first_token_pvalues(runs: list[Run]) -> tuple[float, float, float]:
    """χ² p-values of the first tokens against the mixture, p^device and p^cloud."""
    counts = hist([r.tokens[0] for r in runs], V_TOY)
    return (
        chi2_pvalue(counts, toy_mixture(Q_SAMPLED, [], SAMPLED)),
        chi2_pvalue(counts, side_dense(Q_SAMPLED, Side.DEVICE, [], SAMPLED)),
        chi2_pvalue(counts, side_dense(Q_SAMPLED, Side.CLOUD, [], SAMPLED)),
    )


def after_rejection_pvalues(runs: list[Run]) -> tuple[float, float, float]:
    """The token after a rejected step 0, tested per first token x0 against the distributions
    given x0 (Fisher's combination over the x0 seen ≥ 50 times)."""
    groups: defaultdict[int, list[int]] = defaultdict(list)
    for r in runs:
        first = r.targets[0][1]
        if not (first.device_accepted and first.cloud_accepted):
            groups[r.tokens[0]].append(r.tokens[1])
    groups = defaultdict(list, {x0: ts for x0, ts in groups.items() if len(ts) >= 50})
    assert sum(map(len, groups.values())) > N_LOOP // 3

    def combined(expected: Callable[[list[int]], np.ndarray]) -> float:
        return fisher_pvalue(
            [chi2_pvalue(hist(ts, V_TOY), expected([x0])) for x0, ts in groups.items()]
        )

    return (
        combined(lambda prefix: toy_mixture(Q_SAMPLED, prefix, SAMPLED)),
        combined(lambda prefix: side_dense(Q_SAMPLED, Side.DEVICE, prefix, SAMPLED)),
        combined(lambda prefix: side_dense(Q_SAMPLED, Side.CLOUD, prefix, SAMPLED)),
    )


@pytest.mark.parametrize(
    "policy", [AggregatorPolicy.DEVICE, AggregatorPolicy.CLOUD], ids=["device", "cloud"]
)
async def test_sampled_loop_follows_the_exact_mixture(policy):
    runs = await sampled_runs(policy)
    assert all(len(r.tokens) == 2 for r in runs)
    mixture, own_device, own_cloud = first_token_pvalues(runs)
    assert mixture >= ALPHA and own_device < ALPHA and own_cloud < ALPHA
    mixture, own_device, own_cloud = after_rejection_pvalues(runs)
    assert mixture >= ALPHA and own_device < ALPHA and own_cloud < ALPHA


async def test_negative_control_loop_preferring_the_accepted_draft_is_rejected(monkeypatch):
    monkeypatch.setattr(collab.dragon.peer, "aggregate", aggregate_prefer_accepted)
    runs = await sampled_runs(AggregatorPolicy.DEVICE)
    assert first_token_pvalues(runs)[0] < ALPHA
    assert after_rejection_pvalues(runs)[0] < ALPHA


# ---------------------------------------------------------------------------- 5. the ledger


def target(token: int, dev_ok: bool, cloud_ok: bool, step: int, nxt: Side = Side.DEVICE):
    return DragonTarget(token, dev_ok, cloud_ok, nxt, step=step)


def one_hot(token: int, step: int, epoch: int = 0) -> DragonDraft:
    return frame(token, [token], [1.0], step=step, epoch=epoch)


def test_ledger_drops_stale_and_out_of_order_drafts():
    ledger = Ledger(Side.DEVICE, Transcript(8, frozenset({9})))
    ledger.add_own(one_hot(1, 0))
    ledger.add_own(one_hot(2, 1))
    assert ledger.receive(one_hot(1, 0)) and ledger.receive(one_hot(4, 1))
    assert not ledger.receive(one_hot(5, 3))  # skips step 2: out of order
    assert ledger.stale == 1 and ledger.ready()
    applied = ledger.apply(target(1, True, True, 0))
    assert applied.kept == [1] and not applied.own_rejected and not applied.switched
    assert [d.step for d in ledger.queues[Side.CLOUD]] == [1]
    applied = ledger.apply(target(2, True, False, 1))  # the cloud's 4 is rejected
    assert applied.kept == [2] and not applied.own_rejected
    assert ledger.epochs == {Side.DEVICE: 0, Side.CLOUD: 1} and not ledger.queues[Side.CLOUD]
    # drafts the cloud sent before it learned of its rejection (epoch 0) are dropped…
    assert not ledger.receive(one_hot(3, 2, epoch=0))
    # …and so is a draft of the new epoch for a step already resolved
    assert not ledger.receive(one_hot(3, 1, epoch=1))
    assert ledger.stale == 3
    assert ledger.receive(one_hot(3, 2, epoch=1))
    assert ledger.made == {Side.DEVICE: 2, Side.CLOUD: 3}
    assert ledger.drafted == {Side.DEVICE: 2, Side.CLOUD: 2}  # judged by the two targets
    assert ledger.accepted == {Side.DEVICE: 2, Side.CLOUD: 1}
    assert ledger.acceptance(Side.CLOUD) == pytest.approx(1 / 2)
    assert not ledger.ready()  # the device has nothing for step 2 yet


def test_ledger_apply_rejects_own_switches_and_finishes():
    ledger = Ledger(Side.CLOUD, Transcript(4, frozenset({9})))
    assert not ledger.aggregating and ledger.next_draft_step(Side.CLOUD) == 0
    for step, token in enumerate([3, 4, 5]):
        ledger.add_own(one_hot(token, step))
    assert ledger.receive(one_hot(7, 0))
    with pytest.raises(ValueError):
        ledger.apply(target(7, True, False, 1))  # wrong step: nothing changes
    assert (
        ledger.step == 0 and ledger.transcript.tokens == [] and len(ledger.queues[Side.CLOUD]) == 3
    )
    applied = ledger.apply(target(7, True, False, 0, nxt=Side.CLOUD))
    assert applied.kept == [7] and applied.own_rejected and applied.switched
    assert ledger.aggregating and ledger.switches == 1 and ledger.epochs[Side.CLOUD] == 1
    assert not ledger.queues[Side.CLOUD] and ledger.next_draft_step(Side.CLOUD) == 1
    # the stop token ends the answer and is not kept
    ledger.add_own(one_hot(9, 1, epoch=1))
    assert ledger.own_ended()  # drafted up to a stop token
    assert ledger.receive(one_hot(9, 1))
    applied = ledger.apply(target(9, True, True, 1, nxt=Side.CLOUD))
    assert applied.kept == [] and ledger.finished and not ledger.ready()
    assert ledger.transcript.tokens == [7] and ledger.switches == 1


def test_ledger_finishes_on_length():
    ledger = Ledger(Side.DEVICE, Transcript(2, frozenset()))
    for step in range(2):
        ledger.add_own(one_hot(step, step))
        assert ledger.receive(one_hot(step, step))
    assert ledger.own_ended()  # nothing to draft beyond max_new_tokens
    for step in range(2):
        assert not ledger.finished
        ledger.apply(target(step, True, True, step))
    assert ledger.finished and ledger.transcript.tokens == [0, 1] and ledger.step == 2


# ---------------------------------------------------------------------------- 6. the scheduler


def eq7(alpha_remote: float, c_local: float, c_remote: float, rtt: float) -> float:
    """DRAGON eq. (7), written out again: z^l while l aggregates."""
    return alpha_remote * max(c_local, c_remote) + (1 - alpha_remote) * max(c_local, c_remote + rtt)


def fed_scheduler(
    c: dict[Side, float], accepted: dict[Side, bool], rtt: float | None, sides=tuple(Side)
) -> Scheduler:
    """An AUTO scheduler fed six drafts per side in `sides` (constant decode times), ten
    targets with the given verdicts, and the round trip."""
    sched = Scheduler(AggregatorPolicy.AUTO)
    for step in range(6):
        for side in sides:
            sched.observe_draft(
                side,
                DragonDraft(0, np.array([0]), np.array([1.0], np.float16), 0.0, c[side], step=step),
            )
    for step in range(10):
        sched.observe_target(target(0, accepted[Side.DEVICE], accepted[Side.CLOUD], step))
    if rtt is not None:
        sched.observe_rtt(rtt)
    return sched


def test_pinned_scheduler_never_moves():
    fast_cloud = {Side.DEVICE: 0.01, Side.CLOUD: 0.1}
    for pol, side in ((AggregatorPolicy.DEVICE, Side.DEVICE), (AggregatorPolicy.CLOUD, Side.CLOUD)):
        sched = fed_scheduler(fast_cloud, {Side.DEVICE: True, Side.CLOUD: False}, 0.2)
        sched.policy = pol
        for current in Side:
            assert all(sched.choose(current, step) == side for step in range(10))


def test_auto_scheduler_follows_eq7():
    """The device decodes 10× faster and the cloud's drafts are always rejected: with the
    device aggregating every rejected cloud draft costs a round trip (z^d = 0.3 s), with the
    cloud aggregating it waits only for its own decode (z^c = 0.1 s) — move to the cloud."""
    c = {Side.DEVICE: 0.01, Side.CLOUD: 0.1}
    acc = {Side.DEVICE: True, Side.CLOUD: False}
    rtt = 0.2
    z_device = eq7(0.0, c[Side.DEVICE], c[Side.CLOUD], rtt)
    z_cloud = eq7(1.0, c[Side.CLOUD], c[Side.DEVICE], rtt)
    assert z_device == pytest.approx(0.3) and z_cloud == pytest.approx(0.1)
    sched = fed_scheduler(c, acc, rtt)
    assert sched.choose(Side.DEVICE, 6) == Side.CLOUD
    assert sched.choose(Side.CLOUD, 6) == Side.CLOUD
    # equal sides: z^d == z^c, the aggregator stays where it is
    same = fed_scheduler({s: 0.05 for s in Side}, {s: True for s in Side}, rtt)
    assert same.choose(Side.DEVICE, 6) == Side.DEVICE and same.choose(Side.CLOUD, 6) == Side.CLOUD


def test_auto_scheduler_stays_until_rtt_and_both_decode_times_are_known():
    c = {Side.DEVICE: 0.01, Side.CLOUD: 0.1}
    acc = {Side.DEVICE: True, Side.CLOUD: False}
    assert fed_scheduler(c, acc, None).choose(Side.DEVICE, 6) == Side.DEVICE  # no rtt
    no_cloud = fed_scheduler(c, acc, 0.2, sides=(Side.DEVICE,))
    assert no_cloud.choose(Side.DEVICE, 6) == Side.DEVICE  # no cloud decode time
    no_device = fed_scheduler(c, acc, 0.2, sides=(Side.CLOUD,))
    assert no_device.choose(Side.DEVICE, 6) == Side.DEVICE
    assert fed_scheduler(c, acc, 0.2).choose(Side.DEVICE, 6) == Side.CLOUD  # all known: moves


# ---------------------------------------------------------------------------- DRDG/SW's math


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.5])
def test_side_logprobs_is_the_log_of_the_whole_mixture(temperature):
    """log Σ_d softmax(R)_d softmax(z_d / T)[x_t] at every position, with a −inf logit (an
    impossible token for one document), a one-hot document and tied logits."""
    from collab.dragon.ledger import side_logprobs

    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 5, 7))
    logits[0, :, 2] = -np.inf
    logits[1] = np.where(np.arange(7) == 4, 50.0, -50.0)
    logits[2, 0] = 1.0
    scores = np.array([2.0, -1.0, 0.3])
    tokens = np.array([2, 4, 0, 6, 2])
    got = side_logprobs(logits, scores, tokens, temperature)
    t = temperature or 1.0
    w = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
    for pos, x in enumerate(tokens):
        z = logits[:, pos] / t
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        assert got[pos] == pytest.approx(np.log(w @ p[:, x]), rel=1e-9, abs=1e-9)


def test_sequence_choice_greedy_and_sampled():
    """P(y) = η^d P^d(y) + η^c P^c(y) over the two whole answers: greedy keeps the likelier
    (the device's on a tie); sampling keeps each in proportion (χ² over 4,000 draws), and an
    impossible answer under both mixtures is never kept."""
    from collab.dragon.ledger import sequence_choice

    rng = np.random.default_rng(0)
    h = (0.0, np.log(3.0))  # η = (1/4, 3/4)
    device_answer = (np.log(0.2), np.log(0.1))  # P = 0.25·0.2 + 0.75·0.1 = 0.125
    cloud_answer = (np.log(0.05), np.log(0.5))  # P = 0.0125 + 0.375 = 0.3875
    assert sequence_choice(device_answer, cloud_answer, h, True, rng) == Side.CLOUD
    assert sequence_choice(cloud_answer, cloud_answer, h, True, rng) == Side.DEVICE
    draws = [sequence_choice(device_answer, cloud_answer, h, False, rng) for _ in range(4000)]
    n_cloud = sum(d == Side.CLOUD for d in draws)
    p = 0.3875 / (0.3875 + 0.125)
    assert stats.binomtest(n_cloud, 4000, p).pvalue > 1e-3
    impossible = (-np.inf, -np.inf)
    assert all(
        sequence_choice(impossible, cloud_answer, h, False, rng) == Side.CLOUD for _ in range(200)
    )


def test_the_first_draft_s_prefill_time_is_not_a_decode_time():
    """A side's first draft comes from its prefill (seconds, with documents); taking that as
    a decode time made the cloud look ~0.6 s a token slower for a whole answer (EWMA)."""
    sched = Scheduler(AggregatorPolicy.AUTO)
    probs = np.array([1.0], np.float16)
    sched.observe_draft(Side.CLOUD, DragonDraft(0, np.array([0]), probs, 0.0, 11.0, step=0))
    assert sched.profiles[Side.CLOUD].mean is None
    for step in range(1, 6):
        sched.observe_draft(Side.CLOUD, DragonDraft(0, np.array([0]), probs, 0.0, 0.15, step=step))
    assert sched.profiles[Side.CLOUD].mean == pytest.approx(0.15)
    assert sched.profiles[Side.CLOUD].decode_at(20) == pytest.approx(0.15)
