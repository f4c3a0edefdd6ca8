"""DRAGON's latency with the real model pair over an emulated link (docs/math.md#dragon,
docs/benchmarks/index.md#measuring-honestly).

    python -m benchmarks.dragon                  # the full grid: both engines, 20 prompts (hours)
    python -m benchmarks.dragon --quick          # CI's smoke run: 1 prompt, +100 ms, ort
    python -m benchmarks.dragon --engines torch --latency-ms 100 200 --prompts 8
    python -m benchmarks.dragon --engines ort --sampling greedy --prompt-range 0 10   # a piece
    python -m benchmarks.dragon --trace --engines ort --prompts 10   # §7.4: latency changes
    python -m benchmarks.dragon --report benchmarks/results/dragon/*.json   # pieces pooled
    python -m benchmarks.dragon --caches --engines ort --prompts 10   # KV reuse: off/cold/warm

The cloud (`tandem serve` with its public corpus, 1 thread) runs in its own process pinned to
core 1 with `taskset`; this process (the device: ONNX Runtime int8 0.5B, 1 thread, its
private index, and the link emulator, a TCP proxy) is pinned to core 0. The private index is
built once, in a temporary folder, from a few generated notes (`NOTES`); each side retrieves
its top-k (default 2) documents. The extra latency L is added to the round trip as in the
paper (netem on the server, jitter L/5): L/2 each way, with jitter uniform in [0, L/10] each
way. For every engine × latency × sampling × prompt, the same question is answered by every
method, one after the other on the same link:

    dragon-auto    DRAGON, the live scheduler picks the aggregator before every token
    dragon-device  DRAGON, aggregation pinned to the device
    dragon-cloud   DRAGON, aggregation pinned to the cloud
    drdg-tw        DRDG/TW: token-wise synchronous aggregation on the device (lookahead 0:
                   each side drafts one token and waits for its target)
    local-rag      CRCG/Device: device-only RAG (local mode, the same k private passages)
    crcg-cloud     CRCG/Cloud: cloud-only RAG (cloud mode, k public passages in its prompt)
    drcg-text      DRCG/Text: the cloud's k public passages sent as text, the device answers
                   with all 2k in its prompt (`benchmarks.baselines`)
    drdg-sw        DRDG/SW: each side answers alone, the two whole answers are scored under
                   both mixtures and aggregated once (`benchmarks.baselines`); nothing streams,
                   so its per-token latency is its decoding time (prefills excluded) per token

The grid runs with both document caches off, so that every method prefills its documents and
methods answered one after another compare alike; `--caches` measures what the caches change
(`benchmarks.dragon_reuse`). It prints per-token latency (the mean time between commits after
the first token), TTFT
(retrieval included), each side's acceptance, aggregator switches and bytes per token each
way; then, from this run alone, the issue's targets averaged over latencies of 100–300 ms,
each with PASS or FAIL. JSON goes to benchmarks/results/dragon/<name>.json."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a file: the repository root is the import root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fmt, host_port, pin_device, start_cloud

if TYPE_CHECKING:
    from benchmarks.prompts import Prompt
    from edge_runtime.device import DeviceModel, Retriever
    from edge_runtime.modes.base import AnswerOptions, Orchestrator

log = logging.getLogger("benchmarks.dragon")

RESULTS = Path(__file__).resolve().parent / "results" / "dragon"
LATENCIES_MS = (0, 50, 100, 200, 300)
BAND_MS = (100, 300)  # the targets average over these latencies (inclusive)
TEMPERATURE = 0.7  # sampled runs
QUICK_K = 1  # documents per side in --quick (also the shared cloud's --corpus-k: dragon_eval)
CLOUD_TOKEN_ENV = "TANDEM_BENCH_CLOUD_TOKEN"  # --cloud-url's token (kept off the command line)


@dataclass(frozen=True)
class Method:
    """One way to answer: a registry mode and the context settings that make it this method."""

    mode: str  # a registry mode, or a baseline of `benchmarks.baselines`
    aggregator: str = "auto"
    lookahead: int | None = None  # None: DRAGON's default lookahead


METHODS: dict[str, Method] = {
    "dragon-auto": Method("dragon", "auto"),
    "dragon-device": Method("dragon", "device"),
    "dragon-cloud": Method("dragon", "cloud"),
    "drdg-tw": Method("dragon", "device", lookahead=0),  # the paper aggregates it on the device
    "local-rag": Method("local"),  # CRCG/Device
    "crcg-cloud": Method("cloud"),
    "drcg-text": Method("drcg-text"),
    "drdg-sw": Method("drdg-sw"),
}

# The private notes the device's index holds: a person's own text, loosely about the topics
# of the prompt set, so that private retrieval finds passages of some relevance.
NOTES: dict[str, str] = {
    "hawaii-trip.md": "# Maui, last spring\nWe stayed at the Hale Kai guesthouse in Paia for "
    "nine days. The luau at Lahaina was the highlight; Keoni taught us a few hula steps and "
    "how poi is made. Road to Hana: start before 7 am, buy banana bread at mile 16.\n",
    "planner.md": "# How I plan my week\nSunday evening: list three priorities. Deep work "
    "9-11 am, no meetings. Email twice a day only. Friday 4 pm review what slipped and why. "
    "Pomodoro 25/5 works for writing, not for debugging.\n",
    "health.txt": "Doctor's advice (March): sleep 7.5 h, walk 30 minutes a day, box breathing "
    "4-4-4-4 when stressed before presentations. Cut coffee after 2 pm. Magnesium at night.\n",
    "work-q3.md": "# Quarterly Financial Report (Q3)\nRevenue up 8 % to 2.4 M EUR; costs flat. "
    "My supervisor Dana wants the cash-flow table on page 2 and the forecast in one chart. "
    "Joint venture idea with Nordlicht GmbH: shared warehouse in Hamburg, 50/50 split.\n",
    "scripts.md": "# Handy scripts\nword_count.py walks a folder with pathlib.rglob('*.txt'), "
    "lower-cases, splits on non-letters and keeps a collections.Counter; most_common(5). "
    "The C++ version uses std::ifstream and std::getline line by line.\n",
    "restaurants.txt": "Places locals actually go: Tasca do Chico (fado on Thursdays), the "
    "noodle bar behind the station (cash only, queue at noon), Maria's bakery. Rule of thumb: "
    "menus only in the local language and prices without photos.\n",
    "reading.md": "# Reading notes\nQuantum superposition: a state is a sum of basis states "
    "until measured; entanglement means the joint state does not factor. Renaissance: the "
    "printing press (Gutenberg, c. 1450) spread ideas within decades.\n",
}


def write_notes(folder: Path) -> Path:
    """The private notes as files in `folder` (what the device's index is built from)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in NOTES.items():
        (folder / name).write_text(text)
    return folder


def build_private_index(root: Path, embedder_dir: Path | None = None) -> Any:
    """A private index over the notes, built once under `root`."""
    from cloud_backend.corpus import default_embedder_dir
    from personal_index.index import PersonalIndex

    index = PersonalIndex(root / "index", embedder_dir or default_embedder_dir())
    index.ingest([write_notes(root / "notes")])
    return index


def make_modes(
    device: DeviceModel, index: Retriever, url: str, token: str, methods: Sequence[str]
) -> dict[str, Orchestrator]:
    """One mode per method, each with its own context and so its own session on the link."""
    from benchmarks.baselines import BASELINES
    from edge_runtime.modes import get_mode
    from edge_runtime.modes.base import CloudSettings, ModeContext

    modes = {}
    for name in methods:
        m = METHODS[name]
        # the benchmark's own cloud on this machine: on-device, as the embedded one
        cloud = CloudSettings(url, token, embedded=True)
        ctx = ModeContext(
            device=device,
            index=index,
            cloud=cloud,
            aggregator=m.aggregator,
            dragon_lookahead=m.lookahead,
        )
        modes[name] = (BASELINES.get(m.mode) or get_mode(m.mode))(ctx)
    return modes


async def measure(
    mode: Orchestrator,
    question: str,
    options: AnswerOptions,
    on_tokens: Callable[[int], None] | None = None,
) -> dict:
    """Answer once and return its figures. Per-token latency is the time between the first
    and the last commit that produced text over the tokens committed in between (each text
    delta is stamped with the committed count at that moment). `on_tokens(n)` is told the
    committed count at each text delta (a latency trace keyed to the answer's position)."""
    from edge_runtime.events import Failure, Stats, TextDelta

    first: tuple[float, int] | None = None
    last: tuple[float, int] | None = None
    commits: list[tuple[float, int]] = []  # (seconds since the question, tokens committed)
    stats: Stats | None = None
    start = time.perf_counter()
    failures: list[str] = []
    async for ev in mode.answer(question, [], options):
        if isinstance(ev, TextDelta):
            live = mode.live_stats()
            assert live is not None  # an answer is in progress
            last = (time.perf_counter(), live.tokens)
            first = first or last
            commits.append((last[0] - start, live.tokens))
            if on_tokens is not None:
                on_tokens(live.tokens)
        elif isinstance(ev, Stats):
            stats = ev
        elif isinstance(ev, Failure):
            failures.append(ev.message)
    assert stats is not None  # every answer ends with its Stats
    per_token = None
    if first is not None and last is not None and last[1] > first[1]:
        per_token = (last[0] - first[0]) / (last[1] - first[1])
    n = max(stats.tokens, 1)
    span = getattr(mode, "decode_span_s", None)  # DRDG/SW: the whole answer lands at once
    if span is not None:
        per_token = span / n
    return {
        "tokens": stats.tokens,
        "ttft_s": stats.ttft_s,
        "per_token_s": per_token,
        "elapsed_s": stats.elapsed_s,
        "finish": stats.finish,
        "aggregator": stats.aggregator,
        "switches": stats.switches,
        "device_drafted": stats.device_drafted,
        "device_accepted": stats.device_accepted,
        "cloud_drafted": stats.cloud_drafted,
        "cloud_accepted": stats.cloud_accepted,
        "device_acceptance": stats.device_acceptance,
        "cloud_acceptance": stats.cloud_acceptance,
        "device_decode_s": stats.device_decode_s,
        "cloud_decode_s": stats.cloud_decode_s,
        "up_bytes_per_token": stats.bytes_up / n,
        "down_bytes_per_token": stats.bytes_down / n,
        "failures": failures,
        "token_ids": stats.token_ids,
        "commits": commits,
    }


async def run_latency(
    device: DeviceModel,
    index: Retriever,
    cloud_url: str,
    token: str,
    latency_ms: float,
    prompts: Sequence[Prompt],
    *,
    engine: str,
    samplings: Sequence[str] = ("greedy", "sampled"),
    max_tokens: int = 32,
    k: int = 2,
    methods: Sequence[str] = tuple(METHODS),
    mbit: float | None = None,
) -> list[dict]:
    """Every method on every prompt over one emulated link to the cloud at `cloud_url`: the
    link adds `latency_ms` to the round trip (jitter a fifth of it). One row per answer."""
    from benchmarks.link_emulator import LinkEmulator, LinkProfile
    from edge_runtime.modes.base import AnswerOptions

    host, port = host_port(cloud_url)
    one_way = LinkProfile(latency_ms / 2000, latency_ms / 10_000, mbit * 1e6 / 8 if mbit else None)
    link = LinkEmulator(host, port, one_way, one_way, seed=int(latency_ms))
    await link.start()
    modes = make_modes(device, index, f"ws://127.0.0.1:{link.port}/v1/session", token, methods)
    rows: list[dict] = []
    try:
        # connect and ping; no documents, so no long prefill (`warm_up` did that once)
        warm = AnswerOptions(max_new_tokens=2, temperature=0.0, k=0)
        for mode in modes.values():
            async for _ in mode.answer("Say hello.", [], warm):
                pass
        for sampling in samplings:
            temperature = 0.0 if sampling == "greedy" else TEMPERATURE
            for i, prompt in enumerate(prompts):
                options = AnswerOptions(max_tokens, temperature=temperature, seed=i, k=k)
                for name, mode in modes.items():  # methods interleaved: drift hits all alike
                    row = {
                        "engine": engine,
                        "latency_ms": latency_ms,
                        "jitter_ms": latency_ms / 5,
                        "mbit": mbit,
                        "sampling": sampling,
                        "prompt": prompt.id,
                        "method": name,
                    }
                    row |= await measure(mode, prompt.text, options)
                    rows.append(row)
                    print(_line(row), flush=True)
    finally:
        for mode in modes.values():
            await mode.close()
        await link.close()
    return rows


TRACE = ((0, 20.0), (10, 250.0), (22, 20.0))  # (from answer token n, extra RTT ms): §7.4
TRACE_METHODS = ("dragon-auto", "dragon-device", "dragon-cloud")


async def run_trace(
    device: DeviceModel,
    index: Retriever,
    cloud_url: str,
    token: str,
    prompts: Sequence[Prompt],
    *,
    engine: str,
    trace: Sequence[tuple[int, float]] = TRACE,
    max_tokens: int = 32,
    k: int = 2,
) -> list[dict]:
    """DRAGON §7.4 on the real link: the extra latency changes during every answer, keyed to
    its position (`trace`: from token n on, this many ms added to the round trip, jitter a
    fifth of it), for the live scheduler and both pinned sides; greedy. One row per answer."""
    from benchmarks.link_emulator import LinkEmulator, LinkProfile
    from edge_runtime.modes.base import AnswerOptions

    def one_way(ms: float) -> LinkProfile:
        return LinkProfile(ms / 2000, ms / 10_000)

    host, port = host_port(cloud_url)
    link = LinkEmulator(host, port, one_way(trace[0][1]), one_way(trace[0][1]), seed=13)
    await link.start()
    modes = make_modes(
        device, index, f"ws://127.0.0.1:{link.port}/v1/session", token, TRACE_METHODS
    )
    rows: list[dict] = []

    def follow(n: int) -> None:
        ms = [extra for start, extra in trace if n >= start][-1]
        link.retune(one_way(ms), one_way(ms))

    try:
        warm = AnswerOptions(max_new_tokens=2, temperature=0.0, k=0)
        for mode in modes.values():
            async for _ in mode.answer("Say hello.", [], warm):
                pass
        label = " → ".join(f"{extra:.0f} ms from token {start}" for start, extra in trace)
        for i, prompt in enumerate(prompts):
            options = AnswerOptions(max_tokens, temperature=0.0, seed=i, k=k)
            for name, mode in modes.items():
                follow(0)
                row: dict[str, Any] = {
                    "engine": engine,
                    "trace": label,
                    "sampling": "greedy",
                    "prompt": prompt.id,
                    "method": name,
                }
                row |= await measure(mode, prompt.text, options, on_tokens=follow)
                rows.append(row)
                print(
                    f"trace {prompt.id:>14} {name:13} {fmt(_ms(row['per_token_s']), '6.1f')} "
                    f"ms/tok, {row['switches']} switches",
                    flush=True,
                )
    finally:
        for mode in modes.values():
            await mode.close()
        await link.close()
    return rows


def _segment(commits: Sequence[Sequence[float]], lo: int, hi: int) -> tuple[float, int] | None:
    """(seconds, tokens) an answer spent from its lo-th to its hi-th committed token."""
    at_lo = next(((t, n) for t, n in commits if n >= lo), None)
    at_hi = next(((t, n) for t, n in commits if n >= hi), None) or (
        commits[-1] if commits else None
    )
    if at_lo is None or at_hi is None or at_hi[1] <= at_lo[1]:
        return None
    return at_hi[0] - at_lo[0], int(at_hi[1] - at_lo[1])


def trace_summary(rows: Sequence[dict], trace: Sequence[tuple[int, float]] = TRACE) -> dict:
    """The trace study (§7.4): per method, the per-token latency in each segment of the trace
    (pooled over answers; a segment's first token is timed from the previous one) and over
    the whole decoding; the targets: the live scheduler within 5 % of the better pinned side
    in every segment, and strictly faster than both over the whole trace."""
    bounds = [*(start for start, _ in trace), 10**9]
    out: dict[str, Any] = {"segments": [], "whole": {}}
    for (start, extra), end in zip(trace, bounds[1:], strict=True):
        seg: dict[str, Any] = {"from_token": start, "extra_ms": extra, "ms_per_token": {}}
        for name in TRACE_METHODS:
            parts = [
                x
                for r in rows
                if r["method"] == name
                if (x := _segment(r["commits"], max(start, 1), end)) is not None
            ]
            seg["ms_per_token"][name] = (
                1000 * sum(t for t, _ in parts) / sum(n for _, n in parts) if parts else None
            )
        out["segments"].append(seg)
    for name in TRACE_METHODS:
        parts = [
            x
            for r in rows
            if r["method"] == name
            if (x := _segment(r["commits"], 1, 10**9)) is not None
        ]
        out["whole"][name] = (
            1000 * sum(t for t, _ in parts) / sum(n for _, n in parts) if parts else None
        )

    def vs_best(cell: dict) -> float | None:
        auto, pinned = cell["dragon-auto"], (cell["dragon-device"], cell["dragon-cloud"])
        return None if auto is None or None in pinned else auto / min(pinned) - 1

    out["segment_vs_better_pinned"] = [vs_best(s["ms_per_token"]) for s in out["segments"]]
    out["whole_vs_better_pinned"] = vs_best(out["whole"])
    out["whole_vs_better_pinned_ci"] = whole_interval(rows)
    return out


def whole_interval(rows: Sequence[dict]) -> tuple[float, float] | None:
    """95 % interval of the scheduler vs the better pinned side over the whole trace, by a
    bootstrap over prompts (each prompt's three answers resampled together)."""
    from benchmarks.intervals import bootstrap_ci

    by_prompt: dict[str, dict[str, tuple[float, int]]] = {}
    for r in rows:
        if r["method"] in TRACE_METHODS and (x := _segment(r["commits"], 1, 10**9)):
            by_prompt.setdefault(r.get("prompt", ""), {})[r["method"]] = x
    items = [cells for cells in by_prompt.values() if set(cells) == set(TRACE_METHODS)]
    if len(items) < 2:
        return None

    def stat(sample: Sequence[dict[str, tuple[float, int]]]) -> float:
        rate = {
            m: sum(c[m][0] for c in sample) / sum(c[m][1] for c in sample) for m in TRACE_METHODS
        }
        return rate["dragon-auto"] / min(rate["dragon-device"], rate["dragon-cloud"]) - 1

    return bootstrap_ci(items, stat)


def print_trace(summary: dict) -> None:
    from benchmarks.intervals import verdict

    print("\ntrace — ms per token (greedy; per segment of the answer, then over all of it)")
    names = "".join(f"{m:>15}" for m in TRACE_METHODS)
    print(f"  {'segment':28}{names}{'auto vs best':>14}")
    rows = [
        (f"+{s['extra_ms']:.0f} ms from token {s['from_token']}", s["ms_per_token"], v)
        for s, v in zip(summary["segments"], summary["segment_vs_better_pinned"], strict=True)
    ]
    rows.append(("whole answer", summary["whole"], summary["whole_vs_better_pinned"]))
    for label, cells, versus in rows:
        print(
            f"  {label:28}"
            + "".join(f"{fmt(cells[m], '.1f'):>15}" for m in TRACE_METHODS)
            + f"{fmt(versus, '+.1%'):>14}"
        )
    whole = summary["whole_vs_better_pinned"]
    segs = [v for v in summary["segment_vs_better_pinned"] if v is not None]
    print(
        f"  {'PASS' if segs and max(segs) <= 0.05 else 'FAIL'} auto within 5 % of the better "
        "pinned side in every segment"
    )
    ci = summary.get("whole_vs_better_pinned_ci")
    if ci is None:
        print(
            f"  {'PASS' if whole is not None and whole < 0 else 'FAIL'} auto strictly faster "
            "than both pinned sides over the whole trace (too few prompts for an interval)"
        )
    else:
        word = verdict(ci[0], ci[1], up="FAIL", down="PASS")
        print(
            f"  {word}: auto vs the better pinned side over the whole trace "
            f"{fmt(whole, '+.1%')} (95 % CI {ci[0]:+.1%} to {ci[1]:+.1%}, bootstrap over "
            "prompts; target: strictly faster)"
        )


async def warm_up(
    device: DeviceModel, index: Retriever, cloud_url: str, token: str, k: int
) -> None:
    """One short DRAGON answer with k documents a side straight to the cloud (no link): the
    runtimes' first batched prefill and decode, and both retrievers, before any measurement."""
    from edge_runtime.modes.base import AnswerOptions

    mode = make_modes(device, index, cloud_url, token, ["dragon-auto"])["dragon-auto"]
    try:
        async for _ in mode.answer("Say hello.", [], AnswerOptions(2, temperature=0.0, k=k)):
            pass
    finally:
        await mode.close()


# ---------------------------------------------------------------------------- the figures


def _mean(values: Sequence[float | None]) -> float | None:
    have = [v for v in values if v is not None]
    return statistics.mean(have) if have else None


def _rate(rows: Sequence[dict], side: str) -> float | None:
    """Pooled acceptance: accepted drafts over drafted ones, over all answers of a cell."""
    drafted = sum(r[f"{side}_drafted"] for r in rows)
    return sum(r[f"{side}_accepted"] for r in rows) / drafted if drafted else None


def cell_means(rows: Sequence[dict]) -> dict:
    """The means of one method at one latency (over prompts, and engines or samplings pooled)."""
    return {
        "answers": len(rows),
        "per_token_ms": _ms(_mean([r["per_token_s"] for r in rows])),
        "ttft_ms": _ms(_mean([r["ttft_s"] for r in rows])),
        "device_acceptance": _rate(rows, "device"),
        "cloud_acceptance": _rate(rows, "cloud"),
        "switches": _mean([r["switches"] for r in rows]),
        "up_bytes_per_token": _mean([r["up_bytes_per_token"] for r in rows]),
        "down_bytes_per_token": _mean([r["down_bytes_per_token"] for r in rows]),
        "failures": sum(len(r.get("failures", ())) for r in rows),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


@dataclass(frozen=True)
class Target:
    """One of the issue's targets: a value averaged over the band's latencies, and its bound
    (`at_least`: the value must reach it; else it must not exceed it)."""

    name: str
    value: float | None
    bound: float
    at_least: bool
    per_latency: dict[float, float]

    @property
    def passed(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.bound if self.at_least else self.value <= self.bound

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "value": self.value,
            "bound": self.bound,
            "at_least": self.at_least,
            "passed": self.passed,
            "per_latency": {str(k): v for k, v in self.per_latency.items()},
        }


def targets(cells: dict[tuple[str, float], dict], band: tuple[float, float] = BAND_MS) -> list:
    """The issue's three targets from the cell means of one group, each averaged over the
    latencies in `band` at which both of its methods ran:
    DRAGON(auto)'s per-token latency reduction vs DRDG/TW (≥ 45 %), auto vs the better pinned
    side (at most 5 % slower), and auto's TTFT vs device-only RAG (at most 10 % more)."""

    def value(method: str, latency: float, key: str) -> float | None:
        cell = cells.get((method, latency))
        return None if cell is None else cell[key]

    latencies = sorted({lat for _, lat in cells if band[0] <= lat <= band[1]})

    def per_latency(fn: Any) -> dict[float, float]:
        out = {}
        for lat in latencies:
            v = fn(lat)
            if v is not None:
                out[lat] = v
        return out

    def vs_tw(lat: float) -> float | None:
        auto, tw = value("dragon-auto", lat, "per_token_ms"), value("drdg-tw", lat, "per_token_ms")
        return 1 - auto / tw if auto is not None and tw else None

    def vs_pinned(lat: float) -> float | None:
        auto = value("dragon-auto", lat, "per_token_ms")
        pinned = [value(m, lat, "per_token_ms") for m in ("dragon-device", "dragon-cloud")]
        best = min((p for p in pinned if p is not None), default=None)
        return auto / best - 1 if auto is not None and best else None

    def vs_local(lat: float) -> float | None:
        auto, local = value("dragon-auto", lat, "ttft_ms"), value("local-rag", lat, "ttft_ms")
        return auto / local - 1 if auto is not None and local else None

    out = []
    for name, fn, bound, at_least in (
        ("per-token latency reduction vs DRDG/TW", vs_tw, 0.45, True),
        ("per-token latency vs the better pinned side", vs_pinned, 0.05, False),
        ("TTFT vs device-only RAG", vs_local, 0.10, False),
    ):
        got = per_latency(fn)
        out.append(Target(name, _mean(list(got.values())), bound, at_least, got))
    return out


def pooled_rows(paths: Sequence[Path]) -> tuple[list[dict], int]:
    """The grid rows of several runs (pieces of one grid), each (engine, sampling, method,
    latency, prompt) once: a cell run again beside other methods is not counted twice (the
    first file listed wins). Also the number of rows left out."""
    seen: set[tuple] = set()
    rows: list[dict] = []
    for path in paths:
        for r in json.loads(Path(path).read_text()).get("rows", []):
            key = (r["engine"], r["sampling"], r["method"], r["latency_ms"], r.get("prompt"))
            if key[-1] is None or key not in seen:  # a row with no prompt is its own cell
                seen.add(key)
                rows.append(r)
    total = sum(len(json.loads(Path(p).read_text()).get("rows", [])) for p in paths)
    return rows, total - len(rows)


def summarise(rows: Sequence[dict], band: tuple[float, float] = BAND_MS) -> dict:
    """Cell means per (engine, sampling) group and pooled over all ("all", "all"), and each
    group's targets."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["engine"], r["sampling"]), []).append(r)
    if len(groups) > 1:
        groups[("all", "all")] = list(rows)
    out = {}
    for (engine, sampling), group in groups.items():
        cells: dict[tuple[str, float], dict] = {}
        for key in sorted({(r["method"], r["latency_ms"]) for r in group}):
            cells[key] = cell_means([r for r in group if (r["method"], r["latency_ms"]) == key])
        out[f"{engine}/{sampling}"] = {
            "cells": [{"method": m, "latency_ms": lat, **c} for (m, lat), c in cells.items()],
            "targets": [t.as_dict() for t in targets(cells, band)],
        }
    return out


def print_summary(summary: dict) -> None:
    for group, s in summary.items():
        print(
            f"\n{group} — means over prompts (per-token: mean time between commits after "
            "the first token)"
        )
        print(
            f"  {'method':14} {'+ms':>4} {'ms/token':>9} {'TTFT ms':>8} {'acc dev':>7} "
            f"{'acc cloud':>9} {'switches':>8} {'↑ B/tok':>8} {'↓ B/tok':>8}"
        )
        for c in sorted(
            s["cells"], key=lambda c: (c["latency_ms"], list(METHODS).index(c["method"]))
        ):
            print(
                f"  {c['method']:14} {c['latency_ms']:>4.0f} {fmt(c['per_token_ms'], '.1f'):>9} "
                f"{fmt(c['ttft_ms'], '.0f'):>8} {fmt(c['device_acceptance'], '.2f'):>7} "
                f"{fmt(c['cloud_acceptance'], '.2f'):>9} {fmt(c['switches'], '.1f'):>8} "
                f"{fmt(c['up_bytes_per_token'], '.1f'):>8} "
                f"{fmt(c['down_bytes_per_token'], '.1f'):>8}"
                + (f"  ({c['failures']} failures)" if c["failures"] else "")
            )
        lo, hi = BAND_MS
        for t in s["targets"]:
            verdict = {True: "PASS", False: "FAIL", None: "n/a "}[t["passed"]]
            sign = "≥" if t["at_least"] else "≤"
            per = ", ".join(f"{float(k):.0f} ms {v:+.1%}" for k, v in t["per_latency"].items())
            print(
                f"  {verdict} {t['name']}: {fmt(t['value'], '+.1%')} ({sign} {t['bound']:+.0%}, "
                f"averaged over {lo}–{hi} ms: {per or 'none ran'})"
            )


def _line(r: dict) -> str:
    return (
        f"{r['engine']:5} +{r['latency_ms']:>3.0f} ms {r['sampling']:7} {r['prompt']:>14} "
        f"{r['method']:13} {fmt(_ms(r['per_token_s']), '6.1f')} ms/tok TTFT "
        f"{fmt(_ms(r['ttft_s']), '6.0f')} ms acc {fmt(r['device_acceptance'], '.2f')}/"
        f"{fmt(r['cloud_acceptance'], '.2f')} sw {r['switches']} ↑ "
        f"{r['up_bytes_per_token']:6.1f} ↓ {r['down_bytes_per_token']:6.1f} B/tok"
        + (f" FAILED: {'; '.join(r['failures'])}" if r["failures"] else "")
    )


# ---------------------------------------------------------------------------- the run


async def run(args: argparse.Namespace) -> list[dict]:
    from benchmarks.prompts import load_prompts
    from edge_runtime.device import DeviceModel
    from tandem_packaging.prepare import model_path

    prompts = load_prompts(n=args.prompts)[slice(*args.prompt_range)]
    device = DeviceModel.load(model_path("device", "onnx-quant"), threads=1)
    device.documents = None  # every method prefills its documents (`--caches` measures reuse)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tandem-dragon-bench-") as tmp:
        index = build_private_index(Path(tmp))
        try:
            for engine in args.engines:
                cloud, url, token = await grid_cloud(args, engine)
                try:
                    await warm_up(device, index, url, token, args.k)
                    if args.trace:
                        rows += await run_trace(
                            device,
                            index,
                            url,
                            token,
                            prompts,
                            engine=engine,
                            max_tokens=args.max_tokens,
                            k=args.k,
                        )
                        continue
                    for latency in args.latency_ms:
                        rows += await run_latency(
                            device,
                            index,
                            url,
                            token,
                            latency,
                            prompts,
                            engine=engine,
                            samplings=args.sampling,
                            max_tokens=args.max_tokens,
                            k=args.k,
                            methods=args.methods,
                            mbit=args.mbit,
                        )
                finally:
                    if cloud is not None:
                        await cloud.stop()
        finally:
            index.close()
    return rows


async def grid_cloud(args: argparse.Namespace, engine: str) -> tuple[Any, str, str]:
    """The cloud for `engine` (None, url, token): the one at --cloud-url (`dragon_eval` starts
    it once for the grid, the trace and the perplexity's network check, with the flags below),
    else a new `tandem serve` pinned to --cloud-core, stopped by the caller."""
    if args.cloud_url:
        return None, args.cloud_url, os.environ[CLOUD_TOKEN_ENV]
    return await start_cloud(  # the grid compares methods cold
        engine, args.cloud_core, corpus=True, corpus_k=args.k, extra=list(GRID_CLOUD_FLAGS)
    )


GRID_CLOUD_FLAGS = ("--document-cache-mb", "0")  # both caches off: every method prefills


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["torch", "ort"], choices=["torch", "ort"])
    parser.add_argument("--latency-ms", nargs="+", type=float, default=list(LATENCIES_MS))
    parser.add_argument("--mbit", type=float, help="link bandwidth each way (default: unlimited)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--sampling", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"]
    )
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument(
        "--prompt-range",
        nargs=2,
        type=int,
        default=(0, None),
        metavar=("START", "END"),
        help="run only prompts START..END-1 of the --prompts chosen (a grid in pieces)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("-k", type=int, default=2, help="documents per side")
    parser.add_argument("--device-core", type=int, default=0)
    parser.add_argument("--cloud-core", type=int, default=1)
    parser.add_argument(
        "--cloud-url",
        help=f"use this running ort cloud (its token in ${CLOUD_TOKEN_ENV}, its corpus-k = -k, "
        "started with the grid's flags on --cloud-core) instead of starting one",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI's smoke run: 1 prompt, k = 1, +100 ms, 8 tokens, greedy, ort",
    )
    parser.add_argument(
        "--name", help="results/dragon/<name>.json (default: quick, or a timestamp)"
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="DRAGON §7.4 instead of the grid: the link's latency changes during each answer "
        "(+20 ms, +250 ms from token 10, +20 ms from token 22); auto vs both pinned, greedy",
    )
    parser.add_argument(
        "--caches",
        action="store_true",
        help="instead of the grid: TTFT with the document caches off, cold and warm, and a "
        "question stream's hit rate and memory (benchmarks.dragon_reuse); ort, greedy, the "
        "first --latency-ms",
    )
    parser.add_argument("--out", type=Path, help="write the JSON here instead")
    parser.add_argument(
        "--report",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="print the means and targets of earlier runs (run nothing)",
    )
    args = parser.parse_args(argv)
    if args.report:  # the pieces of one grid, pooled
        saved = [json.loads(path.read_text()) for path in args.report]
        traces = [r for data in saved for r in data.get("trace", [])]
        if traces:
            print_trace(trace_summary(traces))
        rows, repeats = pooled_rows(args.report)
        print(
            f"{len(rows)} answers from {len(args.report)} file(s)"
            + (f"; {repeats} repeated cells left out (the first file wins)" if repeats else "")
        )
        print_summary(summarise(rows))
        return
    if args.quick:
        args.prompts, args.latency_ms, args.max_tokens, args.k = 1, [100.0], 8, QUICK_K
        args.sampling, args.engines = ["greedy"], ["ort"]
    if args.cloud_url and (args.engines != ["ort"] or args.caches):
        parser.error("--cloud-url is one ort cloud for the grid or the trace: --engines ort")
    logging.basicConfig(level=logging.WARNING)
    args.cloud_core = pin_device(args.device_core, args.cloud_core)
    started = time.time()
    if args.caches:
        return main_caches(args, argv, started)
    rows = asyncio.run(run(args))
    summary = trace_summary(rows) if args.trace else summarise(rows)
    name = args.name or ("quick" if args.quick else time.strftime("%Y%m%d-%H%M%S"))
    out = args.out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    key = "trace" if args.trace else "rows"  # trace rows have no fixed latency: kept apart
    from benchmarks.provenance import command_line, record

    prov = record(
        command_line("benchmarks.dragon", argv),
        {"device_core": args.device_core, "cloud_core": args.cloud_core},
        {"device": 1, "cloud": 1},
        [f"cloud {e}" for e in args.engines],
    )
    out.write_text(
        json.dumps(
            {
                "provenance": prov,
                "config": config,
                "seconds": time.time() - started,
                key: rows,
                "summary": summary,
            },
            indent=1,
        )
    )
    (print_trace if args.trace else print_summary)(summary)
    print(f"\n{time.time() - started:.0f} s; written to {out}")


def main_caches(args: argparse.Namespace, argv: Sequence[str] | None, started: float) -> None:
    """`--caches`: the document caches off, cold and warm, and a question stream."""
    from benchmarks.dragon_reuse import Harness, print_caches, run_caches, summarise_caches
    from benchmarks.prompts import load_prompts
    from benchmarks.provenance import command_line, default_out, record, write_result
    from edge_runtime.device import DeviceModel
    from tandem_packaging.prepare import model_path

    prov = record(
        command_line("benchmarks.dragon", argv),
        {"device_core": args.device_core, "cloud_core": args.cloud_core},
        {"device": 1, "cloud": 1},
        ["cloud ort"],
    )
    prompts = load_prompts(n=args.prompts)[slice(*args.prompt_range)]
    latency = args.latency_ms[0] if args.latency_ms != list(LATENCIES_MS) else 100.0

    async def go() -> tuple[list[dict], list[dict]]:
        device = DeviceModel.load(model_path("device", "onnx-quant"), threads=1)
        with tempfile.TemporaryDirectory(prefix="tandem-dragon-bench-") as tmp:
            index = build_private_index(Path(tmp))
            try:
                bench = Harness(make_modes, measure, warm_up)
                return await run_caches(
                    bench,
                    device,
                    index,
                    prompts,
                    cloud_core=args.cloud_core,
                    latency_ms=latency,
                    k=args.k,
                    max_tokens=args.max_tokens,
                )
            finally:
                index.close()

    rows, stream = asyncio.run(go())
    summary = summarise_caches(rows, stream)
    for row in rows:
        row.pop("commits", None)
    name = args.name or f"caches-ort-{latency:.0f}ms-{len(prompts)}prompts"
    out = args.out or default_out("dragon", name, args.quick)
    write_result(
        out,
        prov,
        {
            "latency_ms": latency,
            "k": args.k,
            "max_tokens": args.max_tokens,
            "seconds": time.time() - started,
            "rows": rows,
            "stream": stream,
            "summary": summary,
        },
    )
    print_caches(summary)
    print(f"\n{time.time() - started:.0f} s; written to {out}")


if __name__ == "__main__":
    main()
