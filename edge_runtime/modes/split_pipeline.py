"""PicoSpec's pipeline for split decoding on the device (PicoSpec §3; docs/math.md#picospec): the
device
keeps drafting while the cloud verifies, so drafting, the link and verification overlap.

    device                                              cloud
    ──────                                              ─────
    draft S_i (γ) ───── frame(epoch e, step s) ───────▶ verify S_i (no bonus token)
    draft S_{i+1} from S_i's tail ── frame(e, s + γ) ─▶ queued behind S_i
    ◀──────────── Verdict(γ accepted, no token) ─────── keeps P_{γ+1}: S_{i+1}[0] is checked
    ...                                                 against it when S_{i+1} comes up
    ◀──────────── Verdict(j, correction t) ──────────── epoch e + 1: frames of epoch e dropped
    cancel the model step in flight, drop S_{i+1}…, roll back to the committed prefix,
    feed t, draft on in epoch e + 1

Each draft goes out as soon as it is made, as a part of its batch (the frame says how many
drafts of the batch are still to come), so the cloud may verify the first drafts before the
batch is whole (fast verification: it decides, from its own costs). At most DEPTH whole
batches are in flight, so the cloud finds the next batch waiting when it ends one.
Latency-aware truncation: when the cloud has nothing left to verify while the device is still
drafting, the next draft ends its batch. Per batch, the cost model picks the better round:
pipelined (PicoSpec's eq. 9: drafting overlaps the round trip, no bonus token) or stop-and-wait
(the device waits for the verdict and gets the bonus token of a batch accepted whole); where
verification dominates the round, waiting wins. AS² as in stop-and-wait.

Exact: the pipeline changes when things happen, never what is sampled. Every draft is sampled
from the q its frame carries and every position is verified against the cloud's P as in a
stop-and-wait round; a batch accepted whole is followed by drafts made from that very
prefix, so checking the next draft at P_{γ+1} is one more speculative position."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from collab.model_step import ModelStep
from collab.protocol import Done, Verdict
from collab.sampling import distribution
from collab.scheduling import GammaChoice
from collab.variants.base import DraftToken
from edge_runtime.client import CloudProtocolError
from edge_runtime.events import Event
from edge_runtime.modes.base import STOP_IDS
from edge_runtime.modes.split_run import SplitRun

DEPTH = 2  # batches in flight at most: the cloud verifies one while the next crosses the link


@dataclass
class Batch:
    """Drafts verified as one batch: where they start in the answer, the γ they are meant to
    reach, whether the device drafts on past them (`ahead`, else it waits for their verdict),
    how many went out and whether the last did, and their timing."""

    step: int
    gamma: int
    ahead: bool = True
    drafts: list[DraftToken] = field(default_factory=list)
    sent_n: int = 0
    closed: bool = False  # its last part went out
    draft_s: float = 0.0  # device time spent drafting them
    sent: float = 0.0  # when its newest part went out
    alone: bool = False  # nothing queued before it at the cloud: its round time is the link's

    @property
    def tokens(self) -> list[int]:
        return [d.token for d in self.drafts]


class PipelinedRun(SplitRun):
    """Split decoding with PicoSpec's pipeline. The device cache holds the prompt, the
    committed tokens (but `unfed`), then the drafts of the batches not judged yet, in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: deque[Batch] = deque()  # not judged yet; the newest may be drafting
        self.logits: np.ndarray | None = None  # for the next draft, once the cache has caught up
        self._step: ModelStep[np.ndarray] = ModelStep(self.device.cancel)
        self._step_catches_up = False  # the step in flight feeds `unfed` (else: a draft)
        self._step_owner: Batch | None = None  # the batch whose drafting the step is part of
        self._unowned_s = 0.0  # catching up after a rejection: drafting time of the next batch
        self.prompt_length = 0
        self.drafting_ended = False  # a stop token drafted, or drafts reach max_new_tokens
        self.stopping = False  # AS² takes over once the batches in flight are judged
        self.cloud_idle = False  # the cloud holds nothing to verify while we draft: send now
        self.stats.pipeline = True

    @property
    def current(self) -> Batch | None:
        """The batch being drafted (its drafts already went out, but not its last)."""
        return self.batches[-1] if self.batches and not self.batches[-1].closed else None

    def _plan(self, remaining: int) -> tuple[GammaChoice | None, bool]:
        """The better round for the next batch, and whether the device drafts on past it:
        pipelined (eq. 9) or stop-and-wait, as the measured costs predict them."""
        pipe, wait = self.costs.choose(remaining, pipelined=True), self.costs.choose(remaining)
        if pipe is None or wait is None or pipe.tokens_per_second >= wait.tokens_per_second:
            return pipe, True
        return wait, False

    def _choice(self, remaining: int) -> GammaChoice | None:
        return self._plan(remaining)[0]

    async def _speculate(self, logits: np.ndarray) -> AsyncIterator[Event]:
        """Run the pipeline until the answer ends, or until AS² wants the cloud to decode (the
        batches in flight judged first; the cache left at the committed prefix)."""
        self.stopping = self.drafting_ended = self.cloud_idle = False
        self.prompt_length = self.device.length - (len(self.transcript.tokens) - len(self.unfed))
        if self.unfed:
            self._start_step(self.unfed, catch_up=True)
        else:
            self.logits = logits
        recv = asyncio.ensure_future(self.link.recv(Verdict))
        late: BaseException | None = None  # what the last receive raised, after the loop ended
        try:
            while self.transcript.finish is None:
                while self.logits is not None and self._may_draft():
                    await self._draft_one()
                if self.stopping and not self.batches:
                    break
                done = await self._step.race(recv)
                if self._step.future in done:
                    self._take_step()
                if recv in done:
                    msg = recv.result()
                    recv = asyncio.ensure_future(self.link.recv(Verdict))
                    async for event in self._on_message(msg):
                        yield event
                for event in self.link.take_events():
                    yield event
        finally:
            if not recv.done():
                recv.cancel()  # a queue read still waiting: cancelling it loses no frame
                with contextlib.suppress(asyncio.CancelledError):
                    await recv
            elif not recv.cancelled():  # it came with the last one: Done, say, or an Error
                late = recv.exception()
                if late is None:
                    self.link.unread(recv.result())
            await self._stop_step()
        if late is not None:
            raise late
        if self.transcript.finish is None:
            await self._settle()

    # ---- drafting --------------------------------------------------------------------------
    def _ahead(self) -> int:
        """Drafts not judged yet (sent, and being drafted)."""
        return sum(len(b.drafts) for b in self.batches)

    def _may_draft(self) -> bool:
        if self.stopping or self.drafting_ended:
            return False
        closed = [b for b in self.batches if b.closed]
        if len(closed) >= DEPTH or not all(b.ahead for b in closed):
            return False  # the pipeline is full, or a stop-and-wait batch awaits its verdict
        if self.current is None:  # a new batch: AS² or a cloud measurement may come first
            remaining = self.transcript.remaining - self._ahead()
            if self._measure_cloud() or self._as2_tokens(remaining):
                self.stopping = True
                return False
            choice, ahead = self._plan(remaining)
            step = len(self.transcript.tokens) + self._ahead()
            gamma = self._gamma(remaining, choice)
            self.batches.append(Batch(step, gamma, ahead, draft_s=self._unowned_s))
            self._unowned_s = 0.0
            self.stats.waits += not ahead
        return True

    async def _draft_one(self) -> None:
        batch, logits = self.current, self.logits
        assert batch is not None and logits is not None
        self.logits = None
        t0 = time.perf_counter()
        draft = self.scheme.draft(distribution(logits, self.params), self.rng)
        batch.drafts.append(draft)
        batch.draft_s += time.perf_counter() - t0
        if draft.token in STOP_IDS or self._ahead() >= self.transcript.remaining:
            self.drafting_ended = True  # nothing to draft after the end
        else:
            self._start_step([draft.token])
        # truncation is for a pipelined batch: a stop-and-wait one cut short waits a whole
        # round for fewer drafts
        idle = self.cloud_idle and batch.ahead
        last = self.drafting_ended or len(batch.drafts) >= batch.gamma or idle
        await self._send(batch, last)

    async def _send(self, batch: Batch, last: bool) -> None:
        """The drafts of `batch` not sent yet, as one part; `last` ends the batch."""
        if last and self.cloud_idle and batch.ahead and len(batch.drafts) < batch.gamma:
            self.stats.truncations += not self.drafting_ended
        self.cloud_idle = self.cloud_idle and not last
        frame = self.scheme.draft_frame(
            batch.drafts[batch.sent_n :],
            self.device.lm.vocab_size,
            request_id=self.rid,
            epoch=self.epoch,
            step=batch.step + batch.sent_n,
            more=0 if last else batch.gamma - len(batch.drafts),
            ahead=last and batch.ahead,
        )
        batch.alone = not any(b.closed for b in self.batches if b is not batch)
        batch.sent, batch.sent_n, batch.closed = time.perf_counter(), len(batch.drafts), last
        self.stats.draft_bytes_up += await self.link.send(frame)
        depth = sum(b.sent_n > 0 for b in self.batches)  # batches with drafts at the cloud
        self.stats.pipeline_depth = max(self.stats.pipeline_depth, depth)

    def _start_step(self, tokens: list[int], catch_up: bool = False) -> None:
        fed = list(tokens)

        async def forward() -> np.ndarray:
            logits: np.ndarray = (await self.device.forward(fed))[-1]
            return logits

        self._step.start(forward)
        self._step_catches_up, self._step_owner = catch_up, self.current

    def _take_step(self) -> None:
        self.logits, seconds = self._step.take()
        if self._step_catches_up:
            self.unfed = []
        if self._step_owner is not None:
            self._step_owner.draft_s += seconds
        else:  # a catch-up counts as the next batch's drafting, as in stop-and-wait
            self._unowned_s += seconds

    async def _stop_step(self, finish: bool = False) -> None:
        """Preempt the model step in flight (or, `finish`, let it end: it feeds an accepted
        draft); a step not started yet never starts."""
        self.logits = None
        await self._step.stop(finish)

    # ---- verdicts --------------------------------------------------------------------------
    async def _on_message(self, msg: Verdict | Done) -> AsyncIterator[Event]:
        if self.link.ended(msg):
            return
        if not self.batches or msg.accepted > self.batches[0].sent_n:
            raise CloudProtocolError("the cloud judged drafts that were never sent")
        batch = self.batches.popleft()
        n, token = msg.accepted, msg.token
        early = not batch.closed or 0 < msg.scored < batch.sent_n
        self.stats.fast_verified += early  # the cloud began before the batch was whole
        # the round's time on the link, where it can be told: not when the pass that decided
        # began before the newest part went out, nor behind another batch
        link_s = time.perf_counter() - batch.sent - msg.compute_s
        link = None if early or not batch.alone else link_s
        self.costs.observe_round(
            batch.sent_n, n, batch.draft_s, link, msg.compute_s, scored=msg.scored
        )
        self.stats.rounds += 1
        self.stats.drafted += batch.sent_n
        self.stats.accepted += n
        self.stats.per_round.append((batch.sent_n, n))
        kept = self.transcript.commit(batch.tokens[:n])
        if n < len(batch.drafts) and token is None and msg.p_probs is None:
            # no rejection: the cloud ended the answer inside this batch (its own length limit,
            # the context's room); Done follows
            self.drafting_ended = True
            await self._stop_step()
            self.batches.clear()
        elif n == len(batch.drafts) and token is None:
            # accepted whole: the drafts made from its tail are valid. If the cloud holds
            # nothing to verify while we are still drafting, the next draft goes out as a batch
            # of its own, however short (truncation).
            held = any(b.sent_n for b in self.batches)
            self.cloud_idle = not held and self.transcript.finish is None
        else:
            kept += await self._flush(batch, msg)
        for event in self.answer.emit(kept):
            yield event

    async def _flush(self, batch: Batch, verdict: Verdict) -> list[int]:
        """A rejection in `batch` (or its bonus token): every later draft is void. Stop the
        step in flight, roll the cache back to the committed prefix, take the cloud's token
        (or sample the correction the variant leaves to the device) and draft on from it."""
        n, token = verdict.accepted, verdict.token
        rejected = n < len(batch.drafts)
        if rejected and (self._ahead() or self._step.running):
            self.stats.rollbacks += 1  # drafting past the rejection is thrown away
        await self._stop_step(finish=not rejected)
        self.batches.clear()
        self.drafting_ended = self.cloud_idle = False
        if rejected:
            self.epoch += 1
        await self._cut_cache()
        kept: list[int] = []
        if token is None and self.transcript.finish is None:
            token = await self._correct(verdict, batch.drafts[n], batch.step + n)
        if token is not None:
            kept = self.transcript.commit([token])
            self.unfed.append(token)
        if self.transcript.finish is None and not self.stopping:
            self._start_step(self.unfed, catch_up=True)
        return kept

    async def _cut_cache(self, keep_unfed: int = 0) -> None:
        """Roll the cache back to the prompt and the committed tokens (drafts dropped); the
        committed tokens it lacks, and at least the newest `keep_unfed`, become `unfed`. Runs
        on the model's worker, behind a preempted step that may still be finishing there."""
        lm, prompt, tokens = self.device.lm, self.prompt_length, self.transcript.tokens

        def cut() -> list[int]:
            fed = min(lm.lengths[0] - prompt, len(tokens) - keep_unfed)
            if lm.lengths[0] > prompt + fed:
                lm.rollback(prompt + fed)
            return tokens[fed:]

        self.unfed = await self.device.step("rollback", 0, cut)

    async def _settle(self) -> None:
        """Leave the cache at the committed prefix with its newest token unfed, as a
        stop-and-wait round does: the next speculation catches up from there."""
        self.batches.clear()
        await self._cut_cache(keep_unfed=1)
