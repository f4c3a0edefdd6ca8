"""auto against every fixed mode (issue 34; the rules: edge_runtime.mode_choice).

    python -m benchmarks.auto                 # 60 questions × local, cloud, split, dragon, auto
    python -m benchmarks.auto --quick         # 2 questions a group (a smoke run)
    python -m benchmarks.auto --groups chat --name ort-60q-chat   # one piece of a run
    python -m benchmarks.auto --report A.json B.json              # pool pieces, print

The questions (benchmarks/data/auto/questions.toml): facts only the user's notes hold (made-up
notes, `benchmarks.private_facts`), public facts the cloud's corpus states, questions needing
both, and chat. Each is answered greedily in every fixed mode and in auto, each mode on its own
sessions, the order of the modes rotated from one question to the next; an answer is right when
it holds every expected fact. Then auto once more under the policy "questions stay on this
device", with every socket the process opens counted (as tests/test_modes.py's local-mode test
does).

Prints accuracy per mode and group; auto against each fixed mode and against the oracle (the
best mode per question, in hindsight: right if any fixed mode is); on public questions auto's
time per answer against cloud-only's (ratio with a 95 % bootstrap interval, and the worst);
the confusion table of auto's choices per group; and the targets' verdicts."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

QUESTIONS = Path(__file__).parent / "data" / "auto" / "questions.toml"
RESULTS = Path(__file__).parent / "results" / "auto"
GROUPS = ("private", "public", "both", "chat")
FIXED = ("local", "cloud", "split", "dragon")
METHODS = (*FIXED, "auto")
PER_GROUP = 15


@dataclass(frozen=True)
class Question:
    id: str
    group: str
    text: str
    facts: tuple[tuple[str, ...], ...]  # every fact must appear, in one of its spellings


def question_set(per_group: int = PER_GROUP) -> tuple[list[Any], list[Question]]:
    """The notes (made-up facts) and the questions, `per_group` of each group."""
    from benchmarks.private_facts import make_notes

    data = tomllib.loads(QUESTIONS.read_text(encoding="utf-8"))
    notes = make_notes(2 * PER_GROUP)
    out = [
        Question(f"private-{i:02d}", "private", n.question, ((n.fact,),))
        for i, n in enumerate(notes[:per_group])
    ]
    out += [
        Question(f"public-{i:02d}", "public", q["question"], _facts(q))
        for i, q in enumerate(data["public"][:per_group])
    ]
    for i, (note, q) in enumerate(zip(notes[PER_GROUP:], data["both"][:per_group], strict=False)):
        text = f"{note.question.rstrip('?')}, {q['public']}"
        out.append(Question(f"both-{i:02d}", "both", text, ((note.fact,), *_facts(q))))
    out += [
        Question(f"chat-{i:02d}", "chat", q["question"], _facts(q))
        for i, q in enumerate(data["chat"][:per_group])
    ]
    return notes, out


def _facts(q: dict) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(spellings) for spellings in q["facts"])


def right(answer: str, facts: Sequence[Sequence[str]]) -> bool:
    text = answer.lower()
    return all(any(s.lower() in text for s in spellings) for spellings in facts)


@contextmanager
def counting_sockets() -> Iterator[list[object]]:
    """Every connection this process opens meanwhile (socket.connect, connect_ex and the event
    loop's create_connection), as the local-mode privacy test counts them."""
    opened: list[object] = []
    loop = asyncio.get_running_loop()
    real = {name: getattr(socket.socket, name) for name in ("connect", "connect_ex")}
    real_create = loop.create_connection

    def spying(name: str) -> Callable[..., Any]:
        def spy(self: socket.socket, address: Any) -> Any:
            opened.append(address)
            return real[name](self, address)

        return spy

    async def spy_create(*args: Any, **kwargs: Any) -> Any:
        opened.append(args[1:3])
        return await real_create(*args, **kwargs)

    patches: list[tuple[object, str, Any]] = [
        *((socket.socket, name, spying(name)) for name in real),
        (loop, "create_connection", spy_create),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, spy in patches:
        setattr(obj, name, spy)
    try:
        yield opened
    finally:
        for obj, name, original in saved:
            setattr(obj, name, original)


async def answer_one(mode: Any, question: Question, options: Any) -> dict[str, Any]:
    from edge_runtime.events import ModeChoice, Stats, TextDelta

    text, stats, choice, decide_s = "", None, None, None
    start = time.perf_counter()
    async for ev in mode.answer(question.text, [], options):
        if isinstance(ev, TextDelta):
            text += ev.text
        elif isinstance(ev, ModeChoice):  # auto's decision: the private search, the query
            choice, decide_s = ev, time.perf_counter() - start
        elif isinstance(ev, Stats):
            stats = ev
    elapsed = time.perf_counter() - start
    assert stats is not None
    return {
        "question": question.id,
        "group": question.group,
        "answer": text,
        "right": right(text, question.facts),
        "tokens": stats.tokens,
        "ttft_s": stats.ttft_s,
        "elapsed_s": elapsed,
        "tokens_per_s": stats.tokens_per_s,
        "bytes_up": stats.bytes_up,
        "bytes_down": stats.bytes_down,
        "chose": choice.mode if choice else None,
        "decide_s": decide_s,
        "reason": choice.reason if choice else None,
    }


def contexts(
    device: Any, index: Any, url: str, token: str, methods: Sequence[str] = METHODS
) -> dict[str, Any]:
    """One mode context per method: each fixed mode and auto on sessions of their own (a
    cloud session reuses its last prompt's cache: sharing one would favour the mode that asks
    the same question second)."""
    from edge_runtime.modes import build_mode
    from edge_runtime.modes.base import CloudSettings, ModeContext
    from retrieval.embedder import question_cosines

    # the run's own cloud on this machine (on-device, as the embedded one); public passages
    # judged by the device's embedder, as the Assistant does
    judge = partial(question_cosines, index.embedder.embed)
    return {
        m: build_mode(
            m,
            ModeContext(
                device=device,
                index=index,
                judge=judge,
                cloud=CloudSettings(url, token, embedded=True),
            ),
        )
        for m in methods
    }


async def ask_all(
    modes: dict[str, Any],
    questions: Sequence[Question],
    max_tokens: int,
    on_row: Callable[[list[dict]], None],
) -> list[dict]:
    """Every question in every method (the order rotated per question): one row each."""
    from edge_runtime.options import AnswerOptions

    options = AnswerOptions(max_new_tokens=max_tokens, temperature=0.0)
    rows: list[dict] = []
    methods = list(modes)
    for i, q in enumerate(questions):
        for name in methods[i % len(methods) :] + methods[: i % len(methods)]:
            row = {"method": name, **await answer_one(modes[name], q, options)}
            rows.append(row)
            on_row(rows)
            mark = "✓" if row["right"] else "·"
            chose = f" → {row['chose']}" if row["chose"] else ""
            print(
                f"{q.id:11} {name:6}{chose:10} {mark} {row['elapsed_s']:5.1f} s "
                f"{row['answer'][:50]!r}",
                file=sys.stderr,
                flush=True,
            )
    return rows


async def decisions(mode: Any, questions: Sequence[Question], repeats: int) -> list[dict]:
    """auto's decision alone for each question, `repeats` times (the private search and the
    relevance query, run at once): what auto adds to the chosen mode's answer, measured
    apart from the answers' own variation."""
    from edge_runtime.options import AnswerOptions

    options = AnswerOptions(temperature=0.0)
    rows = []
    for q in questions:
        for _ in range(repeats):
            start = time.perf_counter()
            choice = await mode.choose(q.text, [], options)
            rows.append(
                {
                    "question": q.id,
                    "group": q.group,
                    "chose": choice.mode,
                    "decide_s": time.perf_counter() - start,
                }
            )
    return rows


async def device_only_pass(mode: Any, questions: Sequence[Question]) -> dict[str, Any]:
    """auto under the policy "questions stay on this device": every choice and every socket
    the process opened meanwhile (short answers: the choice and the sockets are the point)."""
    from edge_runtime.options import AnswerOptions

    mode.ctx.settings["auto_cloud_questions"] = False
    options = AnswerOptions(max_new_tokens=4, temperature=0.0)
    with counting_sockets() as opened:
        rows = [await answer_one(mode, q, options) for q in questions]
    mode.ctx.settings.pop("auto_cloud_questions")
    return {
        "questions": len(rows),
        "sockets_opened": len(opened),
        "chose": sorted({r["chose"] for r in rows}),
        "bytes": sum(r["bytes_up"] + r["bytes_down"] for r in rows),
    }


# --------------------------------------------------------------------------- summary


def summarise(rows: Sequence[dict]) -> dict[str, Any]:
    """Accuracy per method (overall and per group), the oracle, auto against each, auto's
    speed on public questions against cloud-only's, and auto's choices per group."""
    from benchmarks.intervals import bootstrap_ratio

    by: dict[tuple[str, str], dict] = {(r["method"], r["question"]): r for r in rows}
    methods = [m for m in METHODS if any(k[0] == m for k in by)]
    # the questions every method answered (a run cut short leaves its last one part-done)
    questions = sorted(
        q for q in {r["question"] for r in rows} if all((m, q) in by for m in methods)
    )
    if not questions:  # saved before any question was answered by every method
        return {}
    group = {r["question"]: r["group"] for r in rows}
    fixed = [m for m in FIXED if m in methods]
    acc: dict[str, dict[str, float]] = {}
    for m in methods:
        mine = [by[m, q]["right"] for q in questions if (m, q) in by]
        acc[m] = {"all": sum(mine) / len(mine)}
        for g in GROUPS:
            gs = [by[m, q]["right"] for q in questions if group[q] == g and (m, q) in by]
            if gs:
                acc[m][g] = sum(gs) / len(gs)
    oracle_right = {q: any(by[m, q]["right"] for m in fixed if (m, q) in by) for q in questions}
    acc["oracle"] = {"all": sum(oracle_right.values()) / len(questions)}
    for g in GROUPS:
        gs = [oracle_right[q] for q in questions if group[q] == g]
        if gs:
            acc["oracle"][g] = sum(gs) / len(gs)
    out: dict[str, Any] = {"accuracy": acc, "questions": len(questions), "methods": methods}
    if "auto" not in methods:
        return out
    if fixed:  # a run of auto alone (`--methods auto`) has nothing to compare with here
        out |= _auto_against(fixed, by, questions, oracle_right, acc)
    public = [q for q in questions if group[q] == "public" and ("cloud", q) in by]
    if public:
        ratio_ci = bootstrap_ratio(
            {q: by["auto", q]["elapsed_s"] for q in public},
            {q: by["cloud", q]["elapsed_s"] for q in public},
        )
        assert ratio_ci is not None
        ratio, low, high = ratio_ci
        worst = max(public, key=lambda q: by["auto", q]["elapsed_s"] / by["cloud", q]["elapsed_s"])
        out["public_time_vs_cloud"] = {
            "ratio": ratio,
            "ci95": [low, high],
            "worst": by["auto", worst]["elapsed_s"] / by["cloud", worst]["elapsed_s"],
            "worst_question": worst,
            "ttft_ratio": sum(by["auto", q]["ttft_s"] or 0 for q in public)
            / max(1e-9, sum(by["cloud", q]["ttft_s"] or 0 for q in public)),
        }
    confusion: dict[str, dict[str, int]] = {g: {} for g in GROUPS}
    for q in questions:
        chose = by["auto", q]["chose"] or "?"
        confusion[group[q]][chose] = confusion[group[q]].get(chose, 0) + 1
    out["confusion"] = {g: c for g, c in confusion.items() if c}
    return out


def _auto_against(
    fixed: Sequence[str],
    by: dict[tuple[str, str], dict],
    questions: Sequence[str],
    oracle_right: dict[str, bool],
    acc: dict[str, dict[str, float]],
) -> dict[str, Any]:
    """auto's paired difference to each fixed mode and the oracle (bootstrap over questions)."""
    from benchmarks.intervals import bootstrap_ci, verdict

    vs: dict[str, Any] = {}
    for m in [*fixed, "oracle"]:
        theirs = [oracle_right[q] if m == "oracle" else by[m, q]["right"] for q in questions]
        pairs = [
            (float(by["auto", q]["right"]), float(t))
            for q, t in zip(questions, theirs, strict=True)
        ]
        low, high = bootstrap_ci(pairs, lambda s: sum(a - b for a, b in s) / len(s))
        diff = sum(a - b for a, b in pairs) / len(pairs)
        vs[m] = {
            "difference": diff,
            "ci95": [low, high],
            "verdict": verdict(low, high, up="auto better", down="auto worse"),
        }
    oracle = acc["oracle"]["all"]
    return {
        "best_fixed": max(fixed, key=lambda m: acc[m]["all"]),
        "auto_vs": vs,
        "auto_share_of_oracle": acc["auto"]["all"] / oracle if oracle else None,
    }


def decision_bound(rows: Sequence[dict], decided: Sequence[dict]) -> dict[str, Any] | None:
    """auto on a public question is its decision, then the cloud mode's own answer (the same
    tokens: tests/test_auto_mode.py): per public question, (its slowest decision + cloud-only's
    time) ÷ cloud-only's time, and the worst of them."""
    slowest: dict[str, float] = {}
    for d in decided:
        slowest[d["question"]] = max(slowest.get(d["question"], 0.0), d["decide_s"])
    cloud = {
        r["question"]: r["elapsed_s"]
        for r in rows
        if r["method"] == "cloud" and r["group"] == "public" and r["question"] in slowest
    }
    if not cloud:
        return None
    ratios = {q: (slowest[q] + t) / t for q, t in cloud.items()}
    worst = max(ratios, key=ratios.__getitem__)
    return {
        "questions": len(ratios),
        "worst": ratios[worst],
        "worst_question": worst,
        "slowest_decision_s": max(slowest[q] for q in cloud),
    }


def verdicts(
    summary: dict[str, Any],
    private_pass: dict[str, Any] | None,
    bound: dict[str, Any] | None = None,
) -> list[str]:
    """The issue's targets, each PASS or FAIL with its figures."""
    acc, lines = summary["accuracy"], list[str]()
    if "best_fixed" not in summary:
        return lines
    best, auto = summary["best_fixed"], acc["auto"]["all"]
    vs_best = summary["auto_vs"][best]
    every_mode = set(FIXED) <= set(summary.get("methods", FIXED))  # else no accuracy verdict
    if every_mode:
        low, high = vs_best["ci95"]  # a pass only where the interval clears the target
        word = "PASS" if low > 0 else "FAIL" if high < 0 else "NOT SHOWN (within noise)"
        lines.append(
            f"{word} auto right {auto:.0%} "
            f"vs the best fixed mode ({best}) {acc[best]['all']:.0%} (target ≥; paired "
            f"difference {vs_best['difference']:+.0%}, 95 % CI "
            f"{vs_best['ci95'][0]:+.0%} to {vs_best['ci95'][1]:+.0%})"
        )
    share = summary["auto_share_of_oracle"]
    if share is not None and every_mode:
        lines.append(
            f"{'PASS' if share >= 0.9 else 'FAIL'} auto right {share:.0%} of what the "
            f"oracle is ({acc['oracle']['all']:.0%}; target ≥ 90 %)"
        )
    if (t := summary.get("public_time_vs_cloud")) is not None:
        low, high = t["ci95"]
        word = "PASS" if high <= 1.10 else "FAIL" if low > 1.10 else "NOT SHOWN (holds 1.10)"
        lines.append(
            f"{word} public questions: auto's time per answer "
            f"{t['ratio']:.3f}× cloud-only's (95 % CI {low:.3f}–{high:.3f}; target "
            f"≤ 1.10; worst question {t['worst']:.2f}×)"
        )
    if bound is not None:
        lines.append(
            f"{'PASS' if bound['worst'] <= 1.10 else 'FAIL'} public questions, auto's "
            f"decision measured alone (slowest {bound['slowest_decision_s']:.2f} s) on "
            f"top of each cloud-only answer: at worst {bound['worst']:.3f}× "
            f"({bound['questions']} questions; target ≤ 1.10)"
        )
    if private_pass is not None:
        ok = private_pass["sockets_opened"] == 0 and private_pass["chose"] == ["local"]
        lines.append(
            f'{"PASS" if ok else "FAIL"} policy "questions stay on this device": '
            f"{private_pass['questions']} questions, {private_pass['sockets_opened']} "
            f"sockets opened, choices {private_pass['chose']}"
        )
    return lines


def print_summary(summary: dict[str, Any], private_pass: dict[str, Any] | None) -> None:
    if not summary:
        print("\n  no question was answered in every method")
        return
    acc = summary["accuracy"]
    print(f"\n  {'method':8}{'all':>7}" + "".join(f"{g:>9}" for g in GROUPS))
    for m, a in acc.items():
        print(
            f"  {m:8}{a['all']:>7.0%}"
            + "".join(f"{a[g]:>9.0%}" if g in a else f"{'—':>9}" for g in GROUPS)
        )
    if "confusion" in summary:
        print("\n  auto's choices per group:")
        for g, c in summary["confusion"].items():
            print(f"  {g:8} " + ", ".join(f"{m} {n}" for m, n in sorted(c.items())))
    print()
    for line in verdicts(summary, private_pass):
        print("  " + line)


# --------------------------------------------------------------------------- run


def provenance(args: argparse.Namespace) -> dict[str, Any]:
    """The run's provenance, taken once as it starts (the code that ran, not the tree's state
    when a later answer was saved)."""
    from benchmarks.provenance import command_line, record

    return record(
        command_line("benchmarks.auto", args.argv),
        {"device_core": args.cores[0], "cloud_core": args.cores[1]},
        {"device": 1, "cloud": 1},
        [f"cloud {args.engine}", "device onnxruntime"],
    )


def result(
    args: argparse.Namespace,
    notes: Sequence[Any],
    questions: Sequence[Question],
    rows: list[dict],
    private_pass: dict | None,
    seconds: float,
) -> dict:
    return {
        "provenance": args.provenance,
        "config": {
            "engine": args.engine,
            "max_tokens": args.max_tokens,
            "per_group": args.per_group,
            "groups": list(args.groups),
            "methods": list(args.methods),
        },
        "notes": [asdict(n) for n in notes],
        "questions": [asdict(q) for q in questions],
        "rows": rows,
        "summary": summarise(rows),
        "device_only": private_pass,
        "seconds": seconds,
    }


async def run(args: argparse.Namespace) -> dict:
    from benchmarks.common import pin_device, start_cloud
    from cloud_backend.corpus import default_embedder_dir
    from edge_runtime.device import DeviceModel
    from personal_index.index import PersonalIndex
    from tandem_packaging.prepare import model_path

    args.provenance = provenance(args)
    notes, every_question = question_set(args.per_group)
    questions = [q for q in every_question if q.group in args.groups]
    cloud_core = pin_device(*args.cores)
    device = DeviceModel.load(model_path("device", "onnx-quant"), threads=1)
    started = time.perf_counter()

    def save(rows: list[dict], private_pass: dict | None = None) -> None:
        data = result(args, notes, questions, rows, private_pass, time.perf_counter() - started)
        args.out.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")

    with tempfile.TemporaryDirectory(prefix="tandem-auto-") as tmp:
        folder = Path(tmp) / "notes"
        folder.mkdir()
        for note in notes:
            (folder / note.file).write_text(note.text + "\n", encoding="utf-8")
        index = PersonalIndex(Path(tmp) / "index", default_embedder_dir())
        index.ingest([folder])
        cloud, url, token = await start_cloud(args.engine, cloud_core, corpus=True)
        modes = contexts(device, index, url, token, args.methods)
        try:
            if args.decisions:
                await decisions(modes["auto"], questions, 1)  # warm: the sessions open
                rows = await decisions(modes["auto"], questions, args.decisions)
                args.out.write_text(
                    json.dumps(
                        {
                            "provenance": result(args, notes, questions, [], None, 0)["provenance"],
                            "decisions": rows,
                        },
                        indent=1,
                    ),
                    encoding="utf-8",
                )
                return {"decisions": rows}
            rows = await ask_all(modes, questions, args.max_tokens, save)
            private_pass = await device_only_pass(modes["auto"], every_question)
            save(rows, private_pass)
        finally:
            for mode in modes.values():
                await mode.close()
            await cloud.stop()
            index.close()
    return result(args, notes, questions, rows, private_pass, time.perf_counter() - started)


def pooled(paths: Sequence[Path]) -> tuple[list[dict], dict | None]:
    """The rows of runs made in pieces (`--groups`), a later file's answer replacing an
    earlier one's for the same method and question, and the device-only pass of the last
    piece that ran one (each runs it over every question)."""
    rows: dict[tuple[str, str], dict] = {}
    private_pass = None
    for path in paths:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        rows |= {(r["method"], r["question"]): r for r in data["rows"]}
        private_pass = data.get("device_only") or private_pass
    return list(rows.values()), private_pass


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--engine", default="ort", choices=["ort", "torch"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--per-group", type=int, default=PER_GROUP)
    parser.add_argument("--quick", action="store_true", help="2 questions a group")
    parser.add_argument(
        "--groups",
        nargs="+",
        default=list(GROUPS),
        choices=GROUPS,
        help="ask only these groups (a piece of a run; see --report)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=METHODS,
        help="answer in these methods only (a piece of a run; auto is always among them)",
    )
    parser.add_argument(
        "--cores",
        nargs=2,
        type=int,
        default=[0, 1],
        metavar=("DEVICE", "CLOUD"),
        help="the cores the device and the cloud are pinned to",
    )
    parser.add_argument(
        "--decisions",
        type=int,
        default=0,
        metavar="N",
        help="time auto's decision alone, N times a question (no answers)",
    )
    parser.add_argument("--name", help="the result's file name (default: <engine>-<n>q)")
    parser.add_argument(
        "--report",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="pool runs made in pieces and print them (run nothing)",
    )
    args = parser.parse_args(argv)
    args.argv = argv
    args.methods = [m for m in METHODS if m in {*args.methods, "auto"}]
    if args.report:
        rows, private_pass = pooled(args.report)
        print_summary(summarise(rows), private_pass)
        return
    if args.quick:
        args.per_group, args.max_tokens = 2, 16
    name = args.name or f"{args.engine}-{4 * args.per_group}q" + ("-quick" if args.quick else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.out = RESULTS / f"{name}.json"
    measured = asyncio.run(run(args))  # saved after each answer
    if args.decisions:
        times = sorted(r["decide_s"] for r in measured["decisions"])
        print(
            f"decision: median {times[len(times) // 2]:.3f} s, max {times[-1]:.3f} s; "
            f"written to {args.out}"
        )
        return
    print_summary(measured["summary"], measured["device_only"])
    print(f"\n{measured['seconds']:.0f} s; written to {args.out}")


if __name__ == "__main__":
    main()
