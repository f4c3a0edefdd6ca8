"""Sampling helpers: the returned distribution is exactly the one tokens are drawn from."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from collab.sampling import GREEDY, SamplingParams, distribution, sample, sample_from, softmax

ALPHA = 1e-3  # significance of every χ² test here


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the distribution's support was drawn"
    expected = probs[support] * counts.sum()
    return float(stats.chisquare(counts[support], expected).pvalue)


def draw(logits: np.ndarray, params: SamplingParams, n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    counts = np.zeros(logits.size, dtype=np.int64)
    probs = None
    for _ in range(n):
        token, probs = sample(logits, rng, params)
        counts[token] += 1
    return counts, probs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=6, top_p=0.7),
    ],
)
def test_samples_follow_the_returned_distribution(params):
    logits = np.random.default_rng(0).normal(size=12) * 1.5
    counts, probs = draw(logits, params, 30_000)
    assert chi_square_p(counts, probs) > ALPHA


def test_chi_square_rejects_a_wrong_distribution():
    """Negative control: samples at T=0.7 tested against the T=1 distribution must fail."""
    logits = np.random.default_rng(0).normal(size=12) * 1.5
    counts, _ = draw(logits, SamplingParams(temperature=0.7), 30_000)
    assert chi_square_p(counts, softmax(logits)) < ALPHA


def test_temperature_top_k_top_p_shape_the_distribution():
    logits = np.array([3.0, 2.0, 1.0, 0.0, -1.0])
    np.testing.assert_allclose(distribution(logits), softmax(logits))
    p = distribution(logits, SamplingParams(top_k=2))
    assert (p[2:] == 0).all()
    np.testing.assert_allclose(p[:2], softmax(logits[:2]))
    full = softmax(logits)
    p = distribution(logits, SamplingParams(top_p=0.9))
    # nucleus: the smallest prefix (by probability) whose mass reaches 0.9
    n = int(np.searchsorted(np.cumsum(full), 0.9)) + 1
    assert (p[:n] > 0).all() and (p[n:] == 0).all()
    np.testing.assert_allclose(p.sum(), 1.0)
    cold = distribution(logits, SamplingParams(temperature=0.1))
    assert cold[0] > 0.9999


def test_greedy_is_one_hot_argmax():
    logits = np.random.default_rng(3).normal(size=151_936).astype(np.float32)
    token, probs = sample(logits, np.random.default_rng(0), GREEDY)
    assert token == int(np.argmax(logits))
    assert probs[token] == 1.0 and probs.sum() == 1.0


def test_top_p_on_full_vocabulary_matches_a_full_sort():
    """The partial-sort nucleus equals the obvious full-sort one, on a flat distribution that
    forces the candidate set to grow."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=151_936) * 0.3
    p = distribution(logits, SamplingParams(top_p=0.5))
    full = softmax(logits)
    order = np.argsort(-full, kind="stable")
    n = int(np.searchsorted(np.cumsum(full[order]), 0.5)) + 1
    expected = np.zeros_like(full)
    expected[order[:n]] = full[order[:n]]
    np.testing.assert_allclose(p, expected / expected.sum(), rtol=1e-12, atol=0)


def test_bad_params_are_refused():
    for bad in ({"temperature": -1}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_blocked_inverse_cdf_on_a_large_vocabulary():
    """Above a few thousand ids, sampling walks block sums then one block: still exactly the
    distribution, never a zero-probability id (mass placed at block edges and in gaps)."""
    rng = np.random.default_rng(7)
    v = 20_000
    probs = np.zeros(v)
    ids = np.array(
        [0, 1, 255, 256, 257, 511, 512, 4095, 9000, 9001, 19_999] + list(range(300, 330))
    )
    probs[ids] = rng.dirichlet(np.ones(ids.size))
    counts = np.zeros(v, dtype=np.int64)
    for _ in range(60_000):
        counts[sample_from(probs, rng)] += 1
    assert counts[probs == 0].sum() == 0
    assert chi_square_p(counts, probs) > ALPHA
    # negative control: the same draws against a perturbed distribution must fail
    wrong = probs.copy()
    wrong[ids[:5]] *= 1.5
    assert chi_square_p(counts, wrong / wrong.sum()) < ALPHA
