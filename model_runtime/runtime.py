"""The model runtime interface, used by the device (ONNX Runtime) and available to the cloud.

One `CausalLM` holds `batch_size` independent sequences, each with its own KV cache rows.
Everything a decoding mode needs is here, and only here:

- `prefill(prompts)` starts fresh sequences and returns each one's next-token logits.
- `forward(tokens)` feeds new tokens to every sequence and returns logits at **every** fed
  position (speculative verification scores γ+1 positions in one pass).
- `decode(tokens)` feeds one token per sequence and returns next-token logits.
- `rollback(length, seq=None)` returns one or all sequences to a committed length.
- `cancel()` (from any thread) stops the step in flight; it raises `Cancelled` and leaves
  every sequence exactly as it was before that step.

Cache layout: the cache is append-only over *slots*; each sequence owns a boolean mask
over slots (the attention mask) and a committed length (its next position id). Feeding
sequences of unequal length pads the short ones with masked slots; a per-sequence rollback
masks the dropped slots. Trailing slots no sequence uses are cut off at once; holes inside
the cache are compacted away when they grow, so memory stays bounded without copying the
cache on every token.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


class Cancelled(Exception):
    """The step was cancelled by `CausalLM.cancel()`; no sequence changed."""


class StateLost(RuntimeError):
    """The sequences a step would continue are gone (a server dropped them to stay within its
    memory budget); a fresh prefill still works."""


class RuntimeInputError(ValueError):
    """Invalid tokens, lengths or sequence numbers passed to a runtime."""


def check_feed(
    tokens: Sequence[Sequence[int]],
    lengths: Sequence[int] | np.ndarray,
    vocab_size: int,
    max_context: int,
) -> None:
    """Raise `RuntimeInputError` unless `tokens[b]` may be fed to a sequence holding
    `lengths[b]` tokens of a model with this vocabulary and context: known ids, room left."""
    for b, seq in enumerate(tokens):
        if len(seq) and (min(seq) < 0 or max(seq) >= vocab_size):
            bad = next(t for t in seq if t < 0 or t >= vocab_size)
            raise RuntimeInputError(f"unknown token id {bad} (vocabulary has {vocab_size})")
        if lengths[b] + len(seq) > max_context:
            raise RuntimeInputError(
                f"sequence {b} would hold {lengths[b] + len(seq)} tokens, over the context "
                f"limit of {max_context}"
            )


@dataclass
class SequenceState:
    """Everything one user of a `CausalLM` owns: its sequences, masks and KV cache. A server
    keeps one per session and swaps it in for each step, so one loaded model serves many
    sessions without copying caches."""

    mask: np.ndarray
    lengths: np.ndarray
    cache: Any
    nbytes: int


class CausalLM(ABC):
    """A causal language model with a KV cache of several independent sequences."""

    # Compact when masked holes exceed this fraction of the cache (and a minimum size).
    _COMPACT_FRACTION = 0.5
    _COMPACT_MIN_SLOTS = 256

    def __init__(self, vocab_size: int, max_context: int) -> None:
        self.vocab_size = vocab_size
        self.max_context = max_context
        self._cancel_lock = threading.Lock()
        self._mask = np.zeros((1, 0), dtype=bool)
        self._lengths = np.zeros(1, dtype=np.int64)
        self._clear_cache(1)

    # ---- state -----------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self._lengths)

    @property
    def lengths(self) -> list[int]:
        """Committed tokens in each sequence (the next token's position id)."""
        return self._lengths.tolist()

    @property
    def cache_slots(self) -> int:
        """Slots in the KV cache, masked holes included."""
        return self._mask.shape[1]

    def reset(self, batch_size: int = 1) -> None:
        """Drop every sequence and start `batch_size` empty ones."""
        if batch_size < 1:
            raise RuntimeInputError("batch_size must be at least 1")
        self._mask = np.zeros((batch_size, 0), dtype=bool)
        self._lengths = np.zeros(batch_size, dtype=np.int64)
        self._clear_cache(batch_size)

    @property
    def cache_bytes(self) -> int:
        """Memory held by the KV cache (keys and values of every slot and sequence)."""
        return self.cache_slots * self.batch_size * self._bytes_per_slot()

    def detach_state(self) -> SequenceState:
        """Hand over the current sequences and cache, leaving the runtime empty."""
        state = SequenceState(self._mask, self._lengths, self._get_cache(), self.cache_bytes)
        self.reset(1)
        return state

    def attach_state(self, state: SequenceState) -> None:
        """Continue from a state returned by `detach_state` (of this same model)."""
        self._mask, self._lengths = state.mask, state.lengths
        self._set_cache(state.cache)

    # ---- steps -----------------------------------------------------------------------------
    def feed(
        self, tokens: Sequence[Sequence[int]], *, fresh: bool = False, last_only: bool = False
    ) -> np.ndarray:
        """Feed `tokens[b]` to sequence b (lists may differ in length; empty = feed nothing),
        or with `fresh` start one new sequence per list. Logits [B, K, V]: at every fed
        position (K = T_max; rows past a sequence's own count are padding and meaningless),
        or with `last_only` at each sequence's last fed token (K = 1)."""
        if fresh:
            if len(tokens) == 0:
                raise RuntimeInputError("prefill needs at least one prompt")
            if any(len(p) == 0 for p in tokens):
                raise RuntimeInputError("empty prompt: a sequence needs at least one token")
            self._validate(tokens, fresh=True)
            self.reset(len(tokens))
        return self._feed(tokens, last_only)

    def prefill(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Start one fresh sequence per prompt; return next-token logits, shape [B, V]."""
        return self.feed(prompts, fresh=True, last_only=True)[:, 0]

    def decode(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed one token to each sequence; return next-token logits, shape [B, V]."""
        return self.forward([[t] for t in tokens])[:, 0]

    def forward(self, tokens: Sequence[Sequence[int]]) -> np.ndarray:
        """Feed `tokens[b]` to sequence b; logits at every fed position, [B, T_max, V]."""
        return self.feed(tokens)

    def feed_states(
        self,
        states: Sequence[SequenceState | None],
        tokens: Sequence[Sequence[Sequence[int]]],
        *,
        last_only: bool = False,
    ) -> tuple[list[np.ndarray], list[SequenceState]]:
        """One pass for several users (a server batching its sessions): user u's sequences
        (`states[u]`; None starts one fresh sequence per list) are fed `tokens[u]`. Returns
        each user's logits, as `feed` gives them, and its new state; the states passed in are
        left as they were (a cancelled pass changes nothing) and the runtime is left empty.
        Each user's cache slots are left-padded with masked slots to the longest user's and
        the padding cut off again afterwards, so a user's logits are its own: exactly so in
        float32, up to the rounding of longer reductions in lower precisions."""
        users: list[SequenceState] = []
        for state, rows in zip(states, tokens, strict=True):
            if state is None:
                if len(rows) == 0 or any(len(r) == 0 for r in rows):
                    raise RuntimeInputError("a fresh sequence needs at least one token")
                self.reset(len(rows))
                state = self.detach_state()
            elif len(rows) != len(state.lengths):
                raise RuntimeInputError(
                    f"got tokens for {len(rows)} sequences, the state holds {len(state.lengths)}"
                )
            users.append(state)
        try:
            sizes = self._install(users)
            logits = self._feed([row for rows in tokens for row in rows], last_only)
            out_logits: list[np.ndarray] = []
            out_states: list[SequenceState] = []
            start = 0
            for size in sizes:
                stop = start + size
                mask = self._mask[start:stop]
                used = np.flatnonzero(mask.any(axis=0))
                lo, hi = (int(used[0]), int(used[-1]) + 1) if len(used) else (0, 0)
                cache = self._slice_cache(start, stop, lo, hi)
                nbytes = (hi - lo) * size * self._bytes_per_slot()
                lengths = self._lengths[start:stop].copy()
                out_states.append(SequenceState(mask[:, lo:hi].copy(), lengths, cache, nbytes))
                out_logits.append(logits[start:stop])
                start = stop
        finally:
            self.reset(1)
        return out_logits, out_states

    def _install(self, states: Sequence[SequenceState]) -> list[int]:
        """Make the sequences of `states`, in order, the runtime's: each state's slots
        left-padded with masked slots to the longest. Returns each state's sequence count."""
        sizes = [len(u.lengths) for u in states]
        slots = max(u.mask.shape[1] for u in states)
        pads = [slots - u.mask.shape[1] for u in states]
        self._mask = np.concatenate(
            [np.pad(u.mask, ((0, 0), (pad, 0))) for u, pad in zip(states, pads, strict=True)]
        )
        self._lengths = np.concatenate([u.lengths for u in states])
        self._set_cache(self._concat_caches([u.cache for u in states], sizes, pads))
        return sizes

    # ---- exact reuse of a prefix's KV ------------------------------------------------------
    def prefix_state(self, seq: int, length: int) -> SequenceState:
        """A copy of the KV of the first `length` tokens of sequence `seq`, as a one-sequence
        state: the keys and values of a causal model's prefix do not depend on what follows,
        so any later sequence that starts with the same tokens may continue from it exactly."""
        if not 0 <= seq < self.batch_size:
            raise RuntimeInputError(f"no sequence {seq} (batch of {self.batch_size})")
        slots = np.flatnonzero(self._mask[seq])
        if not 0 < length <= len(slots):
            raise RuntimeInputError(f"sequence {seq} holds {len(slots)} tokens, not {length}")
        lo, hi = int(slots[0]), int(slots[length - 1]) + 1
        mask = self._mask[seq : seq + 1, lo:hi].copy()
        cache = self._slice_cache(seq, seq + 1, lo, hi, copy=True)  # owns its memory only
        return SequenceState(
            mask, np.array([length], dtype=np.int64), cache, (hi - lo) * self._bytes_per_slot()
        )

    def join(self, states: Sequence[SequenceState | None]) -> SequenceState:
        """One state holding the sequences of `states` in order (None: an empty sequence), to
        start a batch whose sequences continue cached prefixes. The states passed in are not
        changed (their caches are copied); the runtime is left empty."""
        empty = None
        filled: list[SequenceState] = []
        for state in states:
            if state is None:
                if empty is None:
                    self.reset(1)
                    empty = self.detach_state()
                state = empty
            filled.append(state)
        try:
            self._install(filled)
            return self.detach_state()
        finally:
            self.reset(1)

    def feed_from(
        self, prefixes: Sequence[SequenceState | None], rows: Sequence[Sequence[int]]
    ) -> np.ndarray:
        """Start one sequence per row that continues `prefixes[b]` (a `prefix_state`; None:
        nothing) with `rows[b]` (at least one token each). Next-token logits [B, V], equal
        within float rounding to a prefill of the prefix's tokens followed by the row."""
        if len(prefixes) != len(rows) or not rows:
            raise RuntimeInputError("one prefix (or None) per row, and at least one row")
        if any(len(row) == 0 for row in rows):
            raise RuntimeInputError("each sequence needs at least one token after its prefix")
        self.attach_state(self.join(prefixes))
        try:
            return self._feed(rows, last_only=True)[:, 0]
        except BaseException:
            self.reset(1)
            raise

    def _feed(self, tokens: Sequence[Sequence[int]], last_only: bool) -> np.ndarray:
        """Feed tokens; logits at every position, or only at each sequence's last one."""
        if len(tokens) != self.batch_size:
            raise RuntimeInputError(
                f"got tokens for {len(tokens)} sequences, the runtime holds {self.batch_size}"
            )
        self._validate(tokens, fresh=False)
        counts = np.array([len(t) for t in tokens], dtype=np.int64)
        width = int(counts.max())
        if width == 0:
            raise RuntimeInputError("no tokens to feed")
        self._maybe_compact()
        ids = np.zeros((self.batch_size, width), dtype=np.int64)
        for b, seq in enumerate(tokens):
            ids[b, : len(seq)] = seq
        new_valid = np.arange(width)[None, :] < counts[:, None]
        mask = np.concatenate([self._mask, new_valid], axis=1)
        # While this step runs, padding rows may attend to the padding slots (to themselves):
        # a row that sees nothing would give NaN keys/values in some attention kernels.
        # Real tokens come before a sequence's padding, so causality hides the padding from
        # them; afterwards the padding slots are masked for good.
        run_mask = np.concatenate([self._mask, np.ones_like(new_valid)], axis=1)
        positions = self._lengths[:, None] + np.arange(width)[None, :]
        if last_only:
            wanted = (counts - 1)[:, None]
        else:
            wanted = np.tile(np.arange(width), (self.batch_size, 1))
        logits = self._run(ids, run_mask.astype(np.int64), positions, wanted)
        self._mask = mask
        self._lengths = self._lengths + counts
        self._trim()
        return logits

    def rollback(self, length: int | Sequence[int], seq: int | None = None) -> None:
        """Return sequence `seq` (or all, if None) to `length` committed tokens; a list gives
        one length per sequence."""
        if seq is not None:
            if not 0 <= seq < self.batch_size:
                raise RuntimeInputError(f"no sequence {seq} (batch of {self.batch_size})")
            targets = self._lengths.copy()
            targets[seq] = int(length)  # type: ignore[arg-type]
        elif isinstance(length, int | np.integer):
            targets = np.full(self.batch_size, int(length), dtype=np.int64)
        else:
            targets = np.asarray(length, dtype=np.int64)
            if targets.shape != self._lengths.shape:
                raise RuntimeInputError("rollback needs one length per sequence")
        if (targets < 0).any() or (targets > self._lengths).any():
            raise RuntimeInputError(
                f"cannot roll back to {targets.tolist()}: committed lengths are {self.lengths}"
            )
        for b in np.nonzero(targets < self._lengths)[0]:
            slots = np.flatnonzero(self._mask[b])
            self._mask[b, slots[targets[b] :]] = False
        self._lengths = targets
        self._trim()

    def cancel(self) -> None:
        """Stop the step in flight (safe from any thread); it raises `Cancelled`."""
        with self._cancel_lock:
            self._cancel_in_flight()

    # ---- bookkeeping -----------------------------------------------------------------------
    def _validate(self, tokens: Sequence[Sequence[int]], fresh: bool) -> None:
        base = np.zeros(len(tokens), dtype=np.int64) if fresh else self._lengths
        self.check(tokens, base)

    def check(self, tokens: Sequence[Sequence[int]], lengths: Sequence[int] | np.ndarray) -> None:
        """Raise `RuntimeInputError` unless `tokens[b]` may be fed to a sequence holding
        `lengths[b]` tokens: known ids, within the context."""
        check_feed(tokens, lengths, self.vocab_size, self.max_context)

    def _trim(self) -> None:
        """Cut trailing slots that no sequence attends to (an exact, cheap rollback)."""
        used = np.flatnonzero(self._mask.any(axis=0))
        keep = int(used[-1]) + 1 if len(used) else 0
        if keep < self.cache_slots:
            self._truncate_cache(keep)
            self._mask = self._mask[:, :keep]

    def _maybe_compact(self) -> None:
        """Squeeze masked holes out of the cache once they are a large share of it."""
        slots = self.cache_slots
        longest = int(self._lengths.max())
        if slots < self._COMPACT_MIN_SLOTS or slots - longest < self._COMPACT_FRACTION * slots:
            return
        # Right-align each sequence's valid slots: index[b, j] is the old slot at new slot j.
        index = np.zeros((self.batch_size, longest), dtype=np.int64)
        mask = np.zeros((self.batch_size, longest), dtype=bool)
        for b in range(self.batch_size):
            valid = np.flatnonzero(self._mask[b])
            if len(valid):
                index[b, longest - len(valid) :] = valid
                mask[b, longest - len(valid) :] = True
        self._gather_cache(index)
        self._mask = mask

    # ---- backend hooks ---------------------------------------------------------------------
    @abstractmethod
    def _run(
        self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, wanted: np.ndarray
    ) -> np.ndarray:
        """Run the model on ids [B, T] with attention mask [B, S+T] and position ids [B, T];
        append the new keys/values to the cache only if the run completes. Returns float32
        logits [B, K, V] at the fed positions `wanted` [B, K] (indices into T). Raises
        `Cancelled` if cancelled."""

    @abstractmethod
    def _clear_cache(self, batch_size: int) -> None:
        """Empty the cache for `batch_size` sequences."""

    @abstractmethod
    def _truncate_cache(self, slots: int) -> None:
        """Keep the first `slots` cache slots."""

    @abstractmethod
    def _gather_cache(self, index: np.ndarray) -> None:
        """New cache slot j of sequence b = old slot index[b, j]."""

    @abstractmethod
    def _concat_caches(
        self, caches: Sequence[Any], sizes: Sequence[int], pads: Sequence[int]
    ) -> Any:
        """One cache of all `caches` (each of `sizes[i]` sequences) stacked along the batch,
        each first left-padded with `pads[i]` zero slots."""

    @abstractmethod
    def _slice_cache(self, start: int, stop: int, lo: int, hi: int, copy: bool = False) -> Any:
        """Sequences start..stop-1 of the current cache, slots lo..hi-1: never changed in place
        afterwards, but possibly a view that keeps the whole cache's memory alive; with
        `copy`, a compact copy that holds only its own (what a cache entry must be)."""

    @abstractmethod
    def _get_cache(self) -> Any:
        """The backend's cache object, as `_set_cache` takes it back."""

    @abstractmethod
    def _set_cache(self, cache: Any) -> None:
        """Install a cache object from `_get_cache`."""

    @abstractmethod
    def _bytes_per_slot(self) -> int:
        """Bytes of keys and values one cache slot of one sequence takes, over all layers."""

    @abstractmethod
    def _cancel_in_flight(self) -> None:
        """Make the running `_run` stop and raise `Cancelled`."""
