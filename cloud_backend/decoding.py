"""The cloud side of a request: cloud-only generation and split-speculation verification.

Session flow (after the Hello/HelloAck handshake; every frame carries request id, epoch, step):

cloud   device → Generate(question, history, sampling, retrieve)
        cloud  → Citations (public sources, if any) → TokenChunk per token → Done
split   device → Generate(...)            the cloud builds the same prompt as in cloud mode
                                          (so greedy split == cloud-only) and prefills it
        cloud  → TokenChunk: the first token, sampled from the prefill (cloud-mode TTFT)
        loop:
          device → draft (step = tokens committed so far, epoch = rejections so far)
                   TopKDraft (tk-slt) | DssdDraft (dssd, dssd-topk) | DsdDraft (dsd)
          cloud  → Verdict(accepted n, token t, compute_s): commit drafts[:n] + [t]
                   dssd rejection: Verdict(n, P_j dense or top-K), no token; the device
                   samples t from norm(max(0, P_j − Q_j)) and sends TokenChunk([t])
          or device → CloudDecode(n): the cloud decodes n tokens itself (AS² fallback) and
                   streams TokenChunks
        cloud  → Done when the answer ends (stop token or length), authoritative for both
any     device → Cancel: the cloud stops and answers Done(CANCELLED)

The cloud's cache holds the prompt and every committed token except the newest one, which is
fed in front of the next draft: one forward pass scores it and the γ drafts (γ+1 rows of P).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from cloud_backend.engine import Evicted
from collab.protocol import (
    Cancel,
    Citations,
    CloudDecode,
    Done,
    DsdDraft,
    DssdDraft,
    Error,
    ErrorCode,
    FinishReason,
    Generate,
    Message,
    Mode,
    Source,
    TokenChunk,
    TopKDraft,
    Verdict,
)
from collab.sampling import SamplingParams, distribution, sample, top_candidates
from collab.split import Transcript
from collab.verification import dsd_round, dssd_cloud_verify, tkslt_cloud_verify
from model_runtime.prompting import Passage, fit_prompt, prompt_budget
from model_runtime.runtime import Cancelled
from model_runtime.tokenizer import IM_END_ID

if TYPE_CHECKING:
    from cloud_backend.context import RequestContext

log = logging.getLogger("tandem.cloud")

VARIANT_DRAFTS: dict[str, type[Message]] = {
    "tk-slt": TopKDraft,
    "dssd": DssdDraft,
    "dssd-topk": DssdDraft,
    "dsd": DsdDraft,
}
DSSD_TOPK = 64  # P_j entries sent back in the approximate PicoSpec-style dssd-topk variant
SOURCE_CHARS = 2000  # the public chunk (a Wikipedia lead summary) the user can open


class _Stop(Exception):
    def __init__(self, reason: FinishReason) -> None:
        self.reason = reason


async def serve_request(gen: Generate, ctx: RequestContext) -> Done:
    """Run one request to its end; send every frame (Done included) and return the Done."""
    start = time.perf_counter()
    req = _Request(gen, ctx, start)
    try:
        await req.run()
        reason = req.transcript.finish or FinishReason.STOP
    except _Stop as stop:
        reason = stop.reason
    except Evicted as exc:
        await ctx.send(Error(ErrorCode.EVICTED, str(exc), request_id=gen.request_id))
        reason = FinishReason.ERROR
    except Cancelled:
        reason = FinishReason.CANCELLED
    up, down = ctx.traffic()
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
    await ctx.send(done)
    return done


class _Request:
    def __init__(self, gen: Generate, ctx: RequestContext, start: float) -> None:
        self.gen, self.ctx, self.start = gen, ctx, start
        self.params = SamplingParams(gen.temperature, gen.top_k, gen.top_p)
        self.rng = np.random.default_rng(gen.seed)
        self.transcript = Transcript(gen.max_new_tokens, frozenset({IM_END_ID}))
        self.rounds = self.drafted = self.accepted = 0
        self.epoch = 0
        self.pending: int | None = None  # newest committed token, not yet in the cache
        self.next_logits: np.ndarray | None = None  # valid while pending is None
        self.awaiting_correction = False
        self.first_token_seen = False

    # ---- shared ----------------------------------------------------------------------------
    async def run(self) -> None:
        ids = await self._prompt()
        lm = self.ctx.engine.lm
        room = lm.max_context - len(ids)
        if room <= 0:
            await self._error(ErrorCode.LIMIT, f"prompt of {len(ids)} tokens fills the context")
            raise _Stop(FinishReason.ERROR)
        self.transcript.max_new_tokens = min(self.transcript.max_new_tokens, room)
        self.next_logits = await self.ctx.session.prefill(ids)
        if self.transcript.max_new_tokens == 0:
            self.transcript.commit([])
            return
        if self.ctx.mode == Mode.CLOUD:
            await self._decode(self.transcript.max_new_tokens)
        else:
            await self._split()

    async def _prompt(self) -> list[int]:
        passages: list[Passage] = []
        corpus = self.ctx.corpus
        if self.gen.retrieve and corpus is not None:
            hits = await asyncio.to_thread(corpus.search, self.gen.question, self.ctx.corpus_k)
            passages = [Passage(h.title, h.location, h.text) for h in hits]
            sources = tuple(
                Source(h.title, h.location, float(h.score), h.text[:SOURCE_CHARS]) for h in hits
            )
            await self.ctx.send(Citations(sources, request_id=self.gen.request_id))
        budget = prompt_budget(self.ctx.engine.lm.max_context, self.gen.max_new_tokens)
        ids, dropped = fit_prompt(
            self.ctx.engine.tokenizer, self.gen.question, self.gen.history, passages, budget
        )
        if dropped:
            log.info("request=%d history_pairs_left_out=%d", self.gen.request_id, dropped)
        return ids

    def _commit(self, tokens: list[int]) -> list[int]:
        kept = self.transcript.commit(tokens)
        if kept and not self.first_token_seen:
            self.first_token_seen = True
            self.ctx.metrics.ttft(time.perf_counter() - self.start)
        self.ctx.metrics.tokens(len(kept))
        return kept

    async def _error(self, code: ErrorCode, message: str) -> None:
        await self.ctx.send(Error(code, message, request_id=self.gen.request_id))

    def _check_cancel(self) -> None:
        """Stop on a Cancel; keep every other frame, in order, for after this decoding (a
        device under AS² asks for its next tokens before the first one arrives)."""
        kept = []
        while not self.ctx.inbox.empty():
            msg = self.ctx.inbox.get_nowait()
            if isinstance(msg, Cancel):
                raise _Stop(FinishReason.CANCELLED)
            kept.append(msg)
        for msg in kept:
            self.ctx.inbox.put_nowait(msg)

    async def _next_logits(self) -> np.ndarray:
        if self.pending is None:
            assert self.next_logits is not None
            return self.next_logits
        logits = (await self.ctx.session.forward([self.pending]))[-1]
        self.pending, self.next_logits = None, logits
        return logits

    # ---- cloud-only decoding (cloud mode, and split's AS² fallback) ------------------------
    async def _decode(self, n: int) -> None:
        for _ in range(n):
            if self.transcript.finish is not None:
                return
            self._check_cancel()
            logits = await self._next_logits()
            token, _ = sample(logits, self.rng, self.params)
            step = len(self.transcript.tokens)
            kept = self._commit([token])
            self.pending = token
            if kept:
                await self.ctx.send(
                    TokenChunk(kept, request_id=self.gen.request_id, epoch=self.epoch, step=step)
                )

    # ---- split verification ----------------------------------------------------------------
    async def _split(self) -> None:
        expected = VARIANT_DRAFTS[self.ctx.variant]
        # The first token comes straight from the prefill, as in cloud mode (same TTFT); the
        # device meanwhile prefills its own prompt and drafts from that token on.
        await self._decode(1)
        while self.transcript.finish is None:
            msg = await self.ctx.inbox.get()
            if isinstance(msg, Cancel):
                raise _Stop(FinishReason.CANCELLED)
            if msg.epoch != self.epoch or msg.step != len(self.transcript.tokens):
                log.info(
                    "request=%d stale frame %s epoch=%d step=%d (now %d/%d) dropped",
                    self.gen.request_id, type(msg).__name__, msg.epoch, msg.step,
                    self.epoch, len(self.transcript.tokens),
                )  # fmt: skip
                continue
            if isinstance(msg, TokenChunk) and self.awaiting_correction:
                await self._correction(msg)
            elif isinstance(msg, CloudDecode) and not self.awaiting_correction:
                await self._decode(msg.n_tokens or self.transcript.remaining)
            elif isinstance(msg, expected) and not self.awaiting_correction:
                await self._verify(msg)
            else:
                what = "a correction token" if self.awaiting_correction else expected.__name__
                await self._error(
                    ErrorCode.MALFORMED, f"expected {what}, got {type(msg).__name__}; ignored"
                )

    async def _correction(self, msg: TokenChunk) -> None:
        if msg.token_ids.size != 1:
            await self._error(ErrorCode.MALFORMED, "a correction is exactly one token")
            return
        token = int(msg.token_ids[0])
        self.awaiting_correction = False
        self._commit([token])
        self.pending = token

    async def _verify(self, draft: Message) -> None:
        drafts = np.asarray(draft.token_ids, dtype=np.int64)  # type: ignore[attr-defined]
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
            n, token, p_ids, p_probs = self._judge(draft, drafts, P)
        except ValueError as exc:  # a draft that cannot have been sampled as announced
            await self.ctx.session.rollback(base)  # forget the scored drafts, keep the state
            await self._error(ErrorCode.MALFORMED, f"draft refused: {exc}")
            return
        keep = base + (len(feed) - gamma) + n
        await self.ctx.session.rollback(keep)
        step = len(self.transcript.tokens)
        self.rounds += 1
        self.drafted += gamma
        self.accepted += n
        seconds = time.perf_counter() - t0
        self.ctx.metrics.round(gamma, n, seconds)
        await self.ctx.send(
            Verdict(
                n, token, p_ids, p_probs, compute_s=seconds,
                request_id=self.gen.request_id, epoch=self.epoch, step=step,
            )
        )  # fmt: skip
        if n < gamma:
            self.epoch += 1
        self.pending, self.next_logits = None, None
        if token is None:  # dssd rejection: the device samples the correction
            self._commit(drafts[:n].tolist())
            self.awaiting_correction = self.transcript.finish is None
        else:
            self._commit([*drafts[:n].tolist(), token])
            self.pending = token

    def _judge(
        self, draft: Message, drafts: np.ndarray, P: np.ndarray
    ) -> tuple[int, int | None, np.ndarray | None, np.ndarray | None]:
        """Verify per variant: (n accepted, token or None, P_j ids, P_j probs). Raises
        ValueError for a draft that could not have been sampled as it claims."""
        if isinstance(draft, TopKDraft):
            n, token = tkslt_cloud_verify(drafts, draft.topk_ids, draft.topk_probs, P, self.rng)
            return n, token, None, None
        if isinstance(draft, DsdDraft):
            Q = np.asarray(draft.probs, dtype=np.float64)
            if Q.shape[1] != P.shape[1]:
                raise ValueError(f"dense drafts must cover the {P.shape[1]}-token vocabulary")
            total = Q.sum(axis=1, keepdims=True)
            if not np.all(total > 0):
                raise ValueError("a dense draft distribution is all zeros")
            Q = Q / total
            if not np.all(Q[np.arange(drafts.size), drafts] > 0):
                raise ValueError("a draft has probability 0 in its own distribution")
            n, token = dsd_round(drafts, P, Q, self.rng)
            return n, token, None, None
        assert isinstance(draft, DssdDraft)
        q = np.asarray(draft.q, dtype=np.float64)
        n, bonus, rejected = dssd_cloud_verify(drafts, q, P, self.rng)
        if rejected is None:
            return n, bonus, None, None
        if self.ctx.variant == "dssd-topk":
            cand = top_candidates(P[n], need=min(DSSD_TOPK, P.shape[1]))
            ids = cand[np.argsort(-P[n][cand], kind="stable")[:DSSD_TOPK]]
            return n, None, ids, P[n][ids].astype(np.float16)
        return n, None, None, P[n].astype(np.float16)
