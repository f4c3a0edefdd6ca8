"""Split speculative decoding, cloud side: verify the device's drafts with the variant's
judge (`collab.variants`) and commit what both sides then agree on.

device → Generate(...)            the cloud builds the same prompt as in cloud mode (so greedy
                                  split == cloud-only) and prefills it
cloud  → TokenChunk: the first token, sampled from the prefill (cloud-mode TTFT)
loop:
  device → draft frame (variant.frame; step = tokens committed, epoch = rejections so far)
  cloud  → P = forward(pending + drafts): γ+1 rows in one pass
           variant.judge(frame, P) → Verdict(accepted n, token t, compute_s): commit
           drafts[:n] + [t]; or, for a variant whose cloud cannot resample (DSSD), Verdict(n,
           P_j) with no token: the device samples t and sends TokenChunk([t])
  or device → CloudDecode(n): the cloud decodes n tokens itself (AS² fallback)
  pipelined (PicoSpec, docs/math.md#picospec): a batch whose last frame says `ahead` gets, when
           accepted whole, Verdict(γ, no token) and its last row P_{γ+1} is kept: the device
           has drafted on, and its next frame (step + γ) is verified from that row. A batch
           may come in parts (`more` drafts still to come): when the cloud is free and can
           verify what it holds before the rest arrives (fast verification), it does; a
           rejection there is sent at once, an acceptance waits for the batch's end. After a
           rejection the epoch moves on, so frames drafted past it are dropped.
cloud  → Done when the answer ends (stop token or length), authoritative for both

The cloud's cache holds the prompt and every committed token except the newest one, which is
fed in front of the next draft: one forward pass scores it and the γ drafts (γ+1 rows of P).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cloud_backend.modes.base import Request
from collab.protocol import CloudDecode, Draft, ErrorCode, Generate, Message, TokenChunk
from collab.sampling import distribution
from collab.scheduling import ewma_update, verify_line
from collab.variants import get_variant
from collab.variants.base import Judgement

if TYPE_CHECKING:
    from cloud_backend.context import RequestContext


class SplitRequest(Request):
    def __init__(self, gen: Generate, ctx: RequestContext, start: float) -> None:
        super().__init__(gen, ctx, start)
        self.scheme = get_variant(self.ctx.variant)
        self.awaiting_correction = False
        self.parts: list[Draft] = []  # the batch's frames not verified yet
        self.batch: Batch | None = None  # the batch being received, until its verdict

    def expected_step(self) -> int:
        """Where the next frame starts: after the committed tokens and the parts held."""
        return len(self.transcript.tokens) + sum(p.token_ids.size for p in self.parts)

    async def decode_answer(self) -> None:
        expected = self.scheme.frame
        # The first token comes straight from the prefill, as in cloud mode (same TTFT); the
        # device meanwhile prefills its own prompt and drafts from that token on.
        await self.decode(1)
        while self.transcript.finish is None:
            idle = self.link.empty()
            if self.awaiting_correction:
                kinds: tuple[type[Message], ...] = (TokenChunk,)
            else:
                kinds = (expected,) if self.parts else (CloudDecode, expected)
            msg = await self.link.recv(
                *kinds,
                at=(self.epoch, self.expected_step()),
                what="a correction token" if self.awaiting_correction else expected.__name__,
            )
            if isinstance(msg, TokenChunk):
                await self.correction(msg)
            elif isinstance(msg, CloudDecode):
                await self.decode(msg.n_tokens or self.transcript.remaining)
            else:
                assert isinstance(msg, expected)
                await self.receive(msg, idle)

    async def correction(self, msg: TokenChunk) -> None:
        if msg.token_ids.size != 1:
            await self.link.error(ErrorCode.MALFORMED, "a correction is exactly one token")
            return
        token = int(msg.token_ids[0])
        self.awaiting_correction = False
        self.commit([token])
        self.pending = token

    async def receive(self, frame: Draft, waited: bool) -> None:
        """A batch's frame: verify now if it ends the batch, or (fast verification) if the
        cloud is free and can verify what it holds before the rest arrives."""
        now = time.perf_counter()
        size, room = (
            frame.token_ids.size,
            (self.link.limits.max_draft_tokens if self.batch is None else self.batch.more),
        )
        if size + frame.more > room:  # announced counts only fall within a batch
            await self.link.error(
                ErrorCode.MALFORMED,
                f"a batch part of {size} drafts with {frame.more} more to come, where at most "
                f"{room} drafts were left in the batch; ignored",
            )
            return
        if self.batch is None:
            self.batch = Batch(step=len(self.transcript.tokens), last=now)
        elif waited:  # it arrived while we waited: the gap is the device's drafting
            gap = (now - self.batch.last) / frame.token_ids.size
            self.ctx.pace.gap = ewma_update(self.ctx.pace.gap, gap, 0.3)
        self.batch.last, self.batch.more = now, frame.more
        self.parts.append(frame)
        if frame.more == 0 or (self.link.empty() and self.verify_first(frame.more)):
            await self.verify()

    def verify_first(self, more: int) -> bool:
        """Fast verification pays when verifying the drafts held ends before the rest of the
        batch is here: the cloud would wait anyway, and a rejection reaches the device sooner."""
        pace = self.ctx.pace
        if pace.gap is None or not pace.passes:
            return False
        fed = sum(p.token_ids.size for p in self.parts) + (self.pending is not None)
        return verify_line(pace.passes, fed) <= more * pace.gap

    async def verify(self) -> None:
        """Verify every part held at once and judge them in order, as one batch (from rows, or
        inside the engine). A verdict goes out at a rejection or at the batch's end."""
        parts, self.parts = self.parts, []
        batch = self.batch
        assert batch is not None
        drafts = np.concatenate([np.asarray(p.token_ids, dtype=np.int64) for p in parts])
        t0 = time.perf_counter()
        # Only the drafts the answer can still take are scored: its room (the context's, or
        # max_new_tokens) may end inside the batch, and the context holds no more. The rows
        # past them are stand-ins whose judgements are never used.
        room = self.transcript.remaining
        fit = min(drafts.size, room)
        feed = ([self.pending] if self.pending is not None else []) + drafts[:fit].tolist()
        session = self.ctx.session
        base = session.length
        try:
            judge = self.judge_inside if session.verifies_inside else self.judge_rows
            n, judgement, last_row = await judge(parts, feed, fit)
        except ValueError as exc:  # a draft that cannot have been sampled as announced
            await session.rollback(base)  # forget the scored drafts, keep the state
            self.batch = None
            await self.link.error(ErrorCode.MALFORMED, f"draft refused: {exc}")
            return
        if n >= room:
            # the answer ends at its room in this batch: no token after it (a verdict with
            # neither a token nor P_j tells the device so; Done follows)
            n, judgement = room, Judgement(room, None)
        ended = n == drafts.size and parts[-1].more == 0
        if n == drafts.size and (parts[-1].more or parts[-1].ahead):
            # the device drafts on from here: no bonus token, the next draft starts at this row
            judgement = judgement._replace(token=None)
        token = judgement.token
        keep = base + (len(feed) - fit) + n
        await session.rollback(keep)
        seconds = time.perf_counter() - t0
        self.ctx.pace.passes.append((len(feed), seconds))
        self.rounds += 1
        self.drafted += drafts.size
        self.accepted += n
        self.ctx.metrics.round(drafts.size, n, seconds)
        self.pending, self.next_logits = None, None
        if n == drafts.size and token is None:  # accepted whole, no bonus: go on from the last row
            self.commit(drafts.tolist())
            self.next_logits = last_row
            batch.accepted += n
            if not ended and self.transcript.finish is None:
                return  # fast verification passed: the verdict waits for the batch's end
        elif token is None:  # the device samples the correction (it alone knows Q)
            self.commit(drafts[:n].tolist())
            batch.accepted += n
            self.awaiting_correction = self.transcript.finish is None
        else:
            self.commit([*drafts[:n].tolist(), token])
            batch.accepted += n
            self.pending = token
        verdict = judgement._replace(accepted=batch.accepted).verdict(
            seconds,
            scored=drafts.size,
            request_id=self.gen.request_id,
            epoch=self.epoch,
            step=batch.step,
        )
        await self.link.send(verdict)
        if n < drafts.size:
            self.epoch += 1
        self.batch = None

    async def judge_rows(
        self, parts: list[Draft], feed: list[int], fit: int
    ) -> tuple[int, Judgement, np.ndarray]:
        """Verify from the target's rows: one forward pass scores the feed (γ+1 rows of P),
        each part is judged in order (a part accepted whole goes on at its last row; its bonus
        token is dropped). The drafts accepted, the last judgement and the last row."""
        rows = await self.ctx.session.forward(feed)
        if self.pending is None:
            assert self.next_logits is not None
            rows = np.vstack([self.next_logits[None, :], rows])
        P = np.stack([distribution(r, self.params) for r in rows])
        size = sum(p.token_ids.size for p in parts)
        if fit < size:  # stand-ins past the answer's room, never used
            P = np.vstack([P, np.repeat(P[-1:], size - fit, axis=0)])
        n, at = 0, 0
        for part in parts:
            size = part.token_ids.size
            judgement = self.scheme.judge(part, P[at : at + size + 1], self.rng, eta=self.gen.eta)
            n, at = n + judgement.accepted, at + size
            if judgement.accepted < size:
                break
        return n, judgement, rows[-1]

    async def judge_inside(
        self, parts: list[Draft], feed: list[int], fit: int
    ) -> tuple[int, Judgement, None]:
        """Verify inside an engine that samples itself (vLLM; docs/architecture.md#split-on-vllm):
        it draws each position's verdict as one token, the draft exactly when accepted, so
        only ids come back. The same law as `judge_rows`: each draft's draw is its
        verification, the positions' coins are independent, and the first rejection ends the
        round. A rejection the engine drew only as a coin (DSSD, RAPID with η > 0) takes P_j:
        one row, or none at temperature 0 (P_j is the one-hot of the argmax drawn)."""
        session, eta = self.ctx.session, self.gen.eta
        vocab = self.ctx.engine.lm.vocab_size
        targets = [
            t
            for part in parts
            for t in self.scheme.draft_targets(part, np.asarray(part.token_ids), vocab, eta)
        ][:fit]
        whole = fit == sum(part.token_ids.size for part in parts)  # else the room ends first
        bonus = whole and not (parts[-1].more or parts[-1].ahead)
        first = len(feed) - fit  # the pending token, if any, goes in first
        base = session.length
        tokens = await session.draw(
            feed, first, [*targets, *([None] if bonus else [])], self.params
        )
        n = next((k for k, t in enumerate(targets) if tokens[k] != t.draft), len(targets))
        if n == len(targets):
            return n, Judgement(n, tokens[n] if bonus else None), None
        if not targets[n].coin:
            return n, Judgement(n, tokens[n]), None
        if self.params.temperature == 0.0:
            p = np.zeros(vocab)
            p[tokens[n]] = 1.0
        else:
            p = distribution(await session.row(base + first + n), self.params)
        return n, self.scheme.coin_rejection(n, p, targets[n], self.rng), None


@dataclass
class Batch:
    """A batch of drafts the cloud is receiving: where it starts, its drafts verified so far
    (committed, the verdict still to come), when its newest part arrived and how many drafts
    that part said are still to come (a batch never grows past max_draft_tokens)."""

    step: int
    last: float
    accepted: int = 0
    more: int = 0  # drafts its newest part said are still to come
