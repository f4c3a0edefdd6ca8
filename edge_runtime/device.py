"""The device model and private retrieval, as the mode orchestrators use them (model steps
run on a worker thread: `model_runtime.async_model`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from transformers import PreTrainedTokenizerBase

from edge_runtime.events import Citation
from model_runtime.async_model import AsyncSequence, ModelWorker
from model_runtime.prompting import Passage
from model_runtime.runtime import CausalLM
from model_runtime.tokenizer import load_tokenizer, tokenizer_fingerprint

T = TypeVar("T")
EXCERPT_CHARS = 300


class DeviceModel(AsyncSequence):
    """The device's `CausalLM` with its tokenizer: one sequence, stepped from asyncio."""

    def __init__(self, lm: CausalLM, tokenizer: PreTrainedTokenizerBase, name: str) -> None:
        self.lm = lm
        self.tokenizer = tokenizer
        self.name = name
        self.tokenizer_hash = bytes.fromhex(tokenizer_fingerprint(tokenizer))
        self._worker = ModelWorker("device-model")

    @classmethod
    def load(cls, folder: Path, threads: int | None = None) -> DeviceModel:
        """The prepared ONNX model in `folder` (spinning off: it shares cores with the cloud
        when the backend is embedded, DESIGN §3)."""
        from model_runtime.ort_runtime import OrtCausalLM

        lm = OrtCausalLM(folder, threads=threads, allow_spinning=False)
        return cls(lm, load_tokenizer(folder), folder.parent.name)

    async def step(self, kind: str, n: int, fn: Callable[[], T]) -> T:
        return await self._worker.run(fn)

    @property
    def length(self) -> int:
        return self.lm.lengths[0]

    def cancel(self) -> None:
        self.lm.cancel()


class Retriever(Protocol):
    """The private index as the orchestrators need it (personal_index.PersonalIndex)."""

    def search(self, query: str, k: int = 5, min_score: float | None = None) -> list[Any]: ...


def _location(hit: Any) -> str:
    """Where a chunk is in its file, as a citation shows it: page, line range."""
    parts = []
    if getattr(hit, "page", None):
        parts.append(f"p. {hit.page}")
    start, end = getattr(hit, "line_start", None), getattr(hit, "line_end", None)
    if start:
        parts.append(f"lines {start}–{end}" if end and end != start else f"line {start}")
    return ", ".join(parts)


async def retrieve_private(
    index: Retriever | None, question: str, k: int, min_score: float | None = None
) -> tuple[list[Passage], list[Citation]]:
    """Private passages for the device prompt and their citations (marked device)."""
    if index is None or k <= 0:
        return [], []
    hits = await asyncio.to_thread(index.search, question, k, min_score)
    passages, citations = [], []
    for n, hit in enumerate(hits, 1):
        title = hit.title or os.path.basename(hit.path)
        location = _location(hit)
        passages.append(Passage(title, location, hit.text))
        citations.append(
            Citation(
                n,
                "device",
                title,
                location,
                float(hit.score),
                hit.text[:EXCERPT_CHARS],
                hit.path,
                hit.text,
            )
        )
    return passages, citations
