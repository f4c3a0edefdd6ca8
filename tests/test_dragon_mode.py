"""DRAGON end to end over a real aiohttp server on loopback, with tiny float32 models: the
device model reads private passages, the cloud model public ones (a real public corpus of 60
Wikipedia summaries, a real private index), and every token is aggregated across the link."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from scipy import stats as scipy_stats

from app.embedded import read_metrics
from benchmarks.tiny_models import TINY_CONTEXT
from cloud_backend.config import ServerConfig
from cloud_backend.engine import LLMEngine
from cloud_backend.server import create_app
from collab.dragon.ledger import (
    DRAGON_MAX_SPARSE,
    DRAGON_TOP_P,
    NO_DOCUMENT_COSINE,
    Scheduler,
    relevance,
    side_distribution,
)
from collab.sampling import GREEDY, SamplingParams
from collab.sources import PUBLIC_FLOOR, RELEVANCE_FLOOR
from edge_runtime.device import DeviceModel
from edge_runtime.events import Citation, Stats, TextDelta
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext
from model_runtime.prompting import document_prompt, prompt_budget
from model_runtime.tokenizer import IM_END_ID
from model_runtime.torch_runtime import TorchCausalLM
from retrieval.search import best_of, clauses
from tests.cloud import TOKEN

METRICS_TOKEN = "test-metrics-token-0123"
VOCAB = 151_936
# Relevant on both sides (above the relevance floor): the diary, and a summary among the first 60.
QUESTION = "Where is the spare key hidden, and what was the 1755 Lisbon earthquake?"
FLOOR = RELEVANCE_FLOOR  # the searches below mirror the product's, floors included


def searched(index, question, k, floor):
    """A side's hits as the product searches them: by the question and by each of its clauses
    (edge_runtime.turns, cloud_backend.modes.base), the search finding the best passage kept."""
    return best_of([index.search(q, k, floor) for q in [question, *clauses(question)]])


def public_docs(corpus, question, k):
    return [
        replace(p, number=i) for i, p in enumerate(searched(corpus, question, k, PUBLIC_FLOOR), 1)
    ]


@pytest.fixture(scope="module")
def device(far_device):
    """DRAGON's sides differ here: the far drafter (its weights: `far_weights`)."""
    return far_device


@pytest.fixture(scope="module")
def private_index(tmp_path_factory, embedder_dir):
    from personal_index.index import PersonalIndex

    docs = tmp_path_factory.mktemp("private")
    (docs / "diary.md").write_text(
        "# Private\nMy locker code is 4417 and the spare key hides under the blue flowerpot.\n"
    )
    (docs / "trip.txt").write_text("We stayed at the Casa Azul guesthouse in Aachen in May.\n")
    index = PersonalIndex(tmp_path_factory.mktemp("index"), embedder_dir)
    index.ingest([docs])
    return index


@pytest.fixture
def cloud_corpus(public_corpus):
    return public_corpus


@pytest.fixture
def cloud_config():
    return ServerConfig(token=TOKEN, corpus_enabled=False, corpus_k=2)


async def ask(mode, question, options, history=()):
    events = [e async for e in mode.answer(question, list(history), options)]
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    stats = [e for e in events if isinstance(e, Stats)]
    assert len(stats) == 1 and events[-1] is stats[0]
    return text, stats[0], events


def dragon(device, url, index, aggregator="auto", **kw):
    # a loopback cloud standing in for the embedded one: on-device, no consent asked
    ctx = ModeContext(
        device=device,
        index=index,
        cloud=CloudSettings(url, TOKEN, embedded=True),
        aggregator=aggregator,
        **kw,
    )
    return build_mode("dragon", ctx)


# ---------------------------------------------------------------------------- reference


def reference_answer(far_weights, cloud_dir, tokenizer, question, private, public, n, k=2):
    """A single process, no link: both sides' per-document sequences decoded in lockstep, the
    two sparse mixtures as they are transmitted, and the argmax of their weighted sum."""
    budget = prompt_budget(TINY_CONTEXT, n)
    hits = searched(private, question, k, FLOOR) if private is not None else []
    d_docs = [h.source(k + i, "device") for i, h in enumerate(hits, 1)]
    c_docs = public_docs(public, question, k) if public is not None else []
    sides = []
    for folder, docs in ((far_weights, d_docs), (cloud_dir, c_docs)):
        lm = TorchCausalLM(folder)
        prompts = [document_prompt(tokenizer, question, [], d, budget)[0] for d in docs or [None]]
        cosines = np.array([d.score for d in docs] or [NO_DOCUMENT_COSINE])
        sides.append([lm, relevance(cosines), lm.prefill(prompts)])
    h = [float(np.log(np.sum(np.exp(r)))) for _, r, _ in sides]
    eta = np.exp(np.array(h) - max(h))
    eta /= eta.sum()
    out: list[int] = []
    for _ in range(n):
        mixed = np.zeros(sides[0][2].shape[-1])
        for (_, r, logits), w in zip(sides, eta, strict=True):
            ids, probs = side_distribution(logits, r, GREEDY, DRAGON_TOP_P, DRAGON_MAX_SPARSE)
            p = probs.astype(np.float64)
            mixed[ids] += w * p / p.sum()
        token = int(np.argmax(mixed))
        if token == IM_END_ID:
            break
        out.append(token)
        for side in sides:
            side[2] = side[0].decode([token] * side[0].batch_size)
    return out


def alternate_every_3(self, current, step, frame_bytes=200):
    return current.other if step % 3 == 2 else current


@pytest.mark.parametrize("docs", ["both", "none"])
@pytest.mark.parametrize("aggregator", ["device", "cloud", "switching"])
async def test_greedy_dragon_equals_the_single_process_reference(
    docs,
    aggregator,
    tiny,
    far_weights,
    device,
    tiny_tokenizer,
    cloud_url,
    private_index,
    public_corpus,
    monkeypatch,
):
    if aggregator == "switching":
        monkeypatch.setattr(Scheduler, "choose", alternate_every_3)
    index = private_index if docs == "both" else None
    mode = dragon(
        device,
        cloud_url,
        index,
        "auto" if aggregator == "switching" else aggregator,
        retrieve_public=docs == "both",
    )
    n = 20
    options = AnswerOptions(max_new_tokens=n, temperature=0.0, k=2)
    _, stats, events = await ask(mode, QUESTION, options)
    await mode.close()
    expected = reference_answer(
        far_weights,
        tiny["hf"],
        tiny_tokenizer,
        QUESTION,
        index,
        public_corpus if docs == "both" else None,
        n,
    )
    assert stats.token_ids == expected
    assert stats.device_drafted > 0 and stats.cloud_drafted > 0
    if aggregator == "switching":
        assert stats.switches >= 4
    else:
        assert stats.switches == 0 and stats.aggregator == aggregator
    sides = {e.side for e in events if isinstance(e, Citation)}
    assert sides == ({"device", "cloud"} if docs == "both" else set())
    if docs == "none":  # equal weights: the sides disagree, so both get rejected at times
        assert stats.device_accepted < stats.device_drafted
        assert stats.cloud_accepted < stats.cloud_drafted


# ---------------------------------------------------------------------------- sampling


def mixture_after(far_weights, cloud_dir, tokenizer, prefix, params, which="mix"):
    """The exact target distribution (dense) after `prefix`, with no documents on either side
    (equal weights): ½ p^device + ½ p^cloud as transmitted; or one side's own ("device")."""
    budget = prompt_budget(TINY_CONTEXT, 8)
    prompt = document_prompt(tokenizer, QUESTION, [], None, budget)[0]
    out = np.zeros(VOCAB)
    for name, folder in (("device", far_weights), ("cloud", cloud_dir)):
        if which not in ("mix", name):
            continue
        lm = _lm(folder)
        logits = lm.prefill([prompt])
        for t in prefix:
            logits = lm.decode([t])
        ids, probs = side_distribution(
            logits, relevance(np.zeros(1)), params, DRAGON_TOP_P, DRAGON_MAX_SPARSE
        )
        p = probs.astype(np.float64)
        out[ids] += p / p.sum()
    return out / out.sum()


_LMS: dict = {}


def _lm(folder):
    if folder not in _LMS:
        _LMS[folder] = TorchCausalLM(folder)
    return _LMS[folder]


def chi_square_p(samples: list[int], probs: np.ndarray, groups: np.ndarray) -> float:
    """Pearson's χ² of token samples against probs. Tokens expected ≥ 5 times are bins of
    their own; the rest are pooled by `groups` (a label per token fixed before sampling: which
    side's transmitted support holds it), so a bias between the sides stays visible."""
    n = len(samples)
    counts = np.bincount(samples, minlength=probs.size)
    expected = probs * n
    if (counts[expected == 0] > 0).any():
        return 0.0  # a token the distribution says is impossible
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    for label in np.unique(groups[~big]):
        pool = ~big & (groups == label)
        if expected[pool].sum() > 0:
            obs.append(counts[pool].sum())
            exp.append(expected[pool].sum())
    return float(scipy_stats.chisquare(obs, exp).pvalue)


def prefer_accepted(x_l, p_l, x_r, p_r, eta_l, eta_r, rng):
    """Algorithm 1 with the coin replaced by "prefer a draft that survived" (biased)."""
    from collab.dragon.aggregation import aggregate_sample

    a = aggregate_sample(x_l, p_l, p_r, eta_r, rng)
    b = aggregate_sample(x_r, p_r, p_l, eta_l, rng)
    target = a if a == x_l else b if b == x_r else (a if rng.random() < 0.5 else b)
    return target, target == x_l, target == x_r


@pytest.mark.parametrize("control", [False, True])
async def test_sampled_first_token_follows_the_exact_mixture(
    control, tiny, far_weights, device, tiny_tokenizer, cloud_url, monkeypatch
):
    """Many one-token answers over the wire: the token follows ½ p^device + ½ p^cloud (as
    transmitted), not either side's own; without the coin the same test fails."""
    if control:
        monkeypatch.setattr("collab.dragon.ledger.speculative_aggregation", prefer_accepted)
    mode = dragon(device, cloud_url, None, "cloud", retrieve_public=False)
    firsts = []
    for seed in range(400):
        options = AnswerOptions(max_new_tokens=1, temperature=1.0, seed=seed, k=2)
        _, stats, _ = await ask(mode, QUESTION, options)
        firsts.append(stats.token_ids[0] if stats.token_ids else IM_END_ID)
    await mode.close()
    params = SamplingParams(temperature=1.0)
    mix = mixture_after(far_weights, tiny["hf"], tiny_tokenizer, [], params)
    own = mixture_after(far_weights, tiny["hf"], tiny_tokenizer, [], params, "device")
    cloud = mixture_after(far_weights, tiny["hf"], tiny_tokenizer, [], params, "cloud")
    groups = (own > 0) + 2 * (cloud > 0)
    if control:
        assert chi_square_p(firsts, mix, groups) < 1e-4
    else:
        assert chi_square_p(firsts, mix, groups) > 1e-3
        assert chi_square_p(firsts, own, groups) < 1e-6


async def test_sampled_token_after_a_rejection_follows_the_exact_mixture(
    tiny, far_weights, device, tiny_tokenizer, cloud_url
):
    """The second token of two-token answers, each after at least one rejection at the first
    step: given its own prefix it follows the exact mixture (randomised PIT: uniform under
    the mixture), and the device's own distribution could not have produced it."""
    mode = dragon(device, cloud_url, None, "device", retrieve_public=False)
    params = SamplingParams(temperature=1.0)
    rng = np.random.default_rng(7)
    u_mix, impossible_own = [], 0
    rejected = 0
    for seed in range(150):
        options = AnswerOptions(max_new_tokens=2, temperature=1.0, seed=seed, k=2)
        _, stats, _ = await ask(mode, QUESTION, options)
        if len(stats.token_ids) < 2:
            continue
        rejected += stats.device_accepted + stats.cloud_accepted < 2 * stats.rounds
        x0, x1 = stats.token_ids[:2]
        pi = mixture_after(far_weights, tiny["hf"], tiny_tokenizer, [x0], params)
        assert pi[x1] > 0
        u_mix.append(pi[:x1].sum() + rng.random() * pi[x1])
        own = mixture_after(far_weights, tiny["hf"], tiny_tokenizer, [x0], params, "device")
        impossible_own += own[x1] == 0
    await mode.close()
    assert rejected >= 100  # the sides disagree: the step-1 token comes after a rejection
    assert scipy_stats.kstest(u_mix, "uniform").pvalue > 1e-3
    assert impossible_own >= 30  # about half come from the cloud's support: not p^device


# ---------------------------------------------------------------------------- privacy, faults


async def test_dragon_never_sends_private_text_embeddings_or_cache(
    device, cloud_url, private_index
):
    from tests.test_modes import WireTap

    port = int(cloud_url.split(":")[2].split("/")[0])
    tap = WireTap(port)
    url = f"ws://127.0.0.1:{await tap.start()}/v1/session"
    mode = dragon(device, url, private_index, "auto")
    options = AnswerOptions(max_new_tokens=24, temperature=0.7, seed=3, k=2)
    _, stats, events = await ask(mode, QUESTION, options)
    await mode.close()
    await tap.close()
    assert {e.side for e in events if isinstance(e, Citation)} == {"device", "cloud"}
    frames = tap.payloads()
    wire = b"".join(frames)
    assert QUESTION.encode() in wire  # the tap sees what the device sends
    assert stats.device_drafted > 0
    hits = [h for q in [QUESTION, *clauses(QUESTION)] for h in private_index.search(q, k=5)]
    vectors = private_index.store.get_vectors([h.chunk_id for h in hits])
    for hit, vector in zip(hits, vectors, strict=True):
        chunk = hit.text.encode()
        for i in range(max(1, len(chunk) - 31)):
            assert chunk[i : i + 32] not in wire, f"private text left: {chunk[i : i + 32]}"
        raw = np.asarray(vector, dtype=np.float32).tobytes()
        for i in range(0, len(raw) - 31, 4):  # no embedding, in float32 or float16
            assert raw[i : i + 32] not in wire
        half = np.asarray(vector, dtype=np.float16).tobytes()
        assert all(half[i : i + 32] not in wire for i in range(0, len(half) - 31, 2))
    # no KV tensor either: one cached token of the tiny model alone is larger than any frame
    kv_per_token = device.lm._bytes_per_slot()
    assert max(len(f) for f in frames) < kv_per_token
    assert stats.bytes_up / max(stats.tokens, 1) < 1024


async def test_stale_drafts_from_an_old_epoch_are_dropped(
    tiny, far_weights, device, tiny_tokenizer, cloud_url, monkeypatch
):
    """After each rejection the device also sends a copy of its new draft stamped with the
    old epoch: the cloud drops every one, and the answer is the reference's."""
    from collab.protocol import DragonDraft
    from edge_runtime.client import CloudClient

    send = CloudClient.send
    injected = 0

    async def send_with_stale(self, msg):
        nonlocal injected
        if isinstance(msg, DragonDraft) and msg.epoch > 0:
            stale = DragonDraft(
                msg.token,
                msg.ids,
                msg.probs,
                msg.h,
                msg.decode_time,
                request_id=msg.request_id,
                epoch=msg.epoch - 1,
                step=msg.step,
            )
            await send(self, stale)
            injected += 1
        await send(self, msg)

    monkeypatch.setattr(CloudClient, "send", send_with_stale)
    mode = dragon(device, cloud_url, None, "cloud", retrieve_public=False)
    n = 16
    _, stats, _ = await ask(mode, QUESTION, AnswerOptions(max_new_tokens=n, temperature=0.0))
    await mode.close()
    assert injected > 0
    expected = reference_answer(far_weights, tiny["hf"], tiny_tokenizer, QUESTION, None, None, n)
    assert stats.token_ids == expected


async def test_cloud_killed_mid_answer_is_reported_and_the_device_finishes(
    tiny, device, private_index, tmp_path, monkeypatch
):
    from app.embedded import EmbeddedCloud
    from edge_runtime.events import Failure, Notice

    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    serve = [
        "--engine",
        "torch",
        "--dtype",
        "float32",
        "--model-dir",
        str(tiny["hf"]),
        "--no-corpus",
    ]
    cloud = await EmbeddedCloud.start(serve, timeout_s=120)
    try:
        ctx = ModeContext(
            device, private_index, CloudSettings(cloud.url, cloud.token, embedded=True)
        )
        mode = build_mode("dragon", ctx)
        events, killed = [], False
        options = AnswerOptions(max_new_tokens=60, temperature=0.0, k=2)
        async for event in mode.answer(QUESTION, [], options):
            events.append(event)
            if isinstance(event, TextDelta) and not killed and len(events) > 4:
                cloud.proc.kill()
                killed = True
        assert killed
        failure = next(e for e in events if isinstance(e, Failure))
        assert failure.recoverable and "after" in failure.message
        assert any(isinstance(e, Notice) and "device" in e.text for e in events)
        stats = events[-1]
        assert isinstance(stats, Stats) and stats.finish in ("stop", "length")
        assert stats.tokens > int(failure.message.split("after ")[1].split()[0])
        await mode.close()
    finally:
        await cloud.stop()


async def test_dynamic_reranking_rescores_both_sides_documents(
    device, cloud_url, private_index, public_corpus, monkeypatch
):
    """With re-ranking every 4 tokens each side re-scores its own documents against the
    question and the answer so far (DRAGON §4.1), and the answer still completes."""
    calls = {"device": 0, "cloud": 0}
    for side, obj in (("device", private_index), ("cloud", public_corpus)):
        original = obj.rescore

        def counted(hits, text, original=original, side=side):
            calls[side] += 1
            return original(hits, text)

        monkeypatch.setattr(obj, "rescore", counted)
    mode = dragon(device, cloud_url, private_index, "auto", rerank_every=4)
    _, stats, _ = await ask(mode, QUESTION, AnswerOptions(max_new_tokens=16, temperature=0.0))
    await mode.close()
    assert stats.tokens == 16
    assert calls["device"] >= 3 and calls["cloud"] >= 3


# ---------------------------------------------------------------------------- DRDG/SW


def _side(folder, tokenizer, question, docs, n):
    """One side alone, in this process: its per-document prompts' logits and weights."""
    budget = prompt_budget(TINY_CONTEXT, n)
    prompts = [document_prompt(tokenizer, question, [], d, budget)[0] for d in docs or [None]]
    scores = relevance(np.array([d.score for d in docs] or [NO_DOCUMENT_COSINE]))
    return TorchCausalLM(folder), prompts, scores


def _alone(lm, prompts, scores, n):
    """The side's greedy answer from its own transmitted mixture (as its drafts are drawn)."""
    logits, out = lm.prefill(prompts), []
    while len(out) < n:
        ids, probs = side_distribution(logits, scores, GREEDY, DRAGON_TOP_P, DRAGON_MAX_SPARSE)
        out.append(int(ids[np.flatnonzero(probs == probs.max())].min()))
        if out[-1] == IM_END_ID:
            break
        logits = lm.decode([out[-1]] * len(prompts))
    return out


def _log_likelihood(lm, prompts, scores, tokens):
    """log P^s(tokens) position by position: Σ_d softmax(R)_d softmax(z_d)[x], no shortcuts."""
    logits, total = lm.prefill(prompts), 0.0
    w = np.exp(scores - scores.max())
    w /= w.sum()
    for t in tokens:
        z = logits.astype(np.float64)
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        total += float(np.log(w @ p[:, t]))
        logits = lm.decode([t] * len(prompts))
    return total


async def test_drdg_sw_keeps_the_whole_answer_the_two_mixtures_find_likelier(
    tiny, far_weights, device, tiny_tokenizer, cloud_url, private_index, public_corpus
):
    """DRDG/SW (greedy): each side's answer alone from its own mixture, each answer scored
    under both mixtures across the link, and the device keeps the one with the larger
    η^device P^device(y) + η^cloud P^cloud(y): the same pick as a single-process reference."""
    from benchmarks.baselines import DrdgSwMode

    k, n = 2, 10
    on_device = CloudSettings(cloud_url, TOKEN, embedded=True)
    mode = DrdgSwMode(ModeContext(device=device, index=private_index, cloud=on_device))
    _, stats, events = await ask(mode, QUESTION, AnswerOptions(n, temperature=0.0, k=k))
    await mode.close()
    hits = searched(private_index, QUESTION, k, FLOOR)
    d_docs = [h.source(k + i, "device") for i, h in enumerate(hits, 1)]
    c_docs = public_docs(public_corpus, QUESTION, k)
    sides = [
        _side(f, tiny_tokenizer, QUESTION, docs, n)
        for f, docs in ((far_weights, d_docs), (tiny["hf"], c_docs))
    ]
    answers = [_alone(*side, n) for side in sides]
    assert answers[0] != answers[1]  # different weights, different answers: the pick matters
    h = np.array([np.log(np.exp(s).sum()) for _, _, s in sides])
    eta = np.exp(h - h.max()) / np.exp(h - h.max()).sum()
    likelihood = [
        sum(e * np.exp(_log_likelihood(*side, y)) for e, side in zip(eta, sides, strict=True))
        for y in answers
    ]
    kept = answers[int(np.argmax(likelihood))]
    assert stats.token_ids == [t for t in kept if t != IM_END_ID]
    assert stats.aggregator == ("device" if np.argmax(likelihood) == 0 else "cloud")
    assert mode.decode_span_s is not None and mode.decode_span_s > 0
    assert {e.side for e in events if isinstance(e, Citation)} == {"device", "cloud"}


async def test_teacher_forced_cloud_mixture_across_the_link_equals_one_process(
    tiny, device, tiny_tokenizer, cloud_url, public_corpus
):
    """The cloud's half of a teacher-forced DRAGON pass (policy SCORE: DragonScore → scored
    DragonSequence, no answer of its own) equals log p^cloud computed in this process,
    position by position."""
    from collab.protocol import (
        AggregatorPolicy,
        DragonScore,
        DragonSequence,
        DragonSetup,
        Generate,
        Mode,
        Side,
    )
    from edge_runtime.client import CloudClient

    k = 2
    text = tiny_tokenizer.encode(" Aachen is a spa city in the west of Germany, near Belgium.")
    client = CloudClient(cloud_url, TOKEN, Mode.DRAGON, "", device.tokenizer_hash, device.name)
    await client.connect()
    n = len(text)  # the room to reserve
    await client.send(Generate(QUESTION, max_new_tokens=n, temperature=1.0, request_id=7))
    await client.send(DragonSetup(k, AggregatorPolicy.SCORE, Side.DEVICE, request_id=7))
    await client.send(DragonScore(text, request_id=7))
    frames = []
    while not frames or type(frames[-1]).__name__ != "Done":
        frames.append(await client.recv(timeout=30))
    await client.close()
    sequences = [f for f in frames if isinstance(f, DragonSequence)]
    assert [s.scored for s in sequences] == [True]  # no answer of its own
    assert sequences[0].tokens.tolist() == text
    c_docs = public_docs(public_corpus, QUESTION, k)
    lm, prompts, scores = _side(tiny["hf"], tiny_tokenizer, QUESTION, c_docs, n)
    want = [_log_likelihood(lm, prompts, scores, text[: i + 1]) for i in range(n)]
    np.testing.assert_allclose(np.cumsum(sequences[0].logprobs), want, rtol=1e-5, atol=1e-4)
    assert sequences[0].h == pytest.approx(float(np.log(np.exp(scores).sum())))


@pytest.fixture
async def caching_cloud(tiny, tiny_tokenizer, public_corpus):
    """A cloud whose engine keeps public documents' prefix KV (the product's default)."""
    engine = LLMEngine(
        TorchCausalLM(tiny["hf"]), tiny_tokenizer, "tiny-cloud", document_cache_bytes=2**30
    )
    config = ServerConfig(
        token=TOKEN, metrics_token=METRICS_TOKEN, corpus_enabled=False, corpus_k=2
    )
    app = create_app(config, engine, public_corpus)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield f"ws://127.0.0.1:{server.port}/v1/session", engine
    await server.close()
    engine.close()


async def test_cached_documents_give_the_same_greedy_answer_token_for_token(
    caching_cloud,
    far_weights,
    tiny_tokenizer,
    private_index,
    tiny,
    public_corpus,
):
    """Float32: the answer with both sides' document KV reused (the second and a later
    question) equals the answer with every document prefilled, and the single-process
    reference; the caches are really hit on both sides."""
    url, engine = caching_cloud
    device = DeviceModel(TorchCausalLM(far_weights), tiny_tokenizer, "tiny-device")
    options = AnswerOptions(max_new_tokens=16, temperature=0.0, k=2)
    mode = dragon(device, url, private_index, "auto")
    try:
        _, cold, _ = await ask(mode, QUESTION, options)
        assert engine.documents is not None and engine.documents.misses > 0
        assert device.documents is not None and len(device.documents) > 0
        hits = (engine.documents.hits, device.documents.hits)
        _, warm, _ = await ask(mode, QUESTION, options)
        assert engine.documents.hits > hits[0] and device.documents.hits > hits[1]
    finally:
        await mode.close()
    assert warm.token_ids == cold.token_ids
    expected = reference_answer(
        far_weights, tiny["hf"], tiny_tokenizer, QUESTION, private_index, public_corpus, 16
    )
    assert cold.token_ids == expected


async def test_a_second_turn_reusing_the_conversation_answers_as_a_fresh_session(
    caching_cloud,
    device,
    tiny_tokenizer,
):
    """Cloud and split mode: turn 2 in the session that kept turn 1's KV gives the same greedy
    tokens as turn 2 asked in a new session (every token prefilled), and reused tokens."""
    from edge_runtime.modes.base import Turn

    url, _ = caching_cloud
    options = AnswerOptions(max_new_tokens=12, temperature=0.0, k=0)
    for name in ("cloud", "split"):
        ctx = ModeContext(
            device=device, index=None, cloud=CloudSettings(url, TOKEN), retrieve_public=False
        )
        mode = build_mode(name, ctx)
        try:
            text1, _, _ = await ask(mode, "Tell me about the sea.", options)
            history = [
                Turn(
                    "Tell me about the sea.",
                    text1,
                    name,
                    shared=text1,
                    shared_with=mode.cloud_identity(),
                )
            ]
            _, kept, _ = await ask(mode, "And the mountains?", options, history)
        finally:
            await mode.close()
        fresh = build_mode(
            name,
            ModeContext(
                device=device, index=None, cloud=CloudSettings(url, TOKEN), retrieve_public=False
            ),
        )
        try:
            device.held = None  # the device prefills its own prompt afresh too
            _, again, _ = await ask(fresh, "And the mountains?", options, history)
        finally:
            await fresh.close()
        assert kept.token_ids == again.token_ids, name
    metrics = await read_metrics(url, METRICS_TOKEN)
    counter = 'tandem_reused_prompt_tokens_total{kind="conversation"}'
    reused = [line for line in metrics.splitlines() if line.startswith(counter)]
    assert reused and float(reused[0].split()[-1]) > 20  # both modes' second turns
