"""benchmarks.retrieval: its metrics on hand-made rankings, and a --quick run end to end on the
real documents (the product's ingest, the real embedder, real FTS5 and FAISS)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.retrieval import (
    lowest_safe_floor,
    main,
    margin_floor,
    ranking_metrics,
    relevant_chunk,
    wilson,
)
from benchmarks.retrieval_docs import Answer, Question


def test_ranking_metrics_on_known_lists() -> None:
    m = ranking_metrics([False, True, False, True, False], ideal=2)
    assert m["hit@1"] == 0.0 and m["hit@5"] == 1.0 and m["mrr"] == 0.5
    dcg = 1 / math.log2(3) + 1 / math.log2(5)
    assert m["ndcg@5"] == pytest.approx(dcg / (1 + 1 / math.log2(3)))
    assert ranking_metrics([True], ideal=1) == {
        "hit@1": 1.0,
        "hit@5": 1.0,
        "mrr": 1.0,
        "ndcg@5": 1.0,
    }
    assert ranking_metrics([False] * 10, ideal=3)["mrr"] == 0.0


def test_a_chunk_answers_only_from_its_page_with_the_phrase() -> None:
    q = Question("q", "?", "semantic", (Answer("with", "the  context\nmanager"),))
    assert relevant_chunk(q, "/x/with.md", "... the context manager is ...")
    assert not relevant_chunk(q, "/x/for.md", "... the context manager is ...")
    assert not relevant_chunk(q, "/x/with.md", "... the manager ...")


def test_floors_are_calibrated_from_both_populations() -> None:
    cited = [
        {"kind": "offtopic", "scores": [0.1 + 0.01 * i], "relevant": [False]} for i in range(20)
    ]
    cited += [
        {"kind": "semantic", "scores": [0.5 + 0.01 * i], "relevant": [True]} for i in range(20)
    ]
    m = margin_floor(cited)
    assert m["offtopic_p95"] < m["floor"] < m["answer_p5"]
    rows = [
        {"floor": f, "offtopic_cites": c, "answer_kept": 1.0}
        for f, c in ((0.1, 0.5), (0.2, 0.04), (0.3, 0.0))
    ]
    assert lowest_safe_floor(rows)["floor"] == 0.2
    low, high = wilson(17, 20)
    assert low < 0.85 < high and low >= 0 and high <= 1


def test_quick_run_writes_a_result_with_its_provenance(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    env = result["provenance"]
    assert env["commit"] and env["cpu_model"] and env["command"].endswith(f"--out {out}")
    for name in ("dense", "bm25", "hybrid-rrf", "hybrid-combo"):
        metrics = result["evaluation"][name]["metrics"]
        assert metrics["keyword"]["n"] == 4 and metrics["semantic"]["n"] == 4
        assert 0.0 <= metrics["all"]["hit@5"] <= 1.0
    # the keyword questions' identifiers are found by BM25 (4 of 4 in the top 5)
    assert result["evaluation"]["bm25"]["metrics"]["keyword"]["hit@5"] == 1.0
    assert result["reranker"]["shipped"] is False
    (lat,) = result["latency"]
    assert lat["chunks"] == 2000 and lat["total"]["p99_ms"] > 0
    assert result["ingest"]["embedder_chunks_per_s"] > 0
