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
  pipelined (Generate.pipeline, PicoSpec, DESIGN §5.3): a frame accepted whole gets
           Verdict(γ, no token) and its last row P_{γ+1} is kept: the device has drafted on,
           and its next frame (already queued, step + γ) is verified from that row. After a
           rejection the epoch moves on, so frames drafted past the rejected one are dropped.
cloud  → Done when the answer ends (stop token or length), authoritative for both

The cloud's cache holds the prompt and every committed token except the newest one, which is
fed in front of the next draft: one forward pass scores it and the γ drafts (γ+1 rows of P).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from cloud_backend.modes.base import Request, Stop
from collab.protocol import (
    Cancel,
    CloudDecode,
    Draft,
    ErrorCode,
    FinishReason,
    Generate,
    TokenChunk,
)
from collab.sampling import distribution
from collab.variants import get_variant

if TYPE_CHECKING:
    from cloud_backend.context import RequestContext

log = logging.getLogger("tandem.cloud")


class SplitRequest(Request):
    def __init__(self, gen: Generate, ctx: RequestContext, start: float) -> None:
        super().__init__(gen, ctx, start)
        self.scheme = get_variant(self.ctx.variant)
        self.awaiting_correction = False

    async def decode_answer(self) -> None:
        expected = self.scheme.frame
        # The first token comes straight from the prefill, as in cloud mode (same TTFT); the
        # device meanwhile prefills its own prompt and drafts from that token on.
        await self.decode(1)
        while self.transcript.finish is None:
            msg = await self.ctx.inbox.get()
            if isinstance(msg, Cancel):
                raise Stop(FinishReason.CANCELLED)
            if msg.epoch != self.epoch or msg.step != len(self.transcript.tokens):
                log.info(
                    "request=%d stale frame %s epoch=%d step=%d (now %d/%d) dropped",
                    self.gen.request_id, type(msg).__name__, msg.epoch, msg.step,
                    self.epoch, len(self.transcript.tokens),
                )  # fmt: skip
                continue
            if isinstance(msg, TokenChunk) and self.awaiting_correction:
                await self.correction(msg)
            elif isinstance(msg, CloudDecode) and not self.awaiting_correction:
                await self.decode(msg.n_tokens or self.transcript.remaining)
            elif isinstance(msg, expected) and not self.awaiting_correction:
                await self.verify(msg)
            else:
                what = "a correction token" if self.awaiting_correction else expected.__name__
                await self.error(
                    ErrorCode.MALFORMED, f"expected {what}, got {type(msg).__name__}; ignored"
                )

    async def correction(self, msg: TokenChunk) -> None:
        if msg.token_ids.size != 1:
            await self.error(ErrorCode.MALFORMED, "a correction is exactly one token")
            return
        token = int(msg.token_ids[0])
        self.awaiting_correction = False
        self.commit([token])
        self.pending = token

    async def verify(self, frame: Draft) -> None:
        drafts = np.asarray(frame.token_ids, dtype=np.int64)
        gamma = drafts.size
        t0 = time.perf_counter()
        feed = ([self.pending] if self.pending is not None else []) + drafts.tolist()
        base = self.ctx.session.length
        rows = await self.ctx.session.forward(feed)
        if self.pending is None:
            assert self.next_logits is not None
            rows = np.vstack([self.next_logits[None, :], rows])
        P = np.stack([distribution(r, self.params) for r in rows])
        try:
            judgement = self.scheme.judge(frame, P, self.rng, eta=self.gen.eta)
        except ValueError as exc:  # a draft that cannot have been sampled as announced
            await self.ctx.session.rollback(base)  # forget the scored drafts, keep the state
            await self.error(ErrorCode.MALFORMED, f"draft refused: {exc}")
            return
        n, token = judgement.accepted, judgement.token
        if self.gen.pipeline and n == gamma and token is not None:
            # the device drafts on from here: no bonus token (the one sampled is dropped; it
            # was drawn from an independent coin), the next frame starts at this row
            judgement = judgement._replace(token=None)
            token = None
        keep = base + (len(feed) - gamma) + n
        await self.ctx.session.rollback(keep)
        step = len(self.transcript.tokens)
        self.rounds += 1
        self.drafted += gamma
        self.accepted += n
        seconds = time.perf_counter() - t0
        self.ctx.metrics.round(gamma, n, seconds)
        await self.ctx.send(judgement.verdict(
            seconds, request_id=self.gen.request_id, epoch=self.epoch, step=step
        ))  # fmt: skip
        if n < gamma:
            self.epoch += 1
        self.pending, self.next_logits = None, None
        if token is None and n == gamma:  # pipelined, accepted whole: go on from the last row
            self.commit(drafts.tolist())
            self.next_logits = rows[-1]
        elif token is None:  # the device samples the correction (it alone knows Q)
            self.commit(drafts[:n].tolist())
            self.awaiting_correction = self.transcript.finish is None
        else:
            self.commit([*drafts[:n].tolist(), token])
            self.pending = token
