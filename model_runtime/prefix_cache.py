"""Exact reuse of a prompt's stable prefix: the KV of `[instructions; document]` kept under a
byte budget, so the next sequence over the same document starts from it and prefills only its
question (docs/architecture.md#kv-reuse).

A causal model's keys and values at a position depend only on the tokens up to it, so the KV of
a prompt's first n tokens is the same whatever follows: continuing from it is exact, not an
approximation (unlike patching together caches of documents that shared one context, as
CacheBlend and TurboRAG do). Entries are keyed by the prefix's token ids themselves (hashed with
a salt): an entry is only ever used for exactly the tokens it was computed from, so a document
whose text changed misses and is prefilled again; `drop(tag)` forgets a removed document's
entries at once. Thread-safe: the cloud's engine thread and event loop both use it."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from model_runtime.runtime import SequenceState


def prefix_key(tokens: Sequence[int], salt: bytes = b"") -> bytes:
    """The cache key of a prefix: its token ids, under `salt` (a scope that shares entries)."""
    digest = hashlib.sha256(len(salt).to_bytes(4, "little") + salt)
    digest.update(np.asarray(tokens, dtype=np.uint32).tobytes())
    return digest.digest()


@dataclass
class _Entry:
    state: SequenceState
    tags: frozenset[Hashable]


class PrefixCache:
    """Prefix KV states (one sequence each), least recently used dropped first to stay within
    `budget_bytes`; an entry larger than the whole budget is not kept."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Memory the entries hold now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> SequenceState | None:
        """The state cached under `key` (counted as a hit), or None (a miss)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry.state

    def put(self, key: bytes, state: SequenceState, tags: Sequence[Hashable] = ()) -> bool:
        """Keep `state` under `key` (tagged, for `drop`); whether it was kept."""
        if state.nbytes > self.budget_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.state.nbytes
            self._entries[key] = _Entry(state, frozenset(tags))
            self._bytes += state.nbytes
            while self._bytes > self.budget_bytes:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.state.nbytes
                self.evictions += 1
        return True

    def drop(self, tag: Hashable) -> int:
        """Forget every entry tagged `tag` (a document changed or removed); how many."""
        with self._lock:
            keys = [k for k, e in self._entries.items() if tag in e.tags]
            for key in keys:
                self._bytes -= self._entries.pop(key).state.nbytes
        return len(keys)

    def tags(self) -> set[Hashable]:
        """Every tag an entry holds now."""
        with self._lock:
            return set().union(*(e.tags for e in self._entries.values()))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


class Resumable(Protocol):
    """A model's sequences that can start from cached KV (`AsyncSequence` where `reuses_kv`)."""

    async def resume(
        self, prefixes: Sequence[SequenceState | None], rows: Sequence[Sequence[int]]
    ) -> np.ndarray: ...

    async def snapshot(self, lengths: Sequence[int]) -> list[SequenceState | None]: ...


@dataclass
class PrefixReuse:
    """How one batch of prompts reuses `cache`: prompt b's first `stable[b]` tokens are its
    stable prefix (0: none), cached under `salt` with `tags[b]`. After `start`, `hits` and
    `reused` say what it saved."""

    cache: PrefixCache
    stable: Sequence[int]
    tags: Sequence[Sequence[Hashable]] = ()
    salt: bytes = b""
    hits: int = 0
    reused: int = field(default=0)  # prompt tokens not prefilled thanks to the cache

    async def start(self, seq: Resumable, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Prefill `prompts` on `seq`, each continuing its cached prefix where the cache holds
        it; then cache the prefixes it missed. Next-token logits [B, V]."""
        if len(self.stable) != len(prompts):
            raise ValueError("one stable prefix length per prompt")
        keys = [
            prefix_key(p[:n], self.salt) if 0 < n < len(p) else None
            for p, n in zip(prompts, self.stable, strict=True)
        ]
        states = [None if key is None else self.cache.get(key) for key in keys]
        rows = [
            list(p[n:]) if state is not None else list(p)
            for p, n, state in zip(prompts, self.stable, states, strict=True)
        ]
        logits = await seq.resume(states, rows)
        self.hits = sum(state is not None for state in states)
        self.reused = sum(
            n for n, state in zip(self.stable, states, strict=True) if state is not None
        )
        missed = [
            n if key is not None and state is None else 0
            for n, key, state in zip(self.stable, keys, states, strict=True)
        ]
        if any(missed):
            snaps = await seq.snapshot(missed)
            tags = list(self.tags) or [()] * len(prompts)
            for key, snap, tag in zip(keys, snaps, tags, strict=True):
                if key is not None and snap is not None:
                    self.cache.put(key, snap, tag)
        return logits
