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
from typing import TYPE_CHECKING

import numpy as np

from cloud_backend.modes.base import Stop
from collab.dragon.aggregation import side_weight
from collab.dragon.sequence import answer_alone as alone
from collab.dragon.sequence import score
from collab.protocol import (
    AggregatorPolicy,
    Cancel,
    DragonScore,
    DragonSequence,
    ErrorCode,
    FinishReason,
)
from model_runtime.tokenizer import IM_END_ID

if TYPE_CHECKING:
    from cloud_backend.modes.dragon import DragonRequest


async def answer_alone(req: DragonRequest) -> None:
    """DRDG/SW: the cloud's answer from p^cloud alone, then one scoring of the device's
    answer. SCORE (teacher forcing): the scoring alone."""
    rid, h, setup, params = req.gen.request_id, side_weight(req.scores), req.setup, req.params
    if setup.policy == AggregatorPolicy.SEQUENCE:
        t0 = time.perf_counter()
        tokens, logprobs = await alone(
            req.batch, req.first_logits, req.scores, params, setup.top_p, setup.max_sparse,
            req.transcript.max_new_tokens, {IM_END_ID}, req.rng, check=req.check_cancel,
        )  # fmt: skip
        req.commit(list(tokens))
        decode_s = time.perf_counter() - t0
        await req.ctx.send(
            DragonSequence(np.asarray(tokens), logprobs, h, decode_s, request_id=rid)
        )
    theirs = await _score_request(req)
    scored = await score(req.batch, req.first_logits, req.scores, theirs, params.temperature)
    await req.ctx.send(
        DragonSequence(np.asarray(theirs), scored, h, 0.0, scored=True, request_id=rid)
    )


async def _score_request(req: DragonRequest) -> list[int]:
    """The device's DragonScore (its answer), which it sends once its own answer is done."""
    while True:
        msg = await req.ctx.inbox.get()
        if isinstance(msg, Cancel):
            raise Stop(FinishReason.CANCELLED)
        if isinstance(msg, DragonScore):
            room = req.ctx.engine.lm.max_context - max(req.batch.prompt_lengths)
            if msg.tokens.size > room:
                await req.error(ErrorCode.LIMIT, f"{msg.tokens.size} tokens to score: over "
                                f"the {room} left in the context")  # fmt: skip
                raise Stop(FinishReason.ERROR)
            return [int(t) for t in msg.tokens]
        await req.error(
            ErrorCode.MALFORMED, f"expected DragonScore, got {type(msg).__name__}; ignored"
        )
