"""One model step in flight, on either side: the split pipeline (device) and the DRAGON peer
(device and cloud) decode ahead in a task while they wait for the other side's frames, and a
rejection that arrives meanwhile makes that step worthless. Starting it, timing it, cutting it
short and awaiting it are the same on every loop; this is the one place they are written."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class ModelStep(Generic[T]):
    """At most one step running at a time. `preempt` is the runtime's cancel: it stops a step
    the model is already running (which then raises); cancelling the task as well keeps a step
    that is only scheduled from ever starting (otherwise it would cost a whole decode)."""

    def __init__(self, preempt: Callable[[], None]) -> None:
        self.preempt = preempt
        self.future: asyncio.Future[tuple[T, float]] | None = None  # the step, while in flight

    @property
    def running(self) -> bool:
        return self.future is not None

    def start(self, step: Callable[[], Awaitable[T]]) -> None:
        """Run `step()` in a task; its result comes with the seconds it took."""
        if self.future is not None:
            raise RuntimeError("a model step is already in flight")

        async def timed() -> tuple[T, float]:
            t0 = time.perf_counter()
            result = await step()
            return result, time.perf_counter() - t0

        self.future = asyncio.ensure_future(timed())

    def take(self) -> tuple[T, float]:
        """The finished step's result and seconds (its exception, if it raised)."""
        future = self.future
        if future is None or not future.done():
            raise RuntimeError("no finished model step to take")
        self.future = None
        return future.result()

    async def race(self, other: asyncio.Future[Any]) -> set[asyncio.Future[Any]]:
        """Wait until `other` (a frame from the link) or the step in flight is done, whichever
        comes first; the done ones. With no step in flight, wait for `other` alone."""
        waiting: set[asyncio.Future[Any]] = {other}
        if self.future is not None:
            waiting.add(self.future)
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        return done

    async def result(self) -> tuple[T, float]:
        """Await the step in flight and take its result."""
        if self.future is None:
            raise RuntimeError("no model step in flight")
        await asyncio.wait([self.future])
        return self.take()

    async def stop(self, finish: bool = False) -> None:
        """Drop the step in flight: preempt it (or, `finish`, let it end: it feeds a token
        that stays valid) and wait until it has let go of the model. Its result is dropped and
        the error a preempted step raises is expected, so it is retrieved, never raised."""
        future, self.future = self.future, None
        if future is None:
            return
        if not future.done() and not finish:
            self.preempt()  # stops a step the model is running
            future.cancel()  # and one not started yet never starts
        await asyncio.wait([future])
        if not future.cancelled():
            future.exception()
