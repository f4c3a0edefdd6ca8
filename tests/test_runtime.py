"""The device runtime on tiny models: exactness against torch, rollback, batching,
cancellation and bad input, for both backends behind the one interface."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from model_runtime.ort_runtime import OrtCausalLM
from model_runtime.runtime import Cancelled, CausalLM, RuntimeInputError

RNG = np.random.default_rng(0)
PROMPT = [int(t) for t in RNG.integers(0, 151_000, size=23)]
CONTINUATION = [int(t) for t in RNG.integers(0, 151_000, size=9)]


def greedy(lm: CausalLM, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    logits = lm.prefill([prompt])[0]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = lm.decode([out[-1]])[0]
    return out, logits


def test_ort_fp32_matches_torch_fp32(ort_fp32, torch_fp32):
    full = PROMPT + CONTINUATION
    a = ort_fp32.prefill([full])
    b = torch_fp32.prefill([full])
    assert np.abs(a - b).max() < 1e-3
    # and step by step, through the KV cache
    ort_fp32.prefill([PROMPT])
    torch_fp32.prefill([PROMPT])
    for t in CONTINUATION:
        assert np.abs(ort_fp32.decode([t]) - torch_fp32.decode([t])).max() < 1e-3


def test_forward_returns_logits_at_every_position(lm):
    whole = lm.prefill([PROMPT + CONTINUATION[:5]])
    lm.prefill([PROMPT])
    multi = lm.forward([CONTINUATION[:5]])
    assert multi.shape == (1, 5, lm.vocab_size)
    lm.prefill([PROMPT + CONTINUATION[:4]])
    np.testing.assert_allclose(multi[0, -1], whole[0], atol=1e-4)
    # one-token steps give the same logits as the multi-token pass
    lm.prefill([PROMPT])
    for i, t in enumerate(CONTINUATION[:5]):
        np.testing.assert_allclose(lm.decode([t])[0], multi[0, i], atol=1e-4)


def test_rollback_then_redecode_equals_fresh_decode(lm):
    lm.prefill([PROMPT])
    lm.forward([CONTINUATION])
    assert lm.lengths == [len(PROMPT) + len(CONTINUATION)]
    lm.rollback(len(PROMPT) + 3)
    assert lm.lengths == [len(PROMPT) + 3]
    after_rollback = lm.forward([CONTINUATION[3:6]])
    fresh = lm.prefill([PROMPT + CONTINUATION[:6]])
    np.testing.assert_allclose(after_rollback[0, -1], fresh[0], atol=1e-4)
    with pytest.raises(RuntimeInputError):
        lm.rollback(lm.lengths[0] + 1)


def test_batch_equals_single_runs_with_per_sequence_rollback(lm):
    prompts = [PROMPT, PROMPT[:7], PROMPT[5:20], [PROMPT[0]]]
    singles = []
    for p in prompts:
        first = lm.prefill([p])[0]
        lm.forward([CONTINUATION[:4]])
        lm.rollback(len(p) + 1)
        after = lm.decode([CONTINUATION[6]])[0]
        singles.append((first, after))

    first = lm.prefill(prompts)
    assert lm.batch_size == 4 and lm.lengths == [len(p) for p in prompts]
    lm.forward([CONTINUATION[:4]] * 4)
    for b, p in enumerate(prompts):
        lm.rollback(len(p) + 1, seq=b)
    after = lm.decode([CONTINUATION[6]] * 4)
    for b in range(4):
        np.testing.assert_allclose(first[b], singles[b][0], atol=1e-4)
        np.testing.assert_allclose(after[b], singles[b][1], atol=1e-4)


def test_ragged_forward_and_compaction_keep_results(lm):
    """Sequences that advance by different amounts leave masked holes; compaction squeezes
    them out without changing any result."""
    lm.prefill([PROMPT[:3], PROMPT[:3]])
    reference = lm.prefill([PROMPT[:3]])
    lm.prefill([PROMPT[:3], PROMPT[:3]])
    tokens_a: list[int] = []
    for i in range(60):  # sequence 1 keeps rolling back: its holes pile up
        t = CONTINUATION[i % len(CONTINUATION)]
        out = lm.forward([[t], [t, t]])
        lm.rollback(3, seq=1)
        tokens_a.append(t)
    assert lm.cache_slots <= 2 * (3 + 60) + 2
    fresh = lm.prefill([PROMPT[:3] + tokens_a])
    np.testing.assert_allclose(out[0, 0], fresh[0], atol=1e-4)
    single = lm.prefill([PROMPT[:3]])
    np.testing.assert_allclose(single, reference, atol=1e-5)


def test_a_sequence_fed_nothing_from_empty_stays_exact(lm):
    """Padding rows of a sequence with no tokens yet must not poison its cache."""
    lm.reset(2)
    lm.forward([PROMPT[:4], []])
    lm.forward([[PROMPT[4]], PROMPT[:3]])
    out = lm.decode([PROMPT[5], PROMPT[3]])
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0], lm.prefill([PROMPT[:6]])[0], atol=1e-4)
    np.testing.assert_allclose(out[1], lm.prefill([PROMPT[:4]])[0], atol=1e-4)


def test_compaction_happens_and_is_exact(ort_fp32, torch_fp32):
    """Three sequences advancing in turn leave each slot used by one of them; once holes
    pass half the cache it is compacted, and results do not change."""
    for lm in (ort_fp32, torch_fp32):
        lm._COMPACT_MIN_SLOTS = 16
        try:
            lm.prefill([PROMPT[:2]] * 3)
            fed: list[list[int]] = [[], [], []]
            peak = 0
            for i in range(8):
                for b in range(3):
                    t = CONTINUATION[(i + b) % len(CONTINUATION)]
                    lm.forward([[t] if j == b else [] for j in range(3)])
                    fed[b].append(t)
                    peak = max(peak, lm.cache_slots)
            assert peak < 2 + 3 * 8  # compaction kicked in
            out = lm.decode([CONTINUATION[1]] * 3)
            for b in range(3):
                ref = lm.prefill([PROMPT[:2] + fed[b] + [CONTINUATION[1]]])
                np.testing.assert_allclose(out[b], ref[0], atol=1e-4)
        finally:
            del lm._COMPACT_MIN_SLOTS


def test_io_binding_and_plain_run_agree(tiny, ort_fp32):
    plain = OrtCausalLM(tiny["onnx-fp32"], io_binding=False)
    a, la = greedy(ort_fp32, PROMPT, 8)
    b, lb = greedy(plain, PROMPT, 8)
    assert a == b
    np.testing.assert_array_equal(la, lb)


def test_quantised_model_is_weight_only_and_runs(tiny, ort_fp32):
    """The tiny model's random weights say nothing about accuracy (the slow tier measures KL
    on the real model); here: every weight MatMul became MatMulNBits and the model agrees
    with float32 in the large."""
    import onnx

    graph = onnx.load(str(tiny["onnx-quant"] / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    weights = {i.name for i in graph.initializer}
    assert ops.count("MatMulNBits") == 2 * 7 + 1  # q k v o gate up down per layer + lm_head
    bits = {
        n.name: next(a.i for a in n.attribute if a.name == "bits")
        for n in graph.node
        if n.op_type == "MatMulNBits"
    }
    head = next(n.name for n in graph.node if "logits" in n.output)
    assert bits.pop(head) == 4 and set(bits.values()) == {8}  # the int8-head4 scheme
    # grouped attention: nothing expands the KV cache to all query heads
    assert not [n for n in graph.node if n.op_type == "Expand" and "self_attn" in n.name]
    assert not [n for n in graph.node if n.op_type == "MatMul" and set(n.input) & weights]
    q = OrtCausalLM(tiny["onnx-quant"])
    a = ort_fp32.prefill([PROMPT])[0]
    b = q.prefill([PROMPT])[0]
    assert np.corrcoef(a, b)[0, 1] > 0.9


@pytest.mark.parametrize("bad", [[], [[]]])
def test_empty_prompt_is_refused(lm, bad):
    with pytest.raises(RuntimeInputError):
        lm.prefill(bad)


def test_prompt_over_context_limit_is_refused(lm):
    with pytest.raises(RuntimeInputError, match="context limit"):
        lm.prefill([[1] * (lm.max_context + 1)])
    lm.prefill([[1] * (lm.max_context - 1)])
    with pytest.raises(RuntimeInputError, match="context limit"):
        lm.forward([[1, 2]])


@pytest.mark.parametrize("token", [-1, 151_936, 10**9])
def test_unknown_token_ids_are_refused(lm, token):
    with pytest.raises(RuntimeInputError, match="unknown token id"):
        lm.prefill([[1, token]])
    lm.prefill([[1, 2]])
    with pytest.raises(RuntimeInputError, match="unknown token id"):
        lm.decode([token])
    assert lm.lengths == [2]  # a refused step changes nothing


def test_wrong_batch_is_refused(lm):
    lm.prefill([[1, 2]])
    with pytest.raises(RuntimeInputError):
        lm.decode([1, 2])
    with pytest.raises(RuntimeInputError):
        lm.rollback(1, seq=3)


def _cancel_repeatedly(lm: CausalLM, stop: threading.Event) -> None:
    while not stop.is_set():
        lm.cancel()
        time.sleep(0.001)


def test_cancel_stops_a_step_and_leaves_state_unchanged(lm):
    lm.prefill([PROMPT])
    expected = lm.decode([CONTINUATION[0]])
    big = [[int(t) for t in RNG.integers(0, 151_000, size=200)] for _ in range(3)]
    stop = threading.Event()
    canceller = threading.Thread(target=_cancel_repeatedly, args=(lm, stop))
    lm.reset(3)
    canceller.start()
    try:
        started = time.perf_counter()
        with pytest.raises(Cancelled):
            for _ in range(20):  # each forward is long enough that a cancel lands in flight
                lm.forward(big)
                lm.reset(3)
        assert time.perf_counter() - started < 30
    finally:
        stop.set()
        canceller.join()
    assert lm.lengths == [0, 0, 0]  # the cancelled step committed nothing
    lm.prefill([PROMPT])
    np.testing.assert_allclose(lm.decode([CONTINUATION[0]]), expected, atol=1e-5)


def test_cancel_mid_sequence_keeps_the_committed_prefix(ort_fp32):
    lm = ort_fp32
    lm.prefill([PROMPT])
    stop = threading.Event()
    canceller = threading.Thread(target=_cancel_repeatedly, args=(lm, stop))
    canceller.start()
    long = [int(t) for t in RNG.integers(0, 151_000, size=220)]
    try:
        with pytest.raises(Cancelled):
            for _ in range(50):
                lm.forward([long[: lm.max_context - len(PROMPT) - 1]])
                lm.rollback(len(PROMPT))
    finally:
        stop.set()
        canceller.join()
    assert lm.lengths == [len(PROMPT)]
    got = lm.decode([CONTINUATION[0]])
    ref = lm.prefill([PROMPT + [CONTINUATION[0]]])
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_detached_states_interleave_like_separate_runs(lm):
    """A server swaps one state per session into one loaded model: interleaving two
    sessions step by step gives each the logits it would get alone."""
    alone_a, last_a = greedy(lm, PROMPT, 4)
    alone_b, last_b = greedy(lm, CONTINUATION, 4)
    lm.prefill([PROMPT])
    a = lm.detach_state()
    assert lm.lengths == [0] and a.nbytes > 0 and a.lengths.tolist() == [len(PROMPT)]
    lm.prefill([CONTINUATION])
    b = lm.detach_state()
    for i in range(4):
        lm.attach_state(a)
        out_a = lm.decode([alone_a[i]])
        a = lm.detach_state()
        lm.attach_state(b)
        out_b = lm.decode([alone_b[i]])
        b = lm.detach_state()
    assert np.allclose(out_a[0], last_a, atol=1e-4) and np.allclose(out_b[0], last_b, atol=1e-4)
    assert a.nbytes > 0 and a.nbytes % (len(PROMPT) + 4) == 0


def test_multi_token_forward_of_a_padded_sequence_equals_its_single_run(lm):
    """DRAGON's teacher forcing and verification feed several tokens at once to a batch of
    documents of unequal length: every fed position of the shorter (padded) sequence must be
    what the sequence alone gives."""
    prompts = [PROMPT, PROMPT[:7]]
    fed = CONTINUATION[:5]
    singles = []
    for p in prompts:
        lm.prefill([p])
        singles.append(lm.forward([fed])[0])
    lm.prefill(prompts)
    both = lm.forward([fed, fed])
    for b in range(2):
        np.testing.assert_allclose(both[b], singles[b], atol=1e-4)
