"""Plain generation and streaming detokenisation on the tiny model."""

from __future__ import annotations

import numpy as np

from collab.sampling import GREEDY, SamplingParams
from model_runtime.generate import Generation, TextStream, generate
from model_runtime.ort_runtime import OrtCausalLM


def test_text_stream_holds_back_split_characters(tiny_tokenizer):
    text = "naïve 東京 🚀 done"
    ids = tiny_tokenizer.encode(text)
    stream = TextStream(tiny_tokenizer)
    pieces = [stream.push(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_generate_stops_at_max_tokens_and_is_reproducible(tiny):
    lm = OrtCausalLM(tiny["onnx-quant"])
    prompt = [9707, 11, 1879]
    first, again = Generation(), Generation()
    a = list(generate(lm, prompt, SamplingParams(0.8), np.random.default_rng(1), 12, result=first))
    b = list(generate(lm, prompt, SamplingParams(0.8), np.random.default_rng(1), 12, result=again))
    assert a == b == first.tokens and len(a) <= 12
    assert first.finish_reason in ("length", "stop")


def test_generate_stops_on_a_stop_token(tiny):
    lm = OrtCausalLM(tiny["onnx-quant"])
    prompt = [9707, 11, 1879]
    greedy = list(generate(lm, prompt, GREEDY, np.random.default_rng(0), 5))
    result = Generation()
    stopped = list(
        generate(lm, prompt, GREEDY, np.random.default_rng(0), 5, frozenset({greedy[2]}), result)
    )
    assert stopped == greedy[: greedy.index(greedy[2])]
    assert result.finish_reason == "stop"


def test_generate_stops_at_the_context_limit(tiny):
    lm = OrtCausalLM(tiny["onnx-quant"], max_context=8)
    result = Generation()
    out = list(generate(lm, [1, 2, 3, 4, 5], GREEDY, np.random.default_rng(0), 50, result=result))
    assert len(out) == 4 and result.finish_reason == "context"  # the last is never fed
