"""The cloud side of a request, whatever the mode: the prompt (public retrieval, history),
the prefill, committing tokens, plain decoding (cloud mode, and split's AS² fallback), cancel.
Each mode's request is a `Request` subclass in its own module, registered in
`cloud_backend.modes`.

Session flow (after the Hello/HelloAck handshake; every frame carries request id, epoch, step):

cloud   device → Generate(question, history, sampling, retrieve)
        cloud  → Citations (public sources, if any) → TokenChunk per token → Done
        (max_new_tokens 0 is a retrieval: Citations → Done, no prefill; DRCG/Text uses it)
split   see cloud_backend/modes/split.py
any     device → Cancel: the cloud stops and answers Done(CANCELLED)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from cloud_backend.engine import Evicted
from cloud_backend.modes.link import RequestLink, Stop
from collab.protocol import (
    Citations,
    Done,
    ErrorCode,
    FinishReason,
    Generate,
    TokenChunk,
)
from collab.sampling import SamplingParams, sample
from collab.sources import SOURCE_CHARS, Source
from collab.split import Transcript
from model_runtime.prompting import clipped_prompt, prompt_budget
from model_runtime.runtime import Cancelled
from model_runtime.tokenizer import IM_END_ID
from retrieval.focus import focused
from retrieval.search import best_of, clauses

if TYPE_CHECKING:
    from cloud_backend.context import RequestContext
    from cloud_backend.corpus import PublicCorpus, PublicHit

log = logging.getLogger("tandem.cloud")


async def serve(req: Request) -> Done:
    """Run one request to its end; send every frame (Done included) and return the Done."""
    gen, ctx, start = req.gen, req.ctx, req.start
    try:
        await req.run()
        reason = req.transcript.finish or FinishReason.STOP
    except Stop as stop:
        reason = stop.reason
    except Evicted as exc:
        await req.link.error(ErrorCode.EVICTED, str(exc))
        reason = FinishReason.ERROR
    except Cancelled:
        reason = FinishReason.CANCELLED
    up, down = req.link.traffic()
    done = Done(
        reason,
        tokens=len(req.transcript.tokens),
        rounds=req.rounds,
        drafted=req.drafted,
        accepted=req.accepted,
        bytes_up=up,
        bytes_down=down,
        elapsed_s=time.perf_counter() - start,
        request_id=gen.request_id,
        epoch=req.epoch,
        step=len(req.transcript.tokens),
    )
    ctx.session.release()
    await req.link.send(done)
    return done


def public_passages(
    corpus: PublicCorpus, gen: Generate, k: int, floor: float | None
) -> list[Source]:
    """The corpus's passages for a request: searched by the device's `search` (a follow-up
    with its topic, edge_runtime.turns), by the question and by each clause of a compound
    question (`retrieval.search.clauses`), the best kept (`retrieval.search.best_of`)."""
    asked = (
        [gen.search, gen.question] if gen.search and gen.search != gen.question else [gen.question]
    ) + clauses(gen.question)
    hits: list[PublicHit] = best_of([corpus.search(q, k, floor) for q in asked])
    return list[Source](hits)


class Request(ABC):
    """One Generate being served. Subclasses implement `decode_answer` (after the prefill);
    their frames go through `link`, the request's one link."""

    ping_every_s: float | None = None  # re-measure the round trip as frames come (DRAGON)

    def __init__(self, gen: Generate, ctx: RequestContext, start: float) -> None:
        self.gen, self.ctx, self.start = gen, ctx, start
        self.link = RequestLink(ctx, gen.request_id, self.ping_every_s)
        self.params = SamplingParams(gen.temperature, gen.top_k, gen.top_p)
        self.rng = np.random.default_rng(gen.seed)
        self.transcript = Transcript(gen.max_new_tokens, frozenset({IM_END_ID}))
        self.rounds = self.drafted = self.accepted = 0
        self.epoch = 0
        self.pending: int | None = None  # newest committed token, not yet in the cache
        self.next_logits: np.ndarray | None = None  # valid while pending is None
        self.first_token_seen = False

    async def run(self) -> None:
        ids = await self.prompt()
        if self.gen.max_new_tokens == 0:  # a retrieval: the Citations, then Done; no prefill
            self.transcript.commit([])
            return
        lm = self.ctx.engine.lm
        room = lm.max_context - len(ids)
        if room <= 0:
            await self.link.error(ErrorCode.LIMIT, f"prompt of {len(ids)} tokens fills the context")
            raise Stop(FinishReason.ERROR)
        self.transcript.max_new_tokens = min(self.transcript.max_new_tokens, room)
        session = self.ctx.session
        reused = session.reused_tokens
        self.next_logits = await session.begin(ids)  # extends the last answer's KV if it can
        self.ctx.metrics.reused("conversation", session.reused_tokens - reused)
        await self.decode_answer()

    @abstractmethod
    async def decode_answer(self) -> None:
        """Produce the answer's tokens after the prefill (the mode's own loop)."""

    async def prompt(self) -> list[int]:
        passages: list[Source] = []
        corpus = self.ctx.corpus
        if self.gen.retrieve and corpus is not None:
            passages = await asyncio.to_thread(
                public_passages, corpus, self.gen, self.ctx.corpus_k, self.ctx.corpus_floor
            )
            sources = tuple(p.clipped(SOURCE_CHARS) for p in passages)
            await self.link.send(Citations(sources, request_id=self.gen.request_id))
            passages = self.focused(passages)
        budget = prompt_budget(self.ctx.engine.lm.max_context, self.gen.max_new_tokens)
        # passages too long for the model's context are clipped; tokenising a question of
        # up to a frame's 4 MiB takes seconds: on a thread, the event loop serves the others
        ids, dropped = await asyncio.to_thread(
            clipped_prompt,
            self.ctx.engine.tokenizer,
            self.gen.question,
            self.gen.history,
            passages,
            budget,
        )
        if dropped:
            log.info("request=%d history_pairs_left_out=%d", self.gen.request_id, dropped)
        return ids

    def focused(self, passages: list[Source]) -> list[Source]:
        """The passages as the prompt holds them: each cut to the sentences that answer the
        question (and the words a follow-up was searched with), `corpus_focus_words` long."""
        words = self.ctx.corpus_focus_words
        if not words or not passages:
            return passages
        asked = " ".join(dict.fromkeys(filter(None, [self.gen.search, self.gen.question])))
        texts = focused(asked, [p.text for p in passages], words)
        return [replace(p, text=t) for p, t in zip(passages, texts, strict=True)]

    def commit(self, tokens: list[int]) -> list[int]:
        return self.counted(self.transcript.commit(tokens))

    def counted(self, kept: list[int]) -> list[int]:
        """Report tokens just committed to the answer (the first one: the time to it)."""
        if kept and not self.first_token_seen:
            self.first_token_seen = True
            self.ctx.metrics.ttft(time.perf_counter() - self.start)
        self.ctx.metrics.tokens(len(kept))
        return kept

    async def current_logits(self) -> np.ndarray:
        """Logits for the next token: the pending token goes through the model first."""
        if self.pending is None:
            assert self.next_logits is not None
            return self.next_logits
        logits: np.ndarray = (await self.ctx.session.forward([self.pending]))[-1]
        self.pending, self.next_logits = None, logits
        return logits

    async def decode(self, n: int) -> None:
        """The cloud samples the next n tokens itself and streams them (cloud mode; split's
        first token and its AS² fallback): with the engine's own sampler where it has one."""
        n = min(n, self.transcript.remaining)
        stream = self.ctx.session.sampled(self.pending, self.params, n) if n > 0 else None
        if stream is not None:
            async with contextlib.aclosing(stream):
                async for token in stream:
                    self.next_logits = None
                    self.pending = token
                    await self.stream_token(token)
                    if self.transcript.finish is not None:
                        return
                    self.link.check_cancel()
            return
        for _ in range(n):
            if self.transcript.finish is not None:
                return
            self.link.check_cancel()
            logits = await self.current_logits()
            token, _ = sample(logits, self.rng, self.params)
            self.pending = token
            await self.stream_token(token)

    async def stream_token(self, token: int) -> None:
        """Commit a token the cloud sampled and send it (unless the answer had ended)."""
        step = len(self.transcript.tokens)
        kept = self.commit([token])
        if kept:
            chunk = TokenChunk(
                np.asarray(kept), request_id=self.gen.request_id, epoch=self.epoch, step=step
            )
            await self.link.send(chunk)
