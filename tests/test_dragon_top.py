"""DRAGON from each document's top tokens (vLLM, `collab.dragon.top`): wherever they settle the
transmitted distribution, it is the one the rows give, id for id and value for value; where
they cannot, they say so (and the peer asks for the rows: tests/test_vllm_backend.py)."""

from __future__ import annotations

import numpy as np
import pytest

from collab.dragon.aggregation import logsumexp
from collab.dragon.ledger import DRAGON_MAX_SPARSE, DRAGON_TOP_P, side_distribution
from collab.dragon.top import TOP_K, TopDocuments, Unsettled
from collab.sampling import SamplingParams

V = 4000


def rows(rng: np.random.Generator, docs: int, peak: float) -> np.ndarray:
    """Per-document logits [D, V]: a shared heavy tail, each document its own peaks."""
    z = rng.normal(0, 1, (docs, V))
    for d in range(docs):
        z[d, rng.choice(V, 12, replace=False)] += peak * rng.random(12)
    return z.astype(np.float32)


def top_of(logits: np.ndarray, temperature: float, k: int) -> TopDocuments:
    """What vLLM hands out: each document's k likeliest tokens, log softmax(z / T) there."""
    z = logits.astype(np.float64) / (temperature or 1.0)
    logp = z - logsumexp(z, axis=1)[:, None]
    ids = np.argsort(-logp, axis=1, kind="stable")[:, :k]
    return TopDocuments.of(list(ids), list(np.take_along_axis(logp, ids, axis=1)))


def asked(top: TopDocuments, logits: np.ndarray, temperature: float, scores) -> TopDocuments:
    """`top` completed as the engine would (`TopDocumentBatch.completed`)."""
    z = logits.astype(np.float64) / (temperature or 1.0)
    logp = z - logsumexp(z, axis=1)[:, None]
    wanted = top.missing(scores)
    return top.with_values(wanted, [logp[d, w] for d, w in enumerate(wanted)])


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("docs", [1, 2, 3])
def test_settled_top_tokens_give_the_rows_distribution_exactly(temperature, docs):
    rng = np.random.default_rng(docs * 10 + int(temperature * 10))
    params = SamplingParams(temperature)
    settled = alone = 0
    for _ in range(40):
        logits = rows(rng, docs, peak=9.0)
        scores = rng.normal(0, 2, docs)
        want = side_distribution(logits, scores, params, DRAGON_TOP_P, DRAGON_MAX_SPARSE)
        top = top_of(logits, temperature, TOP_K)
        try:
            got = side_distribution(top, scores, params, DRAGON_TOP_P, DRAGON_MAX_SPARSE)
            alone += 1
        except Unsettled:
            try:
                got = side_distribution(
                    asked(top, logits, temperature, scores),
                    scores,
                    params,
                    DRAGON_TOP_P,
                    DRAGON_MAX_SPARSE,
                )
            except Unsettled:
                continue
        settled += 1
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert settled >= 36  # peaked rows settle nearly always (asking for what is missing)
    if docs == 1:
        assert alone == settled  # one document: its top tokens alone


def test_flat_rows_or_too_few_tokens_do_not_settle():
    rng = np.random.default_rng(4)
    flat = rng.normal(0, 0.1, (2, V)).astype(np.float32)
    with pytest.raises(Unsettled):
        side_distribution(top_of(flat, 1.0, 128), np.zeros(2), SamplingParams(1.0), 0.8, 32)
    peaked = rows(rng, 2, peak=9.0)
    with pytest.raises(Unsettled):  # the wire's 32 pairs out of 8 listed tokens: unknowable
        side_distribution(top_of(peaked, 1.0, 8), np.zeros(2), SamplingParams(1.0), 0.999, 32)


def test_an_unlisted_token_may_beat_a_listed_one_and_is_not_ignored():
    """Document 0 lists a, document 1 lists b; each document's unlisted token could hold up to
    its K-th value, so neither a nor b is known to lead: unsettled, never a guess."""
    top = TopDocuments.of([np.array([1, 2]), np.array([3, 4])], [np.log([0.6, 0.3])] * 2)
    with pytest.raises(Unsettled):
        top.settle(np.zeros(2), 0.5, 32)
    assert [m.tolist() for m in top.missing(np.zeros(2))] == [[3, 4], [1, 2]]
    told = top.with_values(
        [np.array([3, 4]), np.array([1, 2])], [np.log([0.05, 0.01]), np.log([0.2, 0.01])]
    )
    ids, values = told.settle(np.zeros(2), 0.5, 32)  # 1: 0.4, 3: 0.325, then 2 and 4
    assert ids.tolist() == [1, 3] and values == pytest.approx([0.4, 0.325])
    sure = TopDocuments.of([np.array([1, 2])] * 2, [np.log([0.9, 0.05]), np.log([0.8, 0.1])])
    ids, values = sure.settle(np.zeros(2), 0.5, 32)
    assert ids.tolist() == [1] and values[0] == pytest.approx(0.85)
