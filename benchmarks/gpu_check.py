"""What a GPU cloud would do (issue 32, part 5): the real pair's architectures timed on a GPU, and
what those timings PREDICT for split and DRAGON through the cost models the modes use
(docs/benchmarks/vllm.md#gpu-check).

    PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_check --device cuda --out $OUT/gpu-check.json
    python -m benchmarks.gpu_check --device cpu --quick       # smoke run: a tiny config, seconds

Runs where only the standard library, numpy, torch and transformers are installed (4.57 or 5.x):
what it imports from the repository needs nothing else. No weights travel: the cloud's model
(Qwen2.5-Coder 1.5B, the target) and the device's (0.5B, the draft) are built from their
config.json (`benchmarks/data/gpu_check/{target,draft}/config.json`, copied from the prepared
pair) with random weights, in bf16 on the GPU; a forward costs the same with trained weights.
`--quick` shrinks both to 2 layers of width 64 (the vocabulary stays 151,936).

Measured on `--device` (ms, median of `--repeats` after `--warmup`; CUDA events), for each model,
N sessions each with a `--context`-token prompt already in its KV cache (transformers'
DynamicCache, equal lengths, no padding), the forward run as Tandem's torch runtime runs it
(`model.model`, then `lm_head` on the new positions):

  (a) decode: one new token per session (batch N);
  (b) verification: γ + 1 = 5 new tokens per session, the logits of all 5 rows (and 9 rows: with
      decode's 1, the line that prices other γ);
  (c) DRAGON's per-document rows: k = 2 documents per session, one token each (decode at 2N);
  (d) prefill of a `--context`-token prompt at batch 1 (TTFT), the last position's logits;

the GPU-busy time of (a) and (b) from torch.profiler (the kernels alone, launch gaps left out:
what an engine that replays CUDA graphs, vLLM's, approaches); the time to pull the rows each mode
needs to the host as float32 (Tandem's path: its math runs in numpy, timed here per session on
this machine's CPU) against sampling them on the GPU.

Predicted (every derived number is labelled PREDICTION, with its formula), from those timings and
inputs read from result files measured on the CPU machine (the paths are recorded): the real
pair's greedy TK-SLT acceptance (`results/split/`), DRAGON's (`results/dragon/`), the device's
ORT int8 0.5B decode time (`results/device/runtime.json`) and DRAGON's 2-document device step;
RTT `--rtt-ms` (20 and 50), `--mbit`:

  - split TK-SLT tokens/s ÷ cloud-only tokens/s at N = 1, 8, 32 (γ = 4; the best γ; PicoSpec's
    pipeline; the device's own choice with AS²), and TK-SLT's closed form;
  - DRAGON tokens/s ÷ cloud-only;
  - capacity: how many sessions one GPU serves at `--floor` tokens/s each.

Writes the timings, inputs, predictions and provenance (commit "unknown" without git, or
`--commit`; GPU, CUDA, torch, transformers, CPU) to `--out` (default
`results/gpu-check/<name>.json`)."""

from __future__ import annotations

import argparse
import functools
import glob
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import repo_relative
from benchmarks.provenance import ROOT, command_line, default_out, record, write_result
from collab.dragon.ledger import side_distribution
from collab.dragon.schedule import dragon_choose_aggregator
from collab.sampling import GREEDY, distribution
from collab.scheduling import (
    choose_draft_length,
    expected_tokens_per_round,
    speculative_round_time,
    tk_slt_speedup,
    verify_line,
)
from collab.verification import sample_draft_top_k, tkslt_cloud_verify, top_k_truncate
from edge_runtime.split_costs import SplitCosts

CONFIGS = ROOT / "benchmarks" / "data" / "gpu_check"
MODELS = {
    "target": "Qwen2.5-Coder 1.5B (the cloud's model)",
    "draft": "Qwen2.5-Coder 0.5B (the device's model)",
}
PREDICTION = "PREDICTION"
GAMMA = 4
GAMMA_MAX = 12
TOP_K = 32  # TK-SLT's uplinked top-K (the variant's default, docs/math.md#tk-slt)
DRAGON_TOP_P, DRAGON_MAX_SPARSE = 0.8, 32  # what a DRAGON draft carries (docs/math.md#dragon)

#: The per-token cost of streaming cloud-only tokens is left out (they stream: the round trip
#: delays the first token, not the rate), as `choose_draft_length`'s t_cloud_network = 0.
FORMULAS = {
    "t_rows": "host: pull(R rows, bf16 → float32 → numpy) + N × host math per session (numpy, "
    "timed on this CPU); gpu: softmax + multinomial over the R rows on the GPU, ids to "
    "the host. R = N (cloud), 5N (split γ = 4), (γ+1)·N (split γ), 2N (DRAGON, k = 2)",
    "cloud_only_tok_s": "1 / (t_dec(N) + t_rows(N))  [choose_draft_length's cloud-only rate, "
    "t_cloud_network = 0: tokens stream]",
    "T_verify(γ)": "verify_line({(1, t_dec(N)), (5, t_ver5(N)), (9, t_ver9(N))}, γ + 1) + "
    "t_rows((γ+1)·N)  [collab.scheduling.verify_line]",
    "split_gamma4_tok_s": "expected_tokens_per_round(α, 4) / speculative_round_time(4, t_draft, "
    "t_rtt, T_verify(4), t_up) = ((1 − α^5)/(1 − α)) / (4·(t_draft + t_up) "
    "+ t_rtt + T_verify(4))  [TK-SLT eq. 12 with the round trip]",
    "split_best": "choose_draft_length(α, t_draft, t_rtt, T_verify, t_cloud_step = t_dec(N) + "
    "t_rows(N), t_up, γ_max = 12): argmax over γ of E[#tokens](γ) / round time(γ)",
    "split_pipelined": "choose_draft_length(..., pipelined=True): PicoSpec eq. 9 rounds, "
    "(1 − α^γ)/(1 − α) tokens each",
    "split_device_choice": "edge_runtime.split_costs.SplitCosts.choose(): the device's own γ and "
    "AS² (cloud-only unless ≥ 10 % faster); its ratio is 1 when it hands "
    "the answer to the cloud",
    "tk_slt_eq11": "tk_slt_speedup(α, 4, L), L = (t_up + t_draft) / T_verify(4)  [TK-SLT eq. 11: "
    "no round trip, the verification priced as one LLM run]",
    "dragon_tok_s": "1 / z, z = min(z^device, z^cloud) of dragon_choose_aggregator(α^device, "
    "α^cloud, c_dec_device, c_dec_cloud = t_dec(2N) + t_rows(2N), c_trans = "
    "RTT/2 each way)  [DRAGON eq. 6-7]",
    "ratio": "mode tokens/s per session ÷ cloud-only tokens/s per session at the same N",
    "capacity": "the largest N ≤ N_max whose tokens/s per session ≥ the floor, times "
    "interpolated linearly between measured batch sizes (N_max: the largest batch "
    "measured; N_max/2 for DRAGON, whose cloud runs 2N rows)",
}

ASSUMPTIONS = [
    "Random weights: a forward costs what a trained model's does (same shapes, same cache).",
    "The forward is transformers' eager PyTorch (DynamicCache, SDPA attention): Tandem's torch "
    "runtime on a GPU. Basis 'events' is its measured time; basis 'busy' keeps only the GPU's "
    "kernel time (launch gaps removed), a floor that an engine with CUDA graphs approaches; it "
    "replaces the forwards' times only (rows pulled or drawn are host-clock times in both).",
    "N sessions are batched in one pass per step: cloud-only's N decode steps, split's N "
    "verifications, DRAGON's 2N document rows. Split's GPU idles while the devices draft; another "
    "cohort could use it, which this model does not count (split's capacity is understated).",
    "Sampling 'host' is Tandem's code today (rows pulled to the host, numpy math per session, "
    "serial); 'gpu' approximates the mode's math on the GPU by a softmax and a multinomial draw "
    "over the same rows.",
    "Acceptance, device step times and bytes come from runs on the CPU machine (files named "
    "under inputs): the device is the same ORT int8 0.5B; the GPU cloud's bf16 1.5B matches the "
    "torch bf16 cloud of the split grid (DRAGON's acceptance was measured with the ORT int4 "
    "cloud).",
]


@dataclass
class Plan:
    """What to measure."""

    context: int = 512
    sessions: tuple[int, ...] = (1, 8, 32)
    capacity_batches: tuple[int, ...] = (64, 128, 256)
    documents: int = 2
    verify_rows: tuple[int, ...] = (GAMMA + 1, 9)
    warmup: int = 3
    repeats: int = 10

    def decode_batches(self, model: str) -> list[int]:
        """Decode (a) and DRAGON's rows (c) for the sessions; the target also at the capacity
        batch sizes and their DRAGON doubles up to the largest (capacity's interpolation)."""
        out = set(self.sessions) | {self.documents * n for n in self.sessions}
        if model == "target":
            top = max(self.capacity_batches, default=max(self.sessions))
            out |= set(self.capacity_batches) | {
                self.documents * n for n in self.capacity_batches if self.documents * n <= top
            }
        return sorted(out)

    def verify_batches(self, model: str) -> list[int]:
        return sorted(
            set(self.sessions) | (set(self.capacity_batches) if model == "target" else set())
        )


QUICK_PLAN = Plan(context=32, sessions=(1, 2), capacity_batches=(4,), warmup=1, repeats=3)

# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def load_config(model: str, quick: bool) -> Any:
    """The model's transformers config from its copied config.json (AutoConfig.from_pretrained on
    the folder: read the same way by transformers 4.57 and 5.x); `quick`: 2 layers of width 64."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(CONFIGS / model))
    if quick:
        config.num_hidden_layers = 2
        config.hidden_size = 64
        config.intermediate_size = 128
        config.num_attention_heads = 4
        config.num_key_value_heads = 2
        if getattr(config, "head_dim", None):
            config.head_dim = 16
        if getattr(config, "layer_types", None):
            config.layer_types = list(config.layer_types[:2])
        if getattr(config, "max_window_layers", None):
            config.max_window_layers = 2
    return config


def build_model(config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Random weights, created on `device` in `dtype` (no float32 copy on the CPU first)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # an older transformers: torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model.to(device=device, dtype=dtype).eval()


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def forward_rows(model: Any, cache: Any, ids: torch.Tensor) -> torch.Tensor:
    """The logits of every new position, as `model_runtime.torch_runtime` computes them."""
    hidden = model.model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
    logits: torch.Tensor = model.lm_head(hidden)
    return logits


def fill(model: Any, cache: Any, ids: torch.Tensor, chunk_tokens: int = 32_768) -> None:
    """Prefill `ids` [B, T] into `cache` in chunks of at most `chunk_tokens` tokens a pass."""
    batch, length = ids.shape
    step = max(1, min(length, chunk_tokens // batch))
    for start in range(0, length, step):
        model.model(input_ids=ids[:, start : start + step], past_key_values=cache, use_cache=True)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summary(samples: Sequence[float]) -> dict[str, Any]:
    return {
        "ms": statistics.median(samples),
        "min_ms": min(samples),
        "max_ms": max(samples),
        "n": len(samples),
    }


def timed(
    fn: Callable[[], object],
    device: torch.device,
    warmup: int,
    repeats: int,
    after: Callable[[], object] | None = None,
    wall: bool = False,
) -> dict[str, Any]:
    """Median ms of `fn` over `repeats` calls after `warmup`; `after` runs untimed after each
    call. On CUDA the time is the stream's (CUDA events) unless `wall` (the host's clock, the
    device synchronised before and after: a copy to the host or a draw whose ids come back)."""
    for _ in range(warmup):
        fn()
        if after:
            after()
    sync(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda" and not wall:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(float(start.elapsed_time(end)))
        else:
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            samples.append((time.perf_counter() - t0) * 1e3)
        if after:
            after()
    return summary(samples)


def gpu_busy_ms(
    fn: Callable[[], object],
    device: torch.device,
    after: Callable[[], object] | None = None,
    calls: int = 3,
) -> float | None:
    """The GPU's busy time per call of `fn` (the union of its kernels' and copies' intervals, from
    torch.profiler): the forward without launch gaps. None off CUDA or where profiling fails."""
    if device.type != "cuda":
        return None
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
                sync(device)
                if after:
                    after()
        spans = sorted(
            (float(e.time_range.start), float(e.time_range.end))
            for e in prof.events()
            if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
        )
    except Exception as exc:  # the profiler is a bonus: never the run's end
        print(f"  (GPU-busy time not measured: {type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    busy_us, end = 0.0, -math.inf
    for s, e in spans:
        if s > end:
            busy_us += e - s
            end = e
        elif e > end:
            busy_us += e - end
            end = e
    return busy_us / 1e3 / calls if busy_us > 0 else None


def measure_model(model: Any, name: str, plan: Plan, device: torch.device) -> dict[str, Any]:
    """(a) decode, (b) verification and (c) DRAGON's rows at each batch size, (d) prefill."""
    vocab = int(model.config.vocab_size)
    gen = torch.Generator(device=device).manual_seed(0)

    def ids(batch: int, length: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, length), device=device, generator=gen)

    decode_b, verify_b = plan.decode_batches(name), plan.verify_batches(name)
    needed = set(plan.sessions) | {plan.documents * n for n in plan.sessions}
    decode: list[dict[str, Any]] = []
    verify: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for batch in sorted(set(decode_b) | set(verify_b)):
        t0 = time.perf_counter()
        todo = [1] if batch in decode_b else []
        todo += list(plan.verify_rows) if batch in verify_b else []
        done: list[dict[str, Any]] = []
        try:
            cache = new_cache(model)
            fill(model, cache, ids(batch, plan.context))
            for rows in todo:
                x = ids(batch, rows)

                def call(x: torch.Tensor = x, cache: Any = cache) -> object:
                    return forward_rows(model, cache, x)

                def crop(rows: int = rows, cache: Any = cache) -> object:
                    return cache.crop(-rows)

                t = timed(call, device, plan.warmup, plan.repeats, after=crop)
                t["busy_ms"] = gpu_busy_ms(call, device, after=crop)
                t.update(batch=batch, rows_per_session=rows)
                done.append(t)
            del cache
        except (RuntimeError, MemoryError) as exc:  # out of memory at a capacity-only size
            if batch in needed:
                raise
            skipped.append({"batch": batch, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"  {name} batch {batch:>3}: skipped ({type(exc).__name__})", flush=True)
            done = []
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not done:
            continue
        decode += [t for t in done if t["rows_per_session"] == 1]
        verify += [t for t in done if t["rows_per_session"] > 1]
        line = [
            f"{t['rows_per_session']} row{'s' if t['rows_per_session'] > 1 else ''} "
            f"{t['ms']:.2f} ms" + (f" (busy {t['busy_ms']:.2f})" if t["busy_ms"] else "")
            for t in done
        ]
        print(
            f"  {name} batch {batch:>3}: "
            + ", ".join(line)
            + f"  [{time.perf_counter() - t0:.1f} s]",
            flush=True,
        )

    prompt = ids(1, plan.context)

    def prefill() -> object:
        hidden = model.model(input_ids=prompt, past_key_values=new_cache(model), use_cache=True)
        return model.lm_head(hidden.last_hidden_state[:, -1:])

    pre = timed(prefill, device, plan.warmup, plan.repeats)
    pre.update(batch=1, tokens=plan.context)
    print(f"  {name} prefill {plan.context} tokens: {pre['ms']:.2f} ms", flush=True)
    by_batch = {d["batch"]: d for d in decode}
    dragon = [
        {
            "sessions": n,
            "documents": plan.documents,
            "batch": plan.documents * n,
            "ms": by_batch[plan.documents * n]["ms"],
            "busy_ms": by_batch[plan.documents * n]["busy_ms"],
        }
        for n in plan.sessions
    ]
    return {
        "model": MODELS[name],
        "config": f"benchmarks/data/gpu_check/{name}/config.json",
        "layers": int(model.config.num_hidden_layers),
        "hidden_size": int(model.config.hidden_size),
        "vocab_size": vocab,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "attention": str(getattr(model.config, "_attn_implementation", None)),
        "context": plan.context,
        "decode": decode,
        "verify": verify,
        "dragon_rows": dragon,
        "prefill": pre,
        "skipped": skipped,
    }


def llm_like_logits(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """n rows of float32 logits shaped like a model's: Zipf-like by rank over one random order of
    the vocabulary, with per-row noise (benchmarks/collab_math.py's rows)."""
    base = -1.2 * np.log(np.arange(1, vocab + 1, dtype=np.float64))
    order = rng.permutation(vocab)
    rows = np.empty((n, vocab), dtype=np.float32)
    for i in range(n):
        rows[i, order] = base * rng.uniform(2.0, 4.0) + rng.normal(0.0, 1.0, vocab)
    return rows


def measure_rows(plan: Plan, vocab: int, device: torch.device) -> list[dict[str, Any]]:
    """For each row count the modes need: pulling the rows to the host as float32 numpy (what
    `model_runtime.torch_runtime` returns) against a softmax + multinomial draw on the device
    with only the ids coming back. Host-clock ms."""
    batches = sorted(set(plan.sessions) | set(plan.capacity_batches))
    counts = sorted({n * r for n in batches for r in (1, plan.documents, *plan.verify_rows)})
    rng = np.random.default_rng(1)
    template = torch.from_numpy(llm_like_logits(rng, 8, vocab)).to(device)
    out = []
    needed = {n * r for n in plan.sessions for r in (1, plan.documents, *plan.verify_rows)}
    for rows in counts:
        try:
            x = template.repeat((rows + 7) // 8, 1)[:rows].to(torch.bfloat16).contiguous()
        except (RuntimeError, MemoryError):
            if rows in needed:
                raise
            continue

        def pull(x: torch.Tensor = x) -> object:
            return x.float().cpu().numpy()

        def sample(x: torch.Tensor = x) -> object:
            return torch.multinomial(torch.softmax(x.float(), dim=-1), 1).cpu()

        reps, warm = max(2, plan.repeats // 2), min(1, plan.warmup)
        host = timed(pull, device, warm, reps, wall=True)
        gpu = timed(sample, device, warm, reps, wall=True)
        out.append({"rows": rows, "host_pull_ms": host["ms"], "gpu_sample_ms": gpu["ms"]})
        del x
    return out


def measure_host_math(vocab: int, documents: int, repeats: int) -> dict[str, Any]:
    """The numpy math the cloud runs per session on rows it pulled (greedy, as the acceptance
    inputs were measured), on this machine's CPU, ms per session: cloud-only's token
    (`distribution`, argmax), split's TK-SLT round (5 × `distribution` + `tkslt_cloud_verify`),
    DRAGON's side distribution over 2 document rows (`side_distribution`, top-p 0.8)."""
    rng = np.random.default_rng(2)
    rows = llm_like_logits(rng, GAMMA + 1 + GAMMA, vocab)
    target, drafts_logits = rows[: GAMMA + 1], rows[GAMMA + 1 :]
    topk = []
    for z in drafts_logits:
        q = np.exp(z - z.max())
        topk.append(top_k_truncate(q / q.sum(), TOP_K))
    ids = np.stack([t[0] for t in topk])
    probs = np.stack([t[1] for t in topk])
    drafts = np.array([sample_draft_top_k(i, p, rng) for i, p in topk])
    scores = np.linspace(3.0, 1.0, documents)  # relevance R = 20·cosine, two documents apart

    def cloud() -> object:
        return int(np.argmax(distribution(target[0], GREEDY)))

    def split() -> object:
        P = np.stack([distribution(r, GREEDY) for r in target])
        return tkslt_cloud_verify(drafts, ids, probs, P, rng)

    def dragon() -> object:
        return side_distribution(rows[:documents], scores, GREEDY, DRAGON_TOP_P, DRAGON_MAX_SPARSE)

    cpu = torch.device("cpu")
    return {
        "cloud_ms_per_session": timed(cloud, cpu, 1, repeats)["ms"],
        "split_ms_per_session": timed(split, cpu, 1, repeats)["ms"],
        "dragon_ms_per_session": timed(dragon, cpu, 1, repeats)["ms"],
        "what": "numpy on this machine's CPU, one session, serial across sessions",
    }


# --------------------------------------------------------------------------------------------
# Inputs measured on the CPU machine (result files)
# --------------------------------------------------------------------------------------------


def _load(path: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ROOT / path).read_text())
    return data


_RESULTS = ROOT / "benchmarks" / "results"


def _files(pattern: str) -> list[str]:
    """The result files matching `pattern` (under benchmarks/results/), each by its fresh run
    where one exists, else the archived one (results/archive/, `benchmarks.report`)."""
    found: dict[str, str] = {}
    for base in (_RESULTS / "archive", _RESULTS):  # the fresh one last: it wins
        for path in glob.glob(str(base / pattern)):
            found[Path(path).relative_to(base).as_posix()] = repo_relative(path)
    return sorted(found.values())


def _result(rel: str) -> str:
    """One result file by name (under benchmarks/results/): fresh, else archived."""
    fresh = _RESULTS / rel
    return repo_relative(fresh if fresh.exists() else _RESULTS / "archive" / rel)


def split_inputs() -> dict[str, Any]:
    """The real pair's greedy TK-SLT acceptance with the torch bf16 cloud: the per-answer
    accepted ÷ drafted of the split grid (a lower bound on the per-token α: drafts after a
    rejection count as drafted), and the per-token α split's cost model held at each answer's
    end (`SplitCosts.alpha`, the truncated-geometric estimate Σn / Σ(n + [n < γ])) where files
    record it. Also the uplink bytes per drafted token."""
    fraction_sources, alpha_sources = [], []
    fractions, alphas, up_bytes = [], [], []
    for path in _files("split/*.json"):
        rows = _load(path).get("rows") or []
        mine = [
            r
            for r in rows
            if r.get("engine") == "torch"
            and r.get("sampling") == "greedy"
            and r.get("method") in ("tk-slt", "tk-slt:stop")
        ]
        grid = [r for r in mine if r["method"] == "tk-slt" and r.get("acceptance") is not None]
        if Path(path).name.startswith("grid-") and grid:
            fractions += [float(r["acceptance"]) for r in grid]
            up_bytes += [
                float(r["up_bytes_per_drafted"]) for r in grid if r.get("up_bytes_per_drafted")
            ]
            fraction_sources.append(
                {
                    "file": path,
                    "answers": len(grid),
                    "mean": statistics.mean(float(r["acceptance"]) for r in grid),
                }
            )
        held = [
            float(r["cost_model"]["alpha"])
            for r in mine
            if isinstance(r.get("cost_model"), Mapping) and r["cost_model"].get("alpha") is not None
        ]
        if held:
            alphas += held
            alpha_sources.append(
                {"file": path, "answers": len(held), "mean": statistics.mean(held)}
            )
    if not fractions or not alphas:
        raise SystemExit("no torch greedy TK-SLT rows under benchmarks/results/split/")
    return {
        "alpha_per_token": {
            "value": statistics.mean(alphas),
            "what": "split's cost-model α (SplitCosts.alpha, Σn / Σ(n + [n < γ])) at the end of "
            "each greedy TK-SLT answer, torch bf16 cloud; mean over answers",
            "sources": alpha_sources,
        },
        "alpha_accepted_fraction": {
            "value": statistics.mean(fractions),
            "what": "accepted ÷ drafted per greedy TK-SLT answer of the split grid, torch bf16 "
            "cloud, mean over answers (the docs' 'TK-SLT acceptance'; a lower bound on α)",
            "sources": fraction_sources,
        },
        "up_bytes_per_drafted": {
            "value": statistics.mean(up_bytes),
            "what": "TK-SLT uplink bytes per drafted token, the same grid answers",
            "sources": [s["file"] for s in fraction_sources],
        },
        "note": "No file holds a fixed-γ = 4 run: the grid's γ is chosen per round; α is per "
        "token (the i.i.d. model's), so it is used at every γ.",
    }


def dragon_inputs() -> dict[str, Any]:
    """DRAGON with the real pair, greedy, k = 2: the probability that each side's draft becomes
    the target (accepted ÷ drafted: at temperature 0 the target is the mixture's argmax), pooled
    over the dragon-auto answers; the device's decode time for its 2-document step."""
    files = _files("dragon/latency-ort-greedy-p*.json")
    acc = {"device": [0, 0], "cloud": [0, 0]}
    steps: list[float] = []
    sources = []
    for path in files:
        rows = [
            r
            for r in _load(path)["rows"]
            if r.get("sampling") == "greedy" and str(r.get("method", "")).startswith("dragon-")
        ]
        auto = [r for r in rows if r["method"] == "dragon-auto"]
        for side in acc:
            acc[side][0] += sum(int(r.get(f"{side}_accepted") or 0) for r in auto)
            acc[side][1] += sum(int(r.get(f"{side}_drafted") or 0) for r in auto)
        steps += [float(r["device_decode_s"]) for r in rows if r.get("device_decode_s")]
        sources.append(
            {
                "file": path,
                "dragon_auto_answers": len(auto),
                "answers_with_device_decode_s": sum(1 for r in rows if r.get("device_decode_s")),
            }
        )
    if not steps or not all(d for _, d in acc.values()):
        raise SystemExit("no greedy DRAGON rows under benchmarks/results/dragon/")
    return {
        "alpha_device": acc["device"][0] / acc["device"][1],
        "alpha_cloud": acc["cloud"][0] / acc["cloud"][1],
        "device_step_ms": statistics.median(steps) * 1e3,
        "what": "α^s: accepted ÷ drafted of side s's drafts over the dragon-auto answers (ORT int8 "
        "device, ORT int4 cloud, k = 2, greedy); device_step_ms: median device_decode_s "
        "of the DRAGON answers (its 2-document step, ORT int8, one core)",
        "sources": sources,
    }


def device_inputs() -> dict[str, Any]:
    """The device's draft step: ORT int8 0.5B decode on the CPU machine (the default scheme)."""
    path = _result("device/runtime.json")
    data = _load(path)
    scheme = data["config"]["default_scheme"]
    key = next(k for k in data["rows"] if k.startswith("ORT") and scheme in k)
    return {
        "draft_ms": float(data["rows"][key]["decode_ms"]),
        "row": key,
        "file": path,
        "cpu": data["provenance"].get("cpu_model"),
    }


# --------------------------------------------------------------------------------------------
# Predictions
# --------------------------------------------------------------------------------------------


@dataclass
class Times:
    """Seconds of one basis ('events' or 'busy') and sampling path ('host' or 'gpu') as functions
    of the batch size, linear between measured sizes."""

    decode: dict[int, float]
    verify: dict[int, dict[int, float]]  # batch → rows per session → s
    rows: dict[int, float]  # row count → s
    host_math: dict[str, float] = field(default_factory=dict)  # mode → s per session
    memo: dict[tuple[float, int], float] = field(default_factory=dict)

    @staticmethod
    def _interp(table: Mapping[int, float], x: float) -> float:
        keys = sorted(table)
        return float(np.interp(x, keys, [table[k] for k in keys]))

    def t_dec(self, n: float) -> float:
        return self._interp(self.decode, n)

    def t_ver(self, n: float, rows: int) -> float:
        """Verifying `rows` positions per session at batch n: verify_line through decode (1 row)
        and the measured verification rows at that batch."""
        if (n, rows) not in self.memo:
            self.memo[n, rows] = self._t_ver(n, rows)
        return self.memo[n, rows]

    def _t_ver(self, n: float, rows: int) -> float:
        samples = [(1, self.t_dec(n))] + [
            (r, self._interp({b: v[r] for b, v in self.verify.items()}, n))
            for r in sorted(next(iter(self.verify.values())))
        ]
        return verify_line(samples, rows)

    def t_rows(self, mode: str, n: float, rows: float) -> float:
        return self._interp(self.rows, rows) + n * self.host_math.get(mode, 0.0)


def build_times(measured: Mapping[str, Any], basis: str, sampling: str) -> Times | None:
    target = measured["models"]["target"]
    key = "ms" if basis == "events" else "busy_ms"
    if any(d.get(key) is None for d in target["decode"] + target["verify"]):
        return None
    verify: dict[int, dict[int, float]] = {}
    for v in target["verify"]:
        verify.setdefault(v["batch"], {})[v["rows_per_session"]] = v[key] / 1e3
    rows = {
        r["rows"]: r["host_pull_ms" if sampling == "host" else "gpu_sample_ms"] / 1e3
        for r in measured["rows"]
    }
    host = measured["host_math"]
    math_s = (
        {m: host[f"{m}_ms_per_session"] / 1e3 for m in ("cloud", "split", "dragon")}
        if sampling == "host"
        else {}
    )
    return Times({d["batch"]: d[key] / 1e3 for d in target["decode"]}, verify, rows, math_s)


@dataclass(frozen=True)
class Link:
    rtt_s: float
    up_s_per_draft: float


def per_session(
    times: Times,
    n: float,
    alpha: float,
    link: Link,
    t_draft: float,
    dragon: Mapping[str, Any],
    documents: int,
) -> dict[str, Any]:
    """Each mode's tokens/s per session at N = n sessions, by the modes' own cost models."""
    t_cloud = times.t_dec(n) + times.t_rows("cloud", n, n)
    cloud = 1.0 / t_cloud

    def t_verify(g: int) -> float:
        return times.t_ver(n, g + 1) + times.t_rows("split", n, (g + 1) * n)

    round4 = speculative_round_time(
        GAMMA,
        t_draft=t_draft,
        t_rtt=link.rtt_s,
        t_verify=t_verify(GAMMA),
        t_uplink_per_token=link.up_s_per_draft,
    )
    split4 = float(expected_tokens_per_round(alpha, GAMMA)) / round4
    best, piped = (
        choose_draft_length(
            min(alpha, 0.999),
            t_draft=t_draft,
            t_rtt=link.rtt_s,
            t_verify=t_verify,
            t_cloud_step=t_cloud,
            t_uplink_per_token=link.up_s_per_draft,
            gamma_max=GAMMA_MAX,
            pipelined=pipelined,
        )
        for pipelined in (False, True)
    )
    costs = SplitCosts(
        gamma_max=GAMMA_MAX,
        t_draft=t_draft + link.up_s_per_draft,
        t_link=link.rtt_s,
        t_cloud_step=t_cloud,
        accepted=alpha,
        rejected=1.0 - alpha,
    )
    for rows in (1, GAMMA + 1, 2 * GAMMA + 1):
        costs.verify.append((rows, times.t_ver(n, rows) + times.t_rows("split", n, rows * n)))
    device = costs.choose(remaining=10**6)
    assert device is not None
    L = (link.up_s_per_draft + t_draft) / t_verify(GAMMA)
    agg = dragon_choose_aggregator(
        alpha_local=dragon["alpha_device"],
        alpha_remote=dragon["alpha_cloud"],
        c_dec_local=dragon["device_step_ms"] / 1e3,
        c_dec_remote=times.t_dec(documents * n) + times.t_rows("dragon", n, documents * n),
        c_trans_local=link.rtt_s / 2,
        c_trans_remote=link.rtt_s / 2,
    )
    z = agg.z_remote if agg.side == "remote" else agg.z_local
    device_rate = cloud if device.use_cloud_only else device.tokens_per_second
    return {
        "cloud_only_tok_s": cloud,
        "split_gamma4_tok_s": split4,
        "split_gamma4_ratio": split4 / cloud,
        "split_best_gamma": best.gamma,
        "split_best_tok_s": best.tokens_per_second,
        "split_best_ratio": best.tokens_per_second / cloud,
        "split_pipelined_gamma": piped.gamma,
        "split_pipelined_ratio": piped.tokens_per_second / cloud,
        "split_device_gamma": device.gamma,
        "split_device_as2_cloud_only": device.use_cloud_only,
        "split_device_tok_s": device_rate,
        "split_device_ratio": device_rate / cloud,
        "tk_slt_L": L,
        "tk_slt_eq11_speedup": float(tk_slt_speedup(alpha, GAMMA, L)),
        "dragon_aggregator": "cloud" if agg.side == "remote" else "device",
        "dragon_tok_s": 1.0 / z,
        "dragon_ratio": (1.0 / z) / cloud,
    }


def capacity(rate: Callable[[int], float], n_max: int, floor: float) -> dict[str, Any]:
    """The largest N ≤ n_max whose per-session tokens/s holds the floor (rates fall with N)."""
    best = 0
    for n in range(1, n_max + 1):
        if rate(n) >= floor:
            best = n
        else:
            break
    out: dict[str, Any] = {"sessions": best, "at_most_measured": best == n_max}
    if best:
        out["tok_s_per_session"] = rate(best)
        out["aggregate_tok_s"] = best * rate(best)
    return out


def predict(
    measured: Mapping[str, Any],
    inputs: Mapping[str, Any],
    plan: Plan,
    rtts_ms: Sequence[float],
    mbit: float,
    floor: float,
) -> dict[str, Any]:
    split, dragon = inputs["split"], inputs["dragon"]
    t_draft = inputs["device"]["draft_ms"] / 1e3
    up_s = split["up_bytes_per_drafted"]["value"] * 8 / (mbit * 1e6)
    alphas = {
        "per_token": split["alpha_per_token"]["value"],
        "accepted_fraction": split["alpha_accepted_fraction"]["value"],
    }
    records, caps = [], []
    bases = []
    for basis in ("events", "busy"):
        for sampling in ("host", "gpu"):
            times = build_times(measured, basis, sampling)
            if times is not None:
                bases.append((basis, sampling, times))
    decode_max = max(d["batch"] for d in measured["models"]["target"]["decode"])
    n_max = min(decode_max, max(v["batch"] for v in measured["models"]["target"]["verify"]))
    dragon_max = min(n_max, decode_max // plan.documents)
    for basis, sampling, times in bases:
        for rtt in rtts_ms:
            link = Link(rtt / 1e3, up_s)
            for alpha_name, alpha in alphas.items():
                for n in plan.sessions:
                    rec = per_session(times, n, alpha, link, t_draft, dragon, plan.documents)
                    records.append(
                        {
                            "kind": PREDICTION,
                            "basis": basis,
                            "sampling": sampling,
                            "rtt_ms": rtt,
                            "alpha": alpha_name,
                            "alpha_value": alpha,
                            "sessions": n,
                            **rec,
                        }
                    )
            memo: dict[int, dict[str, Any]] = {}

            def rate(
                n: int,
                key: str,
                times: Times = times,
                link: Link = link,
                memo: dict[int, dict[str, Any]] = memo,
            ) -> float:
                if n not in memo:
                    memo[n] = per_session(
                        times, n, alphas["per_token"], link, t_draft, dragon, plan.documents
                    )
                return float(memo[n][key])

            caps.append(
                {
                    "kind": PREDICTION,
                    "basis": basis,
                    "sampling": sampling,
                    "rtt_ms": rtt,
                    "alpha": "per_token",
                    "floor_tok_s": floor,
                    **{
                        mode: capacity(functools.partial(rate, key=key), top, floor)
                        for mode, key, top in (
                            ("cloud_only", "cloud_only_tok_s", n_max),
                            ("split_gamma4", "split_gamma4_tok_s", n_max),
                            ("split_device_choice", "split_device_tok_s", n_max),
                            ("dragon", "dragon_tok_s", dragon_max),
                        )
                    },
                }
            )
    return {
        "label": "Every number here is a PREDICTION: measured GPU timings put through the modes' "
        "cost models with inputs measured on the CPU machine; nothing here ran a mode.",
        "formulas": FORMULAS,
        "assumptions": ASSUMPTIONS,
        "parameters": {
            "gamma": GAMMA,
            "gamma_max": GAMMA_MAX,
            "rtt_ms": list(rtts_ms),
            "mbit": mbit,
            "t_up_ms_per_draft": up_s * 1e3,
            "t_draft_ms": t_draft * 1e3,
            "floor_tok_s": floor,
            "documents": plan.documents,
            "capacity_n_max": n_max,
        },
        "per_session": records,
        "capacity": caps,
    }


# --------------------------------------------------------------------------------------------
# Provenance, printing, main
# --------------------------------------------------------------------------------------------


def gpu_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": device.type,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=torch.cuda.get_device_name(device),
            memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            cudnn=torch.backends.cudnn.version(),
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
            info["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["nvidia_smi"] = None
    return info


def recorded_argv(argv: Sequence[str]) -> list[str]:
    """The arguments as recorded: an --out outside the repository by its file name only (a
    result names no machine's directories)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--out" and i + 1 < len(argv):
            out += [a, _path_as_recorded(argv[i + 1])]
            skip = True
        elif a.startswith("--out="):
            out.append("--out=" + _path_as_recorded(a.split("=", 1)[1]))
        else:
            out.append(a)
    return out


def _path_as_recorded(path: str) -> str:
    rel = repo_relative(path)
    return rel if not os.path.isabs(rel) else Path(rel).name


def _f(v: float | None, spec: str = ".2f") -> str:
    return "—" if v is None else format(v, spec)


def print_report(result: Mapping[str, Any]) -> None:
    m = result["measured"]
    print(
        f"\nMeasured on {m['gpu'].get('name', m['gpu']['device'])} (ms, median; busy = GPU "
        f"kernel time without launch gaps), context {m['plan']['context']} tokens:"
    )
    for name, mm in m["models"].items():
        ver = {(v["batch"], v["rows_per_session"]): v for v in mm["verify"]}
        print(f"  {name}: {mm['model']}, {mm['parameters'] / 1e6:.0f} M parameters, {mm['dtype']}")
        print("     batch | decode (busy) | verify 5 rows (busy) | verify 9 rows")
        for d in mm["decode"]:
            v5 = ver.get((d["batch"], GAMMA + 1), {})
            v9 = ver.get((d["batch"], 9), {})
            print(
                f"     {d['batch']:>5} | {d['ms']:7.2f} ({_f(d['busy_ms'])}) | "
                f"{_f(v5.get('ms')):>8} ({_f(v5.get('busy_ms'))}) | "
                f"{_f(v9.get('ms')):>8}"
            )
        for d in mm["dragon_rows"]:
            print(
                f"     DRAGON rows, {d['sessions']} sessions × {d['documents']} documents "
                f"(batch {d['batch']}): {d['ms']:.2f} ms"
            )
        print(
            f"     prefill {mm['prefill']['tokens']} tokens, batch 1 (TTFT): "
            f"{mm['prefill']['ms']:.2f} ms"
        )
    rows = {r["rows"]: r for r in m["rows"]}
    print("  rows a step needs, host pull (float32 numpy) vs sampled on the device:")
    for n in m["plan"]["sessions"]:
        for mode, r in (
            ("cloud", n),
            ("split γ=4", (GAMMA + 1) * n),
            ("DRAGON k=2", m["plan"]["documents"] * n),
        ):
            print(
                f"     N={n:>3} {mode:<10} {r:>5} rows: host pull {rows[r]['host_pull_ms']:8.2f} ms"
                f" | device sample {rows[r]['gpu_sample_ms']:7.2f} ms"
            )
    hm = m["host_math"]
    print(
        f"  host math per session (numpy, this CPU): cloud {hm['cloud_ms_per_session']:.2f} ms, "
        f"split round {hm['split_ms_per_session']:.2f} ms, DRAGON step "
        f"{hm['dragon_ms_per_session']:.2f} ms"
    )

    inp = result["inputs"]
    s, d, dev = inp["split"], inp["dragon"], inp["device"]
    print("\nInputs measured on the CPU machine:")
    print(
        f"  TK-SLT α per token {s['alpha_per_token']['value']:.3f} (cost model; "
        + ", ".join(x["file"] for x in s["alpha_per_token"]["sources"])
        + ")"
    )
    print(
        f"  TK-SLT accepted ÷ drafted {s['alpha_accepted_fraction']['value']:.3f} ("
        + ", ".join(x["file"] for x in s["alpha_accepted_fraction"]["sources"])
        + ")"
    )
    print(
        f"  DRAGON α device {d['alpha_device']:.3f}, α cloud {d['alpha_cloud']:.3f}, device "
        f"2-document step {d['device_step_ms']:.1f} ms ("
        + ", ".join(x["file"] for x in d["sources"])
        + ")"
    )
    print(f"  device draft step {dev['draft_ms']:.2f} ms ({dev['row']}, {dev['file']})")

    p = result["predictions"]
    print(
        f"\n{PREDICTION}S (α per token; ratios to cloud-only at the same N; formulas in the "
        "JSON under predictions.formulas):"
    )
    for basis in ("events", "busy"):
        for sampling in ("host", "gpu"):
            recs = [
                r
                for r in p["per_session"]
                if r["basis"] == basis and r["sampling"] == sampling and r["alpha"] == "per_token"
            ]
            if not recs:
                continue
            print(f"  [{PREDICTION}] basis {basis}, rows sampled on the {sampling}:")
            print(
                "     RTT ms |   N | cloud tok/s | split γ=4 | best γ (×)  | pipelined | "
                "device's choice | TK-SLT eq.11 | DRAGON (×, aggregator)"
            )
            for r in recs:
                dev_choice = (
                    "cloud-only"
                    if r["split_device_as2_cloud_only"]
                    else f"γ={r['split_device_gamma']} {r['split_device_ratio']:.2f}×"
                )
                print(
                    f"     {r['rtt_ms']:>6.0f} | {r['sessions']:>3} | "
                    f"{r['cloud_only_tok_s']:11.1f} | "
                    f"{r['split_gamma4_ratio']:8.2f}× | γ={r['split_best_gamma']:<2} "
                    f"{r['split_best_ratio']:5.2f}× | {r['split_pipelined_ratio']:8.2f}× | "
                    f"{dev_choice:>15} | {r['tk_slt_eq11_speedup']:11.2f}× | "
                    f"{r['dragon_ratio']:.2f}× ({r['dragon_aggregator']})"
                )
    print(
        f"  [{PREDICTION}] capacity: sessions one GPU serves at ≥ "
        f"{p['parameters']['floor_tok_s']:g} tokens/s each (≥ N: held at the largest batch "
        "measured):"
    )
    for c in p["capacity"]:

        def show(x: Mapping[str, Any]) -> str:
            return ("≥ " if x["at_most_measured"] else "") + str(x["sessions"])

        print(
            f"     {c['basis']:>6}/{c['sampling']:<4} RTT {c['rtt_ms']:>3.0f} ms: cloud-only "
            f"{show(c['cloud_only'])}, split γ=4 {show(c['split_gamma4'])}, split (device's "
            f"choice) {show(c['split_device_choice'])}, DRAGON {show(c['dragon'])}"
        )


def _finite(x: object) -> Iterable[float]:
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        yield float(x)
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from _finite(v)
    elif isinstance(x, list):
        for v in x:
            yield from _finite(v)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cuda", help="cuda (the GPU run) or cpu (a smoke run)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny configs (2 layers, width 64), context 32, N = 1, 2: seconds",
    )
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), help="default bfloat16 on cuda, float32 on cpu"
    )
    parser.add_argument("--context", type=int, help="tokens in each session's cache (512)")
    parser.add_argument("--sessions", type=int, nargs="+", help="N (1 8 32)")
    parser.add_argument(
        "--capacity-batches",
        type=int,
        nargs="*",
        help="the target's extra batch sizes for capacity (64 128 256)",
    )
    parser.add_argument("--repeats", type=int, help="timed calls per figure (10)")
    parser.add_argument("--warmup", type=int, help="untimed calls first (3)")
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[20.0, 50.0])
    parser.add_argument("--mbit", type=float, default=100.0, help="the uplink, Mbit/s")
    parser.add_argument("--floor", type=float, default=10.0, help="tokens/s per session (capacity)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--commit", help="the commit to record where there is no git history")
    parser.add_argument("--name", help="results/gpu-check/<name>.json (default: from the device)")
    parser.add_argument("--out", type=Path, help="write the JSON here instead")
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.threads:
        torch.set_num_threads(args.threads)
    base = QUICK_PLAN if args.quick else Plan()
    plan = Plan(
        context=args.context or base.context,
        sessions=tuple(args.sessions or base.sessions),
        capacity_batches=tuple(
            base.capacity_batches if args.capacity_batches is None else args.capacity_batches
        ),
        documents=base.documents,
        verify_rows=base.verify_rows,
        warmup=base.warmup if args.warmup is None else args.warmup,
        repeats=args.repeats or base.repeats,
    )
    gpu = gpu_info(device)
    slug = re.sub(r"[^a-z0-9]+", "-", str(gpu.get("name", device.type)).lower()).strip("-")
    name = args.name or slug
    out = args.out or default_out("gpu-check", name, args.quick)
    prov = record(
        command_line("benchmarks.gpu_check", recorded_argv(argv)),
        threads={"torch": torch.get_num_threads()},
        engines=["torch", "transformers"],
        packages=(
            "numpy",
            "torch",
            "transformers",
            "tokenizers",
            "safetensors",
            "tandem-assistant",
        ),
    )
    prov["commit"] = args.commit or prov.get("commit") or "unknown"
    prov["gpu"] = gpu
    try:
        import transformers

        prov["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - the run needs it below anyway
        prov["transformers"] = None
    print(
        f"gpu_check on {gpu.get('name', device.type)} ({dtype}), torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), transformers {prov['transformers']}",
        flush=True,
    )

    t_start = time.perf_counter()
    measured: dict[str, Any] = {
        "gpu": gpu,
        "plan": {
            "context": plan.context,
            "sessions": list(plan.sessions),
            "capacity_batches": list(plan.capacity_batches),
            "documents": plan.documents,
            "verify_rows": list(plan.verify_rows),
            "warmup": plan.warmup,
            "repeats": plan.repeats,
            "quick": args.quick,
            "dtype": str(dtype).removeprefix("torch."),
        },
        "models": {},
    }
    vocab = 0
    with torch.inference_mode():
        for name_ in ("target", "draft"):
            t0 = time.perf_counter()
            model = build_model(load_config(name_, args.quick), device, dtype)
            sync(device)
            built = time.perf_counter() - t0
            print(f"{name_}: built in {built:.1f} s", flush=True)
            measured["models"][name_] = measure_model(model, name_, plan, device)
            measured["models"][name_]["build_s"] = built
            vocab = int(model.config.vocab_size)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        measured["rows"] = measure_rows(plan, vocab, device)
    measured["host_math"] = measure_host_math(vocab, plan.documents, max(3, plan.repeats))
    measured["seconds"] = time.perf_counter() - t_start

    # The measurement first: a fault in what follows must not lose a GPU run.
    write_result(out, prov, {"measured": measured, "inputs": None, "predictions": None})
    inputs = {"split": split_inputs(), "dragon": dragon_inputs(), "device": device_inputs()}
    predictions = predict(measured, inputs, plan, args.rtt_ms, args.mbit, args.floor)
    bad = [x for x in _finite(predictions) if not math.isfinite(x)]
    if bad:
        print(f"warning: {len(bad)} predicted figures are not finite", file=sys.stderr)
    result = {"measured": measured, "inputs": inputs, "predictions": predictions}
    path = write_result(out, prov, result)
    print_report(result)
    print(f"\nwrote {_path_as_recorded(str(path))} ({time.perf_counter() - t_start:.0f} s)")
    return {"provenance": prov, **result}


if __name__ == "__main__":
    main()
