"""The answer modes behind one interface: `answer(question, history, options)` streams events.

Every mode is registered in `MODES` under the name the user picks (CLI `--mode`, TUI
switcher), so a mode added later shows up everywhere through this one table. A mode builds
its own prompt, decides what may leave the device, and reports figures as `Stats`.

What each mode sends (DESIGN §1, the invariant): local sends nothing; cloud sends the question
and the cloud-visible history; split sends the question, that history, drafted token ids and
draft probabilities. Private passages only ever enter the device model's prompt. Earlier turns
answered in local mode may rest on private text, so they are never sent."""

from __future__ import annotations

import copy
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from collab.protocol import (
    Cancel,
    Citations,
    Done,
    Error,
    FinishReason,
    Generate,
    Message,
    Mode,
    TokenChunk,
)
from collab.sampling import SamplingParams, sample
from collab.split import Transcript
from edge_runtime.device import EXCERPT_CHARS, DeviceModel, Retriever, retrieve_private
from edge_runtime.events import Citation, Event, Failure, Notice, Stats, TextDelta
from model_runtime.generate import TextStream
from model_runtime.prompting import Passage, fit_prompt, prompt_budget
from model_runtime.tokenizer import IM_END_ID

STOP_IDS = frozenset({IM_END_ID})


@dataclass(frozen=True)
class Turn:
    """One finished exchange and the mode that answered it."""

    question: str
    answer: str
    mode: str


@dataclass(frozen=True)
class AnswerOptions:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    k: int = 3  # private passages retrieved
    min_score: float | None = None

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


@dataclass
class CloudSettings:
    """Where the cloud is and how to reach it."""

    url: str
    token: str
    connect_timeout_s: float = 10.0
    retries: int = 2


@dataclass
class ModeContext:
    """What the modes share: the device model, the private index, the cloud link."""

    device: DeviceModel | None = None
    index: Retriever | None = None
    cloud: CloudSettings | None = None
    variant: str = "tk-slt"
    finish_locally: bool = True  # if the cloud drops mid-answer, the device finishes it
    retrieve_public: bool = True  # cloud mode grounds the cloud in its public corpus
    split_retrieve_public: bool = False  # split: the cloud verifies with the bare question
    clients: dict[tuple[Mode, str], object] = field(default_factory=dict)


def full_history(history: Sequence[Turn]) -> list[str]:
    return [text for turn in history for text in (turn.question, turn.answer)]


def device_prompt(
    device: DeviceModel, question: str, history: Sequence[Turn], passages: Sequence[Passage],
    options: AnswerOptions,
) -> tuple[list[int], list[Notice]]:  # fmt: skip
    """The device model's prompt, the oldest exchanges left out if the conversation outgrew
    its context (and a notice saying so)."""
    budget = prompt_budget(device.lm.max_context, options.max_new_tokens)
    ids, dropped = fit_prompt(device.tokenizer, question, full_history(history), passages, budget)
    if not dropped:
        return ids, []
    what = "exchange" if dropped == 1 else "exchanges"
    notice = Notice(
        f"the {dropped} oldest {what} left out: the conversation is longer than the device "
        f"model's context ({device.lm.max_context} tokens)"
    )
    return ids, [notice]


def cloud_history(history: Sequence[Turn]) -> list[str]:
    """The turns the cloud may see: never those answered locally (they may quote private
    documents)."""
    return full_history([t for t in history if t.mode != "local"])


class Orchestrator(ABC):
    name: str = ""
    needs_cloud: bool = False
    description: str = ""

    def __init__(self, ctx: ModeContext) -> None:
        self.ctx = ctx
        self._live: tuple[Stats, float] | None = None
        self._live_bytes: tuple[object, int, int] | None = None

    def _track(self, stats: Stats, start: float) -> None:
        """Make `stats` the answer in progress that `live_stats` reports."""
        self._live, self._live_bytes = (stats, start), None

    def _track_bytes(self, client, up0: int, down0: int) -> None:
        self._live_bytes = (client, up0, down0)

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

    @abstractmethod
    def answer(
        self, question: str, history: Sequence[Turn], options: AnswerOptions
    ) -> AsyncIterator[Event]:
        """Stream the answer: citations first, text deltas, notices, and a final Stats."""

    async def close(self) -> None:  # noqa: B027 - most modes hold nothing to release
        """Release connections (models and indexes belong to the context)."""


# ---------------------------------------------------------------------------- device side


async def device_generate(
    device: DeviceModel,
    ids: list[int],
    transcript: Transcript,
    stream: TextStream,
    options: AnswerOptions,
    stats: Stats,
    start: float,
) -> AsyncIterator[Event]:
    """Plain decoding on the device from a fresh prefill of `ids` until the transcript ends
    (stop token, length, or the context limit)."""
    rng = np.random.default_rng(options.seed)
    logits = await device.prefill(ids)
    room = device.lm.max_context - device.length
    while transcript.finish is None:
        token, _ = sample(logits, rng, options.sampling)
        kept = transcript.commit([token])
        for t in kept:
            if stats.ttft_s is None:
                stats.ttft_s = time.perf_counter() - start
            if text := stream.push(t):
                yield TextDelta(text)
        stats.tokens = len(transcript.tokens)
        if transcript.finish is None:
            if room <= 1:
                transcript.finish = FinishReason.LENGTH
                break
            logits = (await device.forward([token]))[-1]
            room -= 1


class LocalMode(Orchestrator):
    """Private retrieval + the device model. Opens no socket."""

    name = "local"
    description = "device model + private documents; works offline"

    async def answer(
        self, question: str, history: Sequence[Turn], options: AnswerOptions
    ) -> AsyncIterator[Event]:
        device = _need_device(self.ctx)
        start = time.perf_counter()
        stats = Stats(self.name)
        self._track(stats, start)
        passages, citations = await retrieve_private(
            self.ctx.index, question, options.k, options.min_score
        )
        for c in citations:
            yield c
        ids, notices = device_prompt(device, question, history, passages, options)
        for notice in notices:
            yield notice
        transcript = Transcript(options.max_new_tokens, STOP_IDS)
        async for event in device_generate(
            device, ids, transcript, TextStream(device.tokenizer), options, stats, start
        ):
            yield event
        stats.elapsed_s = time.perf_counter() - start
        stats.token_ids = list(transcript.tokens)
        stats.finish = transcript.finish.name.lower() if transcript.finish else None
        yield stats


def _need_device(ctx: ModeContext) -> DeviceModel:
    if ctx.device is None:
        raise RuntimeError("the device model is not loaded")
    return ctx.device


# ---------------------------------------------------------------------------- cloud link


class CloudBacked(Orchestrator):
    """Shared by the modes that talk to the cloud: one session (websocket) per mode and
    variant, opened on first use and reopened after a drop."""

    needs_cloud = True
    protocol_mode: Mode = Mode.CLOUD
    _request_ids = itertools.count(1)

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._cancelled: int | None = None  # a request we cancelled whose Done is pending

    @property
    def variant(self) -> str:
        return ""

    async def client(self):
        from edge_runtime.client import CloudClient, CloudUnavailable

        if self.ctx.cloud is None:
            raise CloudUnavailable("no cloud is configured")
        key = (self.protocol_mode, self.variant)
        client = self.ctx.clients.get(key)
        if client is not None and client.connected:
            await self._drain(client)
            return client
        device = _need_device(self.ctx)
        client = CloudClient(
            self.ctx.cloud.url,
            self.ctx.cloud.token,
            self.protocol_mode,
            self.variant,
            device.tokenizer_hash,
            device.name,
            connect_timeout=self.ctx.cloud.connect_timeout_s,
        )
        await client.connect(retries=self.ctx.cloud.retries)
        self.ctx.clients[key] = client
        self._cancelled = None
        return client

    async def _drain(self, client) -> None:
        """Wait (briefly) for the Done of a request we cancelled, so the cloud is free."""
        rid, self._cancelled = self._cancelled, None
        if rid is None:
            return
        deadline = time.perf_counter() + 5.0
        while (left := deadline - time.perf_counter()) > 0:
            msg = await client.recv(timeout=left)
            if isinstance(msg, Done) and msg.request_id == rid:
                return

    async def recv(self, client, rid: int) -> Message:
        """The next frame of request `rid` (frames of older requests are dropped)."""
        while True:
            msg = await client.recv()
            if msg.request_id == rid or (isinstance(msg, Error) and msg.request_id == 0):
                return msg

    async def cancel(self, client, rid: int) -> None:
        """Best effort: tell the cloud to stop; its Done is awaited before the next request."""
        try:
            await client.send(Cancel(request_id=rid))
            self._cancelled = rid
        except Exception:  # the link is gone: nothing to cancel
            self._cancelled = None

    def generate_message(
        self, rid: int, question: str, history: Sequence[Turn], options: AnswerOptions,
        retrieve: bool,
    ) -> Generate:  # fmt: skip
        return Generate(
            question,
            max_new_tokens=options.max_new_tokens,
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            seed=options.seed,
            history=tuple(cloud_history(history)),
            retrieve=retrieve,
            request_id=rid,
        )

    async def close(self) -> None:
        key = (self.protocol_mode, self.variant)
        client = self.ctx.clients.pop(key, None)
        if client is not None:
            await client.close()

    async def finish_on_device(
        self,
        question: str,
        history: Sequence[Turn],
        transcript: Transcript,
        stream: TextStream,
        options: AnswerOptions,
        stats: Stats,
        start: float,
    ) -> AsyncIterator[Event]:
        """After the cloud dropped: the device continues the same answer from its tokens."""
        device = _need_device(self.ctx)
        yield Notice(f"finishing the answer on the device ({device.name})")
        ids, _ = device_prompt(device, question, history, (), options)
        ids += transcript.tokens
        async for event in device_generate(device, ids, transcript, stream, options, stats, start):
            yield event


def citations_from(msg: Citations) -> list[Citation]:
    return [
        Citation(
            n, "cloud", s.title, s.location, s.score, s.excerpt[:EXCERPT_CHARS], text=s.excerpt
        )
        for n, s in enumerate(msg.sources, 1)
    ]


class CloudMode(CloudBacked):
    """The cloud model answers from its public corpus; only the question (and the history the
    cloud may see) leaves the device."""

    name = "cloud"
    description = "cloud model + public corpus; private documents never sent"
    protocol_mode = Mode.CLOUD

    async def answer(
        self, question: str, history: Sequence[Turn], options: AnswerOptions
    ) -> AsyncIterator[Event]:
        from edge_runtime.client import CloudError

        start = time.perf_counter()
        stats = Stats(self.name)
        self._track(stats, start)
        device = self.ctx.device
        tokenizer = device.tokenizer if device else None
        transcript = Transcript(options.max_new_tokens, STOP_IDS)
        stream = TextStream(tokenizer) if tokenizer else None
        rid = next(self._request_ids)
        client = None
        up0 = down0 = 0
        finished = False
        try:
            client = await self.client()
            up0, down0 = client.bytes_up, client.bytes_down
            self._track_bytes(client, up0, down0)
            await client.send(self.generate_message(rid, question, history, options,
                                                    self.ctx.retrieve_public))  # fmt: skip
            while True:
                msg = await self.recv(client, rid)
                if isinstance(msg, Citations):
                    for c in citations_from(msg):
                        yield c
                elif isinstance(msg, TokenChunk):
                    for t in transcript.commit(msg.token_ids.tolist()):
                        if stats.ttft_s is None:
                            stats.ttft_s = time.perf_counter() - start
                        if stream and (text := stream.push(t)):
                            yield TextDelta(text)
                    stats.tokens = len(transcript.tokens)
                elif isinstance(msg, Error):
                    yield Failure(f"the cloud refused: {msg.message}")
                elif isinstance(msg, Done):
                    stats.finish = msg.reason.name.lower()
                    finished = True
                    break
        except CloudError as exc:
            yield Failure(str(exc), recoverable=self.ctx.finish_locally and device is not None)
            if self.ctx.finish_locally and device is not None and stream is not None:
                async for event in self.finish_on_device(
                    question, history, transcript, stream, options, stats, start
                ):
                    yield event
                stats.finish = transcript.finish.name.lower() if transcript.finish else None
        finally:
            if client is not None and not finished and client.connected:
                await self.cancel(client, rid)
        if client is not None:
            stats.bytes_up = client.bytes_up - up0
            stats.bytes_down = client.bytes_down - down0
        stats.elapsed_s = time.perf_counter() - start
        stats.token_ids = list(transcript.tokens)
        stats.tokens = len(transcript.tokens)
        yield stats


def _register() -> dict[str, type[Orchestrator]]:
    from edge_runtime.split_mode import SplitMode

    return {m.name: m for m in (LocalMode, CloudMode, SplitMode)}


MODES: dict[str, type[Orchestrator]] = {}


def modes() -> dict[str, type[Orchestrator]]:
    """Every mode by name (local, cloud, split, and any added later)."""
    if not MODES:
        MODES.update(_register())
    return MODES


def build_mode(name: str, ctx: ModeContext) -> Orchestrator:
    try:
        return modes()[name](ctx)
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; choose one of {', '.join(modes())}") from None
