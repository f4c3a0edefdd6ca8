"""DRAGON evaluated as the paper does (DRAGON §7; issue 14), every part in one command:

    python -m benchmarks.dragon_eval --quick     # CI's smoke run: minutes, small sizes
    python -m benchmarks.dragon_eval             # the full study (hours here: run in pieces)

1. latency grid, Figures 6 and 7 (`benchmarks.dragon`): every baseline and DRAGON over the
   real link at each extra latency — per-token latency, TTFT, acceptance, bytes;
2. the changing link, §7.4 (`benchmarks.dragon --trace`): live scheduler vs both pinned sides;
3. the scheduler on many simulated cases, Figure 8 (`benchmarks.dragon_schedule`), fed the
   decode costs and acceptance the grid just measured;
4. perplexity, Figure 5 (`benchmarks.dragon_ppl`), with the network check;
5. DRCG/KV priced from the cloud model's cache size and the link (`benchmarks.dragon_kv`);
6. the figures (`benchmarks.dragon_figures`).

With one engine (ort, the default and --quick), one cloud (`tandem serve` with its public
corpus, pinned to core 1 as the grid pins it) serves the grid, the trace and the perplexity's
network check: one cloud start, not three. The perplexity part runs while that cloud starts
(its network check waits for it), before the grid, so the grid still has the machine alone.

Each part writes its JSON under benchmarks/results/dragon/ with the run's name; the pieces can
be run on their own (each module's docstring) and pooled with `benchmarks.dragon --report`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from asyncio import to_thread
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root is the import root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "dragon"


def part(module: str, *args: str, env: dict[str, str] | None = None) -> None:
    """One part in its own process: the grid pins its process to a core, the others must not
    inherit that. `-P` with the repository root on PYTHONPATH: this checkout's code, never
    the working folder's."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-P", "-m", f"benchmarks.{module}", *args]
    subprocess.run(cmd, check=True, env=env)


async def shared_cloud(quick: bool) -> Any:
    """The ort cloud the grid would start (its corpus, --corpus-k its k, the caches off, one
    thread on core 1 where there are two), started once for every part that talks to one."""
    from benchmarks.common import start_cloud
    from benchmarks.dragon import GRID_CLOUD_FLAGS, QUICK_K

    core = 1 if (os.cpu_count() or 1) > 1 else None  # as `benchmarks.common.pin_device`
    cloud, _, _ = await start_cloud(
        "ort", core, corpus=True, corpus_k=QUICK_K if quick else 2, extra=list(GRID_CLOUD_FLAGS)
    )
    return cloud


def publish(where: Path, cloud: Any) -> None:
    """Tell the waiting perplexity part (`dragon_ppl --cloud-file`) the cloud's URL and token,
    or, with None, that it did not start: the file appears whole (0600, then renamed)."""
    text = f"{cloud.url}\n{cloud.token}\n" if cloud is not None else ""
    tmp = where.with_suffix(".partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.rename(where)


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(study(argv))


async def study(argv: Sequence[str] | None = None) -> None:
    from benchmarks.dragon import CLOUD_TOKEN_ENV

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI's smoke run (minutes)")
    parser.add_argument("--name", help="the run's name in every JSON file (default: time)")
    parser.add_argument("--engines", nargs="+", default=["ort"], choices=["torch", "ort"])
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["grid", "trace", "schedule", "ppl", "kv"]
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args(argv)
    name = args.name or ("quick" if args.quick else time.strftime("%Y%m%d-%H%M%S"))
    quick = ["--quick"] if args.quick else []
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    grid, trace = out / f"{name}-grid.json", out / f"{name}-trace.json"
    schedule, ppl = out / f"schedule-{name}.json", out / f"ppl-{name}.json"
    started = time.time()
    talk = {"grid", "ppl"} | (set() if args.quick else {"trace"})  # the parts with a cloud
    share = args.engines == ["ort"] and len(talk - set(args.skip)) > 1
    ppl_args = [*quick, "--out", str(ppl)]
    cloud, ppl_done = None, None
    with tempfile.TemporaryDirectory(prefix="tandem-dragon-eval-") as private:  # 0700
        where = Path(private) / "cloud"
        if share and "ppl" not in args.skip:  # its perplexities need no cloud: computed while
            ppl_done = asyncio.ensure_future(  # the cloud starts, its network check waits
                to_thread(part, "dragon_ppl", *ppl_args, "--cloud-file", str(where))
            )
        try:
            if share:
                try:
                    cloud = await shared_cloud(args.quick)
                finally:
                    publish(where, cloud)  # or that it failed: the check says so, not waits
            if ppl_done is not None:
                await ppl_done  # before the grid, whose timings have the machine to themselves
            elif "ppl" not in args.skip:
                await to_thread(part, "dragon_ppl", *ppl_args)
            use = ["--cloud-url", cloud.url] if cloud else []
            env = {**os.environ, CLOUD_TOKEN_ENV: cloud.token} if cloud else None
            if "grid" not in args.skip:
                await to_thread(
                    part,
                    "dragon",
                    *quick,
                    "--engines",
                    *args.engines,
                    *use,
                    "--out",
                    str(grid),
                    env=env,
                )
            if "trace" not in args.skip and not args.quick:  # --quick answers are shorter
                await to_thread(
                    part,
                    "dragon",
                    "--trace",
                    "--engines",
                    *args.engines,
                    *use,
                    "--prompts",
                    "10",
                    "--out",
                    str(trace),
                    env=env,
                )
            if "schedule" not in args.skip:
                measured = ["--from", str(grid)] if grid.is_file() else []
                part("dragon_schedule", *quick, *measured, "--out", str(schedule))
        finally:
            if ppl_done is not None and not ppl_done.done():
                with contextlib.suppress(Exception):
                    await ppl_done  # a failed cloud start: its part ends with the check's error
            if cloud is not None:
                await cloud.stop()
    if "kv" not in args.skip:
        part(
            "dragon_kv",
            "--prompts",
            "2" if args.quick else "20",
            "--out",
            str(out / f"drcg-kv-{name}.json"),
        )
    figures = ["--grid", str(grid)] if grid.is_file() else []
    figures += ["--ppl", str(ppl)] if ppl.is_file() else []
    figures += ["--schedule", str(schedule)] if schedule.is_file() else []
    part("dragon_figures", *figures, "--out", str(out / "figures" / name))
    print(f"\nDRAGON study {name}: {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
