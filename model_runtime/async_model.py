"""A `CausalLM` driven from asyncio, written once for the device and the cloud.

Model steps run on one worker thread (ONNX Runtime and torch release the GIL), so the event
loop keeps streaming, receiving frames and answering cancels while the model computes. An
`AsyncSequence` is one sequence's prefill / forward / rollback; how a step reaches the model is
its subclass's business (the device runs it as is; the cloud swaps the session's KV cache in
and out around it). A `DocumentBatch` steps several sequences of one `AsyncSequence` together:
one per retrieved document, as DRAGON decodes."""

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
    """One sequence of a model, stepped from the event loop."""

    lm: CausalLM

    @abstractmethod
    async def step(self, kind: str, n: int, fn: Callable[[], T]) -> T:
        """Run `fn` (a model call) for this sequence: `kind` is prefill, decode, verify or
        rollback, `n` the positions fed."""

    async def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Start a fresh sequence; next-token logits [V]."""
        return await self.step("prefill", len(ids), lambda: self.lm.prefill([list(ids)])[0])

    async def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Feed tokens; logits at every fed position, [T, V] (verification of γ+1 positions)."""
        kind = "decode" if len(ids) == 1 else "verify"
        return await self.step(kind, len(ids), lambda: self.lm.forward([list(ids)])[0])

    async def rollback(self, length: int) -> None:
        await self.step("rollback", 0, lambda: self.lm.rollback(length))

    @abstractmethod
    def cancel(self) -> None:
        """Stop this sequence's model step in flight (it raises `Cancelled`)."""


class DocumentBatch:
    """One sequence per document, [d; question; answer so far], fed the same answer tokens in
    one batched step (DRAGON's per-document decoding, DESIGN §5.5). Prompts differ in length;
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
        batch = [list(p) for p in prompts]
        logits = await self.seq.step(
            "prefill", sum(map(len, batch)), lambda: self.seq.lm.prefill(batch)
        )
        self.prompt_lengths, self.answer_tokens = [len(p) for p in batch], 0
        return logits

    async def advance(self, token: int) -> np.ndarray:
        """Feed one answer token to every sequence; next-token logits [D, V]."""
        n = self.size
        logits = await self.seq.step("decode", n, lambda: self.seq.lm.decode([token] * n))
        self.answer_tokens += 1
        return logits

    async def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed the same answer tokens to every sequence in one step (teacher forcing);
        logits at every fed position, [D, T, V]."""
        batch = [list(tokens)] * self.size
        logits = await self.seq.step(
            "verify", self.size * len(batch[0]), lambda: self.seq.lm.forward(batch)
        )
        self.answer_tokens += len(batch[0])
        return logits

    async def rewind(self, answer_tokens: int) -> None:
        lengths = [p + answer_tokens for p in self.prompt_lengths]
        await self.seq.step("rollback", 0, lambda: self.seq.lm.rollback(lengths))
        self.answer_tokens = answer_tokens

    def cancel(self) -> None:
        self.seq.cancel()
