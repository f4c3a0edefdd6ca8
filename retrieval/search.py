"""Search that finds the passage which answers: meaning (dense), words (BM25), or both fused.

One `Searcher` serves the private index and the public corpus alike, so both sides' relevance
means the same thing (DRAGON weighs one side's passages against the other's, docs/math.md#dragon).

* **dense**: cosine of the question's embedding with each chunk's (FAISS).
* **keyword**: BM25 over each chunk's heading path and text (SQLite FTS5); identifiers in the
  question match as phrases (`retrieval.keywords`).
* **hybrid**: the top `candidates` of each, fused by reciprocal rank (RRF, k = 60): a passage
  that both searches rank high wins; one that only one search finds can still lead. Every
  candidate also gets its cosine from the stored vectors, so found-by-keyword passages are
  judged by meaning too. ("combo", measured against RRF by `benchmarks.retrieval`: the mean
  of each search's min-max normalised scores, Bruch et al. 2023's convex combination.)

No cross-encoder reranker: none ships inside a registry package for offline use (issue 29's
survey, in the benchmark's notes), and we download nothing from a model hub at run time. The
relevance floor drops passages below it: they are neither put in a prompt nor cited.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol, TypeVar

import numpy as np

from retrieval.store import FoundBy, Hit, IndexStore

__all__ = [
    "DEFAULT_CANDIDATES",
    "RRF_K",
    "SEARCH_MODES",
    "SearchMode",
    "SearchTiming",
    "Searcher",
    "best_of",
    "clauses",
    "reciprocal_rank_fusion",
]


class _Scored(Protocol):
    @property
    def score(self) -> float: ...


H = TypeVar("H", bound=_Scored)
SearchMode = Literal["dense", "keyword", "hybrid"]
SEARCH_MODES: tuple[SearchMode, ...] = ("dense", "keyword", "hybrid")
Fusion = Literal["rrf", "combo"]
FUSIONS: tuple[Fusion, ...] = ("rrf", "combo")
#: Candidates taken from each search before fusing.
DEFAULT_CANDIDATES = 40
#: RRF's constant (Cormack et al. 2009): 60 damps the difference between ranks 1 and 2 just
#: enough that agreement between the two searches counts more than one search's top rank.
RRF_K = 60


@dataclass
class SearchTiming:
    """Where one search's time went (seconds), for the benchmark."""

    embed_s: float = 0.0
    dense_s: float = 0.0
    keyword_s: float = 0.0
    fuse_s: float = 0.0


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], k: int = RRF_K) -> dict[int, float]:
    """Σ over rankings of 1 / (k + rank) for each id (rank 1-based): RRF, Cormack et al. 2009."""
    fused: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, 1):
            fused[item] = fused.get(item, 0.0) + 1.0 / (k + rank)
    return fused


def best_of(results: Sequence[Sequence[H]]) -> list[H]:
    """Of several searches' results (one per way of asking, edge_runtime.turns), the one whose
    best passage is the most relevant (the first on a tie; none if every search found none):
    a follow-up searched with its topic and alone keeps whichever finds its passage."""
    best: Sequence[H] = []
    for hits in results:
        if hits and (not best or hits[0].score > best[0].score):
            best = hits
    return list(best)


_CLAUSE_BREAK = re.compile(r",\s*and\s+|;\s*|\?\s+")


def clauses(question: str) -> list[str]:
    """The parts of a compound question ("Where is my passport, and who painted the Mona
    Lisa?"), each a way of asking it: one part's passage is judged by that part, not diluted by
    the rest. A question of one part gives none."""
    parts = [p.strip() for p in _CLAUSE_BREAK.split(question) if p.strip()]
    return parts if len(parts) > 1 else []


def _minmax(scores: dict[int, float]) -> dict[int, float]:
    if not scores:
        return {}
    low, high = min(scores.values()), max(scores.values())
    span = high - low
    return {i: (v - low) / span if span > 0 else 1.0 for i, v in scores.items()}


def _convex_combination(cosine: dict[int, float], bm25: dict[int, float]) -> dict[int, float]:
    """½ min-max(cosine) + ½ min-max(BM25) over the candidates (0 where BM25 did not match)."""
    cos, kw = _minmax(cosine), _minmax(bm25)
    return {i: 0.5 * c + 0.5 * kw.get(i, 0.0) for i, c in cos.items()}


class Searcher:
    """Dense, keyword or hybrid search over one `IndexStore`.

    `embed` turns texts into vectors (the store's embedder); it is called once per search, for
    the question only.
    """

    def __init__(
        self,
        store: IndexStore,
        embed: Callable[[list[str]], np.ndarray],
        *,
        candidates: int = DEFAULT_CANDIDATES,
        fusion: Fusion = "rrf",
    ) -> None:
        if fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {', '.join(FUSIONS)}, got {fusion!r}")
        self.store = store
        self.embed = embed
        self.candidates = candidates
        self.fusion = fusion
        self.last_timing = SearchTiming()

    def search(
        self,
        query: str,
        k: int,
        *,
        mode: SearchMode = "hybrid",
        floor: float | None = None,
        within: Sequence[str] = (),
    ) -> list[Hit]:
        """The k best passages for `query`, best first (fused order), none whose relevance (its
        cosine with the question, whichever search found it) is below `floor`; with `within`,
        only from the documents at or under those paths (a scoped question)."""
        if mode not in SEARCH_MODES:
            raise ValueError(f"search mode must be one of {', '.join(SEARCH_MODES)}, got {mode!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        timing = self.last_timing = SearchTiming()
        depth = max(k, self.candidates)
        dense: list[Hit] = []
        keyword: list[Hit] = []
        t0 = time.perf_counter()
        query_vec = self.embed([query])[0]
        t1 = time.perf_counter()
        timing.embed_s = t1 - t0
        among = self.store.chunk_ids_under(within) if within else None
        if mode != "keyword":
            dense = (
                self.store.search(query_vec, depth)
                if among is None
                else self.store.search_among(query_vec, depth, among)
            )
        t2 = time.perf_counter()
        timing.dense_s = t2 - t1
        if mode != "dense":
            keyword = self.store.keyword_search(query, depth, among)
        t3 = time.perf_counter()
        timing.keyword_s = t3 - t2
        hits = self._fuse(dense, keyword, query_vec)
        timing.fuse_s = time.perf_counter() - t3
        if floor is not None:
            hits = [h for h in hits if h.score >= floor]
        return hits[:k]

    def _fuse(self, dense: list[Hit], keyword: list[Hit], query_vec: np.ndarray) -> list[Hit]:
        """One list, best first: fused order; every hit carries its cosine (its relevance: the
        floor and DRAGON's weights read it), its BM25 where the keyword search found it, and
        what found it."""
        if not keyword:
            return dense
        bm25 = {h.chunk_id: float(h.bm25 or 0.0) for h in keyword}
        by_id = {h.chunk_id: h for h in keyword} | {h.chunk_id: h for h in dense}
        cosine = {h.chunk_id: float(h.cosine or 0.0) for h in dense}
        in_dense = set(cosine)
        missing = [i for i in by_id if i not in in_dense]
        if missing:  # found by keyword only: their cosine from the stored vectors
            q = np.asarray(query_vec, dtype=np.float32)
            q = q / max(float(np.linalg.norm(q)), 1e-12)
            with contextlib.suppress(KeyError):  # removed since the keyword search: left out
                cos = (self.store.get_vectors(missing) @ q).tolist()
                cosine.update(zip(missing, cos, strict=True))
        if self.fusion == "combo":
            fused = _convex_combination(cosine, bm25)
        else:
            rankings = [[h.chunk_id for h in dense], [h.chunk_id for h in keyword]]
            fused = reciprocal_rank_fusion(rankings)
        out = []
        for i in sorted((i for i in fused if i in cosine), key=lambda i: -fused[i]):
            found: FoundBy = (
                "both" if i in bm25 and i in in_dense else "keyword" if i in bm25 else "meaning"
            )
            c = cosine[i]
            out.append(replace(by_id[i], score=c, cosine=c, bm25=bm25.get(i), found_by=found))
        return out
