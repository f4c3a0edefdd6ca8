"""The perplexity study (benchmarks/dragon_ppl.py, DRAGON §7.3): windows, retrieval split
between the sides, every method's teacher-forced log-likelihood against a brute-force
computation on a tiny model, the targets' arithmetic (`--quick` with the real models, whose
cloud half travels over a real server: tests/test_dragon_eval.py)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.dragon_ppl import (
    CONTROL,
    DOC_TOKENS,
    METHODS,
    Documents,
    Window,
    check_targets,
    logprobs,
    make_windows,
    perplexities,
    random_documents,
    retrieval_share,
    retrieve,
    score_window,
    with_docs,
)
from benchmarks.heldout import Article, plain_text
from benchmarks.tiny_models import build_tiny_hf
from collab.dragon.ledger import relevance
from model_runtime.torch_runtime import TorchCausalLM


@pytest.fixture(scope="module")
def lms(tiny, tmp_path_factory):
    other = build_tiny_hf(tiny["tokenizer"], tmp_path_factory.mktemp("d") / "hf", seed=1)
    return TorchCausalLM(other), TorchCausalLM(tiny["hf"])  # device, cloud


def brute_logprob(lm, context, targets):
    """log p of each target by a fresh prefill of each prefix: no cache, no batching."""
    out = []
    for t, token in enumerate(targets):
        z = lm.prefill([list(context) + list(targets[:t])])[0].astype(np.float64)
        out.append(z[token] - np.log(np.exp(z - z.max()).sum()) - z.max())
    return np.array(out)


def test_windows_take_each_article_in_turn(tiny_tokenizer):
    articles = [Article("A", "alpha beta gamma delta " * 60), Article("B", "one two three " * 60)]
    windows = make_windows(articles, tiny_tokenizer, 3, width=32)
    assert [w.title for w in windows] == ["A", "B", "A"]
    assert all(len(w.ids) == 32 and w.split == 4 for w in windows)
    assert windows[2].ids == tiny_tokenizer.encode(articles[0].text)[32:64]


def test_logprobs_equal_a_fresh_prefill_of_every_prefix(lms, tiny_tokenizer):
    device, _ = lms
    ctx = tiny_tokenizer.encode("The capital of France is")
    tgt = tiny_tokenizer.encode(" Paris, a city on the Seine.")
    np.testing.assert_allclose(
        logprobs(device, ctx, tgt), brute_logprob(device, ctx, tgt), atol=1e-4
    )


def test_every_method_is_what_its_definition_says(lms, tiny_tokenizer):
    device, cloud = lms
    enc = tiny_tokenizer.encode
    window = Window(
        "X",
        enc(
            "Albedo is the fraction of sunlight that a surface reflects, "
            "measured on a scale from zero to one."
        )[:24],
    )
    docs = Documents(
        cloud=[enc("Snow reflects most light.")[:DOC_TOKENS], enc("Oceans absorb light.")],
        device=[enc("Charcoal is dark.")],
        cloud_scores=relevance(np.array([0.6, 0.3])),
        device_scores=relevance(np.array([0.5])),
    )
    sep = enc("\n\n")
    got = score_window(window, docs, [0, 1, 2], device, cloud, sep)
    ctx, tgt = window.context, window.targets

    def total(lm, context):
        return float(brute_logprob(lm, context, tgt).sum())

    bare_d, bare_c = total(device, ctx), total(cloud, ctx)
    assert set(got) == set(METHODS) - {"dragon-rerank"}  # no rescoring given
    for m in got:  # no documents: the model alone
        assert got[m][0] == pytest.approx(
            bare_c if m in ("crcg-cloud", "cloud-alone") else bare_d, abs=1e-3
        )
    assert got["crcg-device"][2] == pytest.approx(
        total(device, with_docs(docs.device, sep, ctx)), abs=1e-3
    )  # only one device document
    assert got["crcg-cloud"][2] == pytest.approx(
        total(cloud, with_docs(docs.cloud, sep, ctx)), abs=1e-3
    )
    order = [docs.cloud[0], docs.device[0], docs.cloud[1]]  # ranks 1, 2, 3
    assert got["drcg"][2] == pytest.approx(total(device, with_docs(order, sep, ctx)), abs=1e-3)
    # DRAGON: Σ_t log Σ_d softmax(R)_d p_d(x_t), each document read by its own side's model
    rows = [brute_logprob(cloud, with_docs([d], sep, ctx), tgt) for d in docs.cloud]
    rows.append(brute_logprob(device, with_docs(docs.device, sep, ctx), tgt))
    r = np.concatenate([docs.cloud_scores, docs.device_scores])
    w = np.exp(r - r.max()) / np.exp(r - r.max()).sum()
    want = float(np.log(w @ np.exp(np.array(rows))).sum())
    assert got["dragon"][2] == pytest.approx(want, abs=1e-3)
    assert got["dragon"][1] != pytest.approx(want, abs=1e-3)  # one document a side differs


def test_retrieval_alternates_between_the_sides_and_skips_the_own_article(
    public_corpus, tiny_tokenizer
):
    first = public_corpus.search("history", 1)[0]
    window = Window(first.title, tiny_tokenizer.encode(first.text)[:64])
    docs = retrieve(public_corpus, tiny_tokenizer, window, 3)
    query = tiny_tokenizer.decode(window.context)
    ranked = [h for h in public_corpus.search(query, 20) if h.title != first.title][:6]
    assert docs.cloud == [tiny_tokenizer.encode(h.text)[:DOC_TOKENS] for h in ranked[0::2]]
    assert docs.device == [tiny_tokenizer.encode(h.text)[:DOC_TOKENS] for h in ranked[1::2]]
    assert all(len(d) <= DOC_TOKENS for d in docs.cloud + docs.device)
    np.testing.assert_allclose(
        docs.cloud_scores, relevance(np.array([h.score for h in ranked[0::2]]))
    )


def test_perplexity_and_the_target():
    results = [
        {
            "dragon": {2: -10.0},
            "drcg": {2: -12.0},
            "crcg-device": {2: -9.0},
            "crcg-cloud": {2: -20.0},
            "no-retrieval": {2: -30.0},
            "cloud-alone": {2: -30.0},
        }
    ]
    ppl = perplexities(results, tokens=5)
    assert ppl["dragon"][2] == pytest.approx(np.exp(2.0))
    verdicts = {m: ok for _, m, ok in check_targets(ppl)}
    assert verdicts["drcg"] and not verdicts["crcg-device"]  # -9 beats dragon's -10


def test_plain_text_removes_the_markup():
    markup = (
        "'''Albedo''' is {{convert|0.3}} the [[light|fraction]] of [[Sun]]light"
        "<ref name=a>Smith 2001</ref> reflected.{{cite web|url=x}}\n"
        "[[File:Albedo.svg|thumb|A [[map]]]]\n== Physics ==\n* a list item\n"
        "{| class=wikitable\n| cell\n|}\n== References ==\nRef text"
    )
    assert (
        plain_text(markup)
        == "Albedo is the fraction of Sunlight reflected.\n\nPhysics\na list item"
    )


def test_reranking_recomputes_the_weights_every_eight_tokens(lms, tiny_tokenizer):
    """dragon-rerank: the retrieval scores for the first 8 positions, then softmax(20·cos) of
    each document with query + text scored so far, recomputed every 8; a rescoring that
    returns the retrieval cosines again changes nothing."""
    device, cloud = lms
    enc = tiny_tokenizer.encode
    text = "Albedo is the fraction of sunlight that a surface reflects, measured from 0 to 1."
    window = Window("X", enc(text)[:24])
    cos = np.array([0.6, 0.2])
    docs = Documents(
        [enc("Snow reflects most light.")],
        [enc("Charcoal is dark.")],
        relevance(cos[:1]),
        relevance(cos[1:]),
        ["c"],
        ["d"],
    )
    sep = enc("\n\n")
    seen = []

    def flipped(hits, text):
        seen.append(text)
        return cos[::-1].copy()  # after 8 tokens the device's document is the relevant one

    got = score_window(window, docs, [1], device, cloud, sep, (flipped, tiny_tokenizer.decode))
    same = score_window(
        window,
        docs,
        [1],
        device,
        cloud,
        sep,
        (lambda hits, text: cos.copy(), tiny_tokenizer.decode),
    )
    assert same["dragon-rerank"][1] == pytest.approx(same["dragon"][1])
    ctx, tgt = window.context, window.targets
    rows = np.array(
        [
            brute_logprob(cloud, with_docs(docs.cloud, sep, ctx), tgt),
            brute_logprob(device, with_docs(docs.device, sep, ctx), tgt),
        ]
    )
    w0, w1 = (np.exp(relevance(c)) / np.exp(relevance(c)).sum() for c in (cos, cos[::-1]))
    weights = np.array([w0 if t < 8 else w1 for t in range(len(tgt))]).T
    assert got["dragon-rerank"][1] == pytest.approx(
        float(np.log((weights * np.exp(rows)).sum(0)).sum()), abs=1e-3
    )
    assert len(seen) == (len(tgt) - 1) // 8
    assert seen[0] == tiny_tokenizer.decode(ctx) + " " + tiny_tokenizer.decode(tgt[:8])


def test_the_random_control_is_dragons_mixture_over_other_documents(lms, tiny_tokenizer):
    """dragon-random aggregates its documents exactly as dragon does: given the retrieved
    documents it equals dragon; given others, the brute-force mixture over those."""
    device, cloud = lms
    enc = tiny_tokenizer.encode
    window = Window(
        "X",
        enc(
            "Albedo is the fraction of sunlight that a surface reflects, "
            "measured on a scale from zero to one."
        )[:24],
    )
    docs = Documents(
        [enc("Snow reflects most light.")],
        [enc("Charcoal is dark.")],
        relevance(np.array([0.6])),
        relevance(np.array([0.5])),
    )
    other = Documents(
        [enc("Trains run on rails."), enc("Cats sleep a lot.")],
        [enc("Bread needs yeast.")],
        relevance(np.array([0.1, 0.05])),
        relevance(np.array([0.2])),
    )
    sep = enc("\n\n")
    same = score_window(window, docs, [0, 1], device, cloud, sep, control=docs)
    assert same[CONTROL] == pytest.approx(same["dragon"], abs=1e-9)
    got = score_window(window, docs, [0, 2], device, cloud, sep, control=other)
    ctx, tgt = window.context, window.targets
    rows = [brute_logprob(cloud, with_docs([d], sep, ctx), tgt) for d in other.cloud]
    rows.append(brute_logprob(device, with_docs(other.device, sep, ctx), tgt))
    r = np.concatenate([other.cloud_scores, other.device_scores])
    w = np.exp(r - r.max()) / np.exp(r - r.max()).sum()
    assert got[CONTROL][2] == pytest.approx(
        float(np.log(w @ np.exp(np.array(rows))).sum()), abs=1e-3
    )
    assert got[CONTROL][0] == pytest.approx(got["no-retrieval"][0])
    plain = score_window(window, docs, [0, 2], device, cloud, sep)
    assert CONTROL not in plain and {m: v for m, v in got.items() if m != CONTROL} == plain


def test_random_documents_are_drawn_from_the_corpus_not_retrieved(public_corpus, tiny_tokenizer):
    first = public_corpus.search("history", 1)[0]
    window = Window(first.title, tiny_tokenizer.encode(first.text)[:64])
    control = random_documents(public_corpus, tiny_tokenizer, window, 3, np.random.default_rng(0))
    again = random_documents(public_corpus, tiny_tokenizer, window, 3, np.random.default_rng(0))
    assert len(control.cloud) == len(control.device) == 3 and control.cloud == again.cloud
    hits = control.cloud_hits + control.device_hits
    assert len({h.chunk_id for h in hits}) == 6 and first.title not in {h.title for h in hits}
    assert all(len(d) <= DOC_TOKENS for d in control.cloud + control.device)
    retrieved = retrieve(public_corpus, tiny_tokenizer, window, 3)
    assert control.cloud + control.device != retrieved.cloud + retrieved.device
    cos = public_corpus.rescore(control.cloud_hits, tiny_tokenizer.decode(window.context))
    np.testing.assert_allclose(
        control.cloud_scores, relevance(np.asarray(cos, np.float64)), rtol=1e-5
    )


def test_retrieval_share_of_the_gain():
    ppl = {
        "no-retrieval": {0: 20.0, 2: 20.0},
        "dragon": {0: 20.0, 2: 10.0},
        CONTROL: {0: 20.0, 2: float(np.sqrt(200.0))},
    }
    assert retrieval_share(ppl) == {2: pytest.approx(0.5)}  # half the log-gain is retrieval
    assert retrieval_share({"dragon": {2: 1.0}}) == {}
