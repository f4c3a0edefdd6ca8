"""The cloud LLM engine: one loaded model, one KV cache per session, one step at a time.

Sessions do not own a model; each owns a `SequenceState` that is swapped into the shared
`CausalLM` for its step (no copy). Steps run on one worker thread, so the event loop stays
free for pings, cancels and other sessions' frames, and two steps never fight for the cores.
The caches of all sessions share a memory budget: when a step pushes the total over it, the
least recently used *other* sessions lose their cache and learn it on their next step
(`Evicted`), which the server turns into a clear error for that session alone.
`build_engine` loads the model a `ServerConfig` names into an engine.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from cloud_backend.config import ConfigError, ServerConfig
from cloud_backend.logfmt import kv
from model_runtime.async_model import AsyncSequence, ModelWorker
from model_runtime.runtime import CausalLM, SequenceState
from model_runtime.tokenizer import load_tokenizer, tokenizer_fingerprint

log = logging.getLogger("tandem.cloud")

T = TypeVar("T")
StepObserver = Callable[[str, int, float], None]  # (kind, positions fed, seconds)


class Evicted(RuntimeError):
    """This session's KV cache was dropped to stay within the engine's memory budget."""


class LLMEngine:
    def __init__(
        self,
        lm: CausalLM,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        kv_budget_bytes: int = 2 * 1024**3,
        on_step: StepObserver | None = None,
    ) -> None:
        self.lm = lm
        self.tokenizer = tokenizer
        self.name = name
        self.kv_budget_bytes = kv_budget_bytes
        self.tokenizer_hash = bytes.fromhex(tokenizer_fingerprint(tokenizer))
        self.on_step = on_step
        self.evictions = 0
        self._worker = ModelWorker("llm-engine")
        self._lru: OrderedDict[int, EngineSession] = OrderedDict()
        self._lock = threading.Lock()  # guards _lru between the loop and the worker
        self._current_lock = threading.Lock()  # a cancel reaches only the step it was meant for
        self._ids = itertools.count(1)
        self._current: EngineSession | None = None

    @property
    def vocab_size(self) -> int:
        return self.lm.vocab_size

    @property
    def cache_bytes(self) -> int:
        """KV cache memory held by all sessions now."""
        with self._lock:
            return sum(s.nbytes for s in self._lru.values())

    def open_session(self, on_evict: Callable[[], None] | None = None) -> EngineSession:
        session = EngineSession(self, next(self._ids), on_evict)
        with self._lock:
            self._lru[session.id] = session
        return session

    def close(self) -> None:
        self._worker.close()

    # ---- internals -------------------------------------------------------------------------
    def _step(self, session: EngineSession, kind: str, n: int, fn: Callable[[], T]) -> T:
        if session.closed:
            raise Evicted("session closed")
        if session.evicted and kind != "prefill":
            raise Evicted(
                "this session's cache was evicted to stay within the cloud's memory budget; "
                "ask again"
            )
        if session.state is not None:
            self.lm.attach_state(session.state)
        else:
            self.lm.reset(1)
        with self._current_lock:
            self._current = session
        start = time.perf_counter()
        try:
            result = fn()
        finally:
            with self._current_lock:
                self._current = None
            state = self.lm.detach_state()
            session.state = None if session.closed else state  # closed mid-step: drop it
        seconds = time.perf_counter() - start
        session.evicted = False
        session.last_step_s = seconds
        self._enforce_budget(keep=session)
        if self.on_step is not None:
            self.on_step(kind, n, seconds)
        return result

    def _enforce_budget(self, keep: EngineSession) -> None:
        """Count `keep`'s cache as it is after its step and evict others to fit, in one go
        (`cache_bytes` never sees the total over the budget, unless `keep` alone is)."""
        with self._lock:
            keep.nbytes = keep.state.nbytes if keep.state is not None else 0
            if keep.id in self._lru:
                self._lru.move_to_end(keep.id)
            total = sum(s.nbytes for s in self._lru.values())
            victims = []
            for other in list(self._lru.values()):
                if total <= self.kv_budget_bytes:
                    break
                if other is keep or other.state is None:
                    continue
                total -= other.nbytes
                other.state, other.nbytes, other.evicted = None, 0, True
                victims.append(other)
        for victim in victims:
            self.evictions += 1
            if victim.on_evict is not None:
                victim.on_evict()

    def _cancel(self, session: EngineSession) -> None:
        # Under the lock the worker cannot move on to another session's step between the
        # check and the cancel (the runtime forgets a cancel when its run ends).
        with self._current_lock:
            if self._current is session:
                self.lm.cancel()


class EngineSession(AsyncSequence):
    """One session's view of the engine: its own sequence and KV cache, swapped into the
    shared model for each of its steps on the engine's worker."""

    def __init__(
        self, engine: LLMEngine, session_id: int, on_evict: Callable[[], None] | None
    ) -> None:
        self.engine = engine
        self.lm = engine.lm
        self.id = session_id
        self.on_evict = on_evict
        self.state: SequenceState | None = None
        self.nbytes = 0
        self.evicted = False
        self.closed = False
        self.last_step_s = 0.0

    @property
    def length(self) -> int:
        """Tokens in this session's sequence (its next position)."""
        return 0 if self.state is None else int(self.state.lengths[0])

    async def step(self, kind: str, n: int, fn: Callable[[], T]) -> T:
        return await self.engine._worker.run(self.engine._step, self, kind, n, fn)

    def cancel(self) -> None:
        """Stop this session's step if it is running now (from the event loop)."""
        self.engine._cancel(self)

    def release(self) -> None:
        """Drop the cache (between requests) but keep the session."""
        with self.engine._lock:
            self.state, self.nbytes = None, 0

    def close(self) -> None:
        with self.engine._lock:
            self.engine._lru.pop(self.id, None)
            self.state, self.nbytes, self.closed = None, 0, True


# ---------------------------------------------------------------------------- model loading

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _tokenizer_dir(model_dir: Any) -> Any:
    """The model folder itself (prepare saves the tokenizer beside every variant), else the
    sibling `hf` folder of a prepared model."""
    for candidate in (model_dir, model_dir.parent / "hf"):
        if any((candidate / name).is_file() for name in _TOKENIZER_FILES):
            return candidate
    raise ConfigError(f"no tokenizer files (tokenizer.json) in {model_dir}")


def _model_name(model_dir: Any) -> str:
    """A prepared model lives in `<models>/<key>/<variant>/`: name it by its key."""
    if (model_dir.parent / "manifest.json").is_file():
        return model_dir.parent.name
    return model_dir.name


def build_engine(config: ServerConfig) -> LLMEngine:
    """Load the cloud model (ONNX Runtime or torch) and its tokenizer into an engine."""
    model_dir = config.model_dir
    if model_dir is None:
        # Only here does the cloud look at the device's model store: a deployment that
        # passes model_dir never imports the packaging code.
        from tandem_packaging.prepare import model_path
        from tandem_packaging.sources import PrepareError

        variant = "onnx-quant" if config.engine == "ort" else "hf"
        try:
            model_dir = model_path("cloud", variant)
        except PrepareError as exc:
            raise ConfigError(str(exc)) from None
    if not model_dir.is_dir():
        raise ConfigError(f"model folder {model_dir} does not exist")
    log.info(kv("loading_model", path=str(model_dir), engine=config.engine))
    if config.engine == "ort":
        from model_runtime.ort_runtime import OrtCausalLM

        lm: Any = OrtCausalLM(model_dir, threads=config.threads, allow_spinning=False)
    else:
        import torch

        from model_runtime.torch_runtime import TorchCausalLM

        dtype = torch.bfloat16 if config.torch_dtype == "bfloat16" else torch.float32
        lm = TorchCausalLM(model_dir, dtype=dtype, threads=config.threads)
    tokenizer = load_tokenizer(_tokenizer_dir(model_dir))
    name = config.model_name or _model_name(model_dir)
    return LLMEngine(lm, tokenizer, name, kv_budget_bytes=config.kv_budget_bytes)
