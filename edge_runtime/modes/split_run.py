"""Split decoding's stop-and-wait loop on the device (and what the pipelined loop shares with
it: the first token, AS², receiving the cloud's tokens). One round:

    device                                            cloud
    ──────                                            ─────
    feed tokens the cloud committed (catch-up)
    γ × { q = distribution(logits)
          d = variant.draft(q, rng)
          logits = forward(d.token) }
    variant.draft_frame(drafts) ──── epoch, step ───▶ P = forward(pending + drafts)  (γ+1 rows)
                                                      variant.judge(frame, P) → n, token
    rollback to the accepted prefix ◀──── Verdict ─── (n, token | P_j, compute_s)
    token None: variant.correct(verdict, Q_n) ── TokenChunk([t]) ──▶ commit
    commit drafts[:n] + [token]; epoch += rejected                  commit the same
    costs.observe_round(γ, n, draft_s, link_s, compute_s) → next γ (or AS²)

The first token comes from the cloud's prefill (so the time to first token is cloud mode's)
while the device prefills its own prompt. γ comes from measured costs (`SplitCosts`); when no
γ beats the cloud decoding alone (AS²), the device asks the cloud to decode the next tokens
itself and says so in the stats. Under AS² a request covers every token up to the next probe
round, and when an answer starts under AS² it goes out right behind Generate: the cloud never
waits a round trip for the device, so the fallback costs no more than cloud mode."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np

from collab.protocol import CloudDecode, TokenChunk, Verdict
from collab.sampling import distribution
from collab.scheduling import GammaChoice
from collab.variants.base import DraftToken, SplitVariant
from edge_runtime.client import CloudProtocolError
from edge_runtime.device import DeviceModel
from edge_runtime.events import Event, Notice
from edge_runtime.modes.base import STOP_IDS, Answer, AnswerOptions
from edge_runtime.modes.link import RequestLink
from edge_runtime.split_costs import INITIAL_GAMMA, SplitCosts

MEASURE_CLOUD = 4  # tokens the cloud decodes alone once per session, to time it
PROBE_EVERY = 96  # under AS², one speculative round per this many cloud tokens re-measures


class SplitRun:
    """One answer's speculation on the device: tokens the device cache has not seen yet, the
    epoch (rejections so far) and the request's frames. Stop-and-wait rounds; a subclass
    changes how speculation proceeds by overriding `_speculate` (and `_choice`, the cost
    model's answer for its kind of round)."""

    def __init__(
        self,
        link: RequestLink,
        scheme: SplitVariant,
        costs: SplitCosts,
        device: DeviceModel,
        options: AnswerOptions,
        answer: Answer,
    ) -> None:
        self.link, self.rid, self.answer = link, link.rid, answer
        self.scheme, self.costs, self.device = scheme, costs, device
        self.stats, self.transcript = answer.stats, answer.transcript
        self.params = options.sampling
        self.rng = np.random.default_rng(
            None if options.seed is None else [options.seed, 0x5EED]
        )  # never the cloud's stream
        self.unfed: list[int] = []
        self.epoch = 0
        self.as2_choice: GammaChoice | None = None  # the cost model's last AS² verdict
        # RAPID's η acts only in speculative rounds: an answer asked for with η > 0 always
        # speculates (AS²'s cloud decoding would drop what the device knows)
        self.always_speculate = options.eta > 0

    async def decode(self, prompt: list[int]) -> AsyncIterator[Event]:
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
            if self._measure_cloud():
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
            async for event in self._speculate(logits):
                yield event
            for event in self.link.take_events():
                yield event
        await self._await_done()

    def _measure_cloud(self) -> bool:
        """AS² compares with the cloud decoding alone: time that once per session, as soon as
        the speculation's own costs are known."""
        costs, remaining = self.costs, self.transcript.remaining
        return (
            costs.as2
            and not self.always_speculate
            and costs.t_cloud_step is None
            and self._choice(remaining) is not None
        )

    def _choice(self, remaining: int) -> GammaChoice | None:
        """The cost model's best round (γ, or AS²); None until it has measured."""
        return self.costs.choose(remaining)

    def _gamma(self, remaining: int, choice: GammaChoice | None) -> int:
        """The next batch's draft length: the cost model's (INITIAL_GAMMA before it knows),
        within what the cloud said it accepts in a batch."""
        wanted = INITIAL_GAMMA if choice is None else choice.gamma
        gamma = max(1, min(wanted, remaining, self.link.limits.max_draft_tokens))
        self.stats.gamma = gamma
        return gamma

    def _as2_tokens(self, remaining: int) -> int:
        """How many tokens to hand the cloud now under AS² (all of them up to the next probe
        round, which re-measures the costs), or 0 to speculate."""
        costs = self.costs
        since = costs.cloud_tokens_since_round
        if self.always_speculate or remaining <= 0 or costs.t_cloud_step is None:
            return 0
        if since >= PROBE_EVERY:
            return 0
        choice = self._choice(remaining)
        if choice is None or not choice.use_cloud_only:
            return 0
        self.as2_choice = choice
        return min(remaining, PROBE_EVERY - since)

    def _as2_notice(self) -> Notice:
        self.stats.cloud_only = True
        c = self.as2_choice
        assert c is not None
        return Notice(
            f"AS²: no draft length beats the cloud decoding alone (best "
            f"{c.tokens_per_second:.1f} vs {c.cloud_only_tokens_per_second:.1f} tokens/s); "
            "decoding in the cloud"
        )

    async def _ask_cloud(self, n: int, step: int) -> None:
        await self.link.send(CloudDecode(n, request_id=self.rid, epoch=self.epoch, step=step))

    async def _cloud_tokens(self, n: int, asked: bool = False) -> AsyncIterator[Event]:
        """The cloud decodes the next n tokens itself; time it. `asked`: the request went out
        ahead (behind Generate), so the cloud started on it when its first token arrived."""
        costs = self.costs
        if asked:
            t0, link = self.answer.start + (self.stats.ttft_s or 0.0), 0.0
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
            msg = await self.link.recv(TokenChunk)
            if self.link.ended(msg):
                return
            kept = self.transcript.commit(msg.token_ids.tolist())
            got += msg.token_ids.size
            self.unfed += kept
            if as2:
                self.stats.cloud_tokens += len(kept)
                self.costs.cloud_tokens_since_round += len(kept)
            for delta in self.answer.emit(kept):
                yield delta
        for event in self.link.take_events():
            yield event

    async def _draft(self, logits: np.ndarray, gamma: int) -> list[DraftToken]:
        """Up to γ drafts from the variant's draft distribution (none after a stop token)."""
        drafts: list[DraftToken] = []
        for i in range(gamma):
            draft = self.scheme.draft(distribution(logits, self.params), self.rng)
            drafts.append(draft)
            if draft.token in STOP_IDS:
                break  # nothing to draft after the end
            if i < gamma - 1:
                logits = (await self.device.forward([draft.token]))[-1]
        return drafts

    async def _speculate(self, logits: np.ndarray) -> AsyncIterator[Event]:
        """One stop-and-wait round (`logits`: the device's, if it has no tokens to catch up)."""
        gamma = self._gamma(self.transcript.remaining, self._choice(self.transcript.remaining))
        step = len(self.transcript.tokens)
        t0 = time.perf_counter()  # device time per round includes catching up on new tokens
        if self.unfed:
            logits = (await self.device.forward(self.unfed))[-1]
            self.unfed = []
        base = self.device.length
        drafts = await self._draft(logits, gamma)
        tokens = [d.token for d in drafts]
        draft_s = time.perf_counter() - t0
        frame = self.scheme.draft_frame(
            drafts, self.device.lm.vocab_size, request_id=self.rid, epoch=self.epoch, step=step
        )
        self.stats.draft_bytes_up += await self.link.send(frame)
        verdict = await self.link.recv(Verdict)
        if self.link.ended(verdict):
            return
        round_s = time.perf_counter() - t0
        n, token = verdict.accepted, verdict.token
        if n > len(drafts):
            raise CloudProtocolError("the cloud judged drafts that were never sent")
        fed = len(drafts) - 1  # the last draft was never fed to the device model
        await self.device.rollback(base + min(n, fed))
        if n < len(drafts):
            self.epoch += 1
        kept = self.transcript.commit(tokens[:n])
        self.unfed = tokens[min(n, fed) : n]
        ended = False
        if token is None and self.transcript.finish is None:
            if verdict.p_probs is None or n == len(drafts):
                # no correction to sample: the cloud ended the answer in this batch (the room
                # its context leaves, which the device does not know); Done follows
                ended = True
            else:
                token = await self._correct(verdict, drafts[n], step + n)
        if token is not None:
            kept += self.transcript.commit([token])
            self.unfed.append(token)
        self.stats.rounds += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += n
        self.stats.per_round.append((len(drafts), n))
        link_s = round_s - draft_s - verdict.compute_s
        self.costs.observe_round(
            len(drafts), n, draft_s, link_s, verdict.compute_s, scored=verdict.scored
        )
        for event in self.answer.emit(kept):
            yield event
        if ended:
            await self._await_done()

    async def _correct(self, verdict: Verdict, rejected: DraftToken, step: int) -> int:
        """The cloud left the correction to us (it does not know Q): sample it from the
        rejected draft's distribution and tell the cloud."""
        try:
            token = self.scheme.correct(verdict, rejected.q, self.rng)
        except ValueError as exc:  # no distribution to sample from: not an honest cloud's
            raise CloudProtocolError(f"the cloud's verdict cannot be used: {exc}") from None
        await self.link.send(
            TokenChunk(np.asarray([token]), request_id=self.rid, epoch=self.epoch, step=step)
        )
        return token

    async def _await_done(self) -> None:
        while not self.answer.finished:
            self.link.ended(await self.link.recv())
