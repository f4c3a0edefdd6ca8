"""Plain autoregressive generation on a `CausalLM`, streaming text as it is decoded."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from transformers import PreTrainedTokenizerBase

from collab.sampling import SamplingParams, sample
from model_runtime.runtime import CausalLM
from model_runtime.tokenizer import IM_END_ID


@dataclass
class Generation:
    """Token ids produced so far, with the finish reason once done."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class TextStream:
    """Incremental detokenisation: emits only text that later tokens cannot change
    (a multi-byte character split over tokens is held back until complete)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = 0

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[self.emitted :], len(text)
        return delta


def generate(
    lm: CausalLM,
    prompt_ids: list[int],
    params: SamplingParams,
    rng: np.random.Generator,
    max_new_tokens: int = 256,
    stop_ids: frozenset[int] = frozenset({IM_END_ID}),
    result: Generation | None = None,
) -> Iterator[int]:
    """Yield sampled token ids until a stop token, `max_new_tokens`, or the context limit."""
    result = result if result is not None else Generation()
    logits = lm.prefill([prompt_ids])[0]
    for _ in range(max_new_tokens):
        token, _ = sample(logits, rng, params)
        if token in stop_ids:
            result.finish_reason = "stop"
            return
        result.tokens.append(token)
        yield token
        if lm.lengths[0] >= lm.max_context:
            result.finish_reason = "context"
            return
        logits = lm.decode([token])[0]
    result.finish_reason = "length"
