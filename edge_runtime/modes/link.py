"""One cloud request as the device's loops see it: a narrow link (send, receive, cancel, and
the figures the answer reports), built once per request by `CloudBacked.generate` and handed
to the mode's loop, so that no loop (cloud mode's, split's stop-and-wait and pipelined rounds,
the DRAGON peer) needs the mode itself.

This is also the one place the device handles a request's frames: frames of older requests are
dropped; the stall bound (`StallClock`) is kept; Citations become events, numbered on and at
most MAX_CITATIONS; an Error frame raises what it means to the user (`refusal`); a frame the
loop did not ask for is a CloudError; and Done, when the loop takes it (`ended`), closes the
answer."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from collab.protocol import Cancel, Citations, Done, Error, ErrorCode, Limits, Message
from edge_runtime.client import CloudBusy, CloudClient, CloudError, CloudTimeout
from edge_runtime.device import NOTHING_PUBLIC
from edge_runtime.events import Event, Notice
from edge_runtime.modes.base import Answer

if TYPE_CHECKING:
    from typing_extensions import TypeIs

MAX_CITATIONS = Citations.MAX_SOURCES  # per answer: what one frame may carry, never more

M = TypeVar("M", bound=Message)


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


class CitationCount:
    """The cloud's public sources of one answer, numbered on from those already shown; past
    MAX_CITATIONS the rest are left out, with one notice."""

    def __init__(self) -> None:
        self.shown = 0
        self.cut = False

    def cite(self, msg: Citations) -> list[Event]:
        shown = msg.sources[: max(0, MAX_CITATIONS - self.shown)]
        events: list[Event] = [
            replace(s, number=self.shown + n, side="cloud") for n, s in enumerate(shown, 1)
        ]
        self.shown += len(shown)
        if not msg.sources:  # the cloud searched its corpus and nothing passed its floor
            events.append(Notice(NOTHING_PUBLIC))
        if len(shown) < len(msg.sources) and not self.cut:
            self.cut = True
            events.append(
                Notice(
                    f"the cloud sent more than {MAX_CITATIONS} sources for this "
                    f"answer; only the first {MAX_CITATIONS} are shown"
                )
            )
        return events


class RequestLink:
    """Request `rid` over `client`, for `answer`. Per-request state lives here: the stall
    clock, the citations shown, events waiting to be yielded, a frame put back."""

    def __init__(self, client: CloudClient, rid: int, answer: Answer, stall_s: float | None):
        self.client, self.rid, self.answer = client, rid, answer
        self.up0, self.down0 = client.bytes_up, client.bytes_down

        def progress() -> Hashable:
            return len(answer.transcript.tokens), answer.transcript.finish, answer.finished

        self.clock = StallClock(stall_s, progress)
        self.citations = CitationCount()
        self.events: list[Event] = []  # citations (and their notices) not yielded yet
        self._held: list[Message] = []  # frames a loop received ahead and put back

    # ---- figures ---------------------------------------------------------------------------
    @property
    def bytes_up(self) -> int:
        """Bytes this request sent so far."""
        return self.client.bytes_up - self.up0

    @property
    def bytes_down(self) -> int:
        return self.client.bytes_down - self.down0

    @property
    def limits(self) -> Limits:
        """What the cloud said it accepts (the most drafts in a batch, ...)."""
        return self.client.limits

    def rtt(self) -> float | None:
        """The measured round trip in seconds, if any."""
        return self.client.rtt_s

    # ---- frames ----------------------------------------------------------------------------
    async def send(self, msg: Message) -> int:
        """Send one frame of this request; its size on the wire."""
        up0 = self.client.bytes_up
        await self.client.send(msg)
        return self.client.bytes_up - up0

    async def recv(self, *kinds: type[M]) -> M | Done:
        """The request's next frame of one of `kinds`, or its Done (taken with `ended`).
        Citations on the way become `events`; an Error frame raises `refusal`; any other
        frame is a CloudError; CloudTimeout once the cloud has been waited on for the stall
        bound without the answer advancing."""
        while True:
            msg = self._held.pop(0) if self._held else await self._next()
            if isinstance(msg, Citations):
                self.events.extend(self.citations.cite(msg))
            elif isinstance(msg, (Done, *kinds)):
                return msg  # type: ignore[return-value]  # one of `kinds`
            elif isinstance(msg, Error):
                raise refusal(msg)
            else:
                raise CloudError(f"unexpected {type(msg).__name__} from the cloud")

    def unread(self, msg: Message) -> None:
        """Put back a frame received ahead of its reader: the next `recv` returns it first."""
        self._held.append(msg)

    def ended(self, msg: Message) -> TypeIs[Done]:
        """Whether `msg` is the request's Done; if so the answer is closed: finished, its
        reason in the figures and, if the device had not ended it, in the transcript."""
        if not isinstance(msg, Done):
            return False
        answer = self.answer
        answer.finished = True
        answer.stats.finish = msg.reason.name.lower()
        if answer.transcript.finish is None:  # the cloud ended it (context limit, cancel, error)
            answer.transcript.finish = msg.reason
        return True

    def take_events(self) -> list[Event]:
        """The events (citations, notices) received since the last call."""
        out, self.events = self.events, []
        return out

    async def cancel(self) -> bool:
        """Best effort: tell the cloud to stop; whether the Cancel went out (its Done is then
        awaited before the session's next request)."""
        try:
            await self.client.send(Cancel(request_id=self.rid))
            return True
        except Exception:  # the link is gone: nothing to cancel
            return False

    async def _next(self) -> Message:
        """The next frame of this request (or an Error about the session, request id 0)."""
        clock = self.clock
        while True:
            left = clock.left()
            if left is not None and left <= 0:
                raise clock.expired()
            t0 = time.perf_counter()
            try:
                msg = await self.client.recv(timeout=left)
            except CloudTimeout:
                continue  # the answer may have advanced meanwhile (the pipeline's drafting)
            finally:
                clock.waited_s += time.perf_counter() - t0
            clock.frames += 1
            if msg.request_id == self.rid or (isinstance(msg, Error) and msg.request_id == 0):
                return msg


def refusal(msg: Error) -> CloudError:
    """What an Error frame for the running request means to the user; the answer cannot go on
    in the cloud, so the device may finish it."""
    if msg.code == ErrorCode.EVICTED:
        return CloudError(f"the cloud dropped this answer's cache: {msg.message}")
    if msg.code in (ErrorCode.BUSY, ErrorCode.RATE_LIMITED):
        return CloudBusy(f"the cloud turned the question down: {msg.message}", None)
    return CloudError(f"the cloud refused: {msg.message}")
