"""Batching across sessions (issue 17): the runtime runs several users' sequences in one pass
(`CausalLM.feed_states`), and each user's logits and cache are what it would have had alone."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from model_runtime.ort_runtime import OrtCausalLM
from model_runtime.runtime import CausalLM, RuntimeInputError, SequenceState
from model_runtime.torch_runtime import TorchCausalLM
from tests import test_server

start_cloud = test_server.start_cloud  # on this module's engine (prefill chunks of 32)

RNG = np.random.default_rng(7)


def ids(n: int) -> list[int]:
    return RNG.integers(10, 5000, size=n).tolist()


@pytest.fixture(scope="module", params=["torch", "ort"])
def lm(request, tiny) -> CausalLM:
    if request.param == "torch":
        return TorchCausalLM(tiny["hf"])
    return OrtCausalLM(tiny["onnx-fp32"])


def alone(lm: CausalLM, state: SequenceState | None, rows, last_only=False):
    """What one user gets feeding `rows` on its own."""
    if state is None:
        logits = lm.feed(rows, fresh=True, last_only=last_only)
    else:
        lm.attach_state(state)
        logits = lm.feed(rows, last_only=last_only)
    return logits, lm.detach_state()


def test_users_batched_get_what_each_gets_alone(lm):
    """A long session, a two-document session (prompts of unequal length) and a fresh one, fed
    one, one each and a whole prompt, then fed again from the states the batch gave back."""
    _, long = alone(lm, None, [ids(40)])
    _, docs = alone(lm, None, [ids(7), ids(12)])
    lm.attach_state(docs)
    lm.rollback([5, 12])  # a hole-free but uneven pair, as DRAGON's rewind leaves it
    docs = lm.detach_state()
    rounds = [
        [[ids(1)], [ids(1), ids(1)], [ids(9)]],
        [[ids(4)], [ids(1), ids(1)], [ids(2)]],
    ]
    states: list[SequenceState | None] = [long, docs, None]
    ref_states = list(states)
    for rows in rounds:
        got, states = lm.feed_states(states, rows)
        for u, user_rows in enumerate(rows):
            want, ref_states[u] = alone(lm, ref_states[u], user_rows)
            for b, row in enumerate(user_rows):
                np.testing.assert_allclose(
                    got[u][b, : len(row)], want[b, : len(row)], rtol=1e-4, atol=1e-4
                )
            assert states[u].lengths.tolist() == ref_states[u].lengths.tolist()
            assert states[u].nbytes == ref_states[u].nbytes  # no padding kept


def test_last_only_and_the_states_passed_in_are_left_alone(lm):
    _, a = alone(lm, None, [ids(20)])
    before = (a.mask.copy(), a.lengths.copy())
    got, _ = lm.feed_states([a, None], [[ids(1)], [ids(6), ids(3)]], last_only=True)
    assert got[0].shape[1] == 1 and got[1].shape[:2] == (2, 1)
    want, _ = alone(lm, None, [ids(6), ids(3)], last_only=True)
    assert got[1].shape == want.shape
    assert (a.mask == before[0]).all() and (a.lengths == before[1]).all()
    assert lm.batch_size == 1 and lm.lengths == [0]  # the runtime is left empty


def test_a_bad_batch_is_refused_and_changes_nothing(lm):
    _, a = alone(lm, None, [ids(5)])
    with pytest.raises(RuntimeInputError):
        lm.feed_states([a, None], [[ids(1)], [[]]])
    with pytest.raises(RuntimeInputError):
        lm.feed_states([a], [[ids(1), ids(1)]])
    with pytest.raises(RuntimeInputError, match="unknown token"):
        lm.feed_states([a], [[[10**9]]])
    _, (after,) = lm.feed_states([a], [[ids(1)]])
    assert after.lengths.tolist() == [6]


# ---------------------------------------------------------------------------- the engine


@pytest.fixture
def engine(tiny):
    from cloud_backend.engine import LLMEngine
    from model_runtime.tokenizer import load_tokenizer

    eng = LLMEngine(TorchCausalLM(tiny["hf"]), load_tokenizer(tiny["hf"]), "tiny", prefill_chunk=32)
    yield eng
    eng.close()


async def greedy(seq, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt`, a step at a time (as cloud mode decodes)."""
    out = [int(np.argmax(await seq.prefill(prompt)))]
    while len(out) < n:
        out.append(int(np.argmax((await seq.forward([out[-1]]))[-1])))
    return out


async def test_sessions_stepping_together_share_passes_and_get_their_own_tokens(engine):
    """Four sessions decoding at once (prompts of 5 to 80 tokens: the longest prefills in
    chunks) run in shared passes, and each gets, token for token, what it gets alone."""
    prompts = [ids(n) for n in (5, 80, 17, 40)]
    alone_out = []
    for prompt in prompts:
        alone_out.append(await greedy(engine.open_session(), prompt, 12))
    passes_alone = engine.passes
    together = await asyncio.gather(*(greedy(engine.open_session(), p, 12) for p in prompts))
    assert together == alone_out
    # the decodes shared passes (the 7 prefill chunks run alone: compute-bound): 51 alone
    assert engine.passes - passes_alone < 0.6 * passes_alone


async def test_a_long_prefill_does_not_stall_a_decoding_session(engine):
    """While one session prefills 240 tokens (8 chunks of 32), another decodes: each of its
    steps waits for at most one chunk's pass, not for the whole prefill."""
    order: list[str] = []
    engine.on_step = lambda kind, n, seconds: order.append(kind)
    decoder = engine.open_session()
    await decoder.prefill(ids(4))
    order.clear()

    async def decode() -> None:
        for _ in range(6):
            await decoder.forward(ids(1))

    long = engine.open_session()
    await asyncio.gather(long.prefill(ids(240)), decode())
    prefills = [i for i, kind in enumerate(order) if kind == "prefill"]
    decodes = [i for i, kind in enumerate(order) if kind == "decode"]
    assert len(prefills) == 8 and len(decodes) == 6
    assert decodes[-1] < prefills[-1]  # the decoder finished before the prefill did
    gaps = np.diff([-1, *decodes])
    assert gaps.max() <= 2  # at most one prefill chunk between two decode steps


async def test_prefills_queued_before_a_decode_do_not_all_go_first(engine):
    """Four sessions' prompts (2 chunks each) are queued before a decoder's next step: it
    still waits for at most one chunk between two of its steps, and each chunk runs alone
    (a prefill is compute-bound: batched, it only adds padding)."""
    passes: list[tuple[str, int]] = []
    engine.on_step = lambda kind, n, seconds: passes.append((kind, n))
    decoder = engine.open_session()
    await decoder.prefill(ids(4))
    passes.clear()
    prompts = [engine.open_session().prefill(ids(60)) for _ in range(4)]
    waiting = [asyncio.ensure_future(p) for p in prompts]
    await asyncio.sleep(0)  # the four prefills are queued first

    async def decode() -> None:
        for _ in range(5):
            await decoder.forward(ids(1))

    await asyncio.gather(decode(), *waiting)
    kinds = [kind for kind, _ in passes]
    assert kinds.count("prefill") == 8  # 4 prompts x 2 chunks, one chunk a pass
    assert all(n <= 32 for kind, n in passes if kind == "prefill")
    decodes = [i for i, kind in enumerate(kinds) if kind == "decode"]
    assert len(decodes) == 5 and np.diff(decodes).max() <= 2
    assert decodes[-1] < max(i for i, k in enumerate(kinds) if k == "prefill")


async def test_answers_queued_together_get_their_first_tokens_one_after_another(engine):
    """Four prompts of 3 chunks queued at once: each prefill, once begun, finishes before the
    next starts (first tokens after 3, 6, 9, 12 chunks: a mean wait of 7.5 chunks), not
    round-robin (all four after 9-12 chunks), with a decoder stepping meanwhile."""
    chunks = 0

    def count(kind: str, n: int, seconds: float) -> None:
        nonlocal chunks
        chunks += kind == "prefill"

    engine.on_step = count
    decoder = engine.open_session()
    await decoder.prefill(ids(4))
    chunks = 0
    finished: list[tuple[int, int]] = []  # (prompt, prefill chunks run when it finished)

    async def answer(n: int) -> None:
        await engine.open_session().prefill(ids(90))
        finished.append((n, chunks))

    async def decode() -> None:
        for _ in range(8):
            await decoder.forward(ids(1))

    await asyncio.gather(*(answer(n) for n in range(4)), decode())
    assert finished == [(0, 3), (1, 6), (2, 9), (3, 12)]


async def test_a_chunked_prefill_gives_the_logits_of_a_whole_one(engine, tiny):
    prompts = [ids(75), ids(33)]  # two documents, chunked at 32: they end in different chunks
    lm = TorchCausalLM(tiny["hf"])
    want = lm.feed(prompts, fresh=True, last_only=True)
    got = await engine.open_session().feed("prefill", prompts, fresh=True, last_only=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    prefix, verify = ids(3), ids(40)  # and a verify feed wider than a chunk keeps every position
    session = engine.open_session()
    await session.feed("prefill", [prefix, prefix], fresh=True)
    lm.feed([prefix, prefix], fresh=True)
    got = await session.feed("verify", [verify, verify[:20]])
    want = lm.feed([verify, verify[:20]])
    assert got.shape == want.shape == (2, 40, lm.vocab_size)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1, :20], want[1, :20], rtol=1e-4, atol=1e-4)


async def test_a_cancel_stops_only_its_own_session(engine):
    from model_runtime.runtime import Cancelled

    """Session a's long prefill is cancelled mid-way (between chunks or in one); b, stepping
    in the same passes, gets its own tokens, and a is left as it was before the prefill."""
    a, b = engine.open_session(), engine.open_session()
    want = await greedy(engine.open_session(), (prompt := ids(200)), 2)
    engine.on_step = lambda kind, n, seconds: time.sleep(0.02)  # 8 chunks: >= 0.16 s
    task_a = asyncio.ensure_future(a.prefill(ids(250)))
    task_b = asyncio.ensure_future(greedy(b, prompt, 2))
    await asyncio.sleep(0.08)
    a.cancel()
    with pytest.raises(Cancelled):
        await task_a
    assert await task_b == want
    assert a.length == 0  # nothing of the cancelled prefill stayed


async def test_max_batch_one_is_a_step_a_pass(tiny):
    from cloud_backend.engine import LLMEngine
    from model_runtime.tokenizer import load_tokenizer

    engine = LLMEngine(
        TorchCausalLM(tiny["hf"]), load_tokenizer(tiny["hf"]), "tiny", max_batch_sequences=1
    )
    try:
        sessions = [engine.open_session() for _ in range(3)]
        await asyncio.gather(*(s.prefill(ids(5)) for s in sessions))
        assert engine.passes == 3
    finally:
        engine.close()


# ---------------------------------------------------------------------------- over the wire


async def test_concurrent_answers_over_the_wire_equal_answers_alone(start_cloud):
    """Cloud mode, greedy, float32: six sessions asking at once get the tokens each gets
    alone, whoever it was batched with."""
    from collab.protocol import Done, Generate, TokenChunk

    cloud = await start_cloud(corpus_enabled=False)
    questions = [f"Tell me about {w}." for w in ("tandems", "rain", "Lisbon", "tea", "owls", "ice")]

    async def answer(question: str) -> list[int]:
        async with test_server.raw(cloud) as s:
            await s.send(Generate(question, max_new_tokens=16, request_id=1))
            frames = await s.recv_until(Done, timeout=120)
        return [t for f in frames if isinstance(f, TokenChunk) for t in f.token_ids.tolist()]

    alone = [await answer(q) for q in questions]
    passes = cloud.engine.passes
    together = await asyncio.gather(*(answer(q) for q in questions))
    assert together == alone and all(len(a) == 16 for a in alone)
    assert cloud.engine.passes - passes < 0.6 * passes  # shared passes
