"""Split speculative decoding vs cloud-only decoding, with the real model pair, over an
emulated link (issue 5; docs/benchmarks/index.md#measuring-honestly).

    python -m benchmarks.split                       # the full grid (hours on 2 cores)
    python -m benchmarks.split --engines torch --rtt-ms 20 50 --mbit 100 --prompts 8 \\
        --sampling greedy --max-tokens 48            # a shorter run
    python -m benchmarks.split --report benchmarks/results/split/*.json   # means of saved runs

The cloud (`tandem serve`, no public corpus, 1 thread) runs in its own process pinned to
core 1 with `taskset`; this process (the device: ONNX Runtime int8-head4, 1 thread, and the
link emulator, a TCP proxy with per-direction delay and token-bucket bandwidth) is pinned
to core 0. For every engine × link × sampling × prompt it answers with cloud-only decoding and
each split variant, pipelined (PicoSpec, the default: `tk-slt`) and stop-and-wait
(`tk-slt:stop`), (same prompt, same link, network cost included), and with `--methods
assisted` transformers' assisted generation (the 0.5B drafting for the 1.5B in this process,
torch, the cloud engine's dtype, one thread, no network: the peer a user would otherwise
pick), and prints tokens/s,
TTFT, acceptance, γ, cloud CPU-ms per emitted token (from /proc of the cloud process) and
bytes per token each way, then the means and the ratios to cloud-only measured in this run.
Per-prompt acceptance is printed too. Results are also written as JSON (--out)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from pathlib import Path

from benchmarks.common import fmt, host_port, mean_of, pin_device, start_cloud

STOP_AND_WAIT = ":stop"  # a method suffix: the variant without the pipeline


def methods() -> list[str]:
    """Cloud-only decoding, every exact split variant of the registry pipelined and
    stop-and-wait (the approximate ones, like dssd-topk, are left out: they do not compute the
    same distribution), and co-located assisted generation."""
    from collab.variants import get_variant, variant_names

    exact = sorted(n for n in variant_names() if get_variant(n).exact)
    return ["cloud", *exact, *(n + STOP_AND_WAIT for n in exact), "assisted"]


def assisted_answer(pair, prompt: list[int], max_tokens: int, temperature: float, seed: int):
    """transformers' assisted generation: (tokens, seconds, TTFT None)."""
    import torch

    from model_runtime.tokenizer import IM_END_ID

    target, draft = pair
    torch.manual_seed(seed)
    ids = torch.tensor([prompt])
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0}
        if temperature
        else {"do_sample": False}
    )
    t0 = time.perf_counter()
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        assistant_model=draft,
        max_new_tokens=max_tokens,
        eos_token_id=IM_END_ID,
        pad_token_id=IM_END_ID,
        **sampling,
    )
    seconds = time.perf_counter() - t0
    new = out[0, len(prompt) :].tolist()
    return len([t for t in new if t != IM_END_ID]), seconds


def load_assisted_pair(engine: str):
    """The 1.5B and the 0.5B as transformers models, in the cloud engine's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem_packaging.prepare import model_path

    torch.set_num_threads(1)
    dtype = torch.bfloat16 if engine == "torch" else torch.float32
    return tuple(
        AutoModelForCausalLM.from_pretrained(model_path(role, "hf"), torch_dtype=dtype).eval()
        for role in ("cloud", "device")
    )


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and the processes it started (all their threads:
    vLLM computes in its engine and worker processes), those alive now."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        child = int(stat.parent.name)
        parents[child] = int(fields[1])
        times[child] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    tree, grew = {pid}, True
    while grew:
        more = {c for c, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return sum(times.get(p, 0.0) for p in tree)


async def run(args: argparse.Namespace) -> list[dict]:
    from benchmarks.link_emulator import LinkEmulator, LinkProfile
    from benchmarks.prompts import load_prompts
    from collab.variants import DEFAULT_VARIANT
    from edge_runtime.device import DeviceModel
    from edge_runtime.events import Stats, TextDelta
    from edge_runtime.modes import build_mode
    from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext
    from model_runtime.prompting import prompt_ids
    from tandem_packaging.prepare import model_path

    prompts = load_prompts(n=args.prompts)
    assisted = None  # transformers' pair, loaded when first asked for
    device = DeviceModel.load(model_path("device", "onnx-quant"), threads=1)
    rows: list[dict] = []
    for engine in args.engines:
        cloud, url, token = await start_cloud(engine, args.cloud_core)
        host, port = host_port(url)
        try:
            for rtt in args.rtt_ms:
                for mbit in args.mbit:
                    rate = mbit * 1e6 / 8
                    one_way = LinkProfile(rtt / 2000, 0.0, rate)
                    link = LinkEmulator(host, port, one_way, one_way)
                    await link.start()
                    link_url = f"ws://127.0.0.1:{link.port}/v1/session"
                    modes = {}
                    for m in args.methods:
                        if m == "assisted":
                            continue
                        variant = DEFAULT_VARIANT if m == "cloud" else m.removesuffix(STOP_AND_WAIT)
                        ctx = ModeContext(
                            device=device, cloud=CloudSettings(link_url, token), variant=variant
                        )
                        modes[m] = build_mode("cloud" if m == "cloud" else "split", ctx)
                        ctx.retrieve_public = False
                        if m != "cloud" and args.no_as2:  # a split mode: it has costs
                            modes[m].costs.as2 = False  # type: ignore[attr-defined]
                    # warm-up: connect, let each split mode measure its costs once
                    warm = AnswerOptions(max_new_tokens=16, temperature=0.0, k=0)
                    for mode in modes.values():
                        async for _ in mode.answer("Say hello.", [], warm):
                            pass
                    for sampling in args.sampling:
                        temp = 0.0 if sampling == "greedy" else 0.7
                        for i, prompt in enumerate(prompts):
                            if "assisted" in args.methods:
                                if assisted is None:
                                    assisted = load_assisted_pair(engine)
                                ids = prompt_ids(device.tokenizer, prompt.text)
                                n, wall = assisted_answer(assisted, ids, args.max_tokens, temp, i)
                                row = _assisted_row(engine, rtt, mbit, sampling, prompt.id, n, wall)
                                rows.append(row)
                                save(args.out, rows, args)  # a stopped run keeps its rows
                                print(_line(row), flush=True)
                            for m, mode in modes.items():
                                pipelined = not m.endswith(STOP_AND_WAIT)
                                options = AnswerOptions(
                                    args.max_tokens,
                                    temperature=temp,
                                    seed=i,
                                    k=0,
                                    pipeline=pipelined,
                                )
                                cpu0 = cpu_seconds(cloud.proc.pid)
                                t0 = time.perf_counter()
                                stats = cpu_first = None
                                async for ev in mode.answer(prompt.text, [], options):
                                    if isinstance(ev, Stats):
                                        stats = ev
                                    elif isinstance(ev, TextDelta) and cpu_first is None:
                                        cpu_first = cpu_seconds(cloud.proc.pid)
                                wall = time.perf_counter() - t0
                                assert stats is not None  # every answer ends with its Stats
                                cpu_end = cpu_seconds(cloud.proc.pid)
                                cpu = cpu_end - cpu0
                                n = max(stats.tokens, 1)
                                # after the first token: the prompt's prefill (the same work in
                                # every method) is left out, the per-token decode cost remains
                                decode_ms = (
                                    1000 * (cpu_end - cpu_first) / (n - 1)
                                    if cpu_first is not None and n > 1
                                    else None
                                )
                                row = {
                                    "engine": engine,
                                    "rtt_ms": rtt,
                                    "mbit": mbit,
                                    "sampling": sampling,
                                    "prompt": prompt.id,
                                    "method": m,
                                    "tokens": stats.tokens,
                                    "wall_s": wall,
                                    "tokens_per_s": stats.tokens / wall,
                                    "ttft_s": stats.ttft_s,
                                    "acceptance": stats.acceptance,
                                    "gamma": stats.gamma,
                                    "rounds": stats.rounds,
                                    "cloud_only_tokens": stats.cloud_tokens,
                                    "cloud_cpu_ms_per_token": 1000 * cpu / n,
                                    "cloud_decode_cpu_ms_per_token": decode_ms,
                                    "up_bytes_per_token": stats.bytes_up / n,
                                    "down_bytes_per_token": stats.bytes_down / n,
                                    "up_bytes_per_drafted": (
                                        stats.draft_bytes_up / stats.drafted
                                        if stats.drafted
                                        else None
                                    ),
                                    "cost_model": _cost_model(getattr(mode, "costs", None)),
                                    "pipeline_depth": stats.pipeline_depth,
                                    "truncations": stats.truncations,
                                    "rollbacks": stats.rollbacks,
                                    "waits": stats.waits,
                                    "fast_verified": stats.fast_verified,
                                }
                                rows.append(row)
                                save(args.out, rows, args)  # a stopped run keeps its rows
                                print(_line(row), flush=True)
                    for mode in modes.values():
                        await mode.close()
                    await link.close()
        finally:
            await cloud.stop()
    return rows


def _assisted_row(engine, rtt, mbit, sampling, prompt, tokens: int, wall: float) -> dict:
    """A row of the same shape for assisted generation (no link, no cloud process)."""
    return {
        "engine": engine,
        "rtt_ms": rtt,
        "mbit": mbit,
        "sampling": sampling,
        "prompt": prompt,
        "method": "assisted",
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_s": None,
        "acceptance": None,
        "gamma": None,
        "rounds": 0,
        "cloud_only_tokens": 0,
        "cloud_cpu_ms_per_token": 0.0,
        "cloud_decode_cpu_ms_per_token": None,
        "up_bytes_per_token": 0.0,
        "down_bytes_per_token": 0.0,
        "up_bytes_per_drafted": None,
        "cost_model": None,
        "pipeline_depth": 0,
        "truncations": 0,
        "rollbacks": 0,
        "waits": 0,
        "fast_verified": 0,
    }


def _cost_model(costs) -> dict | None:
    """What split's cost model believes after this answer (ms): why it chose γ or AS²."""
    if costs is None or costs.t_draft is None:
        return None
    ms = lambda v: None if v is None else 1000 * v  # noqa: E731
    return {
        "draft_ms_per_token": ms(costs.t_draft),
        "link_ms": ms(costs.t_link),
        "cloud_ms_per_token": ms(costs.t_cloud_step),
        "alpha": costs.alpha,
        "verify_ms": {r: ms(costs.verify_time(r)) for r in (2, 3, 5)},
    }


def save(path: Path, rows: list[dict], args: argparse.Namespace | None = None) -> None:
    from benchmarks.provenance import command_line, record

    pinning = (
        {} if args is None else {"device_core": args.device_core, "cloud_core": args.cloud_core}
    )
    engines = [] if args is None else [f"cloud {e}" for e in args.engines]
    prov = record(command_line("benchmarks.split"), pinning, {"device": 1, "cloud": 1}, engines)
    path.write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1))


def load_rows(path: Path) -> list[dict]:
    """The rows of a saved run (a plain list before results carried their provenance)."""
    saved = json.loads(path.read_text())
    return saved if isinstance(saved, list) else saved["rows"]


def _line(r: dict) -> str:
    return (
        f"{r['engine']:5} rtt {r['rtt_ms']:>3} ms {r['mbit']:>4} Mbit {r['sampling']:7} "
        f"{r['prompt']:>14} {r['method']:11} {r['tokens_per_s']:6.2f} tok/s "
        f"TTFT {fmt(r['ttft_s'], '.2f')} s acc {fmt(r['acceptance'], '.2f')} "
        f"γ {fmt(r['gamma'], 'd')} cloud {r['cloud_cpu_ms_per_token']:6.1f} ms/tok "
        f"(decode {fmt(r.get('cloud_decode_cpu_ms_per_token'), '5.1f')}) "
        f"↑ {r['up_bytes_per_token']:7.1f} ↓ {r['down_bytes_per_token']:7.1f} B/tok"
        + (
            f" pipelined: {r.get('waits', 0)} of {r['rounds']} batches waited, "
            f"{r.get('fast_verified', 0)} verified early"
            if r.get("pipeline_depth")
            else ""
        )
    )


def summarise(rows: list[dict]) -> None:
    print("\nmeans over prompts (ratios to cloud-only: same engine, link, sampling, prompts)")
    keys = sorted({(r["engine"], r["rtt_ms"], r["mbit"], r["sampling"]) for r in rows})
    for key in keys:
        group = [r for r in rows if (r["engine"], r["rtt_ms"], r["mbit"], r["sampling"]) == key]
        base = [r for r in group if r["method"] == "cloud"]
        base_tps = statistics.mean(r["tokens_per_s"] for r in base) if base else None
        base_cpu = statistics.mean(r["cloud_cpu_ms_per_token"] for r in base) if base else None
        base_dec = mean_of(base, "cloud_decode_cpu_ms_per_token")
        print(f"\n{key[0]} · RTT {key[1]} ms · {key[2]} Mbit/s · {key[3]}")
        ran = ["cloud", *sorted({r["method"] for r in group} - {"cloud"})]
        for m in ran:
            rs = [r for r in group if r["method"] == m]
            if not rs:
                continue
            tps = statistics.mean(r["tokens_per_s"] for r in rs)
            cpu = statistics.mean(r["cloud_cpu_ms_per_token"] for r in rs)
            acc = [r["acceptance"] for r in rs if r["acceptance"] is not None]
            drafted = [r["up_bytes_per_drafted"] for r in rs if r["up_bytes_per_drafted"]]
            ratio = f"{tps / base_tps:5.2f}×" if base_tps else "  —  "
            cpu_ratio = f"{cpu / base_cpu:5.0%}" if base_cpu else "—"
            dec = mean_of(rs, "cloud_decode_cpu_ms_per_token")
            dec_ratio = f"{dec / base_dec:.0%}" if dec and base_dec else "—"
            print(
                f"  {m:11} {tps:6.2f} tok/s {ratio}  TTFT "
                f"{statistics.mean(r['ttft_s'] or 0 for r in rs):5.2f} s  acceptance "
                f"{fmt(statistics.mean(acc) if acc else None, '.2f')}  cloud CPU "
                f"{cpu:6.1f} ms/tok ({cpu_ratio} of cloud-only; after the first token "
                f"{fmt(dec, '.1f')} ms, {dec_ratio})  ↑ "
                f"{statistics.mean(r['up_bytes_per_token'] for r in rs):7.1f} B/tok "
                f"({fmt(statistics.mean(drafted) if drafted else None, '.1f')} B/drafted) ↓ "
                f"{statistics.mean(r['down_bytes_per_token'] for r in rs):8.1f} B/tok  "
                f"AS² tokens {sum(r['cloud_only_tokens'] for r in rs)}"
            )
        for m in ran:
            last = [r["cost_model"] for r in group if r["method"] == m and r.get("cost_model")]
            if last:
                c = last[-1]
                verify = ", ".join(f"{r} rows {fmt(v, '.0f')}" for r, v in c["verify_ms"].items())
                print(
                    f"  {m} cost model at the end: draft {fmt(c['draft_ms_per_token'], '.1f')} "
                    f"ms/token, cloud alone {fmt(c['cloud_ms_per_token'], '.1f')} ms/token, "
                    f"verify {verify} ms, link {fmt(c['link_ms'], '.1f')} ms, α "
                    f"{c['alpha']:.2f}"
                )
        for m in ran:  # the pipeline against the same variant stop-and-wait, same prompts
            stop = [r for r in group if r["method"] == m + STOP_AND_WAIT]
            if stop:
                pipe = statistics.mean(r["tokens_per_s"] for r in group if r["method"] == m)
                wait = statistics.mean(r["tokens_per_s"] for r in stop)
                print(f"  {m} pipelined vs stop-and-wait: {pipe / wait:.2f}×")
        tk = [r for r in group if r["method"] == "tk-slt"]
        if tk:
            per = ", ".join(f"{r['prompt']} {fmt(r['acceptance'], '.2f')}" for r in tk)
            print(f"  per-prompt TK-SLT acceptance: {per}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["torch", "ort"], choices=["torch", "ort"])
    parser.add_argument("--rtt-ms", nargs="+", type=float, default=[0, 20, 50, 100])
    parser.add_argument("--mbit", nargs="+", type=float, default=[100, 10])
    parser.add_argument("--methods", nargs="+", default=methods(), choices=methods())
    parser.add_argument(
        "--sampling", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"]
    )
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device-core", type=int, default=0)
    parser.add_argument("--cloud-core", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("split-results.json"))
    parser.add_argument(
        "--no-as2", action="store_true", help="always speculate (to measure what AS² saves)"
    )
    parser.add_argument(
        "--report",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="print the means of earlier runs' --out files, file by file (run nothing)",
    )
    args = parser.parse_args()
    if args.report:  # each file on its own: a cell re-run in another file stays apart
        for path in args.report:
            print(f"\n=== {path}")
            summarise(load_rows(path))
        return
    logging.basicConfig(level=logging.WARNING)
    args.cloud_core = pin_device(args.device_core, args.cloud_core)
    rows = asyncio.run(run(args))
    save(args.out, rows, args)
    summarise(rows)


if __name__ == "__main__":
    main()
