"""The device model and private retrieval, as the mode orchestrators use them.

Model steps run on one worker thread (ONNX Runtime releases the GIL), so the event loop keeps
streaming, receiving verdicts and answering cancels while the device computes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
from transformers import PreTrainedTokenizerBase

from collab.sources import Source
from model_runtime.runtime import CausalLM
from model_runtime.tokenizer import load_tokenizer, tokenizer_fingerprint

T = TypeVar("T")


class DeviceModel:
    """A `CausalLM` with its tokenizer, driven from asyncio."""

    def __init__(self, lm: CausalLM, tokenizer: PreTrainedTokenizerBase, name: str) -> None:
        self.lm = lm
        self.tokenizer = tokenizer
        self.name = name
        self.tokenizer_hash = bytes.fromhex(tokenizer_fingerprint(tokenizer))
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="device-model")

    @classmethod
    def load(cls, folder: Path, threads: int | None = None) -> DeviceModel:
        """The prepared ONNX model in `folder` (spinning off: it shares cores with the cloud
        when the backend is embedded, DESIGN §3)."""
        from model_runtime.ort_runtime import OrtCausalLM

        lm = OrtCausalLM(folder, threads=threads, allow_spinning=False)
        return cls(lm, load_tokenizer(folder), folder.parent.name)

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    @property
    def length(self) -> int:
        return self.lm.lengths[0]

    async def prefill(self, ids: Sequence[int]) -> np.ndarray:
        return await self._run(lambda: self.lm.prefill([list(ids)])[0])

    async def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Logits at every fed position, [T, V]."""
        return await self._run(lambda: self.lm.forward([list(ids)])[0])

    async def rollback(self, length: int) -> None:
        await self._run(lambda: self.lm.rollback(length))

    def cancel(self) -> None:
        self.lm.cancel()


class Retriever(Protocol):
    """The private index as the orchestrators need it (personal_index.PersonalIndex)."""

    def search(self, query: str, k: int = 5, min_score: float | None = None) -> list[Any]: ...


async def retrieve_private(
    index: Retriever | None, question: str, k: int, min_score: float | None = None
) -> list[Source]:
    """Private passages for the device prompt, numbered and marked device: the same sources
    are the prompt's passages and the answer's citations."""
    if index is None or k <= 0:
        return []
    hits = await asyncio.to_thread(index.search, question, k, min_score)
    return [hit.source(n, "device") for n, hit in enumerate(hits, 1)]
