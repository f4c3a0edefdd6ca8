"""Cloud mode's public passages cut to the sentences that answer (issue 46 item 1,
`retrieval.focus`): prompt tokens, time to the first token and the answers, whole against
focused, on the public questions of auto's 60-question set (the public ones and the public
part of each "both" question).

    python -m benchmarks.passage_focus                # budgets 0 (whole) and 60 words
    python -m benchmarks.passage_focus --quick        # 4 questions (a smoke run)

Each question's passages are searched as the cloud searches them (the question and each of
its clauses, the best kept, k = 3, the public floor), then the cloud model (the 1.5B, ONNX
int8, one thread, pinned to core 1 as the cloud is in every benchmark here) prefills the
cloud-mode prompt and decodes greedily, once per budget, the order alternating by question.
TTFT here is the prefill alone (no network, no search): what the budget changes. An answer
is right when it holds a spelling of every expected fact (`benchmarks.auto.right`); a fact
"in the prompt" is the same test on the passages the prompt holds."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.auto import right
from benchmarks.intervals import bootstrap_ci, bootstrap_ratio
from benchmarks.provenance import command_line, default_out, record, write_result

QUESTIONS = Path(__file__).with_name("data") / "auto" / "questions.toml"


def public_questions() -> list[tuple[str, list[list[str]]]]:
    data = tomllib.loads(QUESTIONS.read_text(encoding="utf-8"))
    return [(q["question"], q["facts"]) for q in data["public"]] + [
        (q["public"], q["facts"]) for q in data["both"]
    ]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import numpy as np

    from cloud_backend.corpus import PublicCorpus
    from collab.plumbing.paths import cloud_corpus_dir, embedder_dir
    from collab.sources import PUBLIC_FLOOR
    from model_runtime.ort_runtime import OrtCausalLM
    from model_runtime.prompting import clipped_prompt
    from model_runtime.tokenizer import IM_END_ID, load_tokenizer
    from retrieval.focus import focused
    from retrieval.search import best_of, clauses
    from tandem_packaging.prepare import model_path

    questions = public_questions()[: 4 if args.quick else None]
    with PublicCorpus.open(cloud_corpus_dir(), embedder_dir(), threads=1) as corpus:
        searched = [
            best_of([corpus.search(w, 3, PUBLIC_FLOOR) for w in [q, *clauses(q)]])
            for q, _ in questions
        ]
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})  # the cloud's core
    folder = model_path("cloud", "onnx-quant")
    lm = OrtCausalLM(folder, threads=1, allow_spinning=False)
    tokenizer = load_tokenizer(model_path("cloud", "hf"))
    lm.prefill([clipped_prompt(tokenizer, "Warm up.", [], searched[0], 4096)[0]])  # untimed
    rows = []
    for n, ((question, facts), hits) in enumerate(zip(questions, searched, strict=True)):
        budgets = list(args.budgets) if n % 2 == 0 else list(reversed(args.budgets))
        for budget in budgets:
            texts = focused(question, [h.text for h in hits], budget)
            passages = [replace(h, text=t) for h, t in zip(hits, texts, strict=True)]
            ids, _ = clipped_prompt(tokenizer, question, [], passages, 4096)
            started = time.perf_counter()
            logits = lm.prefill([ids])[0]
            ttft = time.perf_counter() - started
            tokens: list[int] = []
            for _ in range(args.max_tokens):
                token = int(np.argmax(logits))
                if token == IM_END_ID:
                    break
                tokens.append(token)
                logits = lm.decode([token])[0]
            answer = tokenizer.decode(tokens, skip_special_tokens=True)
            row = {
                "question": question,
                "budget": budget,
                "passages": len(hits),
                "prompt_tokens": len(ids),
                "ttft_s": round(ttft, 3),
                "fact_in_prompt": right(" ".join(texts), facts),
                "right": right(answer, facts),
                "answer": answer,
            }
            rows.append(row)
            print(
                f"{budget:4} {len(ids):4} tok {ttft:5.2f} s {'✓' if row['right'] else '✗'} "
                f"{question[:60]}",
                file=sys.stderr,
            )
    return rows


def summary(rows: Sequence[dict[str, Any]], budgets: Sequence[int]) -> dict[str, Any]:
    """Per budget: tokens, TTFT, facts in the prompt, right answers; each focused budget
    against the whole passages (budget 0), paired by question."""
    by = {(r["budget"], r["question"]): r for r in rows}
    questions = sorted({r["question"] for r in rows})
    out: dict[str, Any] = {"questions": len(questions), "budgets": {}}
    for b in budgets:
        mine = [by[b, q] for q in questions]
        entry: dict[str, Any] = {
            "prompt_tokens_mean": round(statistics.fmean(r["prompt_tokens"] for r in mine), 1),
            "ttft_s_mean": round(statistics.fmean(r["ttft_s"] for r in mine), 3),
            "fact_in_prompt": sum(r["fact_in_prompt"] for r in mine),
            "right": sum(r["right"] for r in mine),
        }
        if b != 0 and 0 in budgets:
            whole = {q: by[0, q]["ttft_s"] for q in questions}
            ratio = bootstrap_ratio({q: by[b, q]["ttft_s"] for q in questions}, whole)
            assert ratio is not None  # the same questions on both sides
            mean, low, high = ratio
            entry["ttft_vs_whole"] = {
                "ratio": round(mean, 3),
                "ci95": [round(low, 3), round(high, 3)],
            }
            pairs = [(int(by[b, q]["right"]), int(by[0, q]["right"])) for q in questions]
            diff = statistics.fmean(a - c for a, c in pairs)
            lo, hi = bootstrap_ci(pairs, lambda ps: statistics.fmean(a - c for a, c in ps))
            entry["right_vs_whole"] = {
                "difference": round(diff, 3),
                "ci95": [round(lo, 3), round(hi, 3)],
            }
        out["budgets"][str(b)] = entry
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 60])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="4 questions (a smoke run)")
    parser.add_argument("--name", default="ort")
    args = parser.parse_args(argv)
    prov = record(
        command_line("benchmarks.passage_focus", argv),
        pinning={"cloud": 1},
        threads={"cloud": 1},
        engines=["ort"],
    )
    rows = run(args)
    data = {
        "config": {"budgets": args.budgets, "max_tokens": args.max_tokens, "k": 3},
        "rows": rows,
        "summary": summary(rows, args.budgets),
    }
    out = write_result(default_out("passage-focus", args.name, args.quick), prov, data)
    print(json.dumps(data["summary"], indent=1), f"\nwritten to {out}")


if __name__ == "__main__":
    main()
