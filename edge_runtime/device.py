"""The device model and private retrieval, as the mode orchestrators use them (model steps
run on a worker thread: `model_runtime.async_model`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from transformers import PreTrainedTokenizerBase

from collab.sources import Source
from model_runtime.async_model import ModelWorker, WorkerSequence
from model_runtime.prefix_cache import PrefixCache
from model_runtime.runtime import CausalLM
from model_runtime.tokenizer import load_tokenizer, tokenizer_fingerprint
from retrieval.search import best_of

DOCUMENT_CACHE_BYTES = 256 * 1024**2  # ~25 passages' KV with the 0.5B in float32


class DeviceModel(WorkerSequence):
    """The device's `CausalLM` with its tokenizer: one sequence, stepped from asyncio."""

    def __init__(
        self,
        lm: CausalLM,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        document_cache_bytes: int = DOCUMENT_CACHE_BYTES,
    ) -> None:
        self.lm = lm
        self.tokenizer = tokenizer
        self.name = name
        self.tokenizer_hash = bytes.fromhex(tokenizer_fingerprint(tokenizer))
        self._worker = ModelWorker("device-model")
        # private passages' [instructions; passage] KV (DRAGON): in memory only, never sent
        self.documents: PrefixCache | None = (
            PrefixCache(document_cache_bytes) if document_cache_bytes else None
        )

    @classmethod
    def load(cls, folder: Path, threads: int | None = None) -> DeviceModel:
        """The prepared ONNX model in `folder` (spinning off: it shares cores with the cloud
        when the backend is embedded, docs/models.md#models)."""
        from model_runtime.ort_runtime import OrtCausalLM

        lm = OrtCausalLM(folder, threads=threads, allow_spinning=False)
        return cls(lm, load_tokenizer(folder), folder.parent.name)

    @property
    def length(self) -> int:
        return self.lm.lengths[0]

    def cancel(self) -> None:
        self.lm.cancel()


class Retriever(Protocol):
    """The private index as the orchestrators need it (personal_index.PersonalIndex)."""

    def search(
        self, query: str, k: int = 5, min_score: float | None = None, *, within: Sequence[str] = ()
    ) -> list[Any]: ...

    def rescore(self, hits: Sequence[Any], text: str) -> np.ndarray:
        """Cosine of each hit with `text` (DRAGON's dynamic re-ranking)."""
        ...

    def stored_chunks(self, ids: Iterable[int]) -> set[int]:
        """Which of these chunk ids are still indexed."""
        ...


async def forget_removed(cache: PrefixCache, index: Retriever | None) -> int:
    """Drop the cached passages (tagged by chunk id) whose document was removed or changed
    since, here or by another process; how many. A stale entry is never used anyway (its key
    is the passage's tokens), but a removed document's KV should not stay in memory."""
    cached = {t for t in cache.tags() if isinstance(t, int)}
    if index is None or not cached:
        return 0
    gone = cached - await asyncio.to_thread(index.stored_chunks, cached)
    return sum(cache.drop(tag) for tag in gone)


async def retrieve_private(
    index: Retriever | None,
    question: str | Sequence[str],
    k: int,
    min_score: float | None = None,
    within: Sequence[str] = (),
) -> list[Source]:
    """Private passages for the device prompt, numbered and marked device: the same sources
    are the prompt's passages and the answer's citations (`search_private`)."""
    hits = await search_private(index, question, k, min_score, within)
    return [hit.source(n, "device") for n, hit in enumerate(hits, 1)]


def nothing_relevant(index: Retriever | None, k: int, found: Sequence[object]) -> bool:
    """Whether a search over the user's documents found none relevant enough to cite (the
    answer then says so, rather than citing noise)."""
    return index is not None and k > 0 and not found


NOTHING_PRIVATE = "no passage in your documents is relevant enough to this question to use"
NOTHING_PUBLIC = "no passage of the public corpus is relevant enough to this question to use"


async def search_private(
    index: Retriever | None,
    question: str | Sequence[str],
    k: int,
    min_score: float | None = None,
    within: Sequence[str] = (),
) -> list[Any]:
    """The private index's hits for the question (none without an index or with k = 0); given
    several ways of asking it (edge_runtime.turns.search_candidates), the hits of the one that
    finds the most relevant passage; `within`: only from the documents at or under those
    paths (a scoped question: `AnswerOptions.scope`)."""
    if index is None or k <= 0:
        return []
    asked = [question] if isinstance(question, str) else list(dict.fromkeys(question))
    search = partial(index.search, within=tuple(within)) if within else index.search
    found = [await asyncio.to_thread(search, q, k, min_score) for q in asked]
    return best_of(found)
