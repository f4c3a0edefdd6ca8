"""Split speculative decoding, device side: the device drafts, the cloud verifies.

The device model reads the private passages (a RAG drafter); the cloud verifies with a prompt
built from the question and the cloud-visible history only. The first token comes from the
cloud's prefill (so the time to first token is cloud mode's) while the device prefills its
own prompt. Per round the device samples γ drafts and sends what its variant needs of Q
(DESIGN §5.2):

- tk-slt (default, exact): drafts are sampled from the top-K of Q as sent (float16), so the
  cloud knows the draft distribution exactly and resamples any rejection itself.
- dssd: ids + q(x) (float32); on a rejection the cloud sends P_j (dense float16) and the
  device samples the correction from norm(max(0, P_j − Q_j)) with its own Q_j.
- dssd-topk: as dssd with the top 64 of P_j: **approximate** (PicoSpec; the bias is
  `collab.verification.picospec_topk_bias_tv`).
- dsd: the dense Q_j (float16) for every draft: the baseline, heavy on the uplink.

γ comes from measured costs (`SplitCosts`); when no γ beats the cloud decoding alone (AS²),
the device asks the cloud to decode the next tokens itself and says so in the stats. Under
AS² a request covers every token up to the next probe round, and when an answer starts under
AS² it goes out right behind Generate: the cloud never waits a round trip for the device, so
the fallback costs no more than cloud mode."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np

from collab.protocol import (
    Citations,
    CloudDecode,
    Done,
    DsdDraft,
    DssdDraft,
    Error,
    ErrorCode,
    Message,
    Mode,
    TokenChunk,
    TopKDraft,
    Verdict,
)
from collab.sampling import distribution, sample_from
from collab.split import Transcript, pad_rows, topk_draft_row, wire_probs
from collab.verification import dssd_device_resample, picospec_residual_topk
from edge_runtime.device import retrieve_private
from edge_runtime.events import Event, Failure, Notice, Stats, TextDelta
from edge_runtime.modes import (
    STOP_IDS,
    AnswerOptions,
    CloudBacked,
    Turn,
    _need_device,
    citations_from,
    device_prompt,
)
from edge_runtime.split_costs import INITIAL_GAMMA, SplitCosts
from model_runtime.generate import TextStream

VARIANTS = ("tk-slt", "dssd", "dssd-topk", "dsd")
TOPK_MAX = 8  # TK-SLT: at most 8 (id, prob) pairs per drafted position (≤ 56 B)
MEASURE_CLOUD = 4  # tokens the cloud decodes alone once per session, to time it
PROBE_EVERY = 96  # under AS², one speculative round per this many cloud tokens re-measures


class SplitMode(CloudBacked):
    name = "split"
    description = "device drafts (with private documents), cloud verifies"
    protocol_mode = Mode.SPLIT

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        if ctx.variant not in VARIANTS:
            raise ValueError(f"unknown split variant {ctx.variant!r}; one of {VARIANTS}")
        self.costs = SplitCosts()

    @property
    def variant(self) -> str:
        return self.ctx.variant

    async def answer(
        self, question: str, history: Sequence[Turn], options: AnswerOptions
    ) -> AsyncIterator[Event]:
        from edge_runtime.client import CloudError

        device = _need_device(self.ctx)
        start = time.perf_counter()
        stats = Stats(self.name, self.variant)
        self._track(stats, start)
        passages, citations = await retrieve_private(
            self.ctx.index, question, options.k, options.min_score
        )
        for c in citations:
            yield c
        ids, notices = device_prompt(device, question, history, passages, options)
        for notice in notices:
            yield notice
        run = _SplitRun(self, device, options, stats, start)
        client = None
        up0 = down0 = 0
        try:
            client = await self.client()
            up0, down0 = client.bytes_up, client.bytes_down
            self._track_bytes(client, up0, down0)
            rid = next(self._request_ids)
            run.client, run.rid = client, rid
            await client.send(self.generate_message(
                rid, question, history, options, self.ctx.split_retrieve_public
            ))  # fmt: skip
            async for event in run.decode(ids):
                yield event
        except CloudError as exc:
            run.broken = True
            yield Failure(
                f"{exc} (after {len(run.transcript.tokens)} tokens)",
                recoverable=self.ctx.finish_locally,
            )
            if self.ctx.finish_locally:
                async for event in self.finish_on_device(
                    question, history, run.transcript, run.stream, options, stats, start
                ):
                    yield event
        finally:
            if client is not None and not run.finished and not run.broken and client.connected:
                await self.cancel(client, run.rid)
        if client is not None:
            stats.bytes_up = client.bytes_up - up0
            stats.bytes_down = client.bytes_down - down0
        stats.elapsed_s = time.perf_counter() - start
        stats.token_ids = list(run.transcript.tokens)
        stats.tokens = len(run.transcript.tokens)
        if stats.finish is None and run.transcript.finish is not None:
            stats.finish = run.transcript.finish.name.lower()
        yield stats


class _SplitRun:
    """One answer's state on the device: committed tokens, tokens the device cache has not
    seen yet, the epoch (rejections so far) and the figures."""

    def __init__(self, mode: SplitMode, device, options: AnswerOptions, stats: Stats,
                 start: float) -> None:  # fmt: skip
        self.mode, self.device, self.options, self.stats, self.start = (
            mode, device, options, stats, start,
        )  # fmt: skip
        self.params = options.sampling
        self.rng = np.random.default_rng(
            None if options.seed is None else [options.seed, 0x5EED]
        )  # never the cloud's stream
        self.transcript = Transcript(options.max_new_tokens, STOP_IDS)
        self.stream = TextStream(device.tokenizer)
        self.unfed: list[int] = []
        self.epoch = 0
        self.client = None
        self.rid = 0
        self.finished = False
        self.broken = False
        self.pending_events: list[Event] = []  # cloud citations, yielded between steps
        self.as2_choice = None  # the cost model's last AS² verdict, for the notice

    def _emit(self, kept: list[int]) -> list[Event]:
        events: list[Event] = []
        for t in kept:
            if self.stats.ttft_s is None:
                self.stats.ttft_s = time.perf_counter() - self.start
            if text := self.stream.push(t):
                events.append(TextDelta(text))
        self.stats.tokens = len(self.transcript.tokens)
        return events

    async def _recv(self) -> Message:
        while True:
            msg = await self.mode.recv(self.client, self.rid)
            if isinstance(msg, Citations):
                self.pending_events.extend(citations_from(msg))
                continue
            return msg

    async def decode(self, prompt: list[int]) -> AsyncIterator[Event]:
        costs = self.mode.costs
        # Already under AS² (measured on earlier answers): the tokens after the first are
        # asked for now, so the cloud goes on from its first token without waiting for us.
        ahead = self._as2_tokens(self.transcript.remaining - 1)
        if ahead:
            await self._ask_cloud(ahead, step=1)
        # The cloud sends the first token from its prefill; the device prefills meanwhile.
        prefill = asyncio.ensure_future(self.device.prefill(prompt))
        try:
            async for event in self._receive_tokens(1):
                yield event
            if ahead and self.transcript.finish is None:
                yield self._as2_notice()
                async for event in self._cloud_tokens(ahead, asked=True):
                    yield event
            logits = await prefill
        finally:
            if not prefill.done():
                prefill.cancel()
        announced = bool(ahead)
        while self.transcript.finish is None:
            if costs.t_cloud_step is None and costs.choose(self.transcript.remaining):
                # AS² compares with the cloud decoding alone: measure that once, too
                async for event in self._cloud_tokens(
                    min(MEASURE_CLOUD, self.transcript.remaining)
                ):
                    yield event
                continue
            if n := self._as2_tokens(self.transcript.remaining):
                if not announced:
                    announced = True
                    yield self._as2_notice()
                async for event in self._cloud_tokens(n):
                    yield event
                continue
            choice = costs.choose(self.transcript.remaining)
            gamma = INITIAL_GAMMA if choice is None else choice.gamma
            gamma = max(1, min(gamma, self.transcript.remaining))
            self.stats.gamma = gamma
            async for event in self._round(logits, gamma):
                yield event
            while self.pending_events:
                yield self.pending_events.pop(0)
        await self._await_done()

    def _as2_tokens(self, remaining: int) -> int:
        """How many tokens to hand the cloud now under AS² (all of them up to the next probe
        round, which re-measures the costs), or 0 to speculate."""
        costs = self.mode.costs
        since = costs.cloud_tokens_since_round
        if remaining <= 0 or costs.t_cloud_step is None or since >= PROBE_EVERY:
            return 0
        choice = costs.choose(remaining)
        if choice is None or not choice.use_cloud_only:
            return 0
        self.as2_choice = choice
        return min(remaining, PROBE_EVERY - since)

    def _as2_notice(self) -> Notice:
        self.stats.cloud_only = True
        c = self.as2_choice
        return Notice(
            f"AS²: no draft length beats the cloud decoding alone (best "
            f"{c.tokens_per_second:.1f} vs {c.cloud_only_tokens_per_second:.1f} tokens/s); "
            "decoding in the cloud"
        )

    async def _ask_cloud(self, n: int, step: int) -> None:
        await self.client.send(CloudDecode(n, request_id=self.rid, epoch=self.epoch, step=step))

    async def _cloud_tokens(self, n: int, asked: bool = False) -> AsyncIterator[Event]:
        """The cloud decodes the next n tokens itself; time it. `asked`: the request went out
        ahead (behind Generate), so the cloud started on it when its first token arrived."""
        costs = self.mode.costs
        if asked:
            t0, link = self.start + (self.stats.ttft_s or 0.0), 0.0
        else:
            t0, link = time.perf_counter(), costs.t_link or 0.0
            await self._ask_cloud(n, step=len(self.transcript.tokens))
        got = len(self.transcript.tokens)
        async for event in self._receive_tokens(n, as2=True):
            yield event
        seconds = time.perf_counter() - t0 - link
        costs.observe_cloud_tokens(len(self.transcript.tokens) - got, max(seconds, 1e-4))

    async def _receive_tokens(self, n: int, as2: bool = False) -> AsyncIterator[Event]:
        """Tokens the cloud decodes itself (the first one, or n under AS²), to the device's
        cache later."""
        got = 0
        while got < n and self.transcript.finish is None:
            msg = await self._recv()
            if isinstance(msg, TokenChunk):
                kept = self.transcript.commit(msg.token_ids.tolist())
                got += msg.token_ids.size
                self.unfed += kept
                if as2:
                    self.stats.cloud_tokens += len(kept)
                    self.mode.costs.cloud_tokens_since_round += len(kept)
                for event in self._emit(kept):
                    yield event
            elif isinstance(msg, Done):
                self._done(msg)
                return
            else:
                self._unexpected(msg)
        while self.pending_events:
            yield self.pending_events.pop(0)

    async def _round(self, logits: np.ndarray, gamma: int) -> AsyncIterator[Event]:
        variant = self.mode.variant
        step = len(self.transcript.tokens)
        t0 = time.perf_counter()  # device time per round includes catching up on new tokens
        if self.unfed:
            logits = (await self.device.forward(self.unfed))[-1]
            self.unfed = []
        base = self.device.length
        drafts: list[int] = []
        qs: list[np.ndarray] = []  # what each draft was sampled from (as the cloud sees it)
        rows: list[tuple[np.ndarray, np.ndarray]] = []
        dense: list[np.ndarray] = []
        for i in range(gamma):
            q = distribution(logits, self.params)
            if variant == "tk-slt":
                ids, probs = topk_draft_row(q, TOPK_MAX)
                rows.append((ids, probs))
                x = int(ids[sample_from(probs, self.rng)])
            elif variant == "dsd":
                q16 = wire_probs(q, f32=False)  # exactly what the cloud will read
                dense.append(q16)
                q = q16 / q16.sum()
                x = sample_from(q, self.rng)
            else:
                x = sample_from(q, self.rng)
            drafts.append(x)
            qs.append(q)
            if x in STOP_IDS:
                break  # nothing to draft after the end
            if i < gamma - 1:
                logits = (await self.device.forward([x]))[-1]
        draft_s = time.perf_counter() - t0
        msg = self._draft_message(drafts, qs, rows, dense, step)
        up0 = self.client.bytes_up
        await self.client.send(msg)
        self.stats.draft_bytes_up += self.client.bytes_up - up0
        verdict = await self._recv()
        if isinstance(verdict, Done):
            self._done(verdict)
            return
        if not isinstance(verdict, Verdict):
            self._unexpected(verdict)
            return
        round_s = time.perf_counter() - t0
        n, token = verdict.accepted, verdict.token
        fed = len(drafts) - 1  # the last draft was never fed to the device model
        await self.device.rollback(base + min(n, fed))
        if n < len(drafts):
            self.epoch += 1
        kept = self.transcript.commit(drafts[:n])
        self.unfed = drafts[min(n, fed) : n]
        if token is None and self.transcript.finish is None:
            # dssd rejection at n: the device samples the correction and tells the cloud
            p_j = np.asarray(verdict.p_probs, dtype=np.float64)
            if verdict.p_ids is None:
                token = dssd_device_resample(p_j / p_j.sum(), qs[n], self.rng)
            else:
                token = sample_from(picospec_residual_topk(verdict.p_ids, p_j, qs[n]), self.rng)
            await self.client.send(TokenChunk([token], request_id=self.rid, epoch=self.epoch,
                                              step=step + n))  # fmt: skip
        if token is not None:
            kept += self.transcript.commit([token])
            self.unfed.append(token)
        self.stats.rounds += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += n
        self.stats.per_round.append((len(drafts), n))
        self.mode.costs.observe_round(len(drafts), n, draft_s, round_s, verdict.compute_s)
        for event in self._emit(kept):
            yield event

    def _draft_message(self, drafts, qs, rows, dense, step: int) -> Message:
        hdr = {"request_id": self.rid, "epoch": self.epoch, "step": step}
        variant = self.mode.variant
        if variant == "tk-slt":
            ids, probs = pad_rows(rows, self.device.lm.vocab_size)
            return TopKDraft(drafts, ids, probs.astype(np.float16), **hdr)
        if variant == "dsd":
            return DsdDraft(drafts, np.stack(dense).astype(np.float16), **hdr)
        q_of = [float(q[x]) for q, x in zip(qs, drafts, strict=True)]
        return DssdDraft(drafts, np.asarray(q_of, dtype=np.float32), f32=True, **hdr)

    async def _await_done(self) -> None:
        while not self.finished:
            msg = await self._recv()
            if isinstance(msg, Done):
                self._done(msg)
            else:
                self._unexpected(msg)

    def _done(self, msg: Done) -> None:
        self.finished = True
        self.stats.finish = msg.reason.name.lower()
        if self.transcript.finish is None:  # the cloud ended it (context limit, cancel, error)
            self.transcript.finish = msg.reason

    def _unexpected(self, msg: Message) -> None:
        from edge_runtime.client import CloudError

        if isinstance(msg, Error):
            if msg.code == ErrorCode.EVICTED:
                raise CloudError(f"the cloud dropped this answer's cache: {msg.message}")
            raise CloudError(f"the cloud refused a frame: {msg.message}")
        raise CloudError(f"unexpected {type(msg).__name__} from the cloud")
