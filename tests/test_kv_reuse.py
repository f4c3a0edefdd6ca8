"""Exact KV reuse (docs/architecture.md#kv-reuse): a cached prefix's KV continued, a kept
conversation extended, on both backends and through the cloud's batching engine. Every check
compares against a fresh prefill of the same tokens: logits within float32 rounding, greedy
tokens equal; plus the budget, the salt and the document prompt's boundary."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cloud_backend.engine import LLMEngine
from collab.sources import Source
from edge_runtime.device import DeviceModel
from model_runtime.ort_runtime import OrtCausalLM
from model_runtime.prefix_cache import PrefixCache, PrefixReuse, prefix_key
from model_runtime.prompting import document_prompt, fit_prompt
from model_runtime.runtime import CausalLM, RuntimeInputError, SequenceState

RNG = np.random.default_rng(7)
DOCS = [[int(t) for t in RNG.integers(0, 151_000, size=n)] for n in (31, 17, 44)]
QUESTIONS = [[int(t) for t in RNG.integers(0, 151_000, size=n)] for n in (5, 12, 3)]
TOL = 1e-4


def fresh(lm: CausalLM, prompts: list[list[int]]) -> np.ndarray:
    return np.stack([lm.prefill([p])[0] for p in prompts])


def prefixes(lm: CausalLM, docs: list[list[int]]) -> list[SequenceState]:
    out = []
    for doc in docs:
        lm.prefill([doc])
        out.append(lm.prefix_state(0, len(doc)))
    return out


# ---- the runtime ---------------------------------------------------------------------------
def test_continuing_a_prefix_equals_a_fresh_prefill(lm):
    cached = prefixes(lm, DOCS)
    prompts = [d + q for d, q in zip(DOCS, QUESTIONS, strict=True)]
    want = fresh(lm, prompts)
    got = lm.feed_from(cached, QUESTIONS)
    assert np.abs(got - want).max() < TOL
    # decoding on from there follows the same logits as decoding after a fresh prefill
    token = [int(t) for t in np.argmax(got, axis=-1)]
    after = lm.decode(token)
    for b, p in enumerate(prompts):
        lm.prefill([p])
        assert np.abs(lm.decode([token[b]])[0] - after[b]).max() < TOL
    # the cached states were not changed by their use: a second use gives the same logits
    again = lm.feed_from(cached, QUESTIONS)
    assert np.abs(again - got).max() < TOL
    # negative control: another document's prefix gives other logits, far beyond the tolerance
    wrong = lm.feed_from([cached[1]], [QUESTIONS[0]])
    assert np.abs(wrong[0] - want[0]).max() > 100 * TOL


def test_a_prefix_mixes_with_sequences_that_have_none(lm):
    cached = prefixes(lm, DOCS[:1])
    rows = [QUESTIONS[0], DOCS[1] + QUESTIONS[1]]
    got = lm.feed_from([cached[0], None], rows)
    want = fresh(lm, [DOCS[0] + QUESTIONS[0], DOCS[1] + QUESTIONS[1]])
    assert np.abs(got - want).max() < TOL


def test_a_prefix_taken_mid_sequence_after_rollback(lm):
    """The prefix of a sequence that rolled back and went on (holes in its slots)."""
    lm.prefill([DOCS[0] + [5, 6, 7]])
    lm.rollback(len(DOCS[0]))
    lm.forward([QUESTIONS[0]])
    state = lm.prefix_state(0, len(DOCS[0]) + 2)
    got = lm.feed_from([state], [QUESTIONS[1]])
    want = fresh(lm, [DOCS[0] + QUESTIONS[0][:2] + QUESTIONS[1]])
    assert np.abs(got - want).max() < TOL


def test_bad_prefix_requests_are_refused(lm):
    lm.prefill([DOCS[0]])
    with pytest.raises(RuntimeInputError):
        lm.prefix_state(0, len(DOCS[0]) + 1)
    with pytest.raises(RuntimeInputError):
        lm.prefix_state(1, 3)
    state = lm.prefix_state(0, 4)
    with pytest.raises(RuntimeInputError):
        lm.feed_from([state], [[]])  # no token to give logits at


# ---- the cache -----------------------------------------------------------------------------
def test_cache_keeps_to_its_budget_least_recently_used_first(ort_fp32):
    states = prefixes(ort_fp32, DOCS)
    sizes = [s.nbytes for s in states]
    cache = PrefixCache(sizes[0] + sizes[1])
    keys = [prefix_key(d) for d in DOCS]
    assert cache.put(keys[0], states[0]) and cache.put(keys[1], states[1])
    assert cache.get(keys[0]) is states[0]  # 0 is now the most recent
    cache.put(keys[2], states[2])  # 44 tokens: pushes out 1 (and 0 if it must)
    assert cache.nbytes <= cache.budget_bytes
    assert cache.get(keys[1]) is None
    assert cache.evictions >= 1
    assert not PrefixCache(sizes[0] - 1).put(keys[0], states[0])  # larger than the budget


def test_cache_drops_a_documents_entries_by_tag(ort_fp32):
    states = prefixes(ort_fp32, DOCS[:2])
    cache = PrefixCache(10**9)
    cache.put(prefix_key(DOCS[0]), states[0], ["a.md"])
    cache.put(prefix_key(DOCS[1]), states[1], ["b.md"])
    assert cache.drop("a.md") == 1
    assert cache.get(prefix_key(DOCS[0])) is None
    assert cache.get(prefix_key(DOCS[1])) is states[1]
    assert cache.nbytes == states[1].nbytes


def test_a_removed_or_changed_documents_passages_are_forgotten(ort_fp32, tmp_path, embedder_dir):
    """Entries are tagged with their chunk's id (never reused by the store): removed or
    re-ingested with new text, here or by another process (another index on the same
    folder), the document's cached KV is dropped before the next DRAGON answer."""
    from edge_runtime.device import forget_removed
    from personal_index.index import PersonalIndex

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "boat.md").write_text("Mira's sailing boat is called Wavelet.\n")
    (docs / "cat.md").write_text("Tomas named the grey cat Pebble.\n")
    index = PersonalIndex(tmp_path / "index", embedder_dir)
    index.ingest([docs])
    hits = {h.path.rsplit("/", 1)[1]: h.chunk_id for h in index.search("boat cat", k=2)}
    cache = PrefixCache(10**9)
    states = prefixes(ort_fp32, DOCS[:3])
    for n, tag in enumerate([hits["boat.md"], hits["cat.md"], "not a chunk"]):
        cache.put(prefix_key(DOCS[n]), states[n], [tag])

    async def forget() -> int:
        return await forget_removed(cache, index)

    assert asyncio.run(forget()) == 0  # nothing changed
    other = PersonalIndex(tmp_path / "index", embedder_dir)  # e.g. `tandem remove` meanwhile
    assert other.remove(docs / "boat.md") == 1
    assert asyncio.run(forget()) == 1
    assert cache.get(prefix_key(DOCS[0])) is None and len(cache) == 2
    (docs / "cat.md").write_text("Tomas named the grey cat Marble.\n")
    other.ingest([docs])
    assert asyncio.run(forget()) == 1  # re-ingested: new chunks, the old KV goes
    assert cache.tags() == {"not a chunk"}  # other tags are not the index's to judge


def test_salts_keep_scopes_apart():
    assert prefix_key(DOCS[0], b"user:a") != prefix_key(DOCS[0], b"user:b")
    assert prefix_key(DOCS[0]) != prefix_key(DOCS[0][:-1])
    assert prefix_key([1, 2]) != prefix_key([1, 2], b"\x00")


# ---- the device: documents and a conversation ----------------------------------------------
@pytest.fixture
def device(tiny, tiny_tokenizer):
    model = DeviceModel(OrtCausalLM(tiny["onnx-fp32"]), tiny_tokenizer, "tiny")
    yield model
    model._worker.close()


def test_documents_reused_across_questions_and_a_changed_document_misses(device):
    async def go():
        seq = device
        prompts = [d + q for d, q in zip(DOCS, QUESTIONS, strict=True)]
        first = PrefixReuse(device.documents, [len(d) for d in DOCS])
        cold = await first.start(seq, prompts)
        assert first.hits == 0 and len(device.documents) == 3
        other = [d + q for d, q in zip(DOCS, QUESTIONS[::-1], strict=True)]
        second = PrefixReuse(device.documents, [len(d) for d in DOCS])
        warm = await second.start(seq, other)
        assert second.hits == 3 and second.reused == sum(map(len, DOCS))
        assert np.abs(cold - fresh(device.lm, prompts)).max() < TOL
        assert np.abs(warm - fresh(device.lm, other)).max() < TOL
        changed = [DOCS[0][:-1] + [DOCS[0][-1] ^ 1]] + DOCS[1:]  # one token of a document
        third = PrefixReuse(device.documents, [len(d) for d in changed])
        await third.start(seq, [d + QUESTIONS[0] for d in changed])
        assert third.hits == 2  # the changed one was prefilled, never its stale KV

    asyncio.run(go())


def test_a_conversation_that_extends_the_last_prompt_is_not_prefilled_again(device):
    async def go():
        turn1 = DOCS[0] + QUESTIONS[0]
        logits = await device.prefill(turn1)
        answer = []
        for _ in range(6):
            answer.append(int(np.argmax(logits)))
            logits = (await device.forward([answer[-1]]))[-1]
        turn2 = turn1 + answer + QUESTIONS[1]
        before = device.reused_tokens
        got = await device.prefill(turn2)
        assert device.reused_tokens - before == len(turn1) + len(answer)
        assert np.abs(got - fresh(device.lm, [turn2])[0]).max() < TOL
        # a prompt that differs early reuses only what it shares
        await device.prefill(turn2)
        before = device.reused_tokens
        other = turn1[:10] + QUESTIONS[2]
        got = await device.prefill(other)
        assert device.reused_tokens - before == 10
        assert np.abs(got - fresh(device.lm, [other])[0]).max() < TOL
        # after a batch of several sequences nothing is assumed held
        await device.feed("prefill", [DOCS[0], DOCS[1]], fresh=True, last_only=True)
        before = device.reused_tokens
        await device.prefill(DOCS[0] + QUESTIONS[0])
        assert device.reused_tokens == before

    asyncio.run(go())


# ---- the cloud's engine --------------------------------------------------------------------
@pytest.fixture
def engine(tiny, tiny_tokenizer):
    eng = LLMEngine(
        OrtCausalLM(tiny["onnx-fp32"]), tiny_tokenizer, "tiny", document_cache_bytes=10**9
    )
    yield eng
    eng.close()


def test_engine_keeps_a_sessions_conversation_between_requests(engine):
    async def go():
        session = engine.open_session()
        turn1 = DOCS[1] + QUESTIONS[1]
        logits = await session.prefill(turn1)
        token = int(np.argmax(logits))
        await session.forward([token])
        session.release()  # the request ended: kept
        assert engine.cache_bytes > 0
        turn2 = turn1 + [token] + QUESTIONS[0]
        got = await session.prefill(turn2)
        assert session.reused_tokens == len(turn1) + 1
        lm = OrtCausalLM(engine.lm.model_dir)
        assert np.abs(got - lm.prefill([turn2])[0]).max() < TOL
        session.release(keep=False)
        assert engine.cache_bytes == 0
        await session.prefill(turn2)  # nothing held: a plain prefill
        assert session.reused_tokens == len(turn1) + 1

    asyncio.run(go())


def test_engine_evicted_conversation_is_prefilled_again_transparently(tiny, tiny_tokenizer):
    async def go():
        lm = OrtCausalLM(tiny["onnx-fp32"])
        engine = LLMEngine(lm, tiny_tokenizer, "tiny", kv_budget_bytes=1)  # room for one
        try:
            a, b = engine.open_session(), engine.open_session()
            await a.prefill(DOCS[0])
            a.release()
            await b.prefill(DOCS[1])  # pushes a's kept conversation out
            assert a.state is None and a.evicted
            got = await a.prefill(DOCS[0] + QUESTIONS[0])
            assert a.reused_tokens == 0
            ref = OrtCausalLM(tiny["onnx-fp32"])
            assert np.abs(got - ref.prefill([DOCS[0] + QUESTIONS[0]])[0]).max() < TOL
        finally:
            engine.close()

    asyncio.run(go())


def test_engine_documents_batch_from_the_cache(engine):
    from model_runtime.async_model import DocumentBatch

    async def go():
        prompts = [d + q for d, q in zip(DOCS, QUESTIONS, strict=True)]
        cache = engine.documents
        assert cache is not None
        s1 = engine.open_session()
        cold = await DocumentBatch(s1).start(prompts, PrefixReuse(cache, [len(d) for d in DOCS]))
        s1.release()
        s2 = engine.open_session()
        reuse = PrefixReuse(cache, [len(d) for d in DOCS])
        batch = DocumentBatch(s2)
        warm = await batch.start(prompts, reuse)
        assert reuse.hits == 3
        assert np.abs(warm - cold).max() < TOL
        # and it decodes on as a batch prefilled from scratch does
        token = int(np.argmax(warm[0]))
        step = await batch.advance(token)
        ref = OrtCausalLM(engine.lm.model_dir)
        ref.prefill(prompts)
        assert np.abs(step - ref.decode([token] * 3)).max() < TOL
        other = PrefixReuse(cache, [len(d) for d in DOCS], salt=b"user:someone-else")
        await DocumentBatch(engine.open_session()).start(prompts, other)
        assert other.hits == 0  # another scope never sees these entries

    asyncio.run(go())


# ---- the prompt's boundary -----------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "The dentist is on Tuesday at 3pm.",
        "ends mid-word: abc",
        "trailing spaces   \n\n",
        "[/] <|im_end|> \x1b[31m markup",
        "日本語のテキスト。",
    ],
)
def test_a_documents_tokens_are_the_same_whatever_the_question(tiny_tokenizer, text):
    doc = Source("Notes › Health", text=text, number=3)
    seen = set()
    for question, history in [("When?", []), (" leading", ["hi", "hello"]), ("x" * 300, [])]:
        ids, _, stable = document_prompt(tiny_tokenizer, question, history, doc, 4000)
        assert stable > 0
        seen.add(tuple(ids[:stable]))
        assert tiny_tokenizer.decode(ids[:stable]).endswith("<|im_end|>\n")
        assert text.strip()[:8] in tiny_tokenizer.decode(ids[:stable])
    assert len(seen) == 1
    # the prompt is the chat prompt with the source in the system turn (DRAGON's layout did
    # not change), and the source's number (its rank) is part of the prefix: another rank is
    # another entry
    plain = fit_prompt(tiny_tokenizer, "When?", [], [doc], 4000, sources_in_system=True)[0]
    assert document_prompt(tiny_tokenizer, "When?", [], doc, 4000)[0] == plain
    again = document_prompt(
        tiny_tokenizer, "When?", [], Source(doc.title, text=text, number=9), 4000
    )
    assert tuple(again[0][: again[2]]) not in seen
