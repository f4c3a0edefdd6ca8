"""Does search find the passage that answers? Dense, BM25 and hybrid (two fusions) side by
side, on real documents nobody on the team wrote (issue 29). No cross-encoder reranker ships
for offline use (`RERANKER` records the survey), so there is no "hybrid + rerank" row.

The documents are Python 3's language reference as the interpreter ships it
(`pydoc_data.topics`: 79 pages, `benchmarks.retrieval_docs`), ingested by the product's own
ingest into a fresh private index. The questions (`benchmarks/data/retrieval/*.toml`) name, for
each, the page and a phrase of the passage that answers; off-topic questions have none.

Reported, per search configuration and question kind: hit@1, hit@5, MRR and nDCG@5 (binary
relevance: a chunk answers if it is from the named page and holds the phrase); how often an
off-topic question would cite anything at each relevance floor, and how many answerable
questions keep their answer there (the floor's calibration); search latency p50/p99 at 10k and
100k chunks with the query embedding timed apart; ingest throughput beside the embedder's own
throughput on the same chunks (the physical limit of ingest).

    python -m benchmarks.retrieval            # the whole evaluation (~10 min on one core)
    python -m benchmarks.retrieval --quick    # 12 questions on ~20 pages, latency at 2k chunks
    python -m benchmarks.retrieval --questions held-out.toml   # someone else's questions
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import repo_relative
from benchmarks.provenance import record
from benchmarks.retrieval_docs import QUESTION_SET, Question, answers, load_questions
from collab.sources import RELEVANCE_FLOOR

log = logging.getLogger("benchmarks.retrieval")

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "retrieval"
CUTOFFS = (1, 5)
CITED_K = 3  # passages an answer cites (the product's default k)
FLOORS = tuple(round(f, 2) for f in np.arange(0.0, 1.0001, 0.05))


# --------------------------------------------------------------------------- questions


def relevant_chunk(question: Question, path: str, text: str) -> bool:
    """Whether a chunk (its file and text) holds one of the question's answers."""
    page = Path(path).stem
    return any(answers(a, page, text) for a in question.answers)


# --------------------------------------------------------------------------- metrics


def ranking_metrics(relevant: Sequence[bool], ideal: int) -> dict[str, float]:
    """hit@1, hit@5, reciprocal rank and nDCG@5 (binary gains) of one ranked list, where
    `ideal` is how many relevant chunks the index holds for the question."""
    first = next((i for i, r in enumerate(relevant) if r), None)
    out = {f"hit@{n}": float(first is not None and first < n) for n in CUTOFFS}
    out["mrr"] = 0.0 if first is None else 1.0 / (first + 1)
    dcg = sum(1.0 / math.log2(i + 2) for i, r in enumerate(relevant[:5]) if r)
    idcg = sum(1.0 / math.log2(i + 2) for i in range(min(ideal, 5)))
    out["ndcg@5"] = dcg / idcg if idcg else 0.0
    return out


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in ("hit@1", "hit@5", "mrr", "ndcg@5", "page@1") if rows and k in rows[0]]
    return {k: statistics.fmean(r[k] for r in rows) if rows else float("nan") for k in keys}


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson interval of a proportion (for hit rates over a few dozen questions)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class Config:
    name: str
    mode: str
    fusion: str = "rrf"


CONFIGS = (
    Config("dense", "dense"),
    Config("bm25", "keyword"),
    Config("hybrid-rrf", "hybrid", "rrf"),
    Config("hybrid-combo", "hybrid", "combo"),
)
#: Issue 29 asks for hybrid + a cross-encoder reranker "if one can ship". None does: what was
#: checked, recorded with every result (the survey of 2026-11-26, issue 29's notes).
RERANKER = {
    "shipped": False,
    "why": "no PyPI package ships a cross-encoder's weights for offline use; wrappers "
    "(flashrank, swiftrank, mxbai-rerank, rerankers, inranker, rag-reranker, local-reranker, "
    "knowledge-rag, fastretrieval, ...) download the model at run time, which we never do; "
    "nanoranker ships weights but is not a cross-encoder and barely separates relevant from "
    "irrelevant passages",
    "cost_if_it_did_ms_per_pair_1_thread_256_tokens": {
        "MiniLM-L-2 int8": 29,
        "MiniLM-L-6 fp32": 180,
        "MiniLM-L-6 int8": 116,
    },
}


def evaluate(index: Any, questions: list[Question], configs: Sequence[Config]) -> dict[str, Any]:
    """Every configuration over every question: metrics per kind, and the relevance of what
    each would cite, for the floor sweep."""
    chunks = index.store.db.execute(
        "SELECT d.path, c.text FROM chunks c JOIN documents d ON d.id = c.document_id"
    ).fetchall()
    ideal = {q.id: sum(relevant_chunk(q, p, t) for p, t in chunks) for q in questions}
    missing = [q.id for q in questions if q.kind != "offtopic" and ideal[q.id] == 0]
    if missing:
        raise SystemExit(f"no chunk holds the answer of {missing}: check the question set")
    out: dict[str, Any] = {}
    searcher = index.searcher
    for config in configs:
        searcher.fusion = config.fusion
        per_kind: dict[str, list[dict[str, float]]] = {}
        per_question: dict[str, dict[str, float]] = {}
        cited: list[dict[str, Any]] = []
        for q in questions:
            hits = index.search(q.text, 10, mode=config.mode)
            relevant = [relevant_chunk(q, h.path, h.text) for h in hits]
            top = [h.score for h in hits[:CITED_K]]
            cited.append(
                {
                    "id": q.id,
                    "kind": q.kind,
                    "scores": top,
                    "cosines": [h.cosine for h in hits[:CITED_K]],
                    "relevant": relevant[:CITED_K],
                    "found_by": [h.found_by for h in hits[:CITED_K]],
                    "bm25": [h.bm25 for h in hits[:CITED_K]],
                }
            )
            if q.kind != "offtopic":
                row = ranking_metrics(relevant, ideal[q.id])
                # the issue's own first measure: is the first passage from a page that answers?
                pages = {a.topic for a in q.answers}
                row["page@1"] = float(bool(hits) and Path(hits[0].path).stem in pages)
                per_kind.setdefault(q.kind, []).append(row)
                per_kind.setdefault("all", []).append(row)
                per_question[q.id] = row
        metrics: dict[str, dict[str, Any]] = {
            kind: mean_metrics(rows) | {"n": len(rows)} for kind, rows in per_kind.items()
        }
        for m in metrics.values():
            m["hit@1_ci95"] = wilson(round(m["hit@1"] * m["n"]), m["n"])
        out[config.name] = {
            "config": config.__dict__,
            "metrics": metrics,
            "floors": floor_sweep(cited),
            "per_question": per_question,
            "cited": cited,
        }
        log.info("%-18s %s", config.name, _summary(metrics["all"]))
    return out


#: The comparisons the issue asks about, each a paired difference over the same questions.
COMPARISONS = (("hybrid-rrf", "dense"), ("hybrid-rrf", "bm25"), ("hybrid-combo", "hybrid-rrf"))


def paired_difference(
    a: dict[str, dict[str, float]], b: dict[str, dict[str, float]], key: str, seed: int = 0
) -> dict[str, float]:
    """Mean of a − b over the questions both answered, with a 95 % paired bootstrap interval
    (10,000 resamples of questions): a difference whose interval holds 0 is noise."""
    ids = sorted(set(a) & set(b))
    diff = np.array([a[i][key] - b[i][key] for i in ids])
    if not len(diff):
        return {"mean": float("nan"), "low": float("nan"), "high": float("nan"), "n": 0}
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(10_000, len(diff)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"mean": float(diff.mean()), "low": float(low), "high": float(high), "n": len(ids)}


def comparisons(evaluation: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for a, b in COMPARISONS:
        if a in evaluation and b in evaluation:
            pa, pb = evaluation[a]["per_question"], evaluation[b]["per_question"]
            for key in ("hit@1", "mrr"):
                rows.append({"a": a, "b": b, "metric": key, **paired_difference(pa, pb, key)})
    return rows


def floor_sweep(
    cited: list[dict[str, Any]], floors: Sequence[float] = FLOORS
) -> list[dict[str, float]]:
    """At each floor: the share of off-topic questions that would still cite something, and of
    answerable questions whose first answering passage (within the cited k) passes."""
    rows = []
    off = [c for c in cited if c["kind"] == "offtopic"]
    on = [c for c in cited if c["kind"] != "offtopic"]
    for floor in floors:
        cites = sum(any(s >= floor for s in c["scores"]) for c in off)
        kept = sum(
            any(r and s >= floor for s, r in zip(c["scores"], c["relevant"], strict=True))
            for c in on
        )
        rows.append(
            {
                "floor": floor,
                "offtopic_cites": cites / len(off) if off else float("nan"),
                "answer_kept": kept / len(on) if on else float("nan"),
            }
        )
    return rows


def lowest_safe_floor(rows: list[dict[str, float]], max_offtopic: float = 0.05) -> dict[str, float]:
    """The lowest floor of the sweep at which at most `max_offtopic` of off-topic questions
    cite anything."""
    for row in rows:
        if row["offtopic_cites"] <= max_offtopic:
            return row
    return rows[-1]


def margin_floor(cited: list[dict[str, Any]]) -> dict[str, float]:
    """The floor with the widest margin on both sides: halfway between the 95th percentile of
    off-topic questions' best relevance and the 5th percentile of the relevance of passages
    that answer (what the product's RELEVANCE_FLOOR is set from)."""
    off = [max(c["scores"], default=-1.0) for c in cited if c["kind"] == "offtopic"]
    good = [s for c in cited for s, r in zip(c["scores"], c["relevant"], strict=True) if r]
    if not off or not good:
        return {"floor": float("nan")}
    high_off, low_good = float(np.percentile(off, 95)), float(np.percentile(good, 5))
    return {"floor": (high_off + low_good) / 2, "offtopic_p95": high_off, "answer_p5": low_good}


def _summary(m: dict[str, Any]) -> str:
    return " ".join(f"{k} {m[k]:.3f}" for k in ("hit@1", "hit@5", "mrr", "ndcg@5"))


# --------------------------------------------------------------------------- both sides

PERSONAL = re.compile(r"\b(my|I|we|me|our)\b")
#: DRAGON's side weights (docs/math.md#dragon) with the private index (the Python reference) on the
#: device and the public corpus in the cloud, for a question only one side can answer, a
#: question only the other can, and one both can.
DRAGON_QUESTIONS = {
    "private only": "How do I make my own class work with the with statement?",
    "public only": "What is the tallest mountain in Africa?",
    "mixed": "What is a computer program, and how is a function defined in Python?",
}


def public_side(corpus: Any, questions: list[Question], floor: float) -> dict[str, Any]:
    """The public corpus's answer to the off-topic questions that are about the user (their
    notes, appointments, family): how many would still cite a Wikipedia summary at `floor`."""
    rows: list[dict[str, Any]] = []
    bests: list[float] = []
    for q in questions:
        if q.kind != "offtopic" or not PERSONAL.search(q.text):
            continue
        hits = corpus.search(q.text, CITED_K)
        bests.append(max((h.score for h in hits), default=-1.0))
        rows.append({"question": q.text, "best": bests[-1], "titles": [h.title for h in hits]})
    cites = sum(b >= floor for b in bests)
    share = cites / len(rows) if rows else float("nan")
    return {"floor": floor, "personal_questions": len(rows), "cite_at_floor": share, "rows": rows}


def dragon_weights(index: Any, corpus: Any, floor: float) -> list[dict[str, Any]]:
    """η^device and η^cloud for each DRAGON_QUESTIONS entry, without a floor and with it: a
    side that finds nothing relevant decodes without a passage at NO_DOCUMENT_COSINE."""
    from collab.dragon.aggregation import side_etas, side_weight
    from collab.dragon.ledger import NO_DOCUMENT_COSINE, relevance

    rows = []
    for label, text in DRAGON_QUESTIONS.items():
        for name, cut in (("no floor", None), ("floor", floor)):
            dev = [h.score for h in index.search(text, CITED_K, cut)]
            pub = corpus.search(text, CITED_K, cut)
            h_dev = side_weight(relevance(np.array(dev or [NO_DOCUMENT_COSINE])))
            h_pub = side_weight(relevance(np.array([h.score for h in pub] or [NO_DOCUMENT_COSINE])))
            eta_dev, eta_pub = side_etas(h_dev, h_pub)
            rows.append(
                {
                    "question": label,
                    "text": text,
                    "floor": name,
                    "device_scores": dev,
                    "cloud_scores": [h.score for h in pub],
                    "cloud_titles": [h.title for h in pub],
                    "eta_device": eta_dev,
                    "eta_cloud": eta_pub,
                }
            )
            log.info("%-12s %-8s η device %.3f cloud %.3f", label, name, eta_dev, eta_pub)
    return rows


# --------------------------------------------------------------------------- throughput


def ingest_throughput(index: Any, folder: Path, sample: int | None = None) -> dict[str, float]:
    """Ingest the folder (timed), then embed the same chunks' texts in one call (timed): the
    embedder alone is the ceiling of what ingest can reach (on the first `sample` chunks
    only, if given: a rate, for --quick)."""
    t0 = time.perf_counter()
    results = index.ingest([folder])
    ingest_s = time.perf_counter() - t0
    failed = [r for r in results if r.outcome == "failed"]
    if failed:
        raise SystemExit(f"{len(failed)} reference pages failed to ingest: {failed[:3]}")
    rows = index.store.db.execute("SELECT heading, text FROM chunks").fetchall()
    texts = [f"{h}\n{t}" if h else t for h, t in rows][:sample]
    t1 = time.perf_counter()
    index.embedder.embed(texts)
    embed_s = time.perf_counter() - t1
    return {
        "documents": len(results),
        "chunks": len(rows),
        "ingest_s": ingest_s,
        "ingest_chunks_per_s": len(rows) / ingest_s,
        "embedder_chunks_per_s": len(texts) / embed_s,
        "ingest_share_of_embedder": (len(rows) / ingest_s) / (len(texts) / embed_s),
    }


def _filler_texts(n: int, seed: int = 0) -> list[str]:
    """`n` chunk-sized English texts: sentences of the public corpus's Wikipedia summaries,
    reshuffled (real vocabulary and term statistics for BM25 at any size)."""
    from cloud_backend.corpus_build import load_summaries

    sentences = [
        s for _, extract in load_summaries() for s in re.split(r"(?<=[.!?])\s+", extract) if s
    ]
    rng = random.Random(seed)
    return [" ".join(rng.choices(sentences, k=8)) for _ in range(n)]


def search_latency(
    sizes: Sequence[int], queries: Sequence[str], embed: Any, repeats: int
) -> list[dict[str, Any]]:
    """Hybrid search (dense + BM25 + fusion, the query embedding apart) over stores of each size
    filled with real-vocabulary text and random unit vectors (a flat index's cost does not
    depend on the vectors' values)."""
    from retrieval.search import Searcher
    from retrieval.store import ChunkRecord, DocumentMeta, IndexStore

    vectors = {q: embed([q])[0] for q in queries}
    out = []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="tandem-latency-") as tmp:
            store = IndexStore(Path(tmp), len(next(iter(vectors.values()))))
            rng = np.random.default_rng(size)
            texts = _filler_texts(size)
            t0 = time.perf_counter()
            per_doc = 10
            for d in range(0, size, per_doc):
                part = texts[d : d + per_doc]
                meta = DocumentMeta(f"/filler/{d}.txt", 1, 0.0, str(d), title=f"Filler {d}")
                records = [ChunkRecord(i, t, heading=f"Filler {d}") for i, t in enumerate(part)]
                store.replace_document(meta, records, rng.standard_normal((len(part), store.dim)))
            store.flush()
            fill_s = time.perf_counter() - t0
            searcher = Searcher(store, lambda texts: np.stack([vectors[t] for t in texts]))
            samples: dict[str, list[float]] = {"total": [], "dense": [], "keyword": [], "fuse": []}
            for _ in range(repeats):
                for q in queries:
                    searcher.search(q, CITED_K)
                    t = searcher.last_timing
                    samples["dense"].append(t.dense_s)
                    samples["keyword"].append(t.keyword_s)
                    samples["fuse"].append(t.fuse_s)
                    samples["total"].append(t.dense_s + t.keyword_s + t.fuse_s)
            # removing a document scrubs its words from the keyword index (SECURITY.md): the
            # merge rewrites that index, so its cost grows with the index
            t0 = time.perf_counter()
            store.remove_paths(["/filler/0.txt"])
            remove_s = time.perf_counter() - t0
            store.close()
        row: dict[str, Any] = {"chunks": size, "fill_s": fill_s, "searches": len(samples["total"])}
        row["remove_one_document_ms"] = 1e3 * remove_s
        for stage, values in samples.items():
            ms = np.asarray(values) * 1e3
            row[stage] = {
                "p50_ms": float(np.percentile(ms, 50)),
                "p99_ms": float(np.percentile(ms, 99)),
            }
        log.info(
            "latency at %d chunks: p50 %.1f ms, p99 %.1f ms",
            size,
            row["total"]["p50_ms"],
            row["total"]["p99_ms"],
        )
        out.append(row)
    return out


# --------------------------------------------------------------------------- report


def table(result: dict[str, Any]) -> str:
    """The result as Markdown tables (what the docs show, generated from the result file)."""
    lines = [
        "| search | questions | n | hit@1 (95 % CI) | hit@5 | MRR | nDCG@5 | page@1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["evaluation"].items():
        for kind, m in sorted(r["metrics"].items()):
            low, high = m["hit@1_ci95"]
            lines.append(
                f"| {name} | {kind} | {m['n']} | {m['hit@1']:.3f} ({low:.2f}–{high:.2f}) | "
                f"{m['hit@5']:.3f} | {m['mrr']:.3f} | {m['ndcg@5']:.3f} | {m['page@1']:.3f} |"
            )
    product = result["settings"]["relevance_floor"]
    lines += [
        "",
        f"At the product's floor ({product:.2f}): off-topic questions that cite "
        "anything, and answerable questions whose answering passage is cited:",
        "",
        "| search | off-topic citing | answers kept |",
        "|---|---|---|",
    ]
    for name, r in result["evaluation"].items():
        p = r["at_product_floor"]
        lines.append(f"| {name} | {p['offtopic_cites']:.1%} | {p['answer_kept']:.1%} |")
    lines += [
        "",
        "| search | margin floor | lowest floor with ≤ 5 % off-topic citing | "
        "off-topic citing there | answers kept there |",
        "|---|---|---|---|---|",
    ]
    for name, r in result["evaluation"].items():
        f, m = r["calibrated_floor"], r["margin_floor"]
        lines.append(
            f"| {name} | {m['floor']:.3f} | {f['floor']:.2f} | {f['offtopic_cites']:.1%} | "
            f"{f['answer_kept']:.1%} |"
        )
    lines += ["", "| comparison | metric | difference (95 % paired bootstrap) |", "|---|---|---|"]
    for c in result.get("comparisons", []):
        lines.append(
            f"| {c['a']} − {c['b']} | {c['metric']} | "
            f"{c['mean']:+.3f} ({c['low']:+.3f} to {c['high']:+.3f}) |"
        )
    sides = result.get("sides") or {}
    if sides:
        p = sides["public_personal"]
        lines += [
            "",
            f"Public corpus, {p['personal_questions']} questions about the user: "
            f"{p['cite_at_floor']:.0%} still cite a summary at the floor {p['floor']:.3f}.",
            "",
            "| DRAGON question | floor | η device | η cloud |",
            "|---|---|---|---|",
        ]
        for w in sides["dragon_weights"]:
            lines.append(
                f"| {w['question']} | {w['floor']} | {w['eta_device']:.3f} | {w['eta_cloud']:.3f} |"
            )
    if result.get("latency"):
        lines += [
            "",
            "| chunks | hybrid p50 ms | p99 ms | dense p99 | BM25 p99 | remove a document |",
        ]
        lines += ["|---|---|---|---|---|---|"]
        for row in result["latency"]:
            lines.append(
                f"| {row['chunks']:,} | {row['total']['p50_ms']:.1f} | "
                f"{row['total']['p99_ms']:.1f} | {row['dense']['p99_ms']:.1f} | "
                f"{row['keyword']['p99_ms']:.1f} | {row['remove_one_document_ms']:.0f} ms |"
            )
    ing = result["ingest"]
    lines += [
        "",
        f"Ingest: {ing['chunks']} chunks at {ing['ingest_chunks_per_s']:.1f} chunks/s; the "
        f"embedder alone {ing['embedder_chunks_per_s']:.1f} chunks/s "
        f"({ing['ingest_share_of_embedder']:.0%} of it).",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    from benchmarks.retrieval_docs import SOURCE, write_reference_docs
    from collab.plumbing.paths import embedder_dir
    from personal_index.index import PersonalIndex
    from retrieval.store_keywords import KEYWORD_POSTINGS

    header, questions = load_questions(args.questions)
    if args.quick:
        by_kind: dict[str, list[Question]] = {}
        for q in questions:
            by_kind.setdefault(q.kind, []).append(q)
        questions = [q for qs in by_kind.values() for q in qs[:4]]
    with tempfile.TemporaryDirectory(prefix="tandem-retrieval-") as tmp:
        docs, store = Path(tmp) / "docs", Path(tmp) / "index"
        pages = write_reference_docs(docs)
        if args.quick:  # the quick questions' pages and every tenth other page, as distractors
            wanted = {a.topic for q in questions for a in q.answers}
            for n, page in enumerate(pages):
                if page.stem not in wanted and n % 10:
                    page.unlink()
        with PersonalIndex(store, embedder_dir(), threads=args.threads) as index:
            index.searcher.candidates = args.candidates
            ingest = ingest_throughput(index, docs, 32 if args.quick else None)
            log.info("ingested %d chunks in %.1f s", ingest["chunks"], ingest["ingest_s"])
            evaluation = evaluate(index, questions, CONFIGS)
            sizes = [2000] if args.quick else args.sizes
            floor = RELEVANCE_FLOOR  # what both sides use
            sides: dict[str, Any] = {}
            if not args.quick and not args.no_public:
                from cloud_backend.corpus import PublicCorpus
                from collab.plumbing.paths import cloud_corpus_dir

                with PublicCorpus.open(cloud_corpus_dir(), embedder_dir(), threads=1) as corpus:
                    sides = {
                        "public_personal": public_side(corpus, questions, floor),
                        "dragon_weights": dragon_weights(index, corpus, floor),
                    }
            texts = [q.text for q in questions]
            latency = search_latency(sizes, texts, index.embedder.embed, args.repeats)
    for r in evaluation.values():
        r["calibrated_floor"] = lowest_safe_floor(r["floors"])
        r["margin_floor"] = margin_floor(r["cited"])
        (r["at_product_floor"],) = floor_sweep(r["cited"], [RELEVANCE_FLOOR])
    return {
        "benchmark": "retrieval",
        "provenance": record(
            command, {"taskset": args.pinning}, {"threads": args.threads}, ["onnxruntime", "faiss"]
        ),
        "documents": SOURCE,
        "questions": {"file": repo_relative(args.questions), **header, "count": len(questions)},
        "settings": {
            "candidates": args.candidates,
            "cited_k": CITED_K,
            "quick": args.quick,
            "relevance_floor": RELEVANCE_FLOOR,
            "keyword_postings": KEYWORD_POSTINGS,
        },
        "reranker": RERANKER,
        "ingest": ingest,
        "evaluation": evaluation,
        "comparisons": comparisons(evaluation),
        "sides": sides,
        "latency": latency,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few questions, small latency run")
    parser.add_argument("--questions", type=Path, default=QUESTION_SET)
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default: results/)")
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[10_000, 100_000],
        help="chunk counts for the latency run (comma-separated; empty: none)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--candidates", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-public", action="store_true", help="skip the public corpus parts")
    parser.add_argument(
        "--table",
        type=Path,
        metavar="RESULT",
        help="print the Markdown tables of a result file and exit",
    )
    parser.add_argument("--pinning", default="", help="the taskset core list used, to record")
    args = parser.parse_args(argv)
    if args.table:
        result = json.loads(args.table.read_text(encoding="utf-8"))
        print(table(result))
        return result
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    command = " ".join(["python -m benchmarks.retrieval", *(argv or sys.argv[1:])])
    result = run(args, command)
    out = args.out or RESULTS / ("quick.json" if args.quick else "python311-reference.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(table(result))
    print(f"\nwritten to {out}")
    return result


if __name__ == "__main__":
    main()
