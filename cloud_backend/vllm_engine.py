"""The cloud engine on vLLM (`tandem serve --engine vllm`): the same sessions, modes and wire
protocol as the built-in engine, with vLLM's continuous batching and prefix caching running
the model. It needs vLLM, which installs apart from the device's toolchain
(docs/benchmarks/vllm.md#install).

vLLM owns the KV cache; a session here holds only its sequences' token ids. Three kinds of
request, all sharing vLLM's batches with every session's (prefix caching spares each the
blocks already cached):

- Plain decoding (`sampled`): vLLM's own sampler draws the whole run (cloud mode; split's first
  token and its AS² fallback).
- Split verification (`draw`): vLLM's sampler draws each draft's verdict from what the
  logits processor `cloud_backend.vllm_processor` makes of the raw row; token ids come back
  (docs/architecture.md#split-on-vllm).
- DRAGON's per-document steps (`feed_top`): each document's top `collab.dragon.top.TOP_K`
  tokens with their exact log-probabilities at the answer's temperature (vLLM's processed
  logprobs), which settle the transmitted mixture as the rows would
  (docs/architecture.md#dragon-on-vllm).
- Rows (`feed`, `row`, `last_rows`): the model's whole row at a position (log softmax of the
  logits, which the mode turns into its distribution at any temperature), where nothing less
  will do: a coin rejection's P_j, a DRAGON step the top tokens do not settle, DRDG/SW. Each
  row (151,936 floats for Qwen) crosses vLLM's Python output path; counted in `rows_out`.

A rewind costs nothing (the ids are cut; vLLM keeps what it cached). A cancel aborts the
step's requests. There is no eviction to report: vLLM pre-empts and recomputes instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from transformers import PreTrainedTokenizerBase

from cloud_backend.config import ConfigError, ServerConfig
from cloud_backend.engine_api import CloudSequence, StepObserver
from cloud_backend.logfmt import kv
from collab.dragon.top import TopDocuments
from collab.sampling import SamplingParams
from collab.variants.base import DraftTarget
from model_runtime.prefix_cache import PrefixCache
from model_runtime.runtime import Cancelled, RuntimeInputError, check_feed
from model_runtime.tokenizer import tokenizer_fingerprint

log = logging.getLogger("tandem.cloud")
T = TypeVar("T")

DRAWS_PROCESSOR = "cloud_backend.vllm_processor:VerificationDraws"
SHUTDOWN_S = 10.0  # vLLM's engine processes get this long to stop before they are killed
INSTALL_HINT = (
    "engine vllm needs vLLM, in a virtual environment of its own (its transformers conflicts "
    "with the device's export toolchain): `sh packaging/install_vllm_cloud.sh`, then run "
    "`.venv-vllm/bin/tandem serve --engine vllm` (docs/benchmarks/vllm.md#install)"
)


class VllmLimits:
    """The model facts a mode plans with, and the check a feed must pass (as `CausalLM`'s)."""

    def __init__(self, vocab_size: int, max_context: int) -> None:
        self.vocab_size = vocab_size
        self.max_context = max_context

    def check(self, tokens: Sequence[Sequence[int]], lengths: Sequence[int]) -> None:
        check_feed(tokens, lengths, self.vocab_size, self.max_context)


class VllmEngine:
    """An `AsyncLLM` serving the sessions' logits rows (see the module docstring)."""

    def __init__(
        self,
        llm: Any,  # vllm.v1.engine.async_llm.AsyncLLM
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        kv_bytes_per_token: int,
        kv_budget_bytes: int = 2 * 1024**3,
        verify: str = "decode",
    ) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.tokenizer = tokenizer
        self.name = name
        self.tokenizer_hash = bytes.fromhex(tokenizer_fingerprint(tokenizer))
        self.kv_budget_bytes = kv_budget_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        # vLLM's own prefix caching reuses documents (salted by the scope, `share_documents`)
        self.documents: PrefixCache | None = None
        self.on_step: StepObserver | None = None
        self.rows_out = 0  # vocabulary rows vLLM handed out (/metrics, tests, benchmarks)
        self.verify = verify
        config = llm.model_config
        self.lm = VllmLimits(int(config.get_vocab_size()), int(config.max_model_len) - 1)
        # One generated token (greedy: no random state in vLLM) and the whole row of logits
        # at its position; ids in, nothing detokenized.
        self._params = SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=-1, flat_logprobs=True, detokenize=False
        )
        self._sessions: dict[int, VllmSequence] = {}
        self._ids = itertools.count(1)

    @property
    def vocab_size(self) -> int:
        return self.lm.vocab_size

    @property
    def cache_bytes(self) -> int:
        """The KV the sessions' tokens stand for (vLLM may hold more in its prefix cache, or
        less where it pre-empted a sequence to recompute it later)."""
        held = sum(len(row) for s in self._sessions.values() for row in s.rows)
        return held * self.kv_bytes_per_token

    @property
    def alive(self) -> bool:
        return not self.llm.errored  # vLLM's engine process died: every request would fail

    def open_session(
        self, on_evict: Callable[[], None] | None = None, tenant: str = ""
    ) -> VllmSequence:
        """Each session salts its prefix-cache entries with its own id: its rounds reuse its
        cached prefix, no other session ever hits its entries (no timing side channel between
        sessions or users through the shared cache). DRAGON's document rows are salted by the
        document cache's scope instead (`VllmSequence.share_documents`)."""
        session_id = next(self._ids)
        session = VllmSequence(self, session_id, salt=f"session-{session_id}")
        self._sessions[session.id] = session
        return session

    def close(self) -> None:
        """vLLM's engine processes go: asked to stop, then killed with what they started
        after `SHUTDOWN_S` (its EngineCore ignores SIGTERM while it works)."""
        self.llm.shutdown(timeout=SHUTDOWN_S)

    async def logits(self, prompt: list[int], salt: str) -> tuple[np.ndarray, int]:
        """The model's logits [V] after `prompt`, as log softmax (the same distribution at any
        temperature: `collab.sampling.distribution` is shift-invariant), and how many of its
        tokens vLLM took from its prefix cache (shared within `salt`)."""
        from vllm.inputs import TokensPrompt

        final = None
        request_id = f"tandem-{next(self._ids)}"
        async for out in self.llm.generate(
            TokensPrompt(prompt_token_ids=prompt, cache_salt=salt), self._params, request_id
        ):
            final = out
        self.rows_out += 1
        if final is None or not final.outputs or not final.outputs[0].logprobs:
            raise RuntimeError("vLLM returned no logits row")
        flat = final.outputs[0].logprobs
        start, end = flat.start_indices[0], flat.end_indices[0]
        ids = np.asarray(flat.token_ids[start:end], dtype=np.int64)
        row = np.full(self.vocab_size, np.nan, dtype=np.float32)
        row[ids] = np.asarray(flat.logprobs[start:end], dtype=np.float32)
        if np.isnan(row).any():  # every id must be there: a partial row is not a distribution
            raise RuntimeError(f"vLLM returned {len(set(ids.tolist()))} of {len(row)} logits")
        return row, int(final.num_cached_tokens or 0)

    async def top(
        self,
        prompt: list[int],
        k: int,
        temperature: float,
        salt: str,
        token_ids: Sequence[int] = (),
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """The k likeliest next tokens after `prompt` (or, with `token_ids`, those tokens)
        and log softmax(logits / T) there (T 0: 1, vLLM's greedy logprobs), normalised over
        the whole vocabulary (vLLM's processed logprobs); and the prompt tokens vLLM took from
        its prefix cache."""
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt

        asked = [int(t) for t in token_ids]
        sampling = VllmParams(
            max_tokens=1,
            temperature=temperature,
            logprobs=None if asked else k,
            logprob_token_ids=asked or None,
            flat_logprobs=True,
            detokenize=False,
        )
        final = None
        async for out in self.llm.generate(
            TokensPrompt(prompt_token_ids=prompt, cache_salt=salt),
            sampling,
            f"tandem-{next(self._ids)}",
        ):
            final = out
        if final is None or not final.outputs or not final.outputs[0].logprobs:
            raise RuntimeError("vLLM returned no logprobs")
        flat = final.outputs[0].logprobs
        start, end = flat.start_indices[0], flat.end_indices[0]
        got = dict(zip(flat.token_ids[start:end], flat.logprobs[start:end], strict=True))
        # the sampled token comes too and may be neither asked for nor in the top k
        ids = asked if asked else sorted(got, key=lambda t: (-got[t], t))[:k]
        return (
            np.asarray(ids, dtype=np.int64),
            np.asarray([got[t] for t in ids]),
            int(final.num_cached_tokens or 0),
        )

    async def sample(
        self, prompt: list[int], params: SamplingParams, n: int, salt: str
    ) -> AsyncGenerator[int, None]:
        """Up to n tokens vLLM samples after `prompt` (its own decoding: continuous batching,
        the cache kept between tokens) from softmax(logits / T) cut to top-k, then top-p, as
        `collab.sampling.distribution` defines them; no per-request seed (vLLM's CPU build
        dies on seeded requests in chunked batches)."""
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt

        greedy = params.temperature == 0.0
        sampling = VllmParams(
            max_tokens=n,
            temperature=params.temperature,
            top_k=0 if greedy or not params.top_k else params.top_k,
            top_p=1.0 if greedy else params.top_p,
            ignore_eos=True,  # the transcript knows when an answer ends
            detokenize=False,
        )
        seen = 0
        request_id = f"tandem-{next(self._ids)}"
        async for out in self.llm.generate(
            TokensPrompt(prompt_token_ids=prompt, cache_salt=salt), sampling, request_id
        ):
            tokens = out.outputs[0].token_ids
            for token in tokens[seen:]:
                yield int(token)
            seen = len(tokens)

    async def draw(
        self,
        prompts: list[list[int]],
        targets: Sequence[DraftTarget | None],
        params: SamplingParams,
        salt: str,
    ) -> list[int]:
        """Verification draws inside vLLM (`cloud_backend.vllm_draws`): the token drawn after
        each prompt (prompts[k] = the one before plus target k-1's draft), up to the first
        that is not its target's draft. `fanout`: one single-token request per prompt, all
        in one batch (each recomputes its tail past the last cached block); `decode`: one
        request on the first prompt generating one token per target (vLLM keeps the KV
        between them), stopped at the first rejection. Greedy needs no processor: vLLM's
        argmax is the verdict of every variant."""
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt

        from cloud_backend.vllm_draws import Draws

        greedy = params.temperature == 0.0

        def request(first: int, n: int) -> AsyncGenerator[Any, None]:
            extra = None if greedy else Draws(params, list(targets[first : first + n]))
            sampling = VllmParams(
                max_tokens=n,
                temperature=0.0 if greedy else 1.0,
                ignore_eos=True,
                detokenize=False,
                extra_args=None if extra is None else extra.extra_args(),
            )
            return self.llm.generate(
                TokensPrompt(prompt_token_ids=prompts[first], cache_salt=salt),
                sampling,
                f"tandem-{next(self._ids)}",
            )

        drafts = [None if t is None else t.draft for t in targets]
        tokens: list[int] = []
        if self.verify == "fanout":

            async def one(k: int) -> int:
                final = None
                async for out in request(k, 1):
                    final = out
                assert final is not None
                return int(final.outputs[0].token_ids[0])

            for token, draft in zip(
                await asyncio.gather(*map(one, range(len(targets)))), drafts, strict=True
            ):
                tokens.append(token)
                if token != draft:
                    break
            return tokens
        stream = request(0, len(targets))
        async with contextlib.aclosing(stream):
            async for out in stream:
                for token in out.outputs[0].token_ids[len(tokens) :]:
                    tokens.append(int(token))
                    if token != drafts[len(tokens) - 1]:
                        return tokens  # leaving the stream aborts the request
        return tokens

    def forget(self, session: VllmSequence) -> None:
        self._sessions.pop(session.id, None)


class VllmSequence(CloudSequence):
    """One websocket's sequences: token ids only (vLLM caches their KV by prefix)."""

    def __init__(self, engine: VllmEngine, session_id: int, salt: str) -> None:
        self.engine = engine
        self.lm = engine.lm
        self.id = session_id
        self.salt = salt  # this session's own
        self.documents_salt: str | None = None  # DRAGON's rows, until `release`
        self.rows: list[list[int]] = []
        self.closed = False
        self._step: asyncio.Future[Any] | None = None
        self._cancelled = False

    @property
    def length(self) -> int:
        return len(self.rows[0]) if self.rows else 0

    @property
    def step_salt(self) -> str:
        """The prefix-cache salt of this request's steps: the session's own, or DRAGON's
        document scope's (`share_documents`)."""
        return self.salt if self.documents_salt is None else self.documents_salt

    async def feed(
        self,
        kind: str,
        rows: Sequence[Sequence[int]],
        *,
        fresh: bool = False,
        last_only: bool = False,
    ) -> np.ndarray:
        if self.closed:
            raise RuntimeError("session closed")
        batch, _ = self.checked(rows, fresh, [len(r) for r in self.rows] if self.rows else None)
        base = self.rows if self.rows and not fresh else [[] for _ in batch]
        wanted = [  # (row, slot, ids up to the position)
            (b, 0 if last_only else k, base[b] + row[: k + 1])
            for b, row in enumerate(batch)
            for k in ([len(row) - 1] if last_only else range(len(row)))
            if row
        ]
        start = time.perf_counter()
        got = await self._cancellable(
            asyncio.gather(*(self.engine.logits(ids, self.step_salt) for _, _, ids in wanted))
        )
        width = 1 if last_only else max(map(len, batch), default=0)
        out = np.zeros((len(batch), width, self.lm.vocab_size), dtype=np.float32)
        cached = [0] * len(batch)
        for (b, k, _), (row, hit) in zip(wanted, got, strict=True):
            out[b, k] = row
            cached[b] = max(cached[b], hit)
        if kind == "prefill":  # prompt tokens vLLM's prefix cache spared (its own reuse)
            self.reused_tokens += sum(cached)
        self.rows = [old + new for old, new in zip(base, batch, strict=True)]
        if self.engine.on_step is not None:
            self.engine.on_step(kind, sum(map(len, batch)), time.perf_counter() - start)
        return out

    async def _cancellable(self, step: Awaitable[T]) -> T:
        """Run a step that `cancel` can stop (then `Cancelled`; the session is as it was)."""
        self._cancelled = False
        self._step = asyncio.ensure_future(step)
        try:
            return await self._step
        except asyncio.CancelledError:
            if self._cancelled:  # our cancel, not the task's
                raise Cancelled("step cancelled") from None
            raise
        finally:
            self._step = None

    verifies_inside = True

    async def begin(self, ids: Sequence[int]) -> None:
        """The ids only: the first request that samples after them (plain decoding, a draw)
        prefills them, reusing what vLLM's prefix cache holds (the last answer's too)."""
        self.lm.check([list(ids)], [0])
        self.rows = [list(ids)]

    async def draw(
        self,
        feed: Sequence[int],
        first: int,
        targets: Sequence[DraftTarget | None],
        params: SamplingParams,
    ) -> list[int]:
        if self.closed:
            raise RuntimeError("session closed")
        if len(self.rows) != 1:
            raise RuntimeInputError("draws verify one sequence")
        ids = self.rows[0] + list(feed)
        self.lm.check([list(feed)], [len(self.rows[0])])
        at = len(self.rows[0]) + first
        prompts = [ids[: at + k] for k in range(len(targets))]
        start = time.perf_counter()
        tokens = await self._cancellable(self.engine.draw(prompts, targets, params, self.salt))
        if len(tokens) < len(targets) and all(
            t is not None and t.draft == token for t, token in zip(targets, tokens, strict=False)
        ):
            raise RuntimeError(f"vLLM drew {len(tokens)} of {len(targets)} tokens")
        self.rows = [ids]
        if self.engine.on_step is not None:
            self.engine.on_step("verify", len(feed), time.perf_counter() - start)
        return tokens

    tops_inside = True

    async def feed_top(
        self,
        kind: str,
        rows: Sequence[Sequence[int]],
        k: int,
        temperature: float,
        *,
        fresh: bool = False,
    ) -> TopDocuments:
        if self.closed:
            raise RuntimeError("session closed")
        batch, _ = self.checked(rows, fresh, [len(r) for r in self.rows] if self.rows else None)
        base = self.rows if self.rows and not fresh else [[] for _ in batch]
        start = time.perf_counter()
        got = await self._cancellable(
            asyncio.gather(
                *(
                    self.engine.top(old + row, k, temperature, self.step_salt)
                    for old, row in zip(base, batch, strict=True)
                )
            )
        )
        if kind == "prefill":
            self.reused_tokens += sum(hit for _, _, hit in got)
        self.rows = [old + new for old, new in zip(base, batch, strict=True)]
        if self.engine.on_step is not None:
            self.engine.on_step(kind, sum(map(len, batch)), time.perf_counter() - start)
        return TopDocuments.of([ids for ids, _, _ in got], [logp for _, logp, _ in got])

    async def top_values(
        self, token_ids: Sequence[np.ndarray], temperature: float
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        async def values(ids: list[int], wanted: np.ndarray) -> np.ndarray:
            if not wanted.size:
                return np.zeros(0)
            got = await self.engine.top(ids, 0, temperature, self.step_salt, wanted.tolist())
            return got[1]

        logp = await self._cancellable(
            asyncio.gather(
                *(values(ids, wanted) for ids, wanted in zip(self.rows, token_ids, strict=True))
            )
        )
        return list(token_ids), list(logp)

    async def last_rows(self) -> np.ndarray:
        got = await self._cancellable(
            asyncio.gather(*(self.engine.logits(list(ids), self.step_salt) for ids in self.rows))
        )
        return np.stack([row for row, _ in got])

    async def row(self, length: int) -> np.ndarray:
        if not 0 < length <= self.length:
            raise RuntimeInputError(f"no row after {length} of {self.length} tokens")
        row, _ = await self._cancellable(self.engine.logits(self.rows[0][:length], self.salt))
        return row

    async def rewind(self, lengths: int | Sequence[int]) -> None:
        targets = [lengths] * len(self.rows) if isinstance(lengths, int) else list(lengths)
        if len(targets) != len(self.rows) or any(
            not 0 <= n <= len(row) for n, row in zip(targets, self.rows, strict=False)
        ):
            raise RuntimeInputError(f"cannot roll back sequences of {self._lengths()} to {lengths}")
        self.rows = [row[:n] for row, n in zip(self.rows, targets, strict=True)]

    def _lengths(self) -> list[int]:
        return [len(row) for row in self.rows]

    def sampled(
        self, pending: int | None, params: SamplingParams, n: int
    ) -> AsyncGenerator[int, None] | None:
        return self._sampled(pending, params, n) if len(self.rows) == 1 else None

    async def _sampled(
        self, pending: int | None, params: SamplingParams, n: int
    ) -> AsyncGenerator[int, None]:
        ids = self.rows[0]
        if pending is not None:
            self.lm.check([[pending]], [len(ids)])
            ids.append(pending)
        last: int | None = None
        async for token in self.engine.sample(list(ids), params, n, self.salt):
            if last is not None:
                ids.append(last)  # the one before is in the sequence now
            last = token
            yield token

    def cancel(self) -> None:
        if self._step is not None and not self._step.done():
            self._cancelled = True
            self._step.cancel()

    def share_documents(self, salt: bytes) -> None:
        """vLLM salts whole requests and chains its block hashes, so the shared entries go
        past the document into the question: under scope "all", a session of another user
        who sends the same document, history and question to the token hits them too
        (docs/security.md#document-cache)."""
        self.documents_salt = "documents-" + salt.hex()

    def release(self, keep: bool = True) -> None:
        """The rows go; vLLM's prefix cache (this session's salt) keeps what the next
        request can reuse, `keep` or not."""
        self.rows, self.documents_salt = [], None

    def close(self) -> None:
        self.cancel()
        self.rows, self.closed = [], True
        self.engine.forget(self)


# ---------------------------------------------------------------------------- loading


def build_vllm_engine(
    config: ServerConfig, model_dir: Path, tokenizer: PreTrainedTokenizerBase, name: str
) -> VllmEngine:
    """Start vLLM's engine (in its own processes) on a Hugging Face checkpoint folder."""
    try:
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"engine vllm needs a Hugging Face checkpoint folder; {model_dir} is not")
    hf_config = json.loads((model_dir / "config.json").read_text())
    args: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": config.torch_dtype,
        "skip_tokenizer_init": True,  # ids in and out; the server tokenizes
        "enable_prefix_caching": True,
        "max_logprobs": -1,  # the whole row where one is asked for...
        # ...as log softmax(logits / T) over the whole vocabulary (T 1 for the rows, asked
        # for greedy; DRAGON's top tokens at the answer's T): exact log-probabilities, which
        # the modes' softmax turns back into the model's distribution
        "logprobs_mode": "processed_logprobs",
        "logits_processors": [DRAWS_PROCESSOR],  # split verified inside (`vllm_processor`)
    }
    if current_platform.is_cpu():
        _cpu_environment(config)
        args["block_size"] = 32  # the CPU attention's smallest: less tail recomputed a step
    args.update(config.vllm)
    log.info(kv("starting_vllm", **{k: str(v) for k, v in args.items()}))
    try:
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
    except (TypeError, ValueError) as exc:  # a bad [cloud.vllm] setting
        raise ConfigError(f"vLLM refused its settings: {exc}") from None
    return VllmEngine(
        llm,
        tokenizer,
        name,
        _kv_bytes_per_token(hf_config, config.torch_dtype),
        kv_budget_bytes=config.kv_budget_bytes,
        verify=config.vllm_verify,
    )


def _cpu_environment(config: ServerConfig) -> None:
    """vLLM's CPU settings come from the environment: its KV cache from the cloud's budget,
    its threads from `threads`, bound to the cores this process may use (`taskset`), every
    one unless `threads` says fewer. Values already set win."""
    cores = sorted(os.sched_getaffinity(0))[: config.threads or None]
    gib = max(1, -(-config.kv_budget_bytes // 1024**3))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    os.environ.setdefault("OMP_NUM_THREADS", str(len(cores)))


def _kv_bytes_per_token(hf_config: dict[str, Any], dtype: str) -> int:
    layers = int(hf_config["num_hidden_layers"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads", heads))
    head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
    return layers * 2 * kv_heads * head_dim * (2 if dtype == "bfloat16" else 4)
