"""Split verified inside the engine (vLLM, docs/architecture.md#split-on-vllm): the row math
its logits processor runs (`cloud_backend.vllm_draws.step_logits`) against the NumPy
reference verification, and whole answers assembled from single draws as the cloud does
(`SplitRequest.judge_inside`: first mismatch, coin rejections), every frame through the
codec, against the exact law. The full path through vLLM is tests/test_vllm_backend.py."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from scipy import stats

from cloud_backend.vllm_draws import Draws, step_logits
from collab.sampling import SamplingParams, distribution, sample_from
from collab.variants import get_variant
from collab.variants.base import DraftTarget
from collab.verification import draw_distribution, verify_one
from tests.test_math_edges import (
    EXACT,
    P_CLOUD,
    P_MODEL,
    Q_KNOWS,
    V,
    chi2_against,
    draft_round,
    exact_answers,
    rapid_law,
    wire,
)

N = 20_000


def engine_law(logits: np.ndarray, draws: Draws, i: int = 0) -> np.ndarray:
    """What vLLM samples from at step i: softmax of what the processor returns."""
    out = step_logits(np.asarray(logits, dtype=np.float32), draws, i, [])
    return np.exp(out.astype(np.float64)) / np.exp(out.astype(np.float64)).sum()


def reference_tokens(x: int, p: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> list[int]:
    """The NumPy reference: `verify_one`'s token, N times."""
    return [verify_one(x, p, q, rng)[1] for _ in range(N)]


def chi2_p(tokens: list[int], law: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=law.size)
    if counts[law == 0].any():
        return 0.0
    keep = law * len(tokens) >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(law[keep], law[~keep].sum()) * len(tokens)
    nonzero = exp > 0
    if nonzero.sum() < 2:  # one possible token: every draw must be it
        return 1.0 if obs[nonzero].sum() == len(tokens) else 0.0
    return float(stats.chisquare(obs[nonzero], exp[nonzero]).pvalue)


def case(name: str, rng: np.random.Generator, params: SamplingParams) -> tuple:
    """(logits, p, draft, q) for a named adversarial case over a 40-token vocabulary (logits
    scaled with T, so p is as spread at every temperature and a bias shows)."""
    logits = rng.normal(0, 1.5, 40) * params.temperature
    p = distribution(logits, params)
    if name == "q zero where p > 0":
        q = np.zeros(40)
        top = np.argsort(-p)[:6]
        q[top[3:]] = rng.dirichlet(np.ones(3))  # q misses p's three likeliest tokens
    elif name == "p equals q":
        q = p.copy()
    else:  # "q peaked away from p"
        q = rng.dirichlet(np.ones(40) * 0.2)
    x = int(np.argmax(np.where(q > 0, q - p, -np.inf)))  # q's likeliest excess: a < 1 if any
    return logits, p, x, q


CASES = ["q zero where p > 0", "p equals q", "q peaked away from p"]
TEMPERATURES = [0.3, 0.7, 1.0]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_the_engine_draws_what_the_reference_verification_outputs(name, temperature):
    rng = np.random.default_rng(hash((name, temperature)) % 2**32)
    params = SamplingParams(
        temperature,
        top_k=30 if temperature == 0.7 else 0,
        top_p=0.95 if temperature == 0.3 else 1.0,
    )
    logits, p, x, q = case(name, rng, params)
    ids = np.flatnonzero(q)
    draws = Draws(params, [DraftTarget(x, ids, q[ids])])
    law = engine_law(logits, draws)
    np.testing.assert_allclose(law.sum(), 1.0, atol=1e-6)
    tokens = reference_tokens(x, p, q, rng)
    assert chi2_p(tokens, law) > 1e-3
    if name != "p equals q":  # negative control: a residual that ignores q is told apart
        a = min(1.0, p[x] / q[x])
        ignoring_q = (1 - a) * p
        ignoring_q[x] += a
        assert 0.5 * np.abs(ignoring_q - law).sum() > 0.03  # far enough apart to show
        assert chi2_p(tokens, ignoring_q) < 1e-6


def test_a_draft_outside_q_is_refused_and_p_equal_q_always_accepts():
    params = SamplingParams(0.7)
    rng = np.random.default_rng(3)
    logits, p, x, q = case("p equals q", rng, params)
    ids = np.flatnonzero(q)
    law = engine_law(logits, Draws(params, [DraftTarget(x, ids, q[ids])]))
    assert law[x] == pytest.approx(1.0, abs=1e-6)  # p == q: a = 1, nothing else possible
    with pytest.raises(ValueError, match="support"):
        draw_distribution(p, x, np.asarray([(x + 1) % 40]), np.asarray([1.0]))
    with pytest.raises(ValueError, match="q\\(x\\) > 0"):
        draw_distribution(p, x, np.asarray([x, (x + 1) % 40]), np.asarray([0.0, 1.0]))


def test_a_coin_draws_the_draft_exactly_when_accepted_and_a_sentinel_otherwise():
    p = np.array([0.1, 0.6, 0.3])
    out = draw_distribution(p, 2, np.asarray([2]), np.asarray([0.5]), coin=True)
    np.testing.assert_allclose(out, [0.4, 0.0, 0.6])  # a = 0.3 / 0.5 on the draft, s = 0 (mod V)
    with pytest.raises(ValueError, match="coin"):
        draw_distribution(p, 2, np.asarray([1, 2]), np.asarray([0.5, 0.5]), eta=1.0)


def test_steps_after_a_rejection_are_moot():
    """Past a drawn token that is not its step's draft, the context holds a correction: the
    processor returns a cheap one-hot and the cloud never reads it."""
    params = SamplingParams(1.0)
    draws = Draws(params, [DraftTarget(1, np.asarray([1]), np.asarray([1.0])), None])
    out = step_logits(np.zeros(5, dtype=np.float32), draws, 1, [3])
    assert np.isfinite(out).sum() == 1


def test_draws_survive_the_trip_through_extra_args():
    coin = DraftTarget(4, np.asarray([4, 9]), np.asarray([0.25, 0.75]), 2.0, True)
    draws = Draws(SamplingParams(0.7, 5, 0.9), [coin, None])
    back = Draws.read(draws.extra_args()[next(iter(draws.extra_args()))])
    assert back.params == draws.params and back.steps[1] is None
    got, want = back.steps[0], draws.steps[0]
    assert got is not None and want is not None
    assert (got.draft, got.eta, got.coin) == (want.draft, want.eta, want.coin)
    np.testing.assert_array_equal(got.q_ids, want.q_ids)
    np.testing.assert_array_equal(got.q_probs, want.q_probs)


# ---- whole answers, several positions: rejections, corrections, bonus tokens ---------------


def inside_answer(
    variant, gamma: int, length: int, rng: np.random.Generator, ignore_q: bool = False
) -> tuple[int, ...]:
    """As `tests.test_math_edges.split_answer`, verified the way the cloud does on vLLM: one
    draw per position from the processor's row (independent coins), the first token that is
    not its draft ends the round; a coin rejection takes P_j (DSSD: to the device).
    `ignore_q`: a processor whose residual ignores q (a negative control)."""
    out: list[int] = []
    params = SamplingParams(1.0)
    while len(out) < length:
        drafts, frame, tokens = draft_round(variant, gamma, out, rng)
        targets = variant.draft_targets(frame, np.asarray(frame.token_ids), V)
        draws = Draws(params, [*targets, None])
        drawn: list[int] = []
        for k in range(gamma + 1):
            with np.errstate(divide="ignore"):
                logits = np.log(P_MODEL(tuple(out + tokens[:k])))
            law = engine_law(logits, draws, k)
            if ignore_q and k < gamma and not targets[k].coin:
                p = distribution(logits, params)
                law = law[targets[k].draft] * np.eye(V)[targets[k].draft]
                law = law + (1 - law.sum()) * p
            drawn.append(sample_from(law, rng))
            if k == gamma or drawn[-1] != tokens[k]:
                break
        n = next((k for k in range(min(len(drawn), gamma)) if drawn[k] != tokens[k]), gamma)
        if n == gamma:
            out += tokens + [drawn[gamma]]
            continue
        token: int | None = drawn[n]
        if targets[n].coin:
            p = P_MODEL(tuple(out + tokens[:n]))
            verdict = wire(variant.coin_rejection(n, p, targets[n], rng).verdict())
            token = verdict.token
            if token is None:
                token = variant.correct(verdict, drafts[n].q, rng)
        out += tokens[:n] + [token]
    return tuple(out[:length])


@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("name", EXACT)
def test_answers_verified_inside_follow_the_cloud_over_several_positions(name, gamma):
    variant, rng, length = get_variant(name), np.random.default_rng(gamma + 100), 3
    counts = Counter(inside_answer(variant, gamma, length, rng) for _ in range(3000))
    assert chi2_against(counts, exact_answers(length)) > 1e-3


def test_a_residual_that_ignores_q_fails_the_same_test():
    variant, rng, length = get_variant("tk-slt"), np.random.default_rng(9), 3
    counts = Counter(inside_answer(variant, 3, length, rng, ignore_q=True) for _ in range(3000))
    assert chi2_against(counts, exact_answers(length)) < 1e-6


@pytest.mark.parametrize("name", ["tk-slt", "dsd"])
def test_rapid_inside_follows_its_formula(name):
    """η > 0: the engine draws only the coin, the cloud the residual from one row: the token a
    round decides follows docs/math.md#rapid's law, as on the rows path."""
    variant, rng, eta = get_variant(name), np.random.default_rng(6), 4.0
    sent = variant.draft(Q_KNOWS, rng).q
    law, _ = rapid_law(P_CLOUD, sent, eta)
    params = SamplingParams(1.0)
    out = []
    for _ in range(4000):
        drafted = variant.draft(Q_KNOWS, rng)
        frame = wire(variant.draft_frame([drafted], V + 1, request_id=1, epoch=0, step=0))
        (target,) = variant.draft_targets(frame, np.asarray(frame.token_ids), V + 1, eta)
        assert target.coin
        drawn = sample_from(engine_law(np.log(P_CLOUD), Draws(params, [target])), rng)
        if drawn == target.draft:
            out.append(drawn)
        else:
            out.append(wire(variant.coin_rejection(0, P_CLOUD, target, rng).verdict()).token)
    counts = np.bincount(out, minlength=V + 1)
    assert stats.chisquare(counts, law * len(out)).pvalue > 1e-3
    assert stats.chisquare(counts, P_CLOUD * len(out)).pvalue < 1e-6


def test_dssd_refuses_rapid_and_a_q_outside_zero_one_before_anything_is_drawn():
    dssd = get_variant("dssd")
    rng = np.random.default_rng(1)
    frame = wire(dssd.draft_frame([dssd.draft(Q_KNOWS, rng)], V + 1, request_id=1, epoch=0, step=0))
    with pytest.raises(ValueError, match="RAPID"):
        dssd.draft_targets(frame, np.asarray(frame.token_ids), V + 1, eta=1.0)
    bad = dataclasses.replace(frame, q=np.asarray([1.5], dtype=np.float32))
    with pytest.raises(ValueError, match="q\\(x\\)"):
        dssd.draft_targets(bad, np.asarray(bad.token_ids), V + 1)
