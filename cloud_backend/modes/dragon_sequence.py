"""DRDG/SW, cloud side: the sequence-wise baseline DRAGON §2.2 measures itself against
(REPLUG / RAG-Sequence output aggregation across the network). Served when a dragon request's
DragonSetup says `AggregatorPolicy.SEQUENCE`; the app never asks for it, the benchmarks do.

cloud  → (after the per-document prefill) its whole answer from its own mixture p^cloud:
         DragonSequence(tokens, log p^cloud of each, h^cloud, decode time)
device → DragonScore(its own answer)
cloud  → DragonSequence(those tokens, log p^cloud of each, scored) — teacher-forced over every
         public document in one batched step
cloud  → Done

The device scores the cloud's answer under its own mixture and keeps one of the two
(`collab.dragon.ledger.sequence_choice`). Policy SCORE is the scoring alone (teacher forcing): the
cloud's half of a perplexity measured across the network (DRAGON §7.3)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cloud_backend.modes.link import RequestLink, Stop
from collab.dragon.aggregation import side_weight
from collab.dragon.sequence import Teacher, score
from collab.dragon.sequence import answer_alone as alone
from collab.protocol import (
    AggregatorPolicy,
    DragonScore,
    DragonSequence,
    DragonSetup,
    ErrorCode,
    FinishReason,
)
from collab.sampling import SamplingParams
from model_runtime.tokenizer import IM_END_ID


@dataclass
class PublicSide:
    """The cloud's side of a DRAGON answer once its documents are prefilled: the documents'
    sequences, the prefill's logits [D, V] and the documents' relevance."""

    batch: Teacher
    first_logits: np.ndarray
    scores: np.ndarray


async def answer_alone(
    link: RequestLink,
    side: PublicSide,
    setup: DragonSetup,
    params: SamplingParams,
    max_new_tokens: int,
    room: int,
    rng: np.random.Generator,
    commit: Callable[[list[int]], object],
) -> None:
    """DRDG/SW: the cloud's answer from p^cloud alone (committed with `commit`), then one
    scoring of the device's answer (at most `room` tokens: what the context leaves). SCORE
    (teacher forcing): the scoring alone."""
    h = side_weight(side.scores)
    if setup.policy == AggregatorPolicy.SEQUENCE:
        t0 = time.perf_counter()
        tokens, logprobs = await alone(
            side.batch,
            side.first_logits,
            side.scores,
            params,
            setup.top_p,
            setup.max_sparse,
            max_new_tokens,
            {IM_END_ID},
            rng,
            check=link.check_cancel,
        )
        commit(list(tokens))
        decode_s = time.perf_counter() - t0
        await link.send(
            DragonSequence(np.asarray(tokens), logprobs, h, decode_s, request_id=link.rid)
        )
    theirs = await _score_request(link, room)
    scored = await score(side.batch, side.first_logits, side.scores, theirs, params.temperature)
    await link.send(
        DragonSequence(np.asarray(theirs), scored, h, 0.0, scored=True, request_id=link.rid)
    )


async def _score_request(link: RequestLink, room: int) -> list[int]:
    """The device's DragonScore (its answer), which it sends once its own answer is done."""
    msg = await link.recv(DragonScore)
    if msg.tokens.size > room:
        await link.error(
            ErrorCode.LIMIT,
            f"{msg.tokens.size} tokens to score: over the {room} left in the context",
        )
        raise Stop(FinishReason.ERROR)
    return [int(t) for t in msg.tokens]
