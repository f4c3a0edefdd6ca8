"""Many short answers at once, for the statistical tests: each worker is its own session with
its own device model (a device model holds one sequence), the seeds are shared out among them,
and the results come back in seed order. The cloud batches the sessions' steps, as it does for
people using it together, so the law is checked under concurrency too; and the test takes a
fraction of the time one session at a time would."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

W = TypeVar("W")
T = TypeVar("T")

WORKERS = 4


async def by_seed(
    workers: Sequence[W], seeds: range, answer: Callable[[W, int], Awaitable[T]]
) -> list[T]:
    """`answer(worker, seed)` for every seed, the workers in parallel; results by seed."""
    results: dict[int, T] = {}

    async def work(worker: W, mine: range) -> None:
        for seed in mine:
            results[seed] = await answer(worker, seed)

    await asyncio.gather(*(work(w, seeds[i :: len(workers)]) for i, w in enumerate(workers)))
    return [results[seed] for seed in seeds]
