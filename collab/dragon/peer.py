"""One side of a DRAGON answer over the link, the same code on the device and in the cloud
(DRAGON §3–§5; docs/math.md#dragon). The side decodes ahead over its own documents and streams every
draft as soon as it exists; whichever side aggregates merges the two queues token by token:

    decoder ──draft(token, p^s, h^s, decode time; epoch, step)──▶ both ledgers
    aggregator: fronts of both queues for `step` → Algorithm 1 → DragonTarget(token,
                accepted?, accepted?, next aggregator) ──▶ both ledgers (apply)
    a side whose draft was rejected: cancel the model step in flight, roll every document
                sequence back to the committed prefix, feed the target, new epoch

Lookahead is bounded: a side stops drafting while `lookahead` of its drafts are unresolved.
Lookahead 0 is the synchronous baseline DRDG/TW (token-wise aggregation without speculation):
a side drafts one token, then waits for its target and feeds it before decoding on.
A side's ledger drops the other side's drafts from an older epoch (sent before it learned of
its rejection). The link (`PeerLink`) and the model (`Decoder`) are the side's own."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import numpy as np

from collab.dragon.ledger import Ledger, Scheduler, aggregate, make_draft
from collab.dragon.top import TopDocuments, Unsettled
from collab.model_step import ModelStep
from collab.protocol import AggregatorPolicy, DragonDraft, DragonSetup, DragonTarget, Message, Side
from collab.sampling import SamplingParams


class Decoder(Protocol):
    """A side's per-document sequences [d; question; answer so far], stepped together."""

    answer_tokens: int  # answer tokens fed to every sequence

    async def advance(self, token: int) -> np.ndarray | TopDocuments:
        """Feed one answer token to every sequence; next-token logits [D, V] (or each
        document's top tokens, `collab.dragon.top`)."""

    async def rows(self) -> np.ndarray:
        """Every sequence's next-token logits [D, V] now (where the top tokens did not settle
        the draft)."""

    async def completed(self, top: TopDocuments, scores: np.ndarray) -> TopDocuments:
        """`top` with the values of the tokens some documents listed and others did not."""

    async def rewind(self, answer_tokens: int) -> None:
        """Roll every sequence back to its prompt plus this many answer tokens."""

    def cancel(self) -> None:
        """Stop the model step in flight (it raises; no sequence changes)."""


class PeerLink(Protocol):
    """The request's frames to and from the other side (each side's one link per request)."""

    async def send(self, msg: Message) -> object: ...

    async def recv(self, *kinds: type[Message]) -> Message:
        """The other side's next frame of these kinds, or the frame that ends the request
        (`ended`); raises when the request cannot go on."""

    def ended(self, msg: Message) -> bool:
        """Whether `msg` ends the request (the side's own bookkeeping done)."""

    def rtt(self) -> float | None:
        """The measured round trip in seconds, if any."""


class PeerError(Exception):
    """The other side sent a frame that breaks the protocol (reported, then ignored)."""


Rescore = Callable[[list[int]], Awaitable["np.ndarray | None"]]


class DragonPeer:
    """Drive one side's decoder and, while this side aggregates, Algorithm 1."""

    def __init__(
        self,
        ledger: Ledger,
        decoder: Decoder,
        link: PeerLink,
        setup: DragonSetup,
        params: SamplingParams,
        scores: np.ndarray,
        *,
        request_id: int,
        rng: np.random.Generator,
        coin: np.random.Generator,
        scheduler: Scheduler | None = None,
        rescore: Rescore | None = None,
        on_error: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.ledger, self.decoder, self.link, self.setup = ledger, decoder, link, setup
        self.params, self.scores = params, np.asarray(scores, dtype=np.float64)
        self.request_id, self.rng, self.coin = request_id, rng, coin
        self.scheduler = scheduler or Scheduler(setup.policy)
        self.rescore, self.on_error = rescore, on_error
        self.me = ledger.me
        self.greedy = params.temperature == 0.0
        # the next draft's logits (or top tokens) and decode time
        self._logits: tuple[np.ndarray | TopDocuments, float] | None = None
        self._step: ModelStep[np.ndarray | TopDocuments] = ModelStep(decoder.cancel)
        self._commits: list[int] = []
        self.rollbacks = 0

    async def run(
        self, logits: np.ndarray | TopDocuments, decode_time: float
    ) -> AsyncIterator[list[int]]:
        """Decode and aggregate until the answer ends; yields committed tokens as they come.
        `logits` [D, V] are the prefill's, for the answer's first position."""
        ledger = self.ledger
        self._logits = (logits, decode_time)
        recv = asyncio.ensure_future(self.link.recv(DragonDraft, DragonTarget))
        try:
            while not ledger.finished:
                while self._logits is not None and self._can_draft() and not ledger.finished:
                    await self._draft()
                    await self._aggregate()
                if self._commits:
                    yield self._flush()
                if ledger.finished:
                    break
                done = await self._step.race(recv)
                if self._step.future in done:
                    self._logits = self._step.take()
                if recv in done:
                    msg = recv.result()
                    if self.link.ended(msg):
                        break
                    recv = asyncio.ensure_future(self.link.recv(DragonDraft, DragonTarget))
                    await self._on_frame(msg)
                await self._aggregate()
                if self._commits:
                    yield self._flush()
        finally:
            recv.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                # a frame the pending read had already taken when the answer ended: a Done
                # must still close the request (dropped, the side would wait for it forever)
                self.link.ended(await recv)
            await self._stop_step()

    # ---- drafting --------------------------------------------------------------------------
    def _can_draft(self) -> bool:
        ledger = self.ledger
        ahead = max(self.setup.lookahead, 1)
        return not ledger.own_ended() and len(ledger.queues[self.me]) < ahead

    async def _draft(self) -> None:
        assert self._logits is not None
        logits, seconds = self._logits
        self._logits = None
        ledger = self.ledger

        def drafted(logits: np.ndarray | TopDocuments, seconds: float) -> DragonDraft:
            return make_draft(
                logits,
                self.scores,
                self.params,
                self.setup.top_p,
                self.setup.max_sparse,
                self.rng,
                decode_time=seconds,
                epoch=ledger.epochs[self.me],
                step=ledger.next_draft_step(self.me),
                request_id=self.request_id,
            )

        t0 = time.perf_counter()
        try:
            draft = drafted(logits, seconds)
        except Unsettled:  # the documents' top tokens cannot tell: ask what they missed...
            assert isinstance(logits, TopDocuments)
            try:
                completed = await self.decoder.completed(logits, self.scores)
                draft = drafted(completed, seconds + time.perf_counter() - t0)
            except Unsettled:  # ...or, failing that, their rows
                rows = await self.decoder.rows()
                draft = drafted(rows, seconds + time.perf_counter() - t0)
        ledger.add_own(draft)
        self.scheduler.observe_draft(self.me, draft)
        await self.link.send(draft)
        if self.setup.lookahead and not ledger.own_ended():
            self._start_step(draft.token)

    def _start_step(self, token: int) -> None:
        self._step.start(lambda: self.decoder.advance(token))

    async def _stop_step(self) -> None:
        """Drop the model step in flight (its result, if it finished anyway, too). A step only
        scheduled never starts: the step a side starts right after drafting is still queued
        when the target that rejects that draft comes at once (the aggregator's own draft
        completing the pair), and would otherwise cost a whole decode."""
        self._logits = None
        await self._step.stop()

    # ---- frames and targets ----------------------------------------------------------------
    async def _on_frame(self, msg: Message) -> None:
        try:
            if isinstance(msg, DragonDraft):
                if self.ledger.receive(msg, limit=max(self.setup.lookahead, 1)):
                    self.scheduler.observe_draft(self.me.other, msg)
            elif self.ledger.aggregating:
                raise PeerError(f"a target for step {msg.step} from the side not aggregating")
            elif isinstance(msg, DragonTarget):
                await self._apply(msg)
        except (PeerError, ValueError) as exc:
            if self.on_error is None:
                raise
            await self.on_error(f"{exc}; ignored")

    async def _aggregate(self) -> None:
        ledger = self.ledger
        while ledger.aggregating and ledger.ready():
            device, cloud = ledger.fronts()
            token, ok_device, ok_cloud = aggregate(device, cloud, self.greedy, self.coin)
            rtt = self.link.rtt()
            if rtt is not None:
                self.scheduler.rtt = rtt
            after = self.scheduler.choose(self.me, ledger.step)
            target = DragonTarget(
                token, ok_device, ok_cloud, after, request_id=self.request_id, step=ledger.step
            )
            await self.link.send(target)
            await self._apply(target)

    async def _apply(self, target: DragonTarget) -> None:
        applied = self.ledger.apply(target)
        self.scheduler.observe_target(target)
        self._commits += applied.kept
        if self.ledger.finished:
            return
        if applied.own_rejected:
            self.rollbacks += 1
            await self._stop_step()
            await self.decoder.rewind(self.ledger.step - 1)
            self._start_step(target.token)
        elif not self.setup.lookahead:  # synchronous: the target is fed once it is known
            self._start_step(target.token)
        every = self.setup.rerank_every
        if self.rescore is not None and every and self.ledger.step % every == 0:
            scores = await self.rescore(list(self.ledger.transcript.tokens))
            if scores is not None:
                self.scores = np.asarray(scores, dtype=np.float64)

    def _flush(self) -> list[int]:
        out, self._commits = self._commits, []
        return out


def first_aggregator(setup: DragonSetup) -> Side:
    """Where aggregation starts: the pinned side, or the setup's first side under AUTO."""
    if setup.policy == AggregatorPolicy.DEVICE:
        return Side.DEVICE
    if setup.policy == AggregatorPolicy.CLOUD:
        return Side.CLOUD
    return setup.first
