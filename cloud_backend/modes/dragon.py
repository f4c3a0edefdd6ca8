"""DRAGON, cloud side: decode over the public documents, one sequence per document, and take
part in Speculative Aggregation (`collab.dragon.peer`, the same loop as the device's).

device → Generate(question, history, sampling, retrieve) then DragonSetup(k, policy, …)
cloud  → Citations (its public documents), then per-document prefill [d; question] ×k
both   → DragonDraft(token, p^cloud, h^cloud, decode time; epoch, step) as each is decoded
aggregator → DragonTarget(token, accepted?, accepted?, next aggregator)
cloud  → Done when the answer ends (stop token or length)

The cloud never sees the private documents, their embeddings or the device's cache: only the
device's drafts (token, sparse p^device, h^device, timing) and targets."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from cloud_backend.modes.base import Request, public_passages
from cloud_backend.modes.dragon_sequence import PublicSide, answer_alone
from cloud_backend.modes.link import Stop
from collab.dragon.ledger import NO_DOCUMENT_COSINE, Ledger, Scheduler, relevance
from collab.dragon.peer import DragonPeer, first_aggregator
from collab.dragon.top import TOP_K, TopDocuments
from collab.protocol import (
    AggregatorPolicy,
    Citations,
    DragonSetup,
    ErrorCode,
    FinishReason,
    Generate,
    Side,
)
from collab.sources import SOURCE_CHARS, Source
from model_runtime.async_model import DocumentBatch, TopDocumentBatch
from model_runtime.prefix_cache import PrefixReuse
from model_runtime.prompting import document_prompt, prompt_budget

if TYPE_CHECKING:
    from cloud_backend.context import RequestContext

log = logging.getLogger("tandem.cloud")

PING_EVERY_S = 1.0  # how often the cloud re-measures the round trip while it answers


class DragonRequest(Request):
    ping_every_s = PING_EVERY_S

    def __init__(self, gen: Generate, ctx: RequestContext, start: float) -> None:
        super().__init__(gen, ctx, start)
        self.passages: list[Source] = []
        self.batch = DocumentBatch(ctx.session)
        self.decoder: DocumentBatch | TopDocumentBatch = self.batch  # what DRAGON steps
        self.setup = DragonSetup()
        self.scores = np.zeros(1)
        self.first_logits: np.ndarray | TopDocuments = np.zeros((1, 1))
        self.prefill_s = 0.0
        self.reuse: PrefixReuse | None = None

    async def run(self) -> None:
        """DragonSetup, the public documents, one prefill of every document's prompt, then
        the aggregation loop (`decode_answer`)."""
        self.setup = await self.link.recv(DragonSetup)  # it follows the Generate
        prompts, cosines = await self._documents(self.setup.k)
        self.scores = relevance(cosines)
        room = self.ctx.engine.lm.max_context - max(map(len, prompts))
        if room <= 0:
            await self.link.error(ErrorCode.LIMIT, "the documents and question fill the context")
            raise Stop(FinishReason.ERROR)
        self.transcript.max_new_tokens = min(self.transcript.max_new_tokens, room)
        token_wise = self.setup.policy not in (AggregatorPolicy.SEQUENCE, AggregatorPolicy.SCORE)
        t0, reused = time.perf_counter(), self.ctx.session.reused_tokens
        if token_wise and self.ctx.session.tops_inside:  # vLLM: no rows (collab.dragon.top)
            self.decoder = TopDocumentBatch(self.batch, TOP_K, self.params.temperature)
            self.first_logits = await self.decoder.start(prompts)
        else:
            self.first_logits = await self.batch.start(prompts, self.reuse)
        self.prefill_s = time.perf_counter() - t0
        if self.reuse is not None:
            self.ctx.metrics.reused("document", self.reuse.reused)
        else:  # an engine that reuses prefixes itself counts them (vLLM)
            self.ctx.metrics.reused("document", self.ctx.session.reused_tokens - reused)
        if not token_wise:
            assert isinstance(self.first_logits, np.ndarray)
            side = PublicSide(self.batch, self.first_logits, self.scores)
            room = self.ctx.engine.lm.max_context - max(self.batch.prompt_lengths)
            await answer_alone(
                self.link,
                side,
                self.setup,
                self.params,
                self.transcript.max_new_tokens,
                room,
                self.rng,
                self.commit,
            )
            return
        if self.transcript.max_new_tokens == 0:
            self.transcript.commit([])
            return
        await self.decode_answer()

    async def decode_answer(self) -> None:
        setup, seed = self.setup, self.gen.seed
        ledger = Ledger(Side.CLOUD, self.transcript, aggregator=first_aggregator(setup))
        peer = DragonPeer(
            ledger,
            self.decoder,
            self.link,
            setup,
            self.params,
            self.scores,
            request_id=self.gen.request_id,
            rng=self.rng,
            coin=np.random.default_rng(None if seed is None else [seed, 1]),
            scheduler=Scheduler(setup.policy),
            rescore=self._rescore if self.passages else None,
            on_error=lambda text: self.link.error(ErrorCode.MALFORMED, text),
        )
        try:
            async for kept in peer.run(self.first_logits, self.prefill_s):
                self.counted(kept)
        finally:
            self.epoch = ledger.epochs[Side.CLOUD]
            self.rounds = ledger.step
            self.drafted = ledger.drafted[Side.CLOUD]
            self.accepted = ledger.accepted[Side.CLOUD]

    async def _documents(self, k: int) -> tuple[list[list[int]], np.ndarray]:
        """One prompt per public document [d; history; question] and the documents' cosines;
        with none (retrieval off, nothing found), one bare prompt at the no-document score."""
        corpus = self.ctx.corpus
        if self.gen.retrieve and corpus is not None and k > 0:
            self.passages = await asyncio.to_thread(
                public_passages, corpus, self.gen, k, self.ctx.corpus_floor
            )
            sources = tuple(p.clipped(SOURCE_CHARS) for p in self.passages)
            await self.link.send(Citations(sources, request_id=self.gen.request_id))
        tokenizer = self.ctx.engine.tokenizer
        budget = prompt_budget(self.ctx.engine.lm.max_context, self.gen.max_new_tokens)
        docs: list[Source | None] = [replace(p, number=n) for n, p in enumerate(self.passages, 1)]
        built = await asyncio.to_thread(  # off the event loop, as Request.prompt
            lambda: [
                document_prompt(tokenizer, self.gen.question, self.gen.history, doc, budget)
                for doc in docs or [None]
            ]
        )
        prompts = [ids for ids, _, _ in built]
        cache = self.ctx.engine.documents
        if cache is not None:  # each document's [instructions; document] KV, kept
            self.reuse = PrefixReuse(
                cache, [stable for _, _, stable in built], salt=self.ctx.cache_salt
            )
        else:  # the engine's own prefix cache, within the same scope
            self.ctx.session.share_documents(self.ctx.cache_salt)
        if not self.passages:
            return prompts, np.array([NO_DOCUMENT_COSINE])
        return prompts, np.array([p.score for p in self.passages])

    async def _rescore(self, tokens: list[int]) -> np.ndarray | None:
        """DRAGON §4.1 dynamic weights: the documents' cosines with question + answer so far."""
        corpus = self.ctx.corpus
        if corpus is None:
            return None
        text = self.gen.question + " " + self.ctx.engine.tokenizer.decode(tokens)
        cosines = await asyncio.to_thread(corpus.rescore, self.passages, text)
        return relevance(cosines)
