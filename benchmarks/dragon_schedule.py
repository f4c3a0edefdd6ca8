"""DRAGON's scheduling judged on many cases (DRAGON §7.4, Figure 8): a discrete-event model of
the DragonPeer loop (`collab.dragon.peer`) replays acceptance decisions under a link whose
latency changes, with the aggregator pinned to the device, pinned to the cloud, chosen at
random, or chosen by Tandem's own `collab.dragon.ledger.Scheduler` (DRAGON eq. 7) fed what it would
see live: each draft's decode time, each target's verdicts, and a ping every second.

    python -m benchmarks.dragon_schedule                      # Figure 8's grid, defaults below
    python -m benchmarks.dragon_schedule --from benchmarks/results/dragon/*.json   # measured
    python -m benchmarks.dragon_schedule --quick              # CI's smoke run

The model, per answer step t (prefills done at time 0; `one_way(τ)` the delay of a frame sent
at τ; L the lookahead):
- the first drafts come from the prefills' logits; a side's draft for t is decoded right
  after its draft for t − 1 (speculation) and sent once fewer than max(L, 1) of its drafts are
  unresolved; after its draft for t − 1 was rejected (or with L = 0, always) it is decoded
  from target t − 1 once the side learns it (the step in flight is cancelled);
- the aggregator decides t once it holds both drafts for t and knows target t − 1; the other
  side learns the target one_way later; the next aggregator travels with the target.
`tests/test_dragon_schedule.py` checks this model against the real loop on a timed link.

Decode costs and acceptance default to what `benchmarks.dragon` measured on this machine
(ORT int4 cloud, 2 documents a side); `--from` reads them from saved runs instead. The link
follows the paper: base RTT plus the extra latency, with a sinusoidal jitter of period 20π s
and amplitude a fifth of the extra latency. Totals are for 100 tokens, averaged over 50
acceptance sequences (Bernoulli at each side's measured acceptance, the same sequences for
every policy). JSON goes to benchmarks/results/dragon/schedule-<name>.json."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a file: the repository root is the import root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collab.dragon.ledger import DRAGON_LOOKAHEAD, Scheduler
from collab.protocol import AggregatorPolicy, DragonTarget, Side

RESULTS = Path(__file__).resolve().parent / "results" / "dragon"
POLICIES = ("device", "cloud", "random", "auto")
EXTRA_MS = (0, 100, 200, 300, 400, 500)
PING_EVERY_S = 1.0  # as the device and the cloud ping during a dragon answer

OneWay = Callable[[float], float]  # seconds a frame sent at time τ takes to arrive
Verdicts = Sequence[tuple[bool, bool]]  # per step: (device's draft accepted, cloud's)


@dataclass(frozen=True)
class Costs:
    """Each side's decode seconds per step as a line in the answer position (DRAGON §5.2)."""

    device: tuple[float, float]  # (seconds at position 0, seconds more per position)
    cloud: tuple[float, float]

    def decode(self, side: Side, step: int) -> float:
        a, b = self.device if side == Side.DEVICE else self.cloud
        return a + b * step


# Defaults from this machine (ORT int8 0.5B device, ORT int4 1.5B cloud, one thread each, two
# ~350-token documents a side: `--measure` measures them again) and the acceptance of
# benchmarks.dragon's greedy runs over the first 10 prompts (results/dragon/latency-*).
MEASURED = Costs(device=(0.085, 0.0), cloud=(0.150, 0.0))
MEASURED_ACCEPTANCE = (0.78, 0.96)


def sinusoidal(base_rtt: float, extra: float, period: float = 20 * math.pi) -> OneWay:
    """The paper's link: RTT(τ) = base + extra + extra/5 · sin(2πτ / period), half each way."""
    return lambda t: (base_rtt + extra + extra / 5 * math.sin(2 * math.pi * t / period)) / 2


def step_trace(segments: Sequence[tuple[float, float]]) -> OneWay:
    """A piecewise-constant RTT: (until τ seconds, rtt) pairs, the last one holding after."""
    return lambda t: next((rtt for until, rtt in segments if t < until), segments[-1][1]) / 2


def bernoulli_verdicts(n: int, alpha: tuple[float, float], rng: np.random.Generator) -> Verdicts:
    draws = rng.random((n, 2)) < np.array(alpha)
    return [(bool(d), bool(c)) for d, c in draws]


@dataclass
class Simulated:
    """One simulated answer: when each side learned each target, who aggregated each step."""

    learned: dict[Side, list[float]] = field(default_factory=lambda: {s: [] for s in Side})
    aggregators: list[Side] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        """When the device (the user) holds the last token."""
        return self.learned[Side.DEVICE][-1]

    @property
    def switches(self) -> int:
        return sum(a != b for a, b in zip(self.aggregators, self.aggregators[1:], strict=False))


def simulate(
    costs: Costs,
    verdicts: Verdicts,
    one_way: OneWay,
    policy: str,
    *,
    lookahead: int = DRAGON_LOOKAHEAD,
    first: Side = Side.DEVICE,
    rng: np.random.Generator | None = None,
    scheduler: Scheduler | None = None,
) -> Simulated:
    """Replay `verdicts` through the loop's timing (module docstring) with one policy."""
    rng = rng or np.random.default_rng(0)
    if policy == "auto" and scheduler is None:
        scheduler = Scheduler(AggregatorPolicy.AUTO)
    ahead = max(lookahead, 1)
    sim = Simulated()
    made: dict[Side, list[float]] = {s: [] for s in Side}
    rejected = {s: False for s in Side}  # its draft for the previous step was rejected
    pinned = {"device": Side.DEVICE, "cloud": Side.CLOUD}
    aggregator, decided, last_ping = pinned.get(policy, first), 0.0, -math.inf
    for t, verdict in enumerate(verdicts):
        for s in Side:
            if t == 0:  # the prefill's logits give the first draft
                made[s].append(0.0)
            elif rejected[s] or lookahead == 0:  # decoded from the target, once it is known
                made[s].append(sim.learned[s][t - 1] + costs.decode(s, t))
            else:  # decoded from its own draft at once; sent when fewer than L are unresolved
                gate = sim.learned[s][t - ahead] if t >= ahead else 0.0
                made[s].append(max(made[s][t - 1] + costs.decode(s, t), gate))
        arrive = [made[s][t] + (0.0 if s == aggregator else one_way(made[s][t])) for s in Side]
        knows = sim.learned[aggregator][t - 1] if t else 0.0
        decided = max(decided, knows, *arrive)
        sim.learned[aggregator].append(decided)
        sim.learned[aggregator.other].append(decided + one_way(decided))
        sim.aggregators.append(aggregator)
        for s, ok in zip(Side, verdict, strict=True):
            rejected[s] = not ok
        if scheduler is not None:
            if decided - last_ping >= PING_EVERY_S:
                scheduler.observe_rtt(2 * one_way(decided))
                last_ping = decided
            for s in Side:
                if t:  # the first drafts come from the prefills (Scheduler.observe_draft)
                    scheduler.observe_decode(s, t, costs.decode(s, t))
            scheduler.observe_target(DragonTarget(0, verdict[0], verdict[1], aggregator, step=t))
        if policy == "auto":
            assert scheduler is not None
            aggregator = scheduler.choose(aggregator, t + 1)
        elif policy == "random":
            aggregator = Side(int(rng.integers(2)))
        else:
            aggregator = Side.DEVICE if policy == "device" else Side.CLOUD
    return sim


# ---------------------------------------------------------------------------- the study


def grid(
    costs: Costs,
    alpha: tuple[float, float],
    extras_ms: Sequence[float],
    *,
    tokens: int = 100,
    sequences: int = 50,
    base_rtt: float = 0.002,
    lookahead: int = DRAGON_LOOKAHEAD,
    seed: int = 0,
) -> list[dict]:
    """Figure 8: the mean total time of each policy at each extra latency, over `sequences`
    acceptance sequences (the same ones for every policy and latency)."""
    rng = np.random.default_rng(seed)
    replays = [bernoulli_verdicts(tokens, alpha, rng) for _ in range(sequences)]
    rows = []
    for extra in extras_ms:
        link = sinusoidal(base_rtt, extra / 1000)
        for policy in POLICIES:
            runs = [
                simulate(
                    costs,
                    v,
                    link,
                    policy,
                    lookahead=lookahead,
                    rng=np.random.default_rng([seed, i]),
                )
                for i, v in enumerate(replays)
            ]
            rows.append(
                {
                    "extra_ms": extra,
                    "policy": policy,
                    "tokens": tokens,
                    "total_s": statistics.mean(r.total_s for r in runs),
                    "switches": statistics.mean(r.switches for r in runs),
                }
            )
    return rows


def costs_from(paths: Sequence[Path]) -> tuple[Costs, tuple[float, float]]:
    """Each side's mean decode time and pooled acceptance over the DRAGON rows of saved
    `benchmarks.dragon` runs, grid or trace (rows that carry decode times)."""
    saved = [json.loads(p.read_text()) for p in paths]
    rows = [
        r
        for data in saved
        for r in data.get("rows", []) + data.get("trace", [])
        if r["method"].startswith("dragon-") and r.get("device_decode_s")
    ]
    if not rows:
        raise SystemExit("no DRAGON rows with decode times in " + ", ".join(map(str, paths)))

    def mean(key: str) -> float:
        return statistics.mean(r[key] for r in rows if r.get(key) is not None)

    def rate(side: str) -> float:
        return sum(r[f"{side}_accepted"] for r in rows) / sum(r[f"{side}_drafted"] for r in rows)

    costs = Costs((mean("device_decode_s"), 0.0), (mean("cloud_decode_s"), 0.0))
    return costs, (rate("device"), rate("cloud"))


def measure_costs(tokens: int = 16, prompt_tokens: int = 350, docs: int = 2) -> Costs:
    """Each side's decode seconds per token here, measured: its ONNX model on one thread, a
    batch of `docs` per-document sequences of `prompt_tokens`, `tokens` decodes (the mean)."""
    from model_runtime.ort_runtime import OrtCausalLM
    from tandem_packaging.prepare import model_path

    out = []
    for role in ("device", "cloud"):
        lm = OrtCausalLM(model_path(role, "onnx-quant"), threads=1, allow_spinning=False)
        rng = np.random.default_rng(0)
        lm.prefill([list(rng.integers(100, 20_000, prompt_tokens - 7 * d)) for d in range(docs)])
        lm.decode([11] * docs)  # warm
        t0 = time.perf_counter()
        for i in range(tokens):
            lm.decode([12 + i] * docs)
        out.append(((time.perf_counter() - t0) / tokens, 0.0))
    return Costs(out[0], out[1])


def print_grid(rows: Sequence[dict]) -> None:
    print(f"\n{'extra ms':>8} " + " ".join(f"{p:>8}" for p in POLICIES) + "   (total s)")
    for extra in sorted({r["extra_ms"] for r in rows}):
        cells = {r["policy"]: r for r in rows if r["extra_ms"] == extra}
        line = " ".join(f"{cells[p]['total_s']:>8.2f}" for p in POLICIES)
        best = min(cells[p]["total_s"] for p in ("device", "cloud"))
        auto = cells["auto"]
        print(
            f"{extra:>8.0f} {line}   auto vs better static {auto['total_s'] / best - 1:+.1%}, "
            f"{auto['switches']:.1f} switches"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="decode costs and acceptance from saved benchmarks.dragon runs",
    )
    parser.add_argument("--extra-ms", nargs="+", type=float, default=list(EXTRA_MS))
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--sequences", type=int, default=50)
    parser.add_argument("--lookahead", type=int, default=DRAGON_LOOKAHEAD)
    parser.add_argument(
        "--measure",
        action="store_true",
        help="measure the decode costs here (both ONNX models, one thread)",
    )
    parser.add_argument("--quick", action="store_true", help="CI's smoke run: 5 sequences")
    parser.add_argument("--name", help="results/dragon/schedule-<name>.json (default: time)")
    parser.add_argument("--out", type=Path, help="write the JSON here instead")
    args = parser.parse_args(argv)
    if args.quick:
        args.sequences, args.extra_ms = 5, [0.0, 300.0]
    costs, alpha = costs_from(args.sources) if args.sources else (MEASURED, MEASURED_ACCEPTANCE)
    if args.measure:
        costs = measure_costs()
    print(
        f"decode s/token: device {costs.device[0]:.3f}, cloud {costs.cloud[0]:.3f}; "
        f"acceptance: device {alpha[0]:.2f}, cloud {alpha[1]:.2f}"
    )
    started = time.time()
    rows = grid(
        costs,
        alpha,
        args.extra_ms,
        tokens=args.tokens,
        sequences=args.sequences,
        lookahead=args.lookahead,
    )
    print_grid(rows)
    name = args.name or ("quick" if args.quick else time.strftime("%Y%m%d-%H%M%S"))
    out = args.out or RESULTS / f"schedule-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {
        k: [str(p) for p in v] if k == "sources" and v else str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
    }
    from benchmarks.provenance import command_line, record

    prov = record(command_line("benchmarks.dragon_schedule", argv))
    out.write_text(
        json.dumps(
            {
                "provenance": prov,
                "config": config,
                "costs": [costs.device, costs.cloud],
                "acceptance": alpha,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"\n{time.time() - started:.1f} s; written to {out}")


if __name__ == "__main__":
    main()
