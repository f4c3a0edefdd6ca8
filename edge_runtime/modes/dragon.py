"""DRAGON, device side: private and public knowledge in one answer (DRAGON §3–§5,
docs/math.md#dragon).

The device decodes one sequence per private passage [d; question; answer so far], the cloud
one per public passage; each side mixes its documents' next-token distributions into p^s with
side weight h^s, and Speculative Aggregation (`collab.dragon.peer`, the same loop on both
sides) draws every answer token from η^device p^device + η^cloud p^cloud. Only token ids,
sparse p^s, h^s and timing cross the wire: the private passages, their embeddings and this
cache never do.

    device                                             cloud
    Generate, DragonSetup ───────────────────────────▶ public retrieval → Citations
    private retrieval, prefill ×k                      prefill ×k
    drafts ◀──────────────────────────────────────────▶ drafts
    the aggregator (scheduler's pick) → DragonTarget ─▶ both apply it; a rejected side rolls
                                                        back and re-decodes (new epoch)
    Done ◀──────────────────────────────────────────── the answer ended

If the link breaks mid-answer, the device finishes from its own mixture (its documents
only) and says so."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from collab.dragon.ledger import (
    DRAGON_LOOKAHEAD,
    DRAGON_MAX_SPARSE,
    DRAGON_TOP_P,
    NO_DOCUMENT_COSINE,
    Ledger,
    Scheduler,
    draft_token,
    relevance,
    side_distribution,
)
from collab.dragon.peer import DragonPeer, first_aggregator
from collab.protocol import AggregatorPolicy, DragonDraft, DragonSetup, DragonTarget, Mode, Side
from collab.sources import Source
from edge_runtime.client import CloudClient, CloudError, CloudProtocolError
from edge_runtime.consent import refused
from edge_runtime.device import (
    NOTHING_PRIVATE,
    forget_removed,
    nothing_relevant,
    search_private,
)
from edge_runtime.events import Event, Notice
from edge_runtime.modes.base import (
    Answer,
    AnswerOptions,
    ModeContext,
    Turn,
    full_history,
    left_out_notice,
    need_device,
    searched_by,
)
from edge_runtime.modes.cloud_link import CloudBacked
from edge_runtime.modes.dragon_declared import DECLARED
from edge_runtime.modes.link import RequestLink
from model_runtime.async_model import DocumentBatch
from model_runtime.prefix_cache import PrefixReuse
from model_runtime.prompting import document_prompt, prompt_budget

POLICIES = {
    "device": AggregatorPolicy.DEVICE,
    "cloud": AggregatorPolicy.CLOUD,
    "auto": AggregatorPolicy.AUTO,
}


@dataclass
class _Documents:
    """The device's side of one answer: one prompt per private passage and their relevance."""

    prompts: list[list[int]]
    scores: np.ndarray
    batch: DocumentBatch
    question: str
    hits: list[Any]  # the index's hits, for re-ranking
    reuse: PrefixReuse | None = None
    first_logits: np.ndarray | None = None


class DragonMode(CloudBacked):
    name = "dragon"
    declared = DECLARED  # its figures and settings
    description = "device and cloud each read their own documents; every token mixes both"
    protocol_mode = Mode.DRAGON

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._docs: _Documents | None = None

    @property
    def policy(self) -> AggregatorPolicy:
        try:
            return POLICIES[self.ctx.aggregator]
        except KeyError:
            raise ValueError(
                f"aggregator must be one of {', '.join(POLICIES)} (got {self.ctx.aggregator!r})"
            ) from None

    async def prepare(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        """Private retrieval and one prompt per passage (the prefill waits until the request
        is out, so the cloud's retrieval and prefill overlap the device's). The passages are
        numbered after the cloud's (1..k), the way each side's prompts cite them."""
        device = need_device(self.ctx)
        hits = await search_private(
            self.ctx.index,
            searched_by(question, history),
            options.k,
            options.min_score,
            options.scope,
        )
        if await self.shaped_by_private(hits, history) and not await self.private_allowed(
            options
        ):  # its drafts, weights and tokens would carry what they say: answer here instead
            local = [hit.source(n, "device") for n, hit in enumerate(hits, 1)]
            who = self.cloud_identity() or "this cloud"
            yield Notice(f"answered on this device alone (local mode): {refused(who)}")
            for event in self.prompt_with(question, history, local, options, answer):
                yield event
            answer.device_only = True
            return
        passages = [hit.source(options.k + n, "device") for n, hit in enumerate(hits, 1)]
        for source in passages:
            yield source
        if nothing_relevant(self.ctx.index, options.k, passages):
            yield Notice(NOTHING_PRIVATE)
        budget = prompt_budget(device.lm.max_context, options.max_new_tokens)
        prompts, stable, dropped = [], [], 0
        docs: list[Source | None] = list(passages) or [None]
        for doc in docs:
            ids, dropped, prefix = document_prompt(
                device.tokenizer, question, full_history(history), doc, budget
            )
            prompts.append(ids)
            stable.append(prefix)
        reuse = None
        if device.documents is not None:  # each passage's [instructions; passage] KV, kept
            await forget_removed(device.documents, self.ctx.index)
            tags = [[hit.chunk_id] for hit in hits] or [[]]  # hits and passages match 1:1
            reuse = PrefixReuse(device.documents, stable, tags)
        if dropped:
            yield left_out_notice(dropped, device.lm.max_context)
        cosines = [p.score for p in passages] or [NO_DOCUMENT_COSINE]
        self._docs = _Documents(
            prompts, relevance(np.array(cosines)), DocumentBatch(device), question, hits, reuse
        )

    async def converse(
        self, link: RequestLink, options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        docs = self._docs
        assert docs is not None  # prepare ran
        lookahead = self.ctx.dragon_lookahead
        setup = DragonSetup(
            options.k,
            self.policy,
            Side.DEVICE,
            DRAGON_TOP_P,
            DRAGON_MAX_SPARSE,
            DRAGON_LOOKAHEAD if lookahead is None else lookahead,
            self.ctx.rerank_every,
            request_id=link.rid,
        )
        await link.send(setup)
        pinger = asyncio.ensure_future(_ping(link.client))
        try:
            t0 = time.perf_counter()
            docs.first_logits = await docs.batch.start(docs.prompts, docs.reuse)
            prefill_s = time.perf_counter() - t0
            seed = options.seed
            ledger = Ledger(Side.DEVICE, answer.transcript, aggregator=first_aggregator(setup))
            scheduler = Scheduler(setup.policy)
            peer = DragonPeer(
                ledger,
                docs.batch,
                link,
                setup,
                options.sampling,
                docs.scores,
                request_id=link.rid,
                rng=np.random.default_rng(None if seed is None else [seed, 0xD2]),
                coin=np.random.default_rng(None if seed is None else [seed, 0xC0]),
                scheduler=scheduler,
                rescore=self._rescore if docs.hits else None,
                on_error=_cloud_broke_protocol,
            )
            async for kept in peer.run(docs.first_logits, prefill_s):
                _figures(answer, ledger, scheduler)
                for event in [*link.take_events(), *answer.emit(kept)]:
                    yield event
            if not answer.finished:
                _figures(answer, ledger, scheduler)
            while not answer.finished:  # drafts after the end are dropped; Done ends it
                link.ended(await link.recv(DragonDraft, DragonTarget))
        finally:
            pinger.cancel()

    async def _rescore(self, tokens: list[int]) -> np.ndarray | None:
        """DRAGON §4.1 dynamic weights: the passages' cosines with question + answer so far,
        from their stored vectors (only the text is embedded; nothing leaves the device)."""
        docs, index = self._docs, self.ctx.index
        if docs is None or index is None:
            return None
        text = docs.question + " " + need_device(self.ctx).tokenizer.decode(tokens)
        return relevance(await asyncio.to_thread(index.rescore, docs.hits, text))

    async def finish_on_device(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        """The link broke: go on from the device's own mixture p^device (its documents)."""
        docs = self._docs
        if docs is None or docs.first_logits is None:  # broke before the device prefilled
            async for event in super().finish_on_device(question, history, options, answer):
                yield event
            return
        device = need_device(self.ctx)
        yield Notice(f"finishing the answer on the device ({device.name}, private documents)")
        transcript, batch = answer.transcript, docs.batch
        tokens = transcript.tokens
        logits = docs.first_logits
        if tokens:
            have = min(batch.answer_tokens, len(tokens) - 1)
            await batch.rewind(have)
            for token in tokens[have:]:
                logits = await batch.advance(token)
        rng = np.random.default_rng(None if options.seed is None else [options.seed, 0xF1])
        greedy = options.temperature == 0.0
        while transcript.finish is None:
            ids, probs = side_distribution(
                logits, docs.scores, options.sampling, DRAGON_TOP_P, DRAGON_MAX_SPARSE
            )
            kept = transcript.commit([draft_token(ids, probs, greedy, rng)])
            for event in answer.emit(kept):
                yield event
            if transcript.finish is None:
                if max(batch.prompt_lengths) + batch.answer_tokens + 1 > device.lm.max_context:
                    break
                logits = await batch.advance(kept[-1])


async def _cloud_broke_protocol(text: str) -> None:
    """A DRAGON frame from the cloud that no honest cloud sends (a draft past the lookahead, a
    target for the wrong step): the answer cannot go on with it; the device may finish it."""
    what = text.removesuffix("; ignored")
    raise CloudProtocolError(f"the cloud broke the DRAGON protocol: {what}")


async def _ping(client: CloudClient) -> None:
    """Measure the round trip once at the start, and again now and then (the scheduler's
    c_trans); a lost ping only leaves the estimate as it was."""
    with contextlib.suppress(CloudError, asyncio.TimeoutError):
        while True:
            await client.ping()
            await asyncio.sleep(1.0)


def _figures(answer: Answer, ledger: Ledger, scheduler: Scheduler) -> None:
    stats = answer.stats
    stats.device_decode_s = scheduler.profiles[Side.DEVICE].mean
    stats.cloud_decode_s = scheduler.profiles[Side.CLOUD].mean
    stats.aggregator = ledger.aggregator.label
    stats.switches = ledger.switches
    stats.device_drafted = ledger.drafted[Side.DEVICE]
    stats.device_accepted = ledger.accepted[Side.DEVICE]
    stats.cloud_drafted = ledger.drafted[Side.CLOUD]
    stats.cloud_accepted = ledger.accepted[Side.CLOUD]
    stats.rounds = ledger.step
