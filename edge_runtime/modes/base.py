"""What every mode shares: the conversation types, the history policy, the device prompt, and
the answer skeleton (options → `generate` → final `Stats`) written once for all modes.

What each mode sends (docs/index.md#product, the invariant): local sends nothing; cloud sends the
question
and the cloud-visible history; split sends the question, that history, drafted token ids and
draft probabilities. Private passages only ever enter the device model's prompt. Earlier turns
answered in local mode may rest on private text, and so may what the device wrote alone after
the cloud dropped: a cloud is sent back only what it saw itself (`Turn.shared`,
`Turn.shared_with`)."""

from __future__ import annotations

import copy
import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from collab.protocol import FinishReason
from collab.sampling import sample
from collab.sources import Source
from collab.split import Transcript
from edge_runtime.client import HEARTBEAT_S
from edge_runtime.consent import Consent
from edge_runtime.declared import Declaration
from edge_runtime.declared import settings as declared_settings
from edge_runtime.device import (
    NOTHING_PRIVATE,
    DeviceModel,
    Retriever,
    nothing_relevant,
    retrieve_private,
)
from edge_runtime.events import Event, Notice, Stats, TextDelta
from edge_runtime.options import AnswerOptions
from edge_runtime.sent import SentLedger
from edge_runtime.turns import refused, search_candidates
from model_runtime.generate import TextStream
from model_runtime.prompting import fit_prompt, prompt_budget
from model_runtime.tokenizer import IM_END_ID

if TYPE_CHECKING:
    from edge_runtime.client import CloudClient

STOP_IDS = frozenset({IM_END_ID})

__all__ = [
    "STOP_IDS",
    "Answer",
    "AnswerOptions",
    "CloudSettings",
    "ModeContext",
    "Orchestrator",
    "Turn",
    "cloud_history",
    "device_generate",
    "device_prompt",
    "need_device",
    "seen_by",
]


@dataclass(frozen=True)
class Turn:
    """One finished exchange, the mode that answered it, and what of it the cloud has seen:
    `shared` is the part of the answer the cloud produced, verified or aggregated (its prefix
    up to where the device went on alone), or None if the question never reached the cloud
    (local mode; a cloud that could not be reached). `shared_with` names the cloud that saw it
    (edge_runtime.cloud_identity); a shared turn naming none (stored before Tandem recorded
    which cloud) is sent to no cloud. None unless told: private by default."""

    question: str
    answer: str
    mode: str
    shared: str | None = None
    shared_with: str | None = None  # the identity of the cloud that saw `shared`


@dataclass
class CloudSettings:
    """Where the cloud is and how to reach it."""

    url: str
    token: str
    connect_timeout_s: float = 10.0
    retries: int = 2
    # A cloud that is alive (it answers the websocket's heartbeat) but sends nothing for this
    # long mid-answer is given up on; longer than any prefill it may be running.
    stall_timeout_s: float = 300.0
    heartbeat_s: float | None = HEARTBEAT_S  # websocket pings (None: off)
    ca_file: str | None = None  # PEM bundle to verify a wss:// cloud with (None: the system's)
    allow_insecure: bool = False  # ws:// to a host not on loopback (token and text in clear)
    embedded: bool = False  # the cloud Tandem started on this device (counts as on-device)

    def identity(self, server_name: str = "") -> str:
        """This cloud's identity (edge_runtime.cloud_identity): consent and provenance key."""
        from edge_runtime.cloud_identity import cloud_identity

        return cloud_identity(self.url, server_name, embedded=self.embedded)


@dataclass
class ModeContext:
    """What the modes share: the device model, the private index, the cloud link."""

    device: DeviceModel | None = None
    index: Retriever | None = None
    cloud: CloudSettings | None = None
    cloud_starting: bool = False  # no cloud yet, but one is being started or reached
    variant: str = "tk-slt"  # split: a name in collab.variants.variant_names()
    finish_locally: bool = True  # if the cloud drops mid-answer, the device finishes it
    retrieve_public: bool = True  # cloud mode grounds the cloud in its public corpus
    split_retrieve_public: bool = False  # split: the cloud verifies with the bare question
    aggregator: str = "auto"  # dragon: device, cloud, or auto (the scheduler picks per token)
    rerank_every: int = 0  # dragon: re-score documents every n tokens (0 = static weights)
    dragon_lookahead: int | None = None  # dragon: drafts ahead (None = default; 0 = DRDG/TW)
    clients: dict[tuple[Any, str], CloudClient] = field(default_factory=dict)
    # each mode's orchestrator, shared (the Assistant's): auto answers through them, so its
    # answers and those in a mode picked by hand share sessions and split's measured costs
    modes: Callable[[str], Orchestrator] | None = None
    # every mode's declared settings by name (edge_runtime.declared), as the user set them;
    # a mode reads its own with `setting`
    settings: dict[str, Any] = field(default_factory=dict)
    # which clouds may take part in answers shaped by private passages (edge_runtime.consent)
    consent: Consent = field(default_factory=Consent)
    # what leaves for the answer in progress (None between answers): every session a mode
    # takes meanwhile writes what it sends there (edge_runtime.sent, CloudBacked.client)
    sent: SentLedger | None = None
    # the device's own relevance of each text to a question (cosines, its embedder): how the
    # device checks the public relevance a cloud claims (None: no embedder loaded)
    judge: Callable[[str, Sequence[str]], Sequence[float]] | None = None

    def setting(self, name: str) -> Any:
        """A declared setting's value: as set, else its declared default (KeyError: no mode
        declares it)."""
        if name in self.settings:
            return self.settings[name]
        return declared_settings()[name].default


def need_device(ctx: ModeContext) -> DeviceModel:
    if ctx.device is None:
        raise RuntimeError("the device model is not loaded")
    return ctx.device


# ---------------------------------------------------------------------------- history policy


HISTORY_TOKENS = 1024
"""Earlier turns a prompt holds at most (the newest kept): a quarter of what the device's
0.5B model was trained to follow well (4k), the smaller of the two models, whose prompt holds
the conversation in every mode but cloud."""


def steering(
    question: str, history: Sequence[Turn], tokenizer: Any = None, budget: int = HISTORY_TOKENS
) -> list[Turn]:
    """The earlier turns that may steer the answer to `question` (edge_runtime.turns): not
    those whose answer refused or said nothing answers it (the small model copies its refusal
    into the next answer, whatever that one's passages say), and, counted with `tokenizer`,
    the newest within `budget` tokens. Every other turn is kept, a question that seems to stand
    alone included: it may lean on the conversation without a word that says so ("Who's the
    client?"), and leaving the earlier turns out measured worse (docs/benchmarks/multiturn.md)."""
    del question  # the rules kept need only the turns (the one measured against did not)
    kept = [t for t in history if not refused(t.answer)]
    if tokenizer is None:
        return kept
    used, start = 0, len(kept)
    while start > 0:
        turn = kept[start - 1]
        used += len(tokenizer.encode(turn.question)) + len(tokenizer.encode(turn.answer))
        if used > budget:
            break
        start -= 1
    return kept[start:]


def searched_by(question: str, history: Sequence[Turn]) -> list[str]:
    """The ways the search for `question` runs after these turns (edge_runtime.turns): with
    the question it follows, and alone; the search keeps the better. Built only from the
    turns given: the cloud's from the turns it saw (`shared_history`), never private ones."""
    return search_candidates([*(t.question for t in history), question])


def full_history(history: Sequence[Turn]) -> list[str]:
    return [text for turn in history for text in (turn.question, turn.answer)]


def seen_by(turn: Turn, identity: str | None) -> str | None:
    """What the cloud `identity` saw of `turn` (None: nothing, not even the question). Only
    the cloud that saw a turn counts: one the embedded cloud saw is private to a remote cloud
    configured later, and a turn whose cloud is unknown (None) is private to every cloud."""
    if identity is None or turn.shared_with != identity:
        return None
    return turn.shared


def cloud_history(history: Sequence[Turn], identity: str | None) -> list[str]:
    """What the cloud `identity` may see of earlier turns: only what it already saw itself
    (history by provenance, not by mode). A turn answered locally, one whose question never
    reached this cloud, and one another cloud (or an unrecorded one) saw are left out; a turn
    the device finished alone after the cloud dropped is sent only up to where the cloud's
    part ended (the device's continuation may quote private passages); a turn of which the
    cloud saw no answer text is left out."""
    return [
        text for t in history if (shared := seen_by(t, identity)) for text in (t.question, shared)
    ]


def private_history(history: Sequence[Turn], identity: str | None) -> bool:
    """Whether some earlier turn holds text that cloud did not see itself (a local answer,
    the device's own continuation, another cloud's turn): in a device prompt, it shapes what
    the device drafts."""
    return any(seen_by(t, identity) != t.answer for t in history)


def shared_history(history: Sequence[Turn], identity: str | None) -> list[Turn]:
    """The conversation as that cloud saw it: its own turns, each cut to what it saw."""
    return [
        dataclasses.replace(t, answer=shared)
        for t in history
        if (shared := seen_by(t, identity)) is not None
    ]


def device_prompt(
    device: DeviceModel,
    question: str,
    history: Sequence[Turn],
    passages: Sequence[Source],
    options: AnswerOptions,
) -> tuple[list[int], list[Notice]]:
    """The device model's prompt, the oldest exchanges left out if the conversation outgrew
    its context (and a notice saying so)."""
    budget = prompt_budget(device.lm.max_context, options.max_new_tokens)
    ids, dropped = fit_prompt(device.tokenizer, question, full_history(history), passages, budget)
    if not dropped:
        return ids, []
    return ids, [left_out_notice(dropped, device.lm.max_context)]


def left_out_notice(dropped: int, max_context: int) -> Notice:
    what = "exchange" if dropped == 1 else "exchanges"
    return Notice(
        f"the {dropped} oldest {what} left out: the conversation is longer than the device "
        f"model's context ({max_context} tokens)"
    )


# ---------------------------------------------------------------------------- one answer


@dataclass
class Answer:
    """One answer in progress: its figures, committed tokens and text stream, and how its
    cloud request ended (a Done arrived; the link broke)."""

    stats: Stats
    start: float
    transcript: Transcript
    stream: TextStream | None
    prompt: list[int] = field(default_factory=list)  # the device prompt, where one is built
    # set by a mode's `prepare` when the answer must not reach the cloud after all (no
    # consent for private context): the device answers from `prompt` alone, nothing is sent
    device_only: bool = False
    finished: bool = False
    broken: bool = False

    def emit(self, kept: Sequence[int]) -> list[TextDelta]:
        """Text for newly committed tokens; the first one sets the time to first token."""
        events: list[TextDelta] = []
        for t in kept:
            if self.stats.ttft_s is None:
                self.stats.ttft_s = time.perf_counter() - self.start
            if self.stream is not None and (text := self.stream.push(t)):
                events.append(TextDelta(text))
        self.stats.tokens = len(self.transcript.tokens)
        return events


async def device_generate(
    device: DeviceModel, ids: list[int], answer: Answer, options: AnswerOptions
) -> AsyncIterator[Event]:
    """Plain decoding on the device from a fresh prefill of `ids` until the transcript ends
    (stop token, length, or the context limit)."""
    rng = np.random.default_rng(options.seed)
    transcript = answer.transcript
    logits = await device.prefill(ids)
    room = device.lm.max_context - device.length
    while transcript.finish is None:
        token, _ = sample(logits, rng, options.sampling)
        for event in answer.emit(transcript.commit([token])):
            yield event
        if transcript.finish is None:
            if room <= 1:
                transcript.finish = FinishReason.LENGTH
                break
            logits = (await device.forward([token]))[-1]
            room -= 1


# ---------------------------------------------------------------------------- the mode


class Orchestrator(ABC):
    """One answer mode. Subclasses say what they are (name, description, needs_cloud, the
    figures and settings they add: `declared`) and implement `generate`; `answer` wraps it in
    what every mode does (figures, live stats)."""

    name: str = ""
    needs_cloud: bool = False
    description: str = ""
    declared: ClassVar[Declaration] = Declaration()  # its own figures and settings

    def __init__(self, ctx: ModeContext) -> None:
        self.ctx = ctx
        self._live: tuple[Stats, float] | None = None
        self._live_bytes: tuple[CloudClient, int, int] | None = None

    @property
    def variant(self) -> str:
        return ""

    async def answer(
        self, question: str, history: Sequence[Turn], options: AnswerOptions
    ) -> AsyncIterator[Event]:
        """Stream the answer: citations first, text deltas, notices, and a final Stats."""
        start = time.perf_counter()
        stats = Stats(self.name, self.variant)
        self._live, self._live_bytes = (stats, start), None
        device = self.ctx.device
        answer = Answer(
            stats,
            start,
            Transcript(options.max_new_tokens, STOP_IDS),
            TextStream(device.tokenizer) if device is not None else None,
        )
        sent = SentLedger()
        stats.sent, self.ctx.sent = sent.rows, sent
        history = steering(question, history, device.tokenizer if device is not None else None)
        try:
            async for event in self.generate(question, history, options, answer):
                yield event
        finally:
            sent.close()  # what is sent from here on is no longer this answer's
            if self.ctx.sent is sent:
                self.ctx.sent = None
        transcript = answer.transcript
        stats.elapsed_s = time.perf_counter() - start
        stats.token_ids = list(transcript.tokens)
        stats.tokens = len(transcript.tokens)
        if stats.finish is None and transcript.finish is not None:
            stats.finish = transcript.finish.name.lower()
        yield stats

    @abstractmethod
    def generate(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        """The mode itself: commit tokens to `answer.transcript` and yield events."""

    async def private_prompt(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        """Retrieve private passages (yielding their citations) and build the device prompt
        into `answer.prompt` (yielding a notice if old exchanges were left out)."""
        passages = await retrieve_private(
            self.ctx.index,
            searched_by(question, history),
            options.k,
            options.min_score,
            options.scope,
        )
        for event in self.prompt_with(question, history, passages, options, answer):
            yield event

    def prompt_with(
        self,
        question: str,
        history: Sequence[Turn],
        passages: Sequence[Source],
        options: AnswerOptions,
        answer: Answer,
        *,
        withheld: bool = False,
    ) -> list[Event]:
        """Build the device prompt from these passages into `answer.prompt`: their citations,
        and notices (nothing relevant, unless the passages were `withheld`; old exchanges
        left out)."""
        events: list[Event] = list(passages)
        if not withheld and nothing_relevant(self.ctx.index, options.k, passages):
            events.append(Notice(NOTHING_PRIVATE))
        device = need_device(self.ctx)
        answer.prompt, notices = device_prompt(device, question, history, passages, options)
        return events + notices

    def live_stats(self) -> Stats | None:
        """A snapshot of the figures of the answer in progress (elapsed time and bytes so
        far), or of the last answer: the TUI's status bar polls it while text streams."""
        if self._live is None:
            return None
        stats, start = self._live
        snap = copy.copy(stats)
        if snap.finish is None:
            snap.elapsed_s = time.perf_counter() - start
        if self._live_bytes is not None and snap.finish is None:
            client, up0, down0 = self._live_bytes
            snap.bytes_up = client.bytes_up - up0
            snap.bytes_down = client.bytes_down - down0
        return snap

    async def close(self) -> None:  # noqa: B027 - most modes hold nothing to release
        """Release connections (models and indexes belong to the context)."""
