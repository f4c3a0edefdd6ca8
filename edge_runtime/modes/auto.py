"""Auto: before each answer, pick local, cloud, split or dragon (`edge_runtime.mode_choice`), say
which and why (a `ModeChoice` event, then the answer's figures), and answer in that mode.

What it measures first: the private index's passages for the question (on the device), and,
when the policy lets the question leave, the cloud's public passages for the bare question
(a retrieval request, `max_new_tokens` 0: the question alone goes up, no history, nothing
private; the cloud sends its Citations and Done and decodes nothing). The two run at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from collab.protocol import Generate
from collab.split import Transcript
from edge_runtime.client import CloudError
from edge_runtime.device import retrieve_private
from edge_runtime.events import Citation, Event, ModeChoice, Stats
from edge_runtime.mode_choice import Choice, CloudReach, Policy, Signals, Speeds, choose
from edge_runtime.modes.auto_declared import DECLARED
from edge_runtime.modes.base import Answer, AnswerOptions, ModeContext, Orchestrator, Turn
from edge_runtime.modes.cloud_link import CloudBacked

PROBE_TIMEOUT_S = 10.0
"""A cloud that cannot say how well its corpus matches within this (connecting included) is
treated as unreachable: the answer goes on locally rather than waiting."""
PROBE_BACKOFF_S = 30.0
"""After a cloud did not answer, auto does not wait on it again for this long (each question
meanwhile answers locally at once, and says why)."""


class AutoMode(Orchestrator):
    name = "auto"
    description = "picks local, cloud, split or dragon for each question, and says why"
    declared = DECLARED

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self.speeds = Speeds()
        self._own: dict[str, Orchestrator] = {}  # where no shared modes are given (tests)
        self._answering: Orchestrator | None = None
        self._probe_bytes = (0, 0)  # what the last relevance query sent and received
        # (monotonic time, cloud settings): that cloud is not asked again before that time
        self._unreachable: tuple[float, object] = (0.0, None)

    @property
    def policy(self) -> Policy:
        return Policy(
            questions_leave=bool(self.ctx.setting("auto_cloud_questions")),
            private_in_cloud=bool(self.ctx.setting("auto_private_in_cloud")),
        )

    def mode(self, name: str) -> Orchestrator:
        """The mode that answers: the app's own instance (its sessions and split's measured
        costs are shared with answers in that mode picked by hand), else one of auto's."""
        if self.ctx.modes is not None:
            return self.ctx.modes(name)
        if name not in self._own:
            from edge_runtime.modes import build_mode

            self._own[name] = build_mode(name, self.ctx)
        return self._own[name]

    async def generate(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        choice = await self.choose(question, history, options)
        answer.stats.auto_mode, answer.stats.auto_reason = choice.mode, choice.reason
        yield ModeChoice(choice.mode, choice.reason)
        mode = self.mode(choice.mode)
        mode._live_bytes = None  # its last answer's link is not this one's
        self._answering = mode
        try:
            async for event in mode.generate(question, history, options, answer):
                yield event
        finally:
            self._answering = None
            answer.stats.bytes_up += self._probe_bytes[0]  # the relevance query crossed too
            answer.stats.bytes_down += self._probe_bytes[1]
            self._learn(choice.mode, answer.stats, time.perf_counter() - answer.start)

    async def choose(
        self, question: str, history: Sequence[Turn], options: AnswerOptions
    ) -> Choice:
        """Measure the signals (the private search and the cloud's public relevance at once)
        and apply the rules."""
        policy = self.policy
        self._probe_bytes = (0, 0)
        asks_cloud = policy.questions_leave and self.ctx.cloud is not None
        until, which = self._unreachable
        backing_off = which is self.ctx.cloud and time.monotonic() < until  # a new link: ask
        probe = None
        if asks_cloud and not backing_off:
            probe = asyncio.ensure_future(
                asyncio.wait_for(self.public_relevance(question), PROBE_TIMEOUT_S)
            )
        try:
            found = await retrieve_private(self.ctx.index, question, options.k, options.min_score)
        except BaseException:
            if probe is not None:
                probe.cancel()
            raise
        reach: CloudReach = "unreachable" if asks_cloud else "off"
        if reach == "off" and self.ctx.cloud_starting:
            reach = "starting"
        public: list[float] = []
        rtt = None
        if probe is not None:
            try:
                (public, rtt), reach = await probe, "ready"
            except (CloudError, OSError, TimeoutError):
                self._unreachable = (time.monotonic() + PROBE_BACKOFF_S, self.ctx.cloud)
        last = history[-1] if history else None
        signals = Signals(
            private=[s.score for s in found],
            public=public,
            cloud=reach,
            private_turn=last is not None and last.shared is None,
            private_history=any(t.shared != t.answer for t in history),
            speeds=self.speeds,
            rtt_s=rtt,
            split_gain=self.split_gain(options) if reach == "ready" else None,
            tokens=options.max_new_tokens,
        )
        return choose(signals, policy)

    def split_gain(self, options: AnswerOptions) -> float | None:
        """Split's predicted speed over the cloud decoding alone, from its measured costs
        (None until split has run: its rounds are what measure them)."""
        costs = getattr(self.mode("split"), "costs", None)
        predicted = costs.choose(options.max_new_tokens, options.pipeline) if costs else None
        if predicted is None or not predicted.cloud_only_tokens_per_second:
            return None
        return float(predicted.tokens_per_second / predicted.cloud_only_tokens_per_second)

    async def public_relevance(self, question: str) -> tuple[list[float], float | None]:
        """The relevance of each public passage the cloud retrieves for the bare question
        (those past its floor), and the session's round trip: a retrieval request on the
        cloud mode's session, its frames read by the request link every request uses."""
        cloud = self.mode("cloud")
        assert isinstance(cloud, CloudBacked)
        rid = next(CloudBacked._request_ids)
        probe = Answer(Stats(self.name), time.perf_counter(), Transcript(0, frozenset()), None)
        link = cloud.link(await cloud.client(), rid, probe)
        try:
            await link.send(Generate(question, max_new_tokens=0, retrieve=True, request_id=rid))
            while not link.ended(await link.recv()):
                pass
            return [e.score for e in link.take_events() if isinstance(e, Citation)], link.rtt()
        finally:
            self._probe_bytes = (link.bytes_up, link.bytes_down)

    def _learn(self, name: str, stats: Stats, elapsed_s: float) -> None:
        """Keep each mode's decode speed (what the slow-cloud rule weighs)."""
        if stats.ttft_s is not None and stats.tokens > 1 and elapsed_s > stats.ttft_s:
            self.speeds.observe(name, (stats.tokens - 1) / (elapsed_s - stats.ttft_s))

    async def close(self) -> None:
        for mode in self._own.values():
            await mode.close()
        self._own.clear()

    def live_stats(self) -> Stats | None:
        if self._answering is not None:  # the bytes of the answering mode's link
            self._live_bytes = self._answering._live_bytes
        return super().live_stats()
