"""Private knowledge through RAPID (issue 15; docs/math.md#rapid): does a split answer use what only
the device read? Each private note holds a made-up fact no model can know (invented names and
numbers from a seeded generator, not tuned to pass), with a question about it; an answer is
right when it contains the fact. Split with η ∈ {0, 0.5, 1, 2, 5, 10, 20} (the device model
drafts with the note in its prompt, the cloud never sees it) against local mode (the device
alone, note in its prompt), cloud mode (cannot know) and dragon; sampled, since RAPID's p̂ is
p at T = 0.

    python -m benchmarks.private_facts                      # 32 notes, ORT cloud
    python -m benchmarks.private_facts --engine torch --methods cloud split-eta-20
    python -m benchmarks.private_facts --report A.json B.json   # pool runs made in pieces
    python -m benchmarks.private_facts --quick              # 3 notes, local and split η 0/2

Prints, per method, the share of answers holding the fact, acceptance and tokens/s, and the
targets: the best η answers ≥ 80 % of what local mode answers, at ≥ 1.5× cloud-only's speed
(that one is the memory-bound regime's, the torch bf16 cloud)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ETAS = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "zu",
    "ren",
    "tho",
    "vas",
    "quil",
    "dor",
    "nep",
    "sa",
    "wyn",
    "bri",
    "gal",
    "tor",
    "xe",
    "mun",
    "pha",
    "lek",
    "ost",
)
# (note, question) templates: {name} a made-up person, {value} the fact (a made-up word or a
# number), {thing} an everyday object
TEMPLATES = (
    ("{name}'s sailing boat is called {value}.", "What is {name}'s sailing boat called?"),
    ("The door code at {name}'s studio is {value}.", "What is the door code at {name}'s studio?"),
    ("{name} named the grey cat {value}.", "What did {name} name the grey cat?"),
    ("{name}'s {thing} is kept in locker {value}.", "Which locker holds {name}'s {thing}?"),
    ("{name} grew up in a village called {value}.", "In which village did {name} grow up?"),
    (
        "The wifi password at {name}'s flat is {value}.",
        "What is the wifi password at {name}'s flat?",
    ),
)
THINGS = ("bicycle", "violin", "tent", "kayak", "telescope", "sewing machine")


@dataclass(frozen=True)
class Note:
    file: str
    text: str
    question: str
    fact: str


def made_up_word(rng: np.random.Generator, parts: int = 3) -> str:
    return "".join(rng.choice(SYLLABLES, size=parts)).capitalize()


def make_notes(n: int = 32, seed: int = 2026) -> list[Note]:
    """`n` notes with distinct people and facts, the same for a given seed."""
    rng = np.random.default_rng(seed)
    notes: list[Note] = []
    names: set[str] = set()
    while len(notes) < n:
        name = made_up_word(rng, 2) + " " + made_up_word(rng, 3)
        if name in names:
            continue
        names.add(name)
        note, question = TEMPLATES[len(notes) % len(TEMPLATES)]
        numeric = "code" in note or "locker" in note
        value = str(rng.integers(1000, 9999)) if numeric else made_up_word(rng, 3)
        fields = {"name": name, "value": value, "thing": str(rng.choice(THINGS))}
        notes.append(
            Note(
                f"note-{len(notes):02d}.txt",
                note.format(**fields),
                question.format(**fields),
                value,
            )
        )
    return notes


def holds_fact(answer: str, fact: str) -> bool:
    return fact.lower() in answer.lower()


def method_names(etas: Sequence[float], with_dragon: bool = True) -> list[str]:
    return [
        "local",
        "cloud",
        *(["dragon"] if with_dragon else []),
        *(f"split-eta-{eta:g}" for eta in etas),
    ]


async def ask_all(
    device: Any,
    index: Any,
    url: str,
    token: str,
    notes: Sequence[Note],
    methods: Sequence[str],
    *,
    temperature: float,
    max_tokens: int,
    on_row: Callable[[list[dict]], None],
) -> list[dict]:
    """Every note's question in every method: one row each; `on_row` gets the rows so far
    after each answer (a long run cut short keeps what it measured)."""
    from edge_runtime.events import Stats, TextDelta
    from edge_runtime.modes import get_mode
    from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext

    rows = []
    for name in methods:
        mode_name = "split" if name.startswith("split") else name
        eta = float(name.removeprefix("split-eta-")) if mode_name == "split" else 0.0
        mode = get_mode(mode_name)(
            ModeContext(device=device, index=index, cloud=CloudSettings(url, token, embedded=True))
        )
        try:
            for i, note in enumerate(notes):
                options = AnswerOptions(
                    max_new_tokens=max_tokens, temperature=temperature, seed=i, k=2, eta=eta
                )
                text, stats = "", None
                async for ev in mode.answer(note.question, [], options):
                    if isinstance(ev, TextDelta):
                        text += ev.text
                    elif isinstance(ev, Stats):
                        stats = ev
                assert stats is not None
                row = {
                    "method": name,
                    "note": note.file,
                    "fact": note.fact,
                    "answer": text,
                    "right": holds_fact(text, note.fact),
                    "tokens": stats.tokens,
                    "tokens_per_s": stats.tokens_per_s,
                    "acceptance": stats.acceptance,
                    "ttft_s": stats.ttft_s,
                }
                rows.append(row)
                on_row(rows)
                print(
                    f"{name:14} {note.file} {'✓' if row['right'] else '·'} {text[:60]!r}",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            await mode.close()
    return rows


def summarise(rows: Sequence[dict]) -> dict:
    """Per method: share right, mean acceptance, mean tokens/s; and the two targets."""
    out: dict[str, Any] = {"methods": {}}
    for name in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == name]
        acc = [r["acceptance"] for r in mine if r["acceptance"] is not None]
        tps = [r["tokens_per_s"] for r in mine if r["tokens_per_s"]]
        out["methods"][name] = {
            "right": sum(r["right"] for r in mine) / len(mine),
            "answers": len(mine),
            "acceptance": statistics.mean(acc) if acc else None,
            "tokens_per_s": statistics.mean(tps) if tps else None,
        }
    m = out["methods"]
    splits = [k for k in m if k.startswith("split")]
    if "local" in m and splits:
        best = max(splits, key=lambda k: (m[k]["right"], m[k]["tokens_per_s"] or 0))
        out["best_split"] = best
        out["right_vs_local"] = (
            m[best]["right"] / m["local"]["right"] if m["local"]["right"] else None
        )
        if "cloud" in m and m["cloud"]["tokens_per_s"] and m[best]["tokens_per_s"]:
            out["speed_vs_cloud"] = m[best]["tokens_per_s"] / m["cloud"]["tokens_per_s"]
    return out


def compare_right(first: Sequence[dict], second: Sequence[dict]) -> dict:
    """Right answers of one method against another's on the same notes: the counts, Fisher's
    exact p, and a 95 % interval of the difference in share right (bootstrap over notes,
    paired), with a verdict that says "within noise" when the interval holds zero."""
    from benchmarks.intervals import bootstrap_ci, fisher_exact, verdict

    a = {r["note"]: bool(r["right"]) for r in first}
    b = {r["note"]: bool(r["right"]) for r in second}
    notes = sorted(a.keys() & b.keys())
    if not notes:
        raise ValueError("the two methods share no note")
    pairs = [(a[n], b[n]) for n in notes]
    right_a, right_b = sum(x for x, _ in pairs), sum(y for _, y in pairs)

    def diff(sample: Sequence[tuple[bool, bool]]) -> float:
        return sum(x - y for x, y in sample) / len(sample)

    ci = bootstrap_ci(pairs, diff)
    return {
        "right": [right_a, right_b],
        "notes": len(notes),
        "fisher_p": fisher_exact(right_a, len(notes), right_b, len(notes)),
        "difference": diff(pairs),
        "ci95": list(ci),
        "verdict": verdict(ci[0], ci[1], up="PASS", down="FAIL"),
    }


def comparisons(rows: Sequence[dict], summary: dict) -> dict[str, dict]:
    """dragon against the best split and the best split against local, where both ran."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    best = summary.get("best_split")
    out = {}
    for x, y in (("dragon", best), (best, "local")):
        if x in by and y in by and all("note" in r for r in by[x] + by[y]):
            out[f"{x} vs {y}"] = compare_right(by[x], by[y])
    return out


def print_comparisons(found: dict[str, dict]) -> None:
    for name, c in found.items():
        lo, hi = c["ci95"]
        print(
            f"  {c['verdict']}: {name}: {c['right'][0]}/{c['notes']} vs {c['right'][1]}/"
            f"{c['notes']} right, difference {c['difference']:+.0%} (95 % CI {lo:+.0%} to "
            f"{hi:+.0%}, bootstrap over notes; Fisher p = {c['fisher_p']:.2f})"
        )


def print_summary(summary: dict) -> None:
    print(f"\n  {'method':16}{'right':>8}{'acceptance':>12}{'tok/s':>8}")
    for name, s in summary["methods"].items():
        acc = "—" if s["acceptance"] is None else f"{s['acceptance']:.2f}"
        tps = "—" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.1f}"
        print(f"  {name:16}{s['right']:>8.0%}{acc:>12}{tps:>8}")
    if (ratio := summary.get("right_vs_local")) is not None:
        verdict = "PASS" if ratio >= 0.8 else "FAIL"
        print(
            f"  {verdict} best split ({summary['best_split']}) answers {ratio:.0%} of what "
            "local mode answers (target ≥ 80 %)"
        )
    if (speed := summary.get("speed_vs_cloud")) is not None:
        verdict = "PASS" if speed >= 1.5 else "FAIL"
        print(
            f"  {verdict} its speed is {speed:.2f}× cloud-only's (target ≥ 1.5×, "
            "memory-bound regime)"
        )


def provenance(args: argparse.Namespace) -> dict[str, Any]:
    """The run's provenance, taken once as it starts (the code that ran, not the tree's state
    when a later answer was saved)."""
    from benchmarks.provenance import command_line, record

    return record(
        command_line("benchmarks.private_facts", getattr(args, "argv", None)),
        {"device_core": 0, "cloud_core": 1},
        {"device": 1, "cloud": 1},
        [f"cloud {args.engine}", "device onnxruntime"],
    )


def result(
    args: argparse.Namespace,
    notes: Sequence[Note],
    rows: list[dict],
    seconds: float,
) -> dict:
    return {
        "provenance": args.provenance,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "argv", "provenance")},
        "notes": [asdict(n) for n in notes],
        "rows": rows,
        "summary": summarise(rows),
        "comparisons": comparisons(rows, summarise(rows)),
        "seconds": seconds,
    }


async def run(args: argparse.Namespace) -> dict:
    from benchmarks.common import pin_device, start_cloud
    from cloud_backend.corpus import default_embedder_dir
    from edge_runtime.device import DeviceModel
    from personal_index.index import PersonalIndex
    from tandem_packaging.prepare import model_path

    args.provenance = provenance(args)
    notes = make_notes(args.notes)
    cloud_core = pin_device(0, 1)
    device = DeviceModel.load(model_path("device", "onnx-quant"), threads=1)
    started = time.perf_counter()

    def save(rows: list[dict]) -> None:
        args.out.write_text(
            json.dumps(result(args, notes, rows, time.perf_counter() - started), indent=1)
        )

    with tempfile.TemporaryDirectory(prefix="tandem-facts-") as tmp:
        folder = Path(tmp) / "notes"
        folder.mkdir()
        for note in notes:
            (folder / note.file).write_text(note.text + "\n")
        index = PersonalIndex(Path(tmp) / "index", default_embedder_dir())
        index.ingest([folder])
        cloud, url, token = await start_cloud(args.engine, cloud_core, corpus=True)
        try:
            rows = await ask_all(
                device,
                index,
                url,
                token,
                notes,
                args.methods,
                temperature=args.temperature,
                max_tokens=args.max_tokens,
                on_row=save,
            )
        finally:
            await cloud.stop()
            index.close()
    return result(args, notes, rows, time.perf_counter() - started)


def report(paths: Sequence[Path]) -> None:
    """Runs made in pieces (`--methods`), pooled per cloud engine and note set: a method
    measured in two files counts all its answers."""
    pools: dict[tuple[str, int], list[dict]] = {}
    for path in paths:
        run = json.loads(path.read_text())
        pools.setdefault((run["config"]["engine"], run["config"]["notes"]), []).extend(run["rows"])
    for (engine, notes), rows in pools.items():
        print(f"\n{engine} cloud, {notes} notes ({len(rows)} answers)")
        summary = summarise(rows)
        print_summary(summary)
        print_comparisons(comparisons(rows, summary))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--notes", type=int, default=32)
    parser.add_argument("--etas", nargs="+", type=float, default=list(ETAS))
    parser.add_argument("--engine", default="ort", choices=["ort", "torch"])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-dragon", action="store_true")
    parser.add_argument("--methods", nargs="+", help="a subset, in this order (default: all)")
    parser.add_argument("--quick", action="store_true", help="3 notes, local and split η 0 / 2")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--report",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="pool earlier runs' rows per engine and print them (run nothing)",
    )
    args = parser.parse_args(argv)
    args.argv = argv  # the command the result records
    if args.report:
        report(args.report)
        return
    if args.quick:
        args.notes, args.etas, args.max_tokens = 3, [0.0, 2.0], 16
        args.methods = ["local", *(f"split-eta-{eta:g}" for eta in args.etas)]
    elif not args.methods:
        args.methods = method_names(args.etas, not args.no_dragon)
    args.out = args.out or Path(__file__).parent / "results" / "private-facts" / (
        f"{args.engine}-{args.notes}notes.json"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    measured = asyncio.run(run(args))  # saved after each answer
    print_summary(measured["summary"])
    print_comparisons(measured.get("comparisons", {}))
    print(f"\n{measured['seconds']:.0f} s; written to {args.out}")


if __name__ == "__main__":
    main()
