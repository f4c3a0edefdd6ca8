"""What the modes that talk to the cloud share: one session (websocket) per mode and variant,
opened on first use and reopened after a drop; one request per answer, cancelled if the
answer stops early; and, if the link breaks mid-answer, the device finishing the answer.

What a cloud may hold the device to is bounded per answer: the stall bound is time waited
without the answer advancing (frames of older requests, stale epochs or that change nothing
do not restart it), and at most MAX_CITATIONS of its sources are shown."""

from __future__ import annotations

import itertools
import logging
import time
from abc import abstractmethod
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import replace

from collab.protocol import Cancel, Citations, Done, Error, ErrorCode, Generate, Message, Mode
from edge_runtime.client import (
    CloudBusy,
    CloudClient,
    CloudError,
    CloudTimeout,
    CloudUnavailable,
    ConnectionLost,
)
from edge_runtime.device import NOTHING_PUBLIC
from edge_runtime.events import Citation, Event, Failure, Notice, Provenance
from edge_runtime.modes.base import (
    Answer,
    AnswerOptions,
    ModeContext,
    Orchestrator,
    Turn,
    cloud_history,
    device_generate,
    device_prompt,
    need_device,
)

log = logging.getLogger("tandem.edge.modes")

MAX_CITATIONS = Citations.MAX_SOURCES  # per answer: what one frame may carry, never more


class StallClock:
    """One answer's stall bound: seconds spent waiting on the cloud since the answer last
    advanced (`progress()` changed: a token committed, the end). Frames that do not advance
    it (an older request's, a stale epoch's, a repeated citation) do not restart it; the
    device's own work between waits does not count."""

    def __init__(self, bound_s: float | None, progress: Callable[[], Hashable]) -> None:
        self.bound_s, self.progress = bound_s, progress
        self.mark = progress()
        self.waited_s = 0.0
        self.frames = 0  # received since the answer last advanced

    def left(self) -> float | None:
        """Seconds the cloud has left to advance the answer (None: no bound)."""
        now = self.progress()
        if now != self.mark:
            self.mark, self.waited_s, self.frames = now, 0.0, 0
        return None if self.bound_s is None else self.bound_s - self.waited_s

    def expired(self) -> CloudTimeout:
        extra = (
            f" (it sent {self.frames} frames meanwhile, none advancing it)" if self.frames else ""
        )
        return CloudTimeout(f"no answer from the cloud within {self.bound_s:g} s{extra}")


class CloudBacked(Orchestrator):
    """A mode with a cloud side. Subclasses implement `converse` (the frames of one request)
    and may override `prepare` (device work before the request goes out)."""

    needs_cloud = True
    protocol_mode: Mode = Mode.CLOUD
    _request_ids = itertools.count(1)

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._cancelled: int | None = None  # a request we cancelled whose Done is pending
        self._clock: tuple[int, StallClock] | None = None  # the running request's
        self._cited = 0  # cloud sources shown for the running request
        self._cut = False  # and whether some were left out

    @property
    def retrieve_public(self) -> bool:
        """Whether the cloud grounds this mode's requests in its public corpus."""
        return self.ctx.retrieve_public

    async def generate(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        device = self.ctx.device
        stats = answer.stats
        client: CloudClient | None = None
        up0 = down0 = 0
        rid = next(self._request_ids)
        try:
            async for event in self.prepare(question, history, options, answer):
                yield event
            for last_try in (False, True):
                reused = self._open_client() is not None
                client = await self.client()
                up0, down0 = client.bytes_up, client.bytes_down
                self._live_bytes = (client, up0, down0)
                self._start_request(rid, answer)
                try:
                    await client.send(self.generate_message(rid, question, history, options))
                    yield Provenance(True, len(answer.transcript.tokens))
                    async for event in self.converse(client, rid, options, answer):
                        yield event
                    break
                except ConnectionLost as exc:
                    # A session kept from the last answer may have died since (the cloud's
                    # heartbeat, a NAT forgetting it) without this side noticing: open a new
                    # one and ask again, once, if nothing of this answer has come yet.
                    if last_try or not reused or answer.transcript.tokens:
                        raise
                    log.info("the cloud session had dropped (%s); reconnecting", exc)
        except CloudError as exc:
            answer.broken = True
            yield Provenance(False, len(answer.transcript.tokens))  # the rest the cloud never sees
            can_finish = self.ctx.finish_locally and device is not None
            yield Failure(
                f"{exc} (after {len(answer.transcript.tokens)} tokens)", recoverable=can_finish
            )
            if can_finish:
                async for event in self.finish_on_device(question, history, options, answer):
                    yield event
        finally:
            if client is not None and not (answer.finished or answer.broken) and client.connected:
                await self.cancel(client, rid)
        if client is not None:
            stats.bytes_up = client.bytes_up - up0
            stats.bytes_down = client.bytes_down - down0

    async def prepare(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        """Device work before the request goes out (none by default)."""
        return
        yield

    @abstractmethod
    def converse(
        self, client: CloudClient, rid: int, options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        """Exchange the frames of request `rid` until its Done (set `answer.finished`)."""

    # ---- the session ---------------------------------------------------------------------

    def _open_client(self) -> CloudClient | None:
        """This mode's session, if one is open (as far as this side knows)."""
        client = self.ctx.clients.get((self.protocol_mode, self.variant))
        return client if client is not None and client.connected else None

    async def client(self) -> CloudClient:
        if self.ctx.cloud is None:
            raise CloudUnavailable("no cloud is configured")
        key = (self.protocol_mode, self.variant)
        client = self._open_client()
        if client is not None:
            await self._drain(client)
            return client
        dropped = self.ctx.clients.pop(key, None)
        if dropped is not None:
            await dropped.close()  # its HTTP session, after the websocket went away
        device = need_device(self.ctx)
        client = CloudClient(
            self.ctx.cloud.url,
            self.ctx.cloud.token,
            self.protocol_mode,
            self.variant,
            device.tokenizer_hash,
            device.name,
            connect_timeout=self.ctx.cloud.connect_timeout_s,
            heartbeat_s=self.ctx.cloud.heartbeat_s,
            ca_file=self.ctx.cloud.ca_file,
            allow_insecure=self.ctx.cloud.allow_insecure,
        )
        await client.connect(retries=self.ctx.cloud.retries)
        self.ctx.clients[key] = client
        self._cancelled = None
        return client

    async def _drain(self, client: CloudClient) -> None:
        """Wait (briefly) for the Done of a request we cancelled, so the cloud is free."""
        rid, self._cancelled = self._cancelled, None
        if rid is None:
            return
        deadline = time.perf_counter() + 5.0
        while (left := deadline - time.perf_counter()) > 0:
            msg = await client.recv(timeout=left)
            if isinstance(msg, Done) and msg.request_id == rid:
                return

    def _start_request(self, rid: int, answer: Answer) -> None:
        """Per-request bounds: a fresh stall clock (progress: the answer's tokens, its end),
        no citations shown yet."""
        stall = self.ctx.cloud.stall_timeout_s if self.ctx.cloud is not None else None

        def progress() -> Hashable:
            return len(answer.transcript.tokens), answer.transcript.finish, answer.finished

        self._clock = (rid, StallClock(stall, progress))
        self._cited, self._cut = 0, False

    async def recv(self, client: CloudClient, rid: int) -> Message:
        """The next frame of request `rid` (frames of older requests are dropped); CloudTimeout
        once the cloud has been waited on for the stall bound without the answer advancing."""
        if self._clock is not None and self._clock[0] == rid:
            clock = self._clock[1]
        else:  # outside `generate`: the bound restarts with each call
            stall = self.ctx.cloud.stall_timeout_s if self.ctx.cloud is not None else None
            clock = StallClock(stall, lambda: None)
        while True:
            left = clock.left()
            if left is not None and left <= 0:
                raise clock.expired()
            t0 = time.perf_counter()
            try:
                msg = await client.recv(timeout=left)
            except CloudTimeout:
                continue  # the answer may have advanced meanwhile (the pipeline's drafting)
            finally:
                clock.waited_s += time.perf_counter() - t0
            clock.frames += 1
            if msg.request_id == rid or (isinstance(msg, Error) and msg.request_id == 0):
                return msg

    def cite(self, msg: Citations) -> list[Event]:
        """The cloud's public sources, numbered on from those already shown for this answer;
        past MAX_CITATIONS the rest are left out, with one notice."""
        shown = msg.sources[: max(0, MAX_CITATIONS - self._cited)]
        events: list[Event] = [
            replace(s, number=self._cited + n, side="cloud") for n, s in enumerate(shown, 1)
        ]
        self._cited += len(shown)
        if not msg.sources:  # the cloud searched its corpus and nothing passed its floor
            events.append(Notice(NOTHING_PUBLIC))
        if len(shown) < len(msg.sources) and not self._cut:
            self._cut = True
            events.append(Notice(f"the cloud sent more than {MAX_CITATIONS} sources for this "
                                 f"answer; only the first {MAX_CITATIONS} are shown"))  # fmt: skip
        return events

    async def cancel(self, client: CloudClient, rid: int) -> None:
        """Best effort: tell the cloud to stop; its Done is awaited before the next request."""
        try:
            await client.send(Cancel(request_id=rid))
            self._cancelled = rid
        except Exception:  # the link is gone: nothing to cancel
            self._cancelled = None

    def generate_message(
        self, rid: int, question: str, history: Sequence[Turn], options: AnswerOptions
    ) -> Generate:
        return Generate(
            question,
            max_new_tokens=options.max_new_tokens,
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            seed=options.seed,
            history=tuple(cloud_history(history)),
            retrieve=self.retrieve_public,
            request_id=rid,
        )

    async def close(self) -> None:
        key = (self.protocol_mode, self.variant)
        client = self.ctx.clients.pop(key, None)
        if client is not None:
            await client.close()

    async def finish_on_device(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        """After the cloud dropped: the device continues the same answer from its tokens."""
        device = need_device(self.ctx)
        yield Notice(f"finishing the answer on the device ({device.name})")
        ids, _ = device_prompt(device, question, history, (), options)
        ids += answer.transcript.tokens
        async for event in device_generate(device, ids, answer, options):
            yield event


def refusal(msg: Error) -> CloudError:
    """What an Error frame for the running request means to the user; the answer cannot go on
    in the cloud, so the device may finish it."""
    if msg.code == ErrorCode.EVICTED:
        return CloudError(f"the cloud dropped this answer's cache: {msg.message}")
    if msg.code in (ErrorCode.BUSY, ErrorCode.RATE_LIMITED):
        return CloudBusy(f"the cloud turned the question down: {msg.message}", None)
    return CloudError(f"the cloud refused: {msg.message}")


def citations_from(msg: Citations) -> list[Citation]:
    """The cloud's public sources, numbered in the order sent."""
    return [replace(s, number=n, side="cloud") for n, s in enumerate(msg.sources, 1)]
