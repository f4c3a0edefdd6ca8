"""The cloud LLM engine: one loaded model, one KV cache per session, sessions batched.

Sessions do not own a model; each owns a `SequenceState`. Their steps queue on the engine, and
one engine thread runs whatever is ready as one batched pass (`CausalLM.feed_states`): one-token
decodes, split verifications of γ+1 positions and DRAGON's per-document rows of different
sessions together, each session's cache left-padded to the longest and cut back afterwards, so
its logits are its own. Long feeds (a prefill) run in chunks of `prefill_chunk` positions, a
chunk a pass and alone (prefill is compute-bound: batched, it would only add padding); after
each, the waiting short steps go first, so a decoding session waits for at most one chunk
(fairness), then the prefill goes on: one begun finishes before the next starts, so answers
queued together get their first tokens one after another, not all at the end (round-robin
between N prompts would make each wait for all N). Otherwise the oldest step leads. A cancel
stops the pass in flight; the other sessions' steps in it run again.

The caches of all sessions share a memory budget: when a pass pushes the total over it, the
least recently used sessions (all but the last one stepped, if need be) lose their cache and
learn it on their next step (`Evicted`), which the server turns into a clear error for that
session alone. `cloud_backend.loading.build_engine` loads the model a config names.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from cloud_backend.engine_api import CloudSequence, StepObserver
from cloud_backend.logfmt import kv
from model_runtime.prefix_cache import PrefixCache
from model_runtime.runtime import Cancelled, CausalLM, SequenceState, StateLost
from model_runtime.tokenizer import tokenizer_fingerprint

log = logging.getLogger("tandem.cloud")

_STATE_STEPS = ("rollback", "snapshot")  # steps that touch one session's state, run no pass
SHORT_FEED = 16  # positions: feeds up to this wide share a pass (decode, verify); wider are long
PREFILL_CHUNK = 256  # positions of a long feed per pass
MAX_BATCH_SEQUENCES = 64  # sequences in one pass


class Evicted(StateLost):
    """This session's KV cache was dropped to stay within the engine's memory budget."""


@dataclass(eq=False)
class _Step:
    """One session's queued feed or rollback, with the future its coroutine awaits."""

    session: EngineSession
    kind: str  # prefill, decode, verify, rollback
    rows: list[list[int]] = field(default_factory=list)
    fresh: bool = False
    last_only: bool = False
    lengths: int | Sequence[int] = 0  # a rollback's target; a snapshot's prefix lengths
    prefixes: Sequence[SequenceState | None] | None = None  # a fresh feed continues these
    before: list[int] = field(default_factory=list)  # a feed's sequence lengths before it
    future: Future[Any] = field(default_factory=Future)
    fed: int = 0  # positions of each row fed so far (a long feed runs in chunks)
    cancelled: bool = False
    started: bool = False
    outputs: list[np.ndarray] = field(default_factory=list)  # logits of each chunk fed

    @property
    def width(self) -> int:
        """Positions of its longest row still to feed."""
        return max(map(len, self.rows), default=0) - self.fed

    def chunk(self, size: int) -> list[list[int]]:
        return [row[self.fed : self.fed + size] for row in self.rows]

    def collect(self, fed: list[list[int]], logits: np.ndarray, last_only: bool) -> None:
        """Keep what this step returns of a pass that fed it `fed` and gave `logits` (at each
        row's last fed position if `last_only`, else at every position)."""
        counts = [len(row) for row in fed]
        if self.last_only:
            if not last_only:  # this pass fed others wanting every position
                logits = logits[np.arange(len(counts)), np.maximum(np.array(counts) - 1, 0)][
                    :, None
                ]
            ends = [
                0 < len(row) - self.fed <= len(f) for row, f in zip(self.rows, fed, strict=True)
            ]
            if self.outputs:  # rows that end in this chunk take this chunk's logits
                logits = np.where(np.array(ends)[:, None, None], logits, self.outputs[0])
            self.outputs = [logits]
        else:
            self.outputs.append(logits[:, : max(counts)])
        self.fed += max(counts)

    def result(self) -> np.ndarray:
        return self.outputs[0] if self.last_only else np.concatenate(self.outputs, axis=1)


class LLMEngine:
    def __init__(
        self,
        lm: CausalLM,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        kv_budget_bytes: int = 2 * 1024**3,
        on_step: StepObserver | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        max_batch_sequences: int = MAX_BATCH_SEQUENCES,
        document_cache_bytes: int = 0,
        kv_tenant_bytes: int | None = None,
    ) -> None:
        self.lm = lm
        # public documents' [instructions; document] KV, kept for the next question over them
        self.documents = PrefixCache(document_cache_bytes) if document_cache_bytes > 0 else None
        self.tokenizer = tokenizer
        self.name = name
        self.kv_budget_bytes = kv_budget_bytes
        self.kv_tenant_bytes = kv_tenant_bytes  # one tenant's share at most (None: the budget)
        self.tokenizer_hash = bytes.fromhex(tokenizer_fingerprint(tokenizer))
        self.on_step = on_step
        self.prefill_chunk = prefill_chunk
        self.max_batch_sequences = max_batch_sequences
        self.evictions = 0
        self.passes = 0  # batched passes run (for tests and benchmarks)
        self._lru: OrderedDict[int, EngineSession] = OrderedDict()
        self._lock = threading.Condition()  # the queue, the running pass, _lru
        self._queue: deque[_Step] = deque()
        self._running: list[_Step] = []
        self._last_long = False  # the last pass fed a prefill chunk
        self._closed = False
        self.failure = ""  # why the engine thread stopped, if it failed
        self._unresolved: set[_Step] = set()  # submitted, future not yet done
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._serve, name="llm-engine", daemon=True)
        self._thread.start()

    @property
    def vocab_size(self) -> int:
        return self.lm.vocab_size

    @property
    def cache_bytes(self) -> int:
        """KV cache memory held by all sessions now."""
        with self._lock:
            return sum(s.nbytes for s in self._lru.values())

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def open_session(
        self, on_evict: Callable[[], None] | None = None, tenant: str = ""
    ) -> EngineSession:
        session = EngineSession(self, next(self._ids), on_evict, tenant)
        with self._lock:
            self._lru[session.id] = session
        return session

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for step in self._queue:
                _fail(step, RuntimeError("the engine is closed"))
            self._queue.clear()
            self._lock.notify_all()

    # ---- from the event loop ---------------------------------------------------------------
    async def _submit(self, step: _Step) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError(self.failure or "the engine is closed")
            self._queue.append(step)
            self._unresolved.add(step)
            step.future.add_done_callback(lambda _: self._resolved(step))
            self._lock.notify_all()
        return await asyncio.wrap_future(step.future)

    def _resolved(self, step: _Step) -> None:
        with self._lock:  # (reentrant: a step failed under the lock lands here too)
            self._unresolved.discard(step)

    def _cancel(self, session: EngineSession) -> None:
        """Stop `session`'s step: dropped if queued (what a long feed already fed is undone),
        its pass stopped if running (the other sessions' steps in that pass run again)."""
        with self._lock:
            for step in self._queue:
                step.cancelled |= step.session is session
            running = False
            for step in self._running:
                if step.session is session:
                    step.cancelled = running = True
            if running:
                self.lm.cancel()
            self._lock.notify_all()

    # ---- the engine thread -----------------------------------------------------------------
    def _serve(self) -> None:
        """The thread: its loop, guarded. An exception outside a pass's own handling leaves
        the engine's state unknown: every step submitted fails (its session sends an error
        frame), new ones are refused, `alive` turns False (/healthz 503) and the log says why."""
        try:
            self._serve_steps()
        except BaseException as exc:
            self.failure = f"the cloud's engine stopped: {exc!r}"
            log.critical(kv("engine_failed", error=repr(exc)), exc_info=exc)
            with self._lock:
                self._closed = True
                self._queue.clear()
                self._running = []
                unresolved = list(self._unresolved)
            for step in unresolved:
                _fail(step, RuntimeError(self.failure))

    def _serve_steps(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                cancelled = [s for s in self._queue if s.cancelled]
                rollbacks = [s for s in self._queue if s.kind in _STATE_STEPS and not s.cancelled]
                for step in cancelled + rollbacks:
                    self._queue.remove(step)
                batch = [] if cancelled or rollbacks else self._pick()
                self._running = batch
            for step in cancelled:
                self._abandon(step)
            for step in rollbacks:
                if step.kind == "snapshot":
                    self._snapshot(step)
                else:
                    self._rollback(step)
            if batch:
                self._run_pass(batch)

    def _pick(self) -> list[_Step]:
        """The next pass (under the lock): the oldest step, and if it is short every queued
        short step that fits; a long one (a prefill's chunk) runs alone, as prefill is
        compute-bound and batching it would only add padding. After a long pass, waiting
        short steps go first, however old the long ones: a decoding session waits for at most
        one prefill chunk. Steps whose coroutine went away are dropped."""
        steps: list[_Step] = []
        rows = 0
        short_first = self._last_long and any(s.width <= SHORT_FEED for s in self._queue)
        long: bool | None = False if short_first else None
        for step in list(self._queue):
            if step.future.cancelled():
                self._queue.remove(step)
                continue
            is_long = step.width > SHORT_FEED
            long = is_long if long is None else long
            if is_long != long or (
                steps
                and (
                    rows + len(step.rows) > self.max_batch_sequences
                    or long  # a prefill is compute-bound: batched, it only adds padding
                )
            ):
                continue
            if not step.started and not step.future.set_running_or_notify_cancel():
                self._queue.remove(step)
                continue
            step.started = True
            self._queue.remove(step)
            steps.append(step)
            rows += len(step.rows)
        self._last_long = bool(long)
        return steps

    def _run_pass(self, steps: list[_Step]) -> None:
        """Feed every step of the pass (a chunk of each long one) in one batched forward."""
        for step in [s for s in steps if _gone(s)]:
            steps.remove(step)
            _fail(step, Evicted(_gone(step)))
        if not steps:
            return
        long = steps[0].width > SHORT_FEED
        feeds = [s.chunk(self.prefill_chunk if long else s.width) for s in steps]
        last_only = all(s.last_only for s in steps)
        start = time.perf_counter()
        try:
            states = [self._starting_state(s) for s in steps]
            logits, new_states = self.lm.feed_states(states, feeds, last_only=last_only)
        except Cancelled:
            with self._lock:
                self._running = []
                for step in reversed(steps):  # the others run again, first
                    if not step.cancelled:
                        self._queue.appendleft(step)
            for step in steps:
                if step.cancelled:
                    self._abandon(step)
            return
        except Exception as exc:
            with self._lock:
                self._running = []
            if len(steps) == 1:
                _fail(steps[0], exc)
                return
            for step in steps:  # find the step at fault: each alone
                with self._lock:
                    self._running = [step]
                self._run_pass([step])
            return
        seconds = time.perf_counter() - start
        done: list[_Step] = []
        stopped: list[_Step] = []
        with self._lock:
            self._running = []
            self.passes += 1
            for step, rows, out, state in zip(steps, feeds, logits, new_states, strict=True):
                closed = step.session.closed  # mid-pass: its cache goes now
                step.session.state, step.session.evicted = None if closed else state, False
                step.session.last_step_s = seconds
                step.collect(rows, out, last_only)
                if step.width == 0:
                    done.append(step)
                elif step.cancelled:  # cancelled between two chunks of a long feed
                    stopped.append(step)
                else:  # its next chunk leads the next long pass: a prefill begun finishes
                    self._queue.appendleft(step)  # first (waiting short steps still go first)
            victims = self._enforce_budget([s.session for s in steps])
            self.evictions += len(victims)
        for step in stopped:
            self._abandon(step)
        for victim in victims:  # told before anyone's step returns
            if victim.on_evict is not None:
                victim.on_evict()
        self._report(steps, feeds, seconds)
        for step in done:
            _succeed(step, step.result())

    def _starting_state(self, step: _Step) -> SequenceState | None:
        """What a step continues: a fresh one nothing, or the cached prefixes it resumes."""
        if step.fresh and step.fed == 0:
            return None if step.prefixes is None else self.lm.join(step.prefixes)
        return step.session.state

    def _snapshot(self, step: _Step) -> None:
        """Copies of the first `lengths[b]` tokens' KV of each of the session's sequences."""
        session = step.session
        if gone := _gone(step):
            _fail(step, Evicted(gone))
            return
        try:
            assert session.state is not None
            self.lm.attach_state(session.state)
            lengths = list(step.lengths)  # type: ignore[arg-type]
            snaps = [self.lm.prefix_state(b, n) if n else None for b, n in enumerate(lengths)]
        except Exception as exc:
            _fail(step, exc)
            return
        finally:
            self.lm.reset(1)
        _succeed(step, snaps)

    def _abandon(self, step: _Step) -> None:
        """A cancelled step: undo the chunks of it already fed (a cancel leaves the session as
        it was before the step), then raise `Cancelled` in its coroutine."""
        session = step.session
        if step.fed and session.state is not None:  # (closed or evicted since: nothing held)
            state = None
            if not step.fresh:
                self.lm.attach_state(session.state)
                self.lm.rollback(step.before)
                state = self.lm.detach_state()
            with self._lock:
                session.state, session.nbytes = state, state.nbytes if state else 0
        _fail(step, Cancelled("step cancelled"))

    def _rollback(self, step: _Step) -> None:
        session = step.session
        if gone := _gone(step):
            _fail(step, Evicted(gone))
            return
        start = time.perf_counter()
        try:
            if session.state is not None:
                self.lm.attach_state(session.state)
            else:
                self.lm.reset(1)
            self.lm.rollback(step.lengths)
        except Exception as exc:
            self.lm.reset(1)
            _fail(step, exc)
            return
        state = self.lm.detach_state()
        with self._lock:
            session.state = None if session.closed else state
            session.nbytes = state.nbytes if not session.closed else 0
        _succeed(step, None)
        if self.on_step is not None:
            self.on_step("rollback", 0, time.perf_counter() - start)

    def _enforce_budget(self, stepped: list[EngineSession]) -> list[EngineSession]:
        """(Under the lock.) Count the stepped sessions' caches as they are now and evict to
        fit, sparing the last one stepped (so a pass always makes progress): first a tenant
        over its share gives up its least recently used sessions, then, while the total is
        over the budget, the tenant holding the most does (so no tenant can push out another
        holding less: max-min fair). `cache_bytes` never sees the total over the budget,
        unless that one session alone is."""
        for session in stepped:
            session.nbytes = session.state.nbytes if session.state is not None else 0
            if session.id in self._lru:
                self._lru.move_to_end(session.id)
        held: dict[str, int] = {}
        for s in self._lru.values():
            held[s.tenant] = held.get(s.tenant, 0) + s.nbytes
        evictable = [s for s in self._lru.values() if s is not stepped[-1] and s.state is not None]
        victims: list[EngineSession] = []

        def evict_from(tenant: str) -> bool:
            for session in evictable:  # least recently used first
                if session.tenant == tenant:
                    evictable.remove(session)
                    held[tenant] -= session.nbytes
                    session.state, session.nbytes, session.evicted = None, 0, True
                    victims.append(session)
                    return True
            return False

        share = self.kv_tenant_bytes
        for tenant in list(held):
            while share is not None and held[tenant] > share and evict_from(tenant):
                pass
        while sum(held.values()) > self.kv_budget_bytes and evictable:
            tenants = {s.tenant for s in evictable}
            evict_from(max(tenants, key=lambda t: held[t]))
        return victims

    def _report(self, steps: list[_Step], feeds: list[list[list[int]]], seconds: float) -> None:
        """The pass's time to the observer, shared between its kinds by positions fed."""
        if self.on_step is None:
            return
        fed: dict[str, int] = {}
        for step, rows in zip(steps, feeds, strict=True):
            fed[step.kind] = fed.get(step.kind, 0) + sum(map(len, rows))
        total = sum(fed.values()) or 1
        for kind, n in fed.items():
            self.on_step(kind, n, seconds * n / total)


def _gone(step: _Step) -> str:
    """Why this session's step cannot run ('' if it can)."""
    session = step.session
    if session.closed:
        return "session closed"
    if session.evicted and not (step.fresh and step.fed == 0):
        return (
            "this session's cache was evicted to stay within the cloud's memory budget; ask again"
        )
    return ""


def _succeed(step: _Step, result: Any) -> None:
    if not step.future.done():
        step.future.set_result(result)


def _fail(step: _Step, exc: BaseException) -> None:
    if not step.future.done():
        step.future.set_exception(exc)


class EngineSession(CloudSequence):
    """One session's view of the engine: its own sequences and KV cache, fed in the engine's
    batched passes together with other sessions' steps."""

    def __init__(
        self,
        engine: LLMEngine,
        session_id: int,
        on_evict: Callable[[], None] | None,
        tenant: str = "",
    ) -> None:
        self.engine = engine
        self.lm = engine.lm
        self.id = session_id
        self.on_evict = on_evict
        self.tenant = tenant  # whose memory share it counts in
        self.state: SequenceState | None = None
        self.nbytes = 0
        self.evicted = False
        self.closed = False
        self.last_step_s = 0.0

    @property
    def length(self) -> int:
        """Tokens in this session's (first) sequence (its next position)."""
        return 0 if self.state is None else int(self.state.lengths[0])

    async def feed(
        self,
        kind: str,
        rows: Sequence[Sequence[int]],
        *,
        fresh: bool = False,
        last_only: bool = False,
    ) -> np.ndarray:
        held = None if self.state is None else self.state.lengths.tolist()
        batch, lengths = self.checked(rows, fresh, held)
        step = _Step(self, kind, batch, fresh=fresh, last_only=last_only, before=lengths)
        tokens, self.held = self.held, None  # unknown until the step completes
        logits = await self.engine._submit(step)
        self.held = tokens
        self._fed(batch, fresh)
        return logits

    async def rewind(self, lengths: int | Sequence[int]) -> None:
        tokens, self.held = self.held, None
        await self.engine._submit(_Step(self, "rollback", lengths=lengths))
        self.held = tokens
        self._rewound(lengths)

    reuses_kv = True

    def holds(self, length: int) -> bool:
        state = self.state
        return state is not None and not self.evicted and state.lengths.tolist() == [length]

    async def resume(
        self, prefixes: Sequence[SequenceState | None], rows: Sequence[Sequence[int]]
    ) -> np.ndarray:
        held = [int(p.lengths[0]) if p else 0 for p in prefixes]
        batch, lengths = self.checked(rows, False, held)
        step = _Step(
            self,
            "prefill",
            batch,
            fresh=True,
            last_only=True,
            before=lengths,
            prefixes=list(prefixes),
        )
        self.held = None
        logits: np.ndarray = await self.engine._submit(step)
        return logits[:, 0]

    async def snapshot(self, lengths: Sequence[int]) -> list[SequenceState | None]:
        snaps: list[SequenceState | None] = await self.engine._submit(
            _Step(self, "snapshot", lengths=list(lengths))
        )
        return snaps

    def cancel(self) -> None:
        """Stop this session's step, queued or running (from the event loop)."""
        self.engine._cancel(self)

    def release(self, keep: bool = True) -> None:
        """A request ended: keep its one sequence's KV for the next request to extend
        (conversation reuse, counted in the memory budget like any session's), or drop it
        (`keep` False, or several sequences: DRAGON's documents); the session stays open."""
        if keep and self.held is not None:
            return
        self.held = None
        with self.engine._lock:
            self.state, self.nbytes = None, 0

    def close(self) -> None:
        with self.engine._lock:
            self.engine._lru.pop(self.id, None)
            self.state, self.nbytes, self.closed = None, 0, True
