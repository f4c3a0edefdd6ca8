"""Auto: before each answer, pick local, cloud, split or dragon (`edge_runtime.mode_choice`), say
which and why (a `ModeChoice` event, then the answer's figures), and answer in that mode.

What it measures first: the private index's passages for the question (on the device); then,
when the policy lets the question leave and only where the answer can change the choice
(`mode_choice.public_can_matter`), the cloud's public passages for the question (a retrieval
request, `max_new_tokens` 0: the question goes up, no history, nothing private; a follow-up
is searched with the questions it follows of the turns the cloud saw itself,
`cloud_link.public_search`; the cloud sends its Citations and Done and decodes nothing).
Their relevance is the device's own judgement of the returned texts (`public_scores`): a
remote cloud's numbers are claims, and a cloud that lied about them could move a question the
notes answer off the device. Dragon for a cloud the user has not decided about asks them
first (edge_runtime.consent)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence

from collab.protocol import Generate
from collab.sources import PUBLIC_FLOOR
from collab.split import Transcript
from edge_runtime.client import CloudError
from edge_runtime.device import retrieve_private
from edge_runtime.events import Citation, Event, ModeChoice, Stats
from edge_runtime.mode_choice import (
    Choice,
    CloudReach,
    Policy,
    Signals,
    Speeds,
    choose,
    public_can_matter,
)
from edge_runtime.modes.auto_declared import DECLARED
from edge_runtime.modes.base import (
    Answer,
    AnswerOptions,
    ModeContext,
    Orchestrator,
    Turn,
    private_history,
    searched_by,
    seen_by,
)
from edge_runtime.modes.cloud_link import CloudBacked, public_search
from retrieval.search import clauses

log = logging.getLogger("tandem.edge.auto")

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
        self._consented = False  # the user agreed for this answer when auto chose dragon
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
        if self._consented:  # the user was asked for this answer already
            options = dataclasses.replace(options, allow_private_in_cloud=True)
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
        """Search privately first; ask the cloud how well its corpus matches only where its
        answer can change the choice (`public_can_matter`), and judge what it returns with the
        device's own embedder; then apply the rules. Where dragon is chosen for a cloud the
        user has not decided about, they are asked (declined: the notes answer locally)."""
        policy = self.policy
        self._probe_bytes, self._consented = (0, 0), False
        found = await retrieve_private(
            self.ctx.index,
            searched_by(question, history),
            options.k,
            options.min_score,
            options.scope,
        )
        asks_cloud = policy.questions_leave and self.ctx.cloud is not None
        until, which = self._unreachable
        backing_off = which is self.ctx.cloud and time.monotonic() < until  # a new link: ask
        reach: CloudReach = "unreachable" if asks_cloud else "off"
        if reach == "off" and self.ctx.cloud_starting:
            reach = "starting"
        public: list[float] = []
        rtt, identity, consulted, consent = None, None, False, False
        if asks_cloud and not backing_off:
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_S):
                    identity = await self.cloud_identity()
                    consent = identity is not None and self.consent(identity, options) is not False
                    private_turn = bool(history) and seen_by(history[-1], identity) is None
                    scores = [s.score for s in found]
                    if public_can_matter(scores, private_turn, policy, consent, options.k):
                        search = public_search(question, history, identity)
                        public, rtt = await self.public_relevance(question, options, search)
                        consulted = True
                reach = "ready"
            except (CloudError, OSError, TimeoutError):
                self._unreachable = (time.monotonic() + PROBE_BACKOFF_S, self.ctx.cloud)
        signals = Signals(
            private=[s.score for s in found],
            public=public,
            cloud=reach,
            private_turn=bool(history) and seen_by(history[-1], identity) is None,
            private_history=private_history(history, identity),
            speeds=self.speeds,
            rtt_s=rtt,
            split_gain=self.split_gain(options) if reach == "ready" else None,
            tokens=options.max_new_tokens,
            consulted=consulted,
            consent=consent,  # undecided counts as yes until dragon is chosen: then asked
        )
        choice = choose(signals, policy)
        if choice.mode == "dragon" and identity is not None:
            self._consented = await self.ctx.consent.grant(identity, options.allow_private_in_cloud)
            if not self._consented:
                choice = choose(dataclasses.replace(signals, consent=False), policy)
        return choice

    def consent(self, identity: str, options: AnswerOptions) -> bool | None:
        """What the user said for that cloud (None: not yet; they are asked if dragon is
        chosen)."""
        return self.ctx.consent.known(identity, options.allow_private_in_cloud)

    async def cloud_identity(self) -> str | None:
        """Which cloud answers (its session opened if it is not: a handshake, nothing of the
        question): what consent and provenance are keyed on."""
        cloud = self.mode("cloud")
        assert isinstance(cloud, CloudBacked)
        await cloud.client()
        return cloud.cloud_identity()

    def split_gain(self, options: AnswerOptions) -> float | None:
        """Split's predicted speed over the cloud decoding alone, from its measured costs
        (None until split has run: its rounds are what measure them)."""
        costs = getattr(self.mode("split"), "costs", None)
        predicted = costs.choose(options.max_new_tokens, options.pipeline) if costs else None
        if predicted is None or not predicted.cloud_only_tokens_per_second:
            return None
        return float(predicted.tokens_per_second / predicted.cloud_only_tokens_per_second)

    async def public_relevance(
        self, question: str, options: AnswerOptions, search: str = ""
    ) -> tuple[list[float], float | None]:
        """The relevance of each public passage the cloud retrieves for the bare question, as
        the device judges it (`public_scores`: its own embedder on the returned texts; the
        cloud's numbers are claims, never used), and the session's round trip: a retrieval
        request on the cloud mode's session, its frames read by the request link every
        request uses."""
        cloud = self.mode("cloud")
        assert isinstance(cloud, CloudBacked)
        rid = next(CloudBacked._request_ids)
        probe = Answer(Stats(self.name), time.perf_counter(), Transcript(0, frozenset()), None)
        link = cloud.link(await cloud.client(), rid, probe)
        try:
            await link.send(
                Generate(question, max_new_tokens=0, retrieve=True, request_id=rid, search=search)
            )
            while not link.ended(await link.recv()):
                pass
            passages = [e for e in link.take_events() if isinstance(e, Citation)]
        finally:
            self._probe_bytes = (link.bytes_up, link.bytes_down)
        try:
            asked = ([question, search] if search else [question]) + clauses(question)
            scores = await asyncio.to_thread(public_scores, self.ctx.judge, asked, passages)
        except Exception:  # the device's embedder failed: nothing it cannot check counts
            log.warning("could not score the public passages on this device", exc_info=True)
            scores = []
        return counted(scores, options.min_score), link.rtt()

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


_WORD = re.compile(r"\w+")


def restates(question: str, text: str) -> bool:
    """Whether a passage adds nothing to the question (every word of it is the question's) or
    quotes the question whole: no evidence that the corpus answers it. A cloud echoing each
    question back would otherwise make every question look public to the device."""
    asked = _WORD.findall(question.lower())
    words = _WORD.findall(text.lower())
    if not words or set(words) <= set(asked):
        return True
    return bool(asked) and f" {' '.join(asked)} " in f" {' '.join(words)} "


def counted(scores: Sequence[float], min_score: float | None) -> list[float]:
    """The public scores that count as answering: at PUBLIC_FLOOR or over (an encyclopedia
    matches a question about the user's life a little everywhere), or over the user's own
    floor where it is higher."""
    floor = max(PUBLIC_FLOOR, min_score or PUBLIC_FLOOR)
    return [s for s in scores if s >= floor]


def public_scores(
    judge: Callable[[str, Sequence[str]], Sequence[float]] | None,
    question: str | Sequence[str],
    passages: Sequence[Citation],
) -> list[float]:
    """The device's own relevance of each returned public passage: its embedder's cosine of
    the passage text with the question, or with the best of the ways it was asked (a follow-up
    with its topic, edge_runtime.turns); a passage that only restates what was asked counts 0.
    Without an embedder on the device, nothing the cloud returns counts as relevant."""
    if judge is None or not passages:
        return []
    asked = [question] if isinstance(question, str) else list(question)
    texts = [p.text for p in passages]
    best = [0.0] * len(passages)
    for q in asked:
        for i, (p, x) in enumerate(zip(passages, judge(q, texts), strict=True)):
            best[i] = max(best[i], 0.0 if restates(q, p.text) else float(x))
    return best
