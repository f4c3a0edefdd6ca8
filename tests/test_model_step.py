"""`collab.model_step.ModelStep`: the one model step in flight that the split pipeline and the
DRAGON peer start, cut short on a rejection, and await."""

from __future__ import annotations

import asyncio

import pytest

from collab.model_step import ModelStep


class Model:
    """A model whose step runs until it is preempted (the runtimes' cancel makes it raise)."""

    def __init__(self) -> None:
        self.started = 0
        self.preempted = 0
        self.release = asyncio.Event()

    def cancel(self) -> None:
        self.preempted += 1
        self.release.set()

    async def step(self, value: int) -> int:
        self.started += 1
        await self.release.wait()
        if self.preempted:
            raise RuntimeError("preempted")
        return value * 2


async def test_a_step_runs_in_flight_and_its_result_comes_with_its_time() -> None:
    model = Model()
    step: ModelStep[int] = ModelStep(model.cancel)
    step.start(lambda: model.step(21))
    assert step.running
    await asyncio.sleep(0)
    assert model.started == 1  # runs while the caller goes on
    model.release.set()
    value, seconds = await step.result()
    assert value == 42 and seconds >= 0
    assert not step.running and model.preempted == 0


async def test_a_rejection_cuts_the_running_step_short_and_its_error_is_not_raised() -> None:
    model = Model()
    step: ModelStep[int] = ModelStep(model.cancel)
    step.start(lambda: model.step(1))
    await asyncio.sleep(0)  # the model is mid-step
    await step.stop()
    assert model.preempted == 1 and not step.running
    step.start(lambda: model.step(2))  # the next step may start at once


async def test_a_step_only_scheduled_never_starts() -> None:
    model = Model()
    step: ModelStep[int] = ModelStep(model.cancel)
    step.start(lambda: model.step(1))
    await step.stop()  # before the event loop ever ran it
    assert model.started == 0


async def test_finish_lets_a_valid_step_end_and_drops_its_result() -> None:
    model = Model()
    step: ModelStep[int] = ModelStep(model.cancel)
    step.start(lambda: model.step(1))
    await asyncio.sleep(0)
    stopping = asyncio.ensure_future(step.stop(finish=True))
    await asyncio.sleep(0)
    assert not stopping.done()  # waits for the step, which is not preempted
    model.release.set()
    await stopping
    assert model.preempted == 0 and model.started == 1 and not step.running


async def test_a_failing_step_raises_where_it_is_taken() -> None:
    async def broken() -> int:
        raise ValueError("the model broke")

    step: ModelStep[int] = ModelStep(lambda: None)
    step.start(broken)
    with pytest.raises(ValueError, match="the model broke"):
        await step.result()
    assert not step.running


async def test_one_step_at_a_time_and_nothing_to_take_without_one() -> None:
    model = Model()
    step: ModelStep[int] = ModelStep(model.cancel)
    with pytest.raises(RuntimeError):
        step.take()
    await step.stop()  # nothing in flight: nothing to do
    step.start(lambda: model.step(1))
    with pytest.raises(RuntimeError, match="already in flight"):
        step.start(lambda: model.step(2))
    with pytest.raises(RuntimeError):
        step.take()  # not finished yet
    assert step.running  # and still in flight
    await step.stop()
    assert model.preempted == 1


async def test_race_returns_whichever_of_the_frame_and_the_step_ends_first() -> None:
    step: ModelStep[int] = ModelStep(lambda: None)
    frame: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    step.start(lambda: asyncio.sleep(0.01, result=7))
    done = await step.race(frame)
    assert done == {step.future} and step.take()[0] == 7
    frame.set_result("verdict")
    assert await step.race(frame) == {frame}  # no step in flight: the frame alone
