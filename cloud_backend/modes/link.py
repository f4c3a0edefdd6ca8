"""One request as the cloud's loops see it: a narrow link (send, receive, cancel, and the
figures its Done reports), built once per request and handed to the mode's loop (the DRAGON
peer, the sequence-wise baseline), so that no loop needs the request object itself.

This is also the one place the cloud handles a request's frames from the device: a Cancel
stops the request (`Stop`); a frame of an older epoch or for another step than the loop is at
is dropped (the device sent it before it learned of a rejection); any other frame the loop did
not ask for is answered with a MALFORMED error and ignored."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, TypeVar

from collab.protocol import Cancel, Error, ErrorCode, FinishReason, Limits, Message

if TYPE_CHECKING:
    from cloud_backend.context import RequestContext

log = logging.getLogger("tandem.cloud")

M = TypeVar("M", bound=Message)


class Stop(Exception):
    """Ends a request early with this reason (a cancel, an error already reported)."""

    def __init__(self, reason: FinishReason) -> None:
        self.reason = reason


class RequestLink:
    """Request `rid` of the session `ctx`. `ping_every_s`: re-measure the round trip at most
    this often as the loop's frames come (DRAGON's scheduler weighs it); None: never."""

    def __init__(self, ctx: RequestContext, rid: int, ping_every_s: float | None = None) -> None:
        self.ctx, self.rid, self.ping_every_s = ctx, rid, ping_every_s
        self._last_ping = 0.0

    # ---- figures ---------------------------------------------------------------------------
    def traffic(self) -> tuple[int, int]:
        """(bytes up, bytes down) of this request so far."""
        return self.ctx.traffic()

    @property
    def limits(self) -> Limits:
        return self.ctx.limits

    def rtt(self) -> float | None:
        """The session's measured round trip in seconds, if any."""
        return self.ctx.rtt()

    # ---- frames ----------------------------------------------------------------------------
    async def send(self, msg: Message) -> None:
        await self.ctx.send(msg)

    async def error(self, code: ErrorCode, message: str) -> None:
        """Tell the device what was wrong with a frame of this request."""
        await self.send(Error(code, message, request_id=self.rid))

    async def recv(
        self, *kinds: type[M], at: tuple[int, int] | None = None, what: str | None = None
    ) -> M:
        """The request's next frame of one of `kinds`; with `at` (epoch, step), only a frame
        of that epoch and step (others are stale: dropped). `what` names what is expected in
        the error a frame of another kind gets."""
        while True:
            msg = await self.ctx.inbox.get()
            if isinstance(msg, Cancel):
                raise Stop(FinishReason.CANCELLED)
            if at is not None and (msg.epoch, msg.step) != at:
                log.info(
                    "request=%d stale frame %s epoch=%d step=%d (now %d/%d) dropped",
                    self.rid,
                    type(msg).__name__,
                    msg.epoch,
                    msg.step,
                    *at,
                )
                continue
            if isinstance(msg, kinds):
                await self.ping()
                return msg
            expected = what or " or ".join(kind.__name__ for kind in kinds)
            await self.error(
                ErrorCode.MALFORMED, f"expected {expected}, got {type(msg).__name__}; ignored"
            )

    def ended(self, msg: Message) -> bool:
        """No frame from the device ends a request (its Cancel raises `Stop`)."""
        return False

    def empty(self) -> bool:
        """Whether nothing from the device is waiting."""
        return self.ctx.inbox.empty()

    def check_cancel(self) -> None:
        """Stop on a Cancel; every other frame stays queued, in order, for after this decoding
        (a device under AS² asks for its next tokens before the first one arrives)."""
        if self.ctx.inbox.cancelled:
            raise Stop(FinishReason.CANCELLED)

    async def ping(self) -> None:
        """Re-measure the round trip, at most every `ping_every_s`."""
        every, ping = self.ping_every_s, self.ctx.ping
        if every is not None and ping is not None and time.perf_counter() - self._last_ping > every:
            self._last_ping = time.perf_counter()
            await ping()
