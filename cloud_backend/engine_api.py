"""What the server and the modes ask of a cloud engine, whichever runs the model: the
built-in batching engine (`cloud_backend.engine`) or vLLM (`cloud_backend.vllm_engine`).

A mode sees one `CloudSequence` per websocket (feed, rewind, cancel: `AsyncSequence`) and
the engine's tokenizer and limits; the server sees the engine's name, tokenizer fingerprint,
cache size and step timings. Nothing here depends on how a step reaches the model."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Protocol

import numpy as np
from transformers import PreTrainedTokenizerBase

from collab.sampling import SamplingParams
from collab.variants.base import DraftTarget
from model_runtime.async_model import AsyncSequence
from model_runtime.prefix_cache import PrefixCache
from model_runtime.runtime import RuntimeInputError

StepObserver = Callable[[str, int, float], None]  # (kind, positions fed, seconds)


class ModelLimits(Protocol):
    """The model facts a mode plans with."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def check(self, tokens: Sequence[Sequence[int]], lengths: Sequence[int]) -> None:
        """Raise `RuntimeInputError` unless `tokens[b]` may follow `lengths[b]` tokens."""


class CloudSequence(AsyncSequence):
    """One websocket's sequences in the engine (one, or one per DRAGON document)."""

    lm: ModelLimits
    closed: bool

    def checked(
        self, rows: Sequence[Sequence[int]], fresh: bool, held: list[int] | None
    ) -> tuple[list[list[int]], list[int]]:
        """A feed's rows as lists and the lengths they follow (`held`: the sequences' now;
        None: none held, as after `release`), or `RuntimeInputError`: all of it is checked
        before anything runs (a long feed runs in several passes)."""
        batch = [list(r) for r in rows]
        if fresh and (not batch or not all(batch)):
            raise RuntimeInputError("a fresh sequence needs at least one token")
        lengths = [0] * len(batch) if fresh or held is None else held
        if len(lengths) != len(batch):
            raise RuntimeInputError(
                f"got tokens for {len(batch)} sequences, the session holds {len(lengths)}"
            )
        self.lm.check(batch, lengths)
        return batch, lengths

    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens in the first sequence (its next position)."""

    @abstractmethod
    def release(self, keep: bool = True) -> None:
        """A request ended: the session stays open; its cache is dropped, or with `keep`, kept
        where the engine can extend it in the next request (conversation reuse)."""

    @abstractmethod
    def close(self) -> None:
        """The websocket is gone: drop everything."""

    def share_documents(self, salt: bytes) -> None:
        """The rows fed until `release` begin with public documents' prefixes, which an
        engine caching prefixes itself (vLLM) may share within `salt` (the document cache's
        scope, `RequestContext.cache_salt`); the built-in engine shares through `documents`."""

    async def begin(self, ids: Sequence[int]) -> np.ndarray | None:
        """Start an answer's sequence (`prefill`): its next-token logits, or None where the
        engine samples every token itself and a row would only cost (vLLM)."""
        return await self.prefill(ids)

    verifies_inside = False  # whether `draw` is there (an engine that samples itself)

    async def draw(
        self,
        feed: Sequence[int],
        first: int,
        targets: Sequence[DraftTarget | None],
        params: SamplingParams,
    ) -> list[int]:
        """Split verification inside the engine, token ids out (vLLM): `feed` goes into the
        sequence (as `forward`'s tokens do) and at each of its positions first, first + 1, …
        (one per target) the engine draws one token — target None: from the model's
        distribution under `params`; a `DraftTarget`: its verification draw
        (`collab.verification.draw_distribution`), which is the draft exactly when
        accepted. The tokens come back up to the first that is not its target's draft."""
        raise NotImplementedError(f"{type(self).__name__} verifies from rows (`forward`)")

    async def row(self, length: int) -> np.ndarray:
        """`draw`'s one row: the raw logits [V] after the sequence's first `length` tokens
        (P_j of a rejection the engine drew only as a coin)."""
        raise NotImplementedError(f"{type(self).__name__} verifies from rows (`forward`)")

    def sampled(
        self, pending: int | None, params: SamplingParams, n: int
    ) -> AsyncGenerator[int, None] | None:
        """The engine's own sampler for plain decoding, where it batches better than a token
        at a time through `feed` (vLLM's continuous batching): up to n tokens sampled after
        the first sequence and `pending` (fed first, if any), each exactly from the model's
        distribution under `params`. The last token yielded is not in the sequence yet (the
        caller's pending token). None: decode through `feed`."""
        return None


class CloudEngine(Protocol):
    name: str
    tokenizer: PreTrainedTokenizerBase
    tokenizer_hash: bytes
    kv_budget_bytes: int
    on_step: StepObserver | None
    documents: PrefixCache | None  # public documents' prefix KV (None: the engine's own)

    @property
    def lm(self) -> ModelLimits: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def cache_bytes(self) -> int:
        """KV cache memory the sessions hold now."""

    @property
    def alive(self) -> bool:
        """Whether it can still run steps (/healthz says 503 otherwise, so a load balancer
        sends new sessions elsewhere)."""

    def open_session(
        self, on_evict: Callable[[], None] | None = None, tenant: str = ""
    ) -> CloudSequence:
        """A websocket's sequences (an engine that caches prefixes keeps each session's apart,
        so none can time another's); `tenant` (its access token's name) shares memory fairly
        with the other tenants where the engine holds each session's KV."""

    def close(self) -> None: ...
