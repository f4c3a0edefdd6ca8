"""Conversations, not fresh questions (issue 45): is an answer in a conversation as good as the
same question asked alone, and does a follow-up find its passage?

    python -m benchmarks.multiturn --search            # retrieval only: each follow-up's search
    python -m benchmarks.multiturn --modes local split # answers, in conversation and fresh
    python -m benchmarks.multiturn --modes local --rules before shipped   # the rules' ablation
    python -m benchmarks.multiturn --quick             # 2 conversations, local, a smoke run

The set (benchmarks/data/multiturn/conversations.toml, written before any run): made-up notes
indexed as the user's, and conversations of 4-8 turns mixing private, public, both and chat
turns, turns that provoke a refusal, follow-ups leaning on an earlier turn (pronouns, ellipsis),
and topic switches; each follow-up also written by hand as a standalone question.

* `--search`: for every scored turn with a passage to find, whether the search finds it in its
  top k (the answer's citations) when searched with the bare question, with the shipped
  follow-up rule (`edge_runtime.turns.search_questions`), optionally with the device model's
  own rewrite (`--model-rewrite`), and with the hand-written standalone question: the private
  index for notes, the public corpus for articles.
* answers: each conversation asked turn by turn in each mode (greedy, 32 tokens, the history
  the answers built), and each scored turn's standalone question asked fresh in the same mode;
  an answer is right when it holds every fact (as `benchmarks.auto`). `--rules` runs the
  conversation under the history rules as shipped and as before them (every earlier turn in
  the prompt, follow-ups searched with their bare words), for the ablation.

Prints in-conversation accuracy against fresh per mode with a 95 % paired bootstrap ratio over
turns, the same for follow-ups against their standalone versions, and how often a turn after a
refusal refused too. The cloud runs in its own process pinned to core 1, the device on core 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.auto import right

SET = Path(__file__).parent / "data" / "multiturn" / "conversations.toml"
RESULTS = Path(__file__).parent / "results" / "multiturn"
MODES = ("local", "split", "cloud", "dragon", "auto")
RULES = ("shipped", "topic", "before")
K = 3  # the passages an answer cites (the product's default k)


@dataclass(frozen=True)
class TurnSpec:
    conversation: str
    n: int
    kind: str
    follows: bool
    question: str
    standalone: str
    facts: tuple[tuple[str, ...], ...]
    source: str | None
    article: str | None

    @property
    def id(self) -> str:
        return f"{self.conversation}-{self.n}"

    @property
    def scored(self) -> bool:
        return bool(self.facts)


def load_set(path: Path = SET) -> tuple[list[dict[str, str]], list[list[TurnSpec]]]:
    """The notes ({file, text}) and the conversations, each its turns in order."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    conversations = [
        [
            TurnSpec(
                c["id"],
                n,
                t["kind"],
                t["follows"],
                t["question"],
                t["standalone"],
                tuple(tuple(f) for f in t["facts"]),
                t.get("source"),
                t.get("article"),
            )
            for n, t in enumerate(c["turn"])
        ]
        for c in data["conversation"]
    ]
    return data["note"], conversations


# --------------------------------------------------------------------------- search


async def model_rewrite(device: Any, earlier: Sequence[str], question: str) -> str:
    """The device model's own standalone rewrite of a follow-up (greedy, 40 tokens at most):
    what a model-based rule would search with."""
    from edge_runtime.events import TextDelta
    from edge_runtime.modes import build_mode
    from edge_runtime.modes.base import ModeContext
    from edge_runtime.options import AnswerOptions

    said = "\n".join(f"- {q}" for q in earlier[-3:])
    ask = (
        f"Earlier questions:\n{said}\n\nRewrite this follow-up question so that it can be "
        f"understood alone, naming what it refers to. Reply with the question only.\n\n"
        f"Follow-up: {question}"
    )
    mode = build_mode("local", ModeContext(device=device))
    text = ""
    async for ev in mode.answer(ask, [], AnswerOptions(max_new_tokens=40, temperature=0.0, k=0)):
        if isinstance(ev, TextDelta):
            text += ev.text
    return text.strip().splitlines()[0] if text.strip() else question


async def search_rows(
    conversations: Sequence[Sequence[TurnSpec]],
    index: Any,
    corpus: Any,
    device: Any | None,
    floors: dict[str, float],
) -> list[dict]:
    """Per scored turn with a passage to find, and per way of searching it: found in the top K
    above its side's floor (`floors`: the product's, private and public)."""
    from edge_runtime.turns import search_candidates, search_questions

    rows = []
    for turns in conversations:
        rule = search_questions([t.question for t in turns])
        for i, t in enumerate(turns):
            if not t.scored or not (t.source or t.article):
                continue
            asked = [u.question for u in turns[: i + 1]]
            queries: dict[str, Any] = {
                "bare": t.question,
                "rule": rule[i],
                "best": search_candidates(asked),
                "standalone": t.standalone,
            }
            if device is not None and t.follows:
                queries["model"] = await model_rewrite(
                    device, [u.question for u in turns[:i]], t.question
                )
            elif device is not None:
                queries["model"] = t.question
            for how, query in queries.items():
                for side, want in (("private", t.source), ("public", t.article)):
                    if want is None or (side == "public" and corpus is None):
                        continue
                    search = index.search if side == "private" else corpus.search
                    floor = floors[side]
                    if how == "best":  # each candidate searched, the best-scoring list kept
                        found_lists = [search(q, K, floor) for q in query]
                        hits = max(found_lists, key=lambda h: h[0].score if h else -1.0)
                    else:
                        hits = search(query, K, floor)
                    if side == "private":
                        found = any(Path(h.path).name == want for h in hits)
                    else:
                        found = any(h.title == want for h in hits)
                    rows.append(
                        {
                            "turn": t.id,
                            "kind": t.kind,
                            "follows": t.follows,
                            "side": side,
                            "how": how,
                            "query": query,
                            "found": found,
                        }
                    )
    return rows


def search_summary(rows: Sequence[dict]) -> dict[str, Any]:
    """Share found per side and way, over follow-ups and over every turn, with Wilson
    intervals; and each way against the standalone questions (paired bootstrap ratio)."""
    from benchmarks.intervals import bootstrap_ratio
    from benchmarks.retrieval import wilson

    out: dict[str, Any] = {}
    for side in ("private", "public"):
        for subset in ("follow-ups", "all"):
            mine = [r for r in rows if r["side"] == side and (r["follows"] or subset == "all")]
            if not mine:
                continue
            hows = list(dict.fromkeys(r["how"] for r in mine))
            found = {h: {r["turn"]: float(r["found"]) for r in mine if r["how"] == h} for h in hows}
            cell = {}
            for h in hows:
                n, k = len(found[h]), int(sum(found[h].values()))
                cell[h] = {
                    "found": k,
                    "n": n,
                    "share": k / n,
                    "wilson": list(wilson(k, n)),
                    "vs_standalone": bootstrap_ratio(found[h], found["standalone"]),
                }
            out[f"{side} {subset}"] = cell
    return out


# --------------------------------------------------------------------------- answers


@contextlib.contextmanager
def history_rules(name: str) -> Iterator[None]:
    """The history rules as shipped (a refused turn is left out, follow-ups are searched with
    their topic), or one measured against them: "topic" (as shipped, and a question that
    stands alone gets no earlier turn, `edge_runtime.turns.topic_start`) and "before" (main
    before issue 45: every earlier turn in the prompt, each follow-up searched with its bare
    words). The ablation swaps the shipped functions for this run only."""
    from edge_runtime.modes import auto, base, dragon, split
    from edge_runtime.turns import topic_start

    if name == "shipped":
        yield
        return
    saved = [(m, "searched_by", m.searched_by) for m in (base, auto, dragon, split)]
    saved.append((base, "steering", base.steering))
    shipped = base.steering
    if name == "before":
        base.steering = lambda question, history, *_: list(history)
        for m, attr, _ in saved[:-1]:
            setattr(m, attr, lambda question, history: [question])
    elif name == "topic":

        def topic(question: str, history: Sequence[Any], *args: Any) -> list[Any]:
            kept = shipped(question, history, *args)
            return kept[topic_start([*(t.question for t in kept), question]) :]

        setattr(base, "steering", topic)  # noqa: B010 - the swap mypy would refuse
    try:
        yield
    finally:
        for m, attr, f in saved:
            setattr(m, attr, f)


async def ask(mode: Any, question: str, history: list[Any], options: Any) -> dict[str, Any]:
    from edge_runtime.events import Citation, ModeChoice, Stats, TextDelta

    text, stats, chose, cited = "", None, None, []
    start = time.perf_counter()
    async for ev in mode.answer(question, history, options):
        if isinstance(ev, TextDelta):
            text += ev.text
        elif isinstance(ev, Citation):
            cited.append(ev.path or ev.title)
        elif isinstance(ev, ModeChoice):
            chose = ev.mode
        elif isinstance(ev, Stats):
            stats = ev
    assert stats is not None
    return {
        "answer": text,
        "elapsed_s": time.perf_counter() - start,
        "ttft_s": stats.ttft_s,
        "cited": cited,
        "chose": chose,
    }


async def converse(
    name: str, mode: Any, turns: Sequence[TurnSpec], options: Any, rules: str
) -> list[dict]:
    """One conversation in one mode, turn by turn, the history its own answers built: a turn
    the cloud took part in is one it saw (this run's cloud is on this device, as the embedded
    one is), one answered locally it never saw."""
    from edge_runtime.cloud_identity import EMBEDDED
    from edge_runtime.modes.base import Turn
    from edge_runtime.turns import refused

    history: list[Any] = []
    rows = []
    for t in turns:
        row = await ask(mode, t.question, history, options)
        answered_by = row["chose"] or name
        shared = None if answered_by == "local" else row["answer"]
        history.append(
            Turn(
                t.question,
                row["answer"],
                answered_by,
                shared=shared,
                shared_with=EMBEDDED if shared is not None else None,
            )
        )
        rows.append(_row(name, "conversation", rules, t, row) | {"refused": refused(row["answer"])})
        _say(rows[-1])
    return rows


def _row(mode: str, setting: str, rules: str, t: TurnSpec, row: dict) -> dict:
    return {
        "mode": mode,
        "setting": setting,
        "rules": rules,
        "turn": t.id,
        "kind": t.kind,
        "follows": t.follows,
        "scored": t.scored,
        "right": right(row["answer"], t.facts) if t.scored else None,
        **row,
    }


def _say(row: dict) -> None:
    mark = "·" if row["right"] is None else "✓" if row["right"] else "✗"
    print(
        f"{row['turn']:7} {row['mode']:6} {row['setting'][:5]:5} {row['rules']:7} {mark} "
        f"{row['elapsed_s']:5.1f} s {row['answer'][:60]!r}",
        file=sys.stderr,
        flush=True,
    )


async def fresh(name: str, mode: Any, turns: Sequence[TurnSpec], options: Any) -> list[dict]:
    """Each scored turn's standalone question, asked alone in the same mode."""
    from edge_runtime.turns import refused

    rows = []
    for t in turns:
        if t.scored:
            row = await ask(mode, t.standalone, [], options)
            rows.append(_row(name, "fresh", "-", t, row) | {"refused": refused(row["answer"])})
            _say(rows[-1])
    return rows


def summarise(rows: Sequence[dict], turns: Sequence[TurnSpec]) -> dict[str, Any]:
    """Per mode and rules: accuracy in conversation and fresh over the same scored turns, the
    ratio with a paired bootstrap interval over turns; the same over follow-ups; after a
    refusal, how often the next turn refused too."""
    from benchmarks.intervals import bootstrap_ratio

    after_refusal = {
        b.id
        for a, b in itertools.pairwise(turns)
        if a.kind == "refusal" and a.conversation == b.conversation
    }
    fresh_right = {
        (r["mode"], r["turn"]): float(r["right"]) for r in rows if r["setting"] == "fresh"
    }
    out: dict[str, Any] = {}
    for mode, rules in dict.fromkeys(
        (r["mode"], r["rules"]) for r in rows if r["setting"] == "conversation"
    ):
        mine = [
            r
            for r in rows
            if r["mode"] == mode
            and r["rules"] == rules
            and r["setting"] == "conversation"
            and r["scored"]
        ]
        cell: dict[str, Any] = {}
        for subset, keep in (
            ("all", lambda r: True),
            ("follow-ups", lambda r: r["follows"]),
            ("after a refusal", lambda r: r["turn"] in after_refusal),
        ):
            conv = {r["turn"]: float(r["right"]) for r in mine if keep(r)}
            base = {t: fresh_right[mode, t] for t in conv if (mode, t) in fresh_right}
            conv = {t: v for t, v in conv.items() if t in base}
            if not conv:
                continue
            cell[subset] = {
                "n": len(conv),
                "conversation": sum(conv.values()) / len(conv),
                "fresh": sum(base.values()) / len(base),
                "ratio": bootstrap_ratio(conv, base) if sum(base.values()) else None,
            }
        nxt = [r for r in mine if r["turn"] in after_refusal]
        cell["refused after a refusal"] = sum(r["refused"] for r in nxt) / len(nxt) if nxt else None
        cell["seconds_per_answer"] = sum(r["elapsed_s"] for r in mine) / max(1, len(mine))
        out[f"{mode} {rules}"] = cell
    return out


async def answer_runs(
    args: argparse.Namespace,
    conversations: list[list[TurnSpec]],
    device: Any,
    index: Any,
    save: Any,
) -> list[dict]:
    from benchmarks.auto import contexts
    from benchmarks.common import start_cloud
    from edge_runtime.options import AnswerOptions

    options = AnswerOptions(max_new_tokens=args.max_tokens, temperature=0.0)
    needs_cloud = any(m != "local" for m in args.modes)
    cloud = None
    url, token = "ws://127.0.0.1:9/unused", "unused-token-0123456789"
    if needs_cloud:
        cloud, url, token = await start_cloud("ort", args.cloud_core, corpus=True)
    rows: list[dict] = []
    try:
        for name in args.modes:
            for rules in args.rules:
                modes = contexts(device, index, url, token, [name])
                try:
                    with history_rules(rules):
                        for turns in conversations:
                            rows += await converse(name, modes[name], turns, options, rules)
                            save(rows)
                finally:
                    await modes[name].close()
            modes = contexts(device, index, url, token, [name])
            try:
                for turns in conversations:
                    rows += await fresh(name, modes[name], turns, options)
                    save(rows)
            finally:
                await modes[name].close()
    finally:
        if cloud is not None:
            await cloud.stop()
    return rows


# --------------------------------------------------------------------------- run


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.common import pin_device
    from benchmarks.provenance import command_line, record, write_result
    from cloud_backend.corpus import PublicCorpus, default_corpus_dir, default_embedder_dir
    from collab.sources import PUBLIC_FLOOR, RELEVANCE_FLOOR
    from edge_runtime.device import DeviceModel
    from personal_index.index import PersonalIndex
    from tandem_packaging.prepare import model_path

    prov = record(
        command_line("benchmarks.multiturn", args.argv),
        {"device_core": args.device_core, "cloud_core": args.cloud_core},
        {"device": 1, "cloud": 1},
        ["cloud ort", "device onnxruntime"],
    )
    notes, conversations = load_set()
    if args.conversations:
        conversations = conversations[: args.conversations]
    every = [t for turns in conversations for t in turns]
    args.cloud_core = pin_device(args.device_core, args.cloud_core)
    device = DeviceModel.load(model_path("device", "onnx-quant"), threads=1)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "provenance": prov,
        "config": {
            "max_tokens": args.max_tokens,
            "k": K,
            "floor": RELEVANCE_FLOOR,
            "public_floor": PUBLIC_FLOOR,
            "modes": list(args.modes),
            "rules": list(args.rules),
            "search": args.search,
            "conversations": len(conversations),
        },
        "turns": [asdict(t) for t in every],
    }

    def save(rows: list[dict], key: str = "rows") -> None:
        result[key] = rows
        result["seconds"] = time.perf_counter() - started
        write_result(args.out, prov, {k: v for k, v in result.items() if k != "provenance"})

    with tempfile.TemporaryDirectory(prefix="tandem-multiturn-") as tmp:
        folder = Path(tmp) / "notes"
        folder.mkdir()
        for note in notes:
            (folder / note["file"]).write_text(note["text"] + "\n", encoding="utf-8")
        index = PersonalIndex(Path(tmp) / "index", default_embedder_dir())
        index.ingest([folder])
        try:
            if args.search:
                corpus = PublicCorpus.open(default_corpus_dir(), default_embedder_dir(), threads=1)
                try:
                    rows = await search_rows(
                        conversations,
                        index,
                        corpus,
                        device if args.model_rewrite else None,
                        {"private": RELEVANCE_FLOOR, "public": PUBLIC_FLOOR},
                    )
                finally:
                    corpus.close()
                result["search_summary"] = search_summary(rows)
                save(rows, "search_rows")
            if args.modes:
                rows = await answer_runs(args, conversations, device, index, save)
                result["summary"] = summarise(rows, every)
                save(rows)
        finally:
            index.close()
            device._worker.close()
    return result


def print_summary(result: dict[str, Any]) -> None:
    for name, cell in result.get("search_summary", {}).items():
        print(f"\n  search, {name}:")
        for how, c in cell.items():
            vs = c["vs_standalone"]
            ratio = f"{vs[0]:.2f} ({vs[1]:.2f}-{vs[2]:.2f})" if vs else "—"
            print(
                f"    {how:10} found {c['found']}/{c['n']} ({c['share']:.0%}); ÷ standalone {ratio}"
            )
    for name, cell in result.get("summary", {}).items():
        print(f"\n  {name}: {cell['seconds_per_answer']:.1f} s an answer")
        for subset in ("all", "follow-ups", "after a refusal"):
            if subset in cell:
                c, r = cell[subset], cell[subset]["ratio"]
                ratio = f"{r[0]:.2f} (95 % {r[1]:.2f}-{r[2]:.2f})" if r else "—"
                print(
                    f"    {subset:16} in conversation {c['conversation']:.0%}, fresh "
                    f"{c['fresh']:.0%} (n {c['n']}): ratio {ratio}"
                )
        if cell.get("refused after a refusal") is not None:
            print(f"    refused after a refusal: {cell['refused after a refusal']:.0%}")


def main(argv: Sequence[str] | None = None) -> None:
    from benchmarks.provenance import default_out

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--modes", nargs="*", default=[], choices=MODES)
    parser.add_argument("--rules", nargs="+", default=["shipped"], choices=RULES)
    parser.add_argument("--search", action="store_true", help="the retrieval study")
    parser.add_argument(
        "--model-rewrite", action="store_true", help="with --search: the device model's rewrite too"
    )
    parser.add_argument("--conversations", type=int, default=0, help="the first N only")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device-core", type=int, default=0)
    parser.add_argument("--cloud-core", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 conversations, local, 16 tokens")
    parser.add_argument("--name", default="ort")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.quick:
        args.conversations, args.max_tokens = 2, 16
        args.modes = args.modes or ["local"]
    if not args.modes and not args.search:
        parser.error("nothing to run: give --modes and/or --search")
    args.out = default_out("multiturn", args.name, args.quick)
    result = asyncio.run(run(args))
    print_summary(result)
    print(f"\n{result['seconds']:.0f} s; written to {args.out}")


if __name__ == "__main__":
    main()
