"""DRAGON's sequence-wise baseline DRDG/SW and teacher forcing (DRAGON §2.2, §7.3), one side's
part, the same code on the device and in the cloud: answer alone from the side's own mixture,
and score an answer (the other side's, or held-out text) under it.

A side's answer is drawn exactly as its DRAGON drafts are (`side_distribution`: the mixture cut
to top-p and rounded for the wire; greedy: its argmax); its score is the log-probability of each
token under the whole mixture (`side_logprobs`), which is what sequence-level aggregation
(`collab.dragon.ledger.sequence_choice`) and perplexity need."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import numpy as np

from collab.dragon.ledger import draft_token, side_distribution, side_logprobs
from collab.sampling import SamplingParams


class Teacher(Protocol):
    """A side's per-document sequences (`model_runtime.async_model.DocumentBatch`)."""

    async def advance(self, token: int) -> np.ndarray: ...

    async def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed the same tokens to every sequence; logits at every fed position [D, T, V]."""

    async def rewind(self, answer_tokens: int) -> None: ...


async def answer_alone(
    batch: Teacher,
    first: np.ndarray,
    scores: np.ndarray,
    params: SamplingParams,
    top_p: float,
    max_sparse: int,
    max_new: int,
    stop_ids: Collection[int],
    rng: np.random.Generator,
    check: Callable[[], None] = lambda: None,
) -> tuple[list[int], np.ndarray]:
    """Up to `max_new` tokens from the side's own mixture, from the prefill's logits `first`
    [D, V] on; and the log-probability of each under the whole mixture. `check` runs before
    every token (the cloud's cancel)."""
    greedy = params.temperature == 0.0
    logits = first
    tokens: list[int] = []
    logprobs: list[float] = []
    while len(tokens) < max_new:
        check()
        ids, probs = side_distribution(logits, scores, params, top_p, max_sparse)
        tokens.append(draft_token(ids, probs, greedy, rng))
        lp = side_logprobs(logits[:, None, :], scores, np.asarray(tokens[-1:]), params.temperature)
        logprobs.append(float(lp[0]))
        if tokens[-1] in stop_ids:
            break
        logits = await batch.advance(tokens[-1])
    return tokens, np.asarray(logprobs, dtype=np.float64)


async def score(
    batch: Teacher,
    first: np.ndarray,
    scores: np.ndarray,
    tokens: Sequence[int],
    temperature: float,
) -> np.ndarray:
    """log p^s of each token of an answer, teacher-forced from the documents' prompts (every
    sequence rewound to its prompt, then one batched step over the answer)."""
    if not tokens:
        return np.zeros(0)
    await batch.rewind(0)
    logits = first[:, None, :]
    if len(tokens) > 1:
        logits = np.concatenate([logits, await batch.feed(list(tokens[:-1]))], axis=1)
    return side_logprobs(logits, scores, np.asarray(tokens), temperature)
