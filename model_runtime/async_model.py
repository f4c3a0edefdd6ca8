"""A `CausalLM` driven from asyncio, written once for the device and the cloud.

Model steps run off the event loop (ONNX Runtime and torch release the GIL), so it keeps
streaming, receiving frames and answering cancels while the model computes. An
`AsyncSequence` is a model's sequences fed, rolled back and cancelled; how a step reaches the
model is its subclass's business (the device runs it on its own worker, `WorkerSequence`; the
cloud batches it with other sessions' steps). A `DocumentBatch` steps several sequences of one
`AsyncSequence` together: one per retrieved document, as DRAGON decodes."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from model_runtime.runtime import CausalLM

T = TypeVar("T")


class ModelWorker:
    """The one thread a model's steps run on, one at a time."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class AsyncSequence(ABC):
    """A model's sequences (one, or one per document), stepped from the event loop."""

    @abstractmethod
    async def feed(
        self, kind: str, rows: Sequence[Sequence[int]], *, fresh: bool = False,
        last_only: bool = False,
    ) -> np.ndarray:  # fmt: skip
        """`CausalLM.feed` on these sequences: logits [B, K, V]. `kind` (prefill, decode,
        verify) names the step for metrics."""

    @abstractmethod
    async def rewind(self, lengths: int | Sequence[int]) -> None:
        """`CausalLM.rollback`: every sequence to `lengths` (one, or one each)."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop this sequence's model step in flight (it raises `Cancelled`)."""

    async def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Start a fresh sequence; next-token logits [V]."""
        logits = await self.feed("prefill", [ids], fresh=True, last_only=True)
        first: np.ndarray = logits[0, 0]
        return first

    async def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Feed tokens; logits at every fed position, [T, V] (verification of γ+1 positions)."""
        logits = await self.feed("decode" if len(ids) == 1 else "verify", [ids])
        rows: np.ndarray = logits[0]
        return rows

    async def rollback(self, length: int) -> None:
        await self.rewind(length)


class WorkerSequence(AsyncSequence):
    """An `AsyncSequence` whose steps run on its own worker thread, as they come (the
    device's model)."""

    lm: CausalLM
    _worker: ModelWorker

    async def step(self, kind: str, n: int, fn: Callable[[], T]) -> T:
        """Run `fn` (a model call on `lm`) on the worker: `kind` and `n` (positions fed) say
        what it is, for subclasses that time or slow steps."""
        return await self._worker.run(fn)

    async def feed(
        self, kind: str, rows: Sequence[Sequence[int]], *, fresh: bool = False,
        last_only: bool = False,
    ) -> np.ndarray:  # fmt: skip
        batch = [list(row) for row in rows]
        return await self.step(
            kind, sum(map(len, batch)),
            lambda: self.lm.feed(batch, fresh=fresh, last_only=last_only),
        )  # fmt: skip

    async def rewind(self, lengths: int | Sequence[int]) -> None:
        await self.step("rollback", 0, lambda: self.lm.rollback(lengths))


class DocumentBatch:
    """One sequence per document, [d; question; answer so far], fed the same answer tokens in
    one batched step (DRAGON's per-document decoding, docs/math.md#dragon). Prompts differ in
    length;
    the runtime pads them, and a rewind rolls each back to its own prompt plus the answer."""

    def __init__(self, seq: AsyncSequence) -> None:
        self.seq = seq
        self.prompt_lengths: list[int] = []
        self.answer_tokens = 0

    @property
    def size(self) -> int:
        return len(self.prompt_lengths)

    async def start(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Prefill every document's prompt; next-token logits [D, V]."""
        logits = await self.seq.feed("prefill", prompts, fresh=True, last_only=True)
        self.prompt_lengths, self.answer_tokens = [len(p) for p in prompts], 0
        return logits[:, 0]

    async def advance(self, token: int) -> np.ndarray:
        """Feed one answer token to every sequence; next-token logits [D, V]."""
        logits = await self.seq.feed("decode", [[token]] * self.size, last_only=True)
        self.answer_tokens += 1
        return logits[:, 0]

    async def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed the same answer tokens to every sequence in one step (teacher forcing);
        logits at every fed position, [D, T, V]."""
        logits = await self.seq.feed("verify", [list(tokens)] * self.size)
        self.answer_tokens += len(tokens)
        return logits

    async def rewind(self, answer_tokens: int) -> None:
        await self.seq.rewind([p + answer_tokens for p in self.prompt_lengths])
        self.answer_tokens = answer_tokens

    def cancel(self) -> None:
        self.seq.cancel()
