"""How many people one cloud serves (issue 17): aggregate tokens/s, each session's time per
token (p50/p99) and TTFT, and the cloud's CPU per token, with N = 1, 2, 4, 8, 16 sessions
answering at once, for cloud-only decoding, split (TK-SLT) and DRAGON, with the built-in
engine batching the sessions' steps (`--max-batch 64`, the default) and not (`--max-batch 1`:
one step a pass, the engine before issue 17).

    python -m benchmarks.capacity                      # the real cloud model (~15 min)
    python -m benchmarks.capacity --sessions 1 8 --modes cloud --max-batch 1 64
    python -m benchmarks.capacity --engine vllm --max-batch 64   # vLLM (its own environment)
    python -m benchmarks.capacity --quick              # the tiny model in-process (the suite)

The cloud is `tandem serve` (the prepared 1.5B, ONNX Runtime int4 by default, one thread,
pinned to core 1 with `taskset`; public corpus on, for DRAGON's passages). This process,
pinned to core 0, runs *simulated* devices (benchmarks.load's scripted devices, one websocket
each, every session a different prompt of the prompt set): sixteen real device models cannot
run on one core, and the cloud's load is what is measured. Their work is emulated:

- cloud: the device sends Generate and reads the answer.
- split: the device drafts γ = 4 tokens a round from the cloud's own greedy answer to its
  prompt (recorded first, that session alone), each token replaced by another with
  probability 1 − α (α = 0.8, about the real pair's acceptance in `benchmarks/split.py`), and
  waits γ × 22 ms (the 0.5B int8 decode here) before sending each draft.
- dragon: the cloud aggregates over its top-2 public passages; the device drafts one token a
  step (cheap: the cloud's per-document rows are the measured load).

Greedy decoding throughout. Printed and written to results/capacity/<name>.json: per engine
setting, mode and N, the aggregate tokens/s, its ratio to N = 1, p50/p99 time per token and
TTFT over the sessions, split's acceptance, and the cloud's CPU-ms per token (from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks.load import Device, Outcome, quantile
from collab import protocol as p

RESULTS = Path(__file__).parent / "results" / "capacity"
MODES = ("cloud", "split", "dragon")
GAMMA = 4


@dataclass
class SplitDevice(Device):
    """A split device that drafts from a recorded answer at a set acceptance and speed."""

    answer: tuple[int, ...] = ()  # the cloud's greedy answer to this prompt, alone
    alpha: float = 0.8
    draft_s: float = 0.022
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rng = np.random.default_rng(self.seed)

    def split_draft(self, step: int, epoch: int) -> p.TopKDraft:
        at = len(self.committed)
        on_track = tuple(self.committed) == self.answer[:at]
        ids = list(self.answer[at : at + GAMMA]) if on_track else []
        ids += [13] * (GAMMA - len(ids))  # past the recording, or off it: rejected drafts
        for i in np.flatnonzero(self.rng.random(GAMMA) > self.alpha):
            ids[i] = (ids[i] + 1) % p.DEFAULT_LIMITS.vocab_size
        tokens = np.asarray(ids)
        return p.TopKDraft(
            tokens, tokens[:, None], np.ones((GAMMA, 1)), request_id=1, epoch=epoch, step=step
        )

    async def drafting(self, n: int) -> None:
        await asyncio.sleep(n * self.draft_s)


async def answer_alone(
    url: str, token: str, tokenizer_hash: bytes, question: str, n: int
) -> list[int]:
    """The cloud's greedy answer to `question`, one session alone (what split devices draft)."""
    device = Device(url, token, tokenizer_hash, "cloud", n, question=question)
    async with aiohttp.ClientSession() as http:
        out = await device.run(http)
    if out.error:
        raise RuntimeError(f"recording an answer failed: {out.error}")
    return device.committed


CpuClock = Callable[[], float] | None  # the cloud process's CPU seconds so far
Metrics = Callable[[], Awaitable[str]] | None  # the cloud's /metrics page


async def run_round(
    devices: list[Device], cpu: CpuClock, metrics: Metrics
) -> tuple[list[Outcome], float, float | None, float | None]:
    """All devices at once: their outcomes, the wall time, the cloud's CPU seconds and the
    vocabulary rows its engine handed out (vLLM's /metrics; None for another engine)."""
    cpu0 = cpu() if cpu else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        rows0 = await rows_out(metrics)
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(d.run(http) for d in devices))
        wall = time.perf_counter() - t0
        rows1 = await rows_out(metrics)
    cpu_s = (cpu() - cpu0) if cpu and cpu0 is not None else None
    rows = rows1 - rows0 if rows0 is not None and rows1 is not None else None
    return list(outcomes), wall, cpu_s, rows


async def rows_out(metrics: Metrics) -> float | None:
    """The cloud's tandem_engine_rows_out_total (None where its engine has no such count)."""
    if metrics is None:
        return None
    text = await metrics()
    found = re.search(r"^tandem_engine_rows_out_total (\S+)", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def summarise(
    outcomes: list[Outcome], wall: float, cpu_s: float | None, rows: float | None = None
) -> dict:
    tokens = sum(o.tokens for o in outcomes)
    gaps = [g for o in outcomes for g in o.gaps_s]
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    drafted = sum(o.drafted for o in outcomes)
    return {
        "sessions": len(outcomes),
        "errors": [
            "refused (503)" if o.refused else "evicted" if o.evicted else o.error
            for o in outcomes
            if o.error or o.evicted or o.refused
        ],
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else None,
        "per_token_p50_s": quantile(gaps, 0.5),
        "per_token_p99_s": quantile(gaps, 0.99),
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p99_s": quantile(ttft, 0.99),
        "acceptance": sum(o.accepted for o in outcomes) / drafted if drafted else None,
        "cloud_cpu_ms_per_token": 1000 * cpu_s / tokens if cpu_s is not None and tokens else None,
        "rows_per_token": rows / tokens if rows is not None and tokens else None,
    }


async def measure(
    url: str,
    token: str,
    tokenizer_hash: bytes,
    questions: list[str],
    args: argparse.Namespace,
    cpu: CpuClock,
    metrics: Metrics = None,
) -> list[dict]:
    """Every mode × N on one cloud."""
    n_max = max(args.sessions)
    answers = {}
    if "split" in args.modes:
        for q in questions[:n_max]:
            answers[q] = tuple(await answer_alone(url, token, tokenizer_hash, q, args.tokens))
    rows = []
    for mode in args.modes:
        for n in args.sessions:
            devices: list[Device] = []
            for i, q in enumerate(questions[:n]):
                common = dict(
                    url=url,
                    token=token,
                    tokenizer_hash=tokenizer_hash,
                    mode=mode,
                    max_tokens=args.tokens,
                    question=q,
                    dragon_k=2,
                )
                if mode == "split":
                    devices.append(
                        SplitDevice(
                            **common, answer=answers[q], seed=i, draft_s=args.draft_ms / 1000
                        )
                    )
                else:
                    devices.append(Device(**common))
            outcomes, wall, cpu_s, rows_s = await run_round(devices, cpu, metrics)
            row = {"mode": mode, **summarise(outcomes, wall, cpu_s, rows_s)}
            rows.append(row)
            print(
                f"  {mode:6} N={n:2}: {fmt(row['tokens_per_s'], '6.2f')} tok/s  "
                f"per token p50 {fmt(row['per_token_p50_s'], '.3f')} s "
                f"p99 {fmt(row['per_token_p99_s'], '.3f')} s  TTFT p50 "
                f"{fmt(row['ttft_p50_s'], '.2f')} s  acc {fmt(row['acceptance'], '.2f')}  "
                f"cloud {fmt(row['cloud_cpu_ms_per_token'], '.0f')} ms/tok  "
                f"rows/tok {fmt(row['rows_per_token'], '.2f')}"
                + (f"  ERRORS {row['errors']}" if row["errors"] else ""),
                file=sys.stderr,
                flush=True,
            )
    return rows


def fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def ratios(rows: list[dict]) -> dict:
    """Each (setting, mode, N)'s aggregate tokens/s over the same setting and mode at N = 1,
    and split's over cloud-only's at the same setting and N."""
    out = {}
    key = {(r["max_batch"], r["mode"], r["sessions"]): r["tokens_per_s"] for r in rows}
    for (batch, mode, n), rate in key.items():
        one = key.get((batch, mode, 1))
        cloud = key.get((batch, "cloud", n))
        out[f"{mode} max_batch={batch} N={n}"] = {
            "vs_one_session": rate / one if one and rate else None,
            "vs_cloud_only": rate / cloud if cloud and rate and mode != "cloud" else None,
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.capacity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--max-batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument(
        "--engine",
        choices=("ort", "torch", "vllm"),
        default="ort",
        help="vllm: from its own environment (docs/benchmarks/vllm.md#install)",
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="torch's and vLLM's (bfloat16 runs slowly where the CPU lacks it)",
    )
    parser.add_argument(
        "--vllm-verify",
        choices=("decode", "fanout"),
        default=None,
        help="how vLLM verifies split drafts (default: the cloud's setting)",
    )
    parser.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument(
        "--draft-ms", type=float, default=22.0, help="a split device's time to draft a token"
    )
    parser.add_argument("--cloud-core", type=int, default=1)
    parser.add_argument("--device-core", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="the tiny model in this process: N = 1, 4; 8 tokens"
    )
    parser.add_argument("--tiny-root", type=Path, help="where the tiny model is (--quick)")
    parser.add_argument("--name", default=None, help="results/capacity/<name>.json")
    parser.add_argument("--out", type=Path, help="write the JSON here instead")
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.tokens, args.draft_ms = [1, 4], 8, 1.0
    questions = _questions(args)
    rows = []
    for batch in args.max_batch:
        print(f"max_batch {batch}:", file=sys.stderr, flush=True)
        got = (
            _quick(batch, questions, args)
            if args.quick
            else asyncio.run(_one_setting(batch, questions, args))
        )
        rows += [{"max_batch": batch, **row} for row in got]
    measured = ratios(rows)
    for name, r in measured.items():
        than_cloud = r["vs_cloud_only"]
        print(
            f"{name}: ×{fmt(r['vs_one_session'], '.2f')} of one session"
            + (f", ×{than_cloud:.2f} of cloud-only" if than_cloud else ""),
            file=sys.stderr,
        )
    from benchmarks.common import vllm_python
    from benchmarks.provenance import command_line, record

    pinning = {"cloud_core": args.cloud_core, "device_core": args.device_core, "taskset": True}
    vllm = vllm_python() if args.engine == "vllm" else None
    prov = record(
        command_line("benchmarks.capacity", argv),
        pinning,
        {"cloud": 1},
        [f"cloud {args.engine}"],
        vllm_python=vllm,
    )
    summary = {"provenance": prov, "config": vars(args), "rows": rows, "ratios": measured}
    name = args.name or ("quick" if args.quick else time.strftime("%Y%m%d-%H%M%S"))
    out = args.out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _questions(args: argparse.Namespace) -> list[str]:
    n = max(args.sessions)
    if args.quick:
        return [f"Tell me about {w}." for w in ("tandems", "rain", "Lisbon", "tea", "owls")][:n]
    from benchmarks.prompts import load_prompts

    return [pr.text for pr in load_prompts(n=n)]


async def _one_setting(batch: int, questions: list[str], args: argparse.Namespace) -> list[dict]:
    """`tandem serve --max-batch batch` on its own core; every mode and N against it."""
    from benchmarks.common import pin_device, start_cloud
    from benchmarks.split import cpu_seconds

    core = pin_device(args.device_core, args.cloud_core)
    config = Path(tempfile.mkdtemp()) / "capacity.toml"  # room for every session at once
    verify = f'vllm_verify = "{args.vllm_verify}"\n' if args.vllm_verify else ""
    config.write_text(f"[cloud]\nmax_sessions = {2 * max(args.sessions)}\n{verify}")
    cloud, url, token = await start_cloud(
        args.engine,
        core,
        corpus=True,
        corpus_k=2,
        extra=["--max-batch", str(batch), "--config", str(config)],
        dtype=args.dtype,
    )
    try:
        return await measure(
            url,
            token,
            _tokenizer_hash(),
            questions,
            args,
            lambda: cpu_seconds(cloud.proc.pid),
            cloud.metrics,
        )
    finally:
        await cloud.stop()


def _tokenizer_hash() -> bytes:
    """The prepared models' tokenizer (the devices say Hello with it)."""
    from model_runtime.tokenizer import load_tokenizer, tokenizer_fingerprint
    from tandem_packaging.prepare import model_path

    return bytes.fromhex(tokenizer_fingerprint(load_tokenizer(model_path("cloud", "hf"))))


def _quick(batch: int, questions: list[str], args: argparse.Namespace) -> list[dict]:
    """The tiny model on a server thread of this process (no CPU figure: one process)."""
    from platformdirs import user_cache_dir

    from benchmarks.tiny_models import build_all, builder_version
    from benchmarks.wire import TOKEN, ServerThread
    from cloud_backend.engine import LLMEngine
    from model_runtime.tokenizer import load_tokenizer
    from model_runtime.torch_runtime import TorchCausalLM

    quiet = logging.getLogger("tandem")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    cache = Path(user_cache_dir("tandem")) / "load" / f"tiny-qwen2-{builder_version()}"
    tiny = build_all(args.tiny_root or cache)
    engine = LLMEngine(
        TorchCausalLM(tiny["hf"]),
        load_tokenizer(tiny["hf"]),
        "tiny-cloud",
        max_batch_sequences=batch,
    )
    server = ServerThread(engine, p.DEFAULT_LIMITS, max_sessions=32, corpus_enabled=False)
    try:
        return asyncio.run(measure(server.url, TOKEN, engine.tokenizer_hash, questions, args, None))
    finally:
        server.stop()
        engine.close()
        quiet.setLevel(level)


if __name__ == "__main__":
    main()
