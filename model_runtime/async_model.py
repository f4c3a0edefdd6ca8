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
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from collab.dragon.top import TopDocuments
from model_runtime.runtime import CausalLM, SequenceState, StateLost

if TYPE_CHECKING:
    from model_runtime.prefix_cache import PrefixReuse

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
        self,
        kind: str,
        rows: Sequence[Sequence[int]],
        *,
        fresh: bool = False,
        last_only: bool = False,
    ) -> np.ndarray:
        """`CausalLM.feed` on these sequences: logits [B, K, V]. `kind` (prefill, decode,
        verify) names the step for metrics."""

    @abstractmethod
    async def rewind(self, lengths: int | Sequence[int]) -> None:
        """`CausalLM.rollback`: every sequence to `lengths` (one, or one each)."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop this sequence's model step in flight (it raises `Cancelled`)."""

    async def resume(
        self, prefixes: Sequence[SequenceState | None], rows: Sequence[Sequence[int]]
    ) -> np.ndarray:
        """Start one sequence per row continuing `prefixes[b]` (cached KV, None: nothing) with
        `rows[b]` (`CausalLM.feed_from`); next-token logits [B, V]. Only where `reuses_kv`."""
        raise NotImplementedError(f"{type(self).__name__} keeps no KV to reuse")

    async def snapshot(self, lengths: Sequence[int]) -> list[SequenceState | None]:
        """Copies of the KV of the first `lengths[b]` tokens of each sequence b (0: None), to
        cache (`CausalLM.prefix_state`). Only where `reuses_kv`."""
        raise NotImplementedError(f"{type(self).__name__} keeps no KV to reuse")

    tops_inside = False  # `feed_top` and `last_rows` work (an engine that samples itself)

    async def feed_top(
        self,
        kind: str,
        rows: Sequence[Sequence[int]],
        k: int,
        temperature: float,
        *,
        fresh: bool = False,
    ) -> TopDocuments:
        """`feed` with `last_only`, returning each sequence's k likeliest next tokens with
        their log-probabilities at `temperature` (0: at 1) instead of its whole row: DRAGON's
        per-document rows where an engine hands rows out at a price (vLLM)."""
        raise NotImplementedError(f"{type(self).__name__} hands out whole rows (`feed`)")

    async def top_values(
        self, token_ids: Sequence[np.ndarray], temperature: float
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each sequence's next-token log-probabilities at `temperature` of these tokens (one
        array per sequence), as `feed_top` gives them: (ids, log-probabilities)."""
        raise NotImplementedError(f"{type(self).__name__} hands out whole rows (`feed`)")

    async def last_rows(self) -> np.ndarray:
        """Each sequence's next-token logits [B, V] as it stands (what `feed_top`'s tokens
        could not settle)."""
        raise NotImplementedError(f"{type(self).__name__} hands out whole rows (`feed`)")

    reuses_kv = False  # `resume`, `snapshot` and conversation reuse work (we hold the KV)
    held: list[int] | None = None  # the tokens of the one sequence held, while known
    reused_tokens = 0  # prompt tokens `prefill` did not feed again (conversation reuse)

    async def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Start a sequence of `ids`; next-token logits [V]. Where the sequence held now (the
        last answer's prompt and tokens) begins as `ids` does, it is rolled back to what they
        share and only the rest is fed: exact, as that KV depends only on those tokens."""
        common = self._common_prefix(ids)
        if common:
            try:
                await self.rewind(common)
                logits = await self.feed("prefill", [list(ids[common:])], last_only=True)
                self.reused_tokens += common
                first: np.ndarray = logits[0, 0]
                return first
            except StateLost:  # dropped meanwhile to fit the memory budget: start afresh
                self.held = None
        logits = await self.feed("prefill", [ids], fresh=True, last_only=True)
        first = logits[0, 0]
        return first

    def _common_prefix(self, ids: Sequence[int]) -> int:
        """Tokens at the start of `ids` the held sequence already holds (never all of `ids`:
        the last one is fed for its logits); 0 where nothing is known to be held."""
        held = self.held
        if not self.reuses_kv or held is None or not self.holds(len(held)) or len(ids) < 2:
            return 0
        n = min(len(held), len(ids) - 1)
        differ = np.flatnonzero(np.asarray(held[:n]) != np.asarray(ids[:n]))
        return int(differ[0]) if len(differ) else n

    def holds(self, length: int) -> bool:
        """Whether exactly one sequence of `length` tokens is held now."""
        return False

    def _fed(self, rows: Sequence[Sequence[int]], fresh: bool) -> None:
        """Track the one sequence's tokens after a feed that completed."""
        if len(rows) != 1:
            self.held = None
        elif fresh:
            self.held = list(rows[0])
        elif self.held is not None:
            self.held += rows[0]

    def _rewound(self, lengths: int | Sequence[int]) -> None:
        if isinstance(lengths, int | np.integer) and self.held is not None:
            self.held = self.held[: int(lengths)]
        else:
            self.held = None

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
        self,
        kind: str,
        rows: Sequence[Sequence[int]],
        *,
        fresh: bool = False,
        last_only: bool = False,
    ) -> np.ndarray:
        batch = [list(row) for row in rows]
        held, self.held = self.held, None  # unknown until the step completes
        logits = await self.step(
            kind,
            sum(map(len, batch)),
            lambda: self.lm.feed(batch, fresh=fresh, last_only=last_only),
        )
        self.held = held
        self._fed(batch, fresh)
        return logits

    async def rewind(self, lengths: int | Sequence[int]) -> None:
        held, self.held = self.held, None
        await self.step("rollback", 0, lambda: self.lm.rollback(lengths))
        self.held = held
        self._rewound(lengths)

    reuses_kv = True

    def holds(self, length: int) -> bool:
        return self.lm.batch_size == 1 and self.lm.lengths[0] == length

    async def resume(
        self, prefixes: Sequence[SequenceState | None], rows: Sequence[Sequence[int]]
    ) -> np.ndarray:
        batch = [list(row) for row in rows]
        self.held = None
        return await self.step(
            "prefill", sum(map(len, batch)), lambda: self.lm.feed_from(prefixes, batch)
        )

    async def snapshot(self, lengths: Sequence[int]) -> list[SequenceState | None]:
        return await self.step(
            "snapshot",
            0,
            lambda: [self.lm.prefix_state(b, n) if n else None for b, n in enumerate(lengths)],
        )


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

    async def start(
        self, prompts: Sequence[Sequence[int]], reuse: PrefixReuse | None = None
    ) -> np.ndarray:
        """Prefill every document's prompt (continuing the cached KV of each one's stable
        prefix, with `reuse`); next-token logits [D, V]."""
        if reuse is not None and self.seq.reuses_kv:
            logits = await reuse.start(self.seq, prompts)
        else:
            logits = (await self.seq.feed("prefill", prompts, fresh=True, last_only=True))[:, 0]
        self.prompt_lengths, self.answer_tokens = [len(p) for p in prompts], 0
        return logits

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

    async def rows(self) -> np.ndarray:
        """Every document's next-token logits [D, V] now (where `TopDocumentBatch`'s tokens
        do not settle a draft)."""
        return await self.seq.last_rows()

    async def completed(self, top: TopDocuments, scores: np.ndarray) -> TopDocuments:
        raise NotImplementedError("a batch that hands out rows never gives top tokens")

    async def rewind(self, answer_tokens: int) -> None:
        await self.seq.rewind([p + answer_tokens for p in self.prompt_lengths])
        self.answer_tokens = answer_tokens

    def cancel(self) -> None:
        self.seq.cancel()


class TopDocumentBatch:
    """DRAGON's documents (a `DocumentBatch`) on an engine that hands rows out at a price
    (vLLM, `tops_inside`): a step gives each document's k likeliest tokens at `temperature`
    (`collab.dragon.top`), its rows only on request."""

    def __init__(self, batch: DocumentBatch, k: int, temperature: float) -> None:
        self.batch, self.k, self.temperature = batch, k, temperature

    @property
    def answer_tokens(self) -> int:
        return self.batch.answer_tokens

    @answer_tokens.setter
    def answer_tokens(self, n: int) -> None:
        self.batch.answer_tokens = n

    async def start(self, prompts: Sequence[Sequence[int]]) -> TopDocuments:
        seq = self.batch.seq
        top = await seq.feed_top("prefill", prompts, self.k, self.temperature, fresh=True)
        self.batch.prompt_lengths, self.batch.answer_tokens = [len(p) for p in prompts], 0
        return top

    async def advance(self, token: int) -> TopDocuments:
        rows = [[token]] * self.batch.size
        top = await self.batch.seq.feed_top("decode", rows, self.k, self.temperature)
        self.batch.answer_tokens += 1
        return top

    async def rows(self) -> np.ndarray:
        return await self.batch.rows()

    async def completed(self, top: TopDocuments, scores: np.ndarray) -> TopDocuments:
        """`top` with the values of the tokens some documents listed and others did not."""
        ids, logp = await self.batch.seq.top_values(top.missing(scores), self.temperature)
        return top.with_values(ids, logp)

    async def rewind(self, answer_tokens: int) -> None:
        await self.batch.rewind(answer_tokens)

    def cancel(self) -> None:
        self.batch.cancel()
