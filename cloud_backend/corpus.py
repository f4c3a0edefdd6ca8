"""The cloud's public corpus: 10,033 English Wikipedia lead summaries (CC BY-SA 4.0), searched
with the code that searches private documents (`retrieval`), so the two sides' scores are
comparable (DRAGON's aggregation weighs both sides' documents by them, docs/math.md#dragon).

`PublicCorpus.open` returns the cached index, which `cloud_backend.corpus_build` builds (or
resumes) first when needed; this module only opens and searches it.

Run `python -m cloud_backend.corpus` to build the full corpus and try a query, and
`python -m cloud_backend.corpus --write-vectors` to regenerate the vectors shipped with the
project (`cloud_backend.corpus_vectors`) with this machine's embedder.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from cloud_backend import corpus_vectors
from cloud_backend.corpus_build import (
    LICENSE,
    PACKAGE,
    PATH_PREFIX,
    CorpusError,
    OnProgress,
    corpus_texts,
    load_summaries,
    open_or_build,
    source_info,
)
from collab.plumbing.files import sha256_file
from collab.plumbing.paths import cloud_corpus_dir as default_corpus_dir
from collab.plumbing.paths import embedder_dir as default_embedder_dir
from collab.sources import Source
from retrieval.chunking import DEFAULT_CHUNK_TOKENS, DEFAULT_OVERLAP_TOKENS
from retrieval.embedder import OnnxEmbedder, prepare_onnx_embedder
from retrieval.search import Searcher, SearchMode
from retrieval.store import Hit, IndexStore

__all__ = [
    "LOCATION",
    "CorpusError",
    "CorpusStats",
    "PublicCorpus",
    "PublicHit",
    "default_corpus_dir",
    "default_embedder_dir",
    "load_summaries",
]

log = logging.getLogger(__name__)

LOCATION = f"Wikipedia summary ({PACKAGE}, {LICENSE})"


@dataclass(frozen=True)
class PublicHit(Source):
    """A public source (the cloud side's citation) that also knows its summary's page and its
    stored chunk (`rescore` reads the chunk's vector; `vector_stored` is False for a hit of
    the keyword store a first start serves from, `cloud_backend.corpus_serving`)."""

    url: str = ""
    chunk_id: int = -1
    vector_stored: bool = True


@dataclass(frozen=True)
class CorpusStats:
    """Sizes and provenance of the open corpus (for logs, `/metrics` and the UI)."""

    documents: int
    chunks: int
    bytes_on_disk: int
    source_version: str
    source_sha256: str
    limit: int | None
    built_at: float
    build_seconds: float
    folder: Path


def _url(title: str) -> str:
    return "https://en.wikipedia.org/wiki/" + quote(title.replace(" ", "_"), safe="_()',-.!:")


# --------------------------------------------------------------------------- the corpus


class PublicCorpus:
    """Search over the public summaries: the cloud side's retrieval. Open with `open()`.

    The query embedder is loaded on first use, so opening a built corpus costs only checking the
    cache and loading the FAISS file (the embedder's `transformers` import alone takes seconds).
    Thread-safe for searches.
    """

    def __init__(
        self,
        store: IndexStore,
        manifest: dict[str, Any],
        embedder_dir: Path,
        threads: int | None = None,
        embedder: OnnxEmbedder | None = None,
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.embedder_dir = embedder_dir
        self.threads = threads
        self._embedder = embedder
        self._embedder_lock = threading.Lock()
        self.searcher = Searcher(store, lambda texts: self.embedder.embed(texts))

    # ---- opening --------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        root: Path,
        embedder_dir: Path,
        limit: int | None = None,
        progress: bool = True,
        *,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        overlap_tokens: int = DEFAULT_OVERLAP_TOKENS,
        threads: int | None = None,
        shipped_vectors: bool = True,
        on_progress: OnProgress | None = None,
    ) -> PublicCorpus:
        """The corpus cached under `root`, built (or resumed) first if missing, incomplete,
        corrupt or built from anything else. `limit` keeps the first N titles (tests);
        `progress` draws a tqdm bar while building; `threads` is ONNX Runtime's thread count;
        `shipped_vectors`: a build takes what it can from the vectors shipped with the project;
        `on_progress(done, total)` hears of a build's summaries as they are stored."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise TypeError(f"limit must be an integer or None, got {limit!r}")
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if chunk_tokens <= 0 or overlap_tokens <= 0 or overlap_tokens >= chunk_tokens:
            raise ValueError(
                f"need 0 < overlap_tokens < chunk_tokens, got {overlap_tokens}, {chunk_tokens}"
            )
        started = time.perf_counter()
        embedder_dir = prepare_onnx_embedder(Path(embedder_dir))
        store, manifest, embedder = open_or_build(
            Path(root),
            embedder_dir,
            limit,
            progress,
            chunk_tokens,
            overlap_tokens,
            threads,
            shipped_vectors,
            on_progress,
        )
        log.info(
            "public corpus ready: %d summaries, %d chunks (%s) in %.2f s",
            manifest["documents"],
            manifest["chunks"],
            store.root,
            time.perf_counter() - started,
        )
        return cls(store, manifest, embedder_dir, threads, embedder)

    # ---- use ------------------------------------------------------------------------------

    @property
    def embedder(self) -> OnnxEmbedder:
        """The query embedder, loaded on first use."""
        with self._embedder_lock:
            if self._embedder is None:
                self._embedder = OnnxEmbedder(self.embedder_dir, threads=self.threads)
            return self._embedder

    def warm_up(self) -> None:
        """Load the query embedder and run it once, so the first request's time to first token
        does not include it (a server calls this after `open`)."""
        self.embedder.embed(["warm up"])

    def search(
        self,
        query: str,
        k: int = 5,
        min_score: float | None = None,
        *,
        mode: SearchMode = "hybrid",
    ) -> list[PublicHit]:
        """The k summary chunks that best answer `query`, best first, none below the relevance
        floor `min_score` (the same search as the device's: `retrieval.search`)."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("empty query: nothing to search the public corpus for")
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        hits = self.searcher.search(query, k, mode=mode, floor=min_score)
        return [self._public(h) for h in hits]

    def rescore(self, hits: Sequence[PublicHit], text: str) -> np.ndarray:
        """Cosine of each hit's chunk with `text` (DRAGON's dynamic re-ranking: query plus the
        text generated so far) from the stored vectors: only `text` is embedded."""
        if not hits:
            return np.empty(0, dtype=np.float32)
        vectors = self.store.get_vectors([h.chunk_id for h in hits])
        return vectors @ self.embedder.embed([text])[0]

    @staticmethod
    def _public(hit: Hit) -> PublicHit:
        title = hit.title or hit.path.removeprefix(PATH_PREFIX)
        return PublicHit(
            title=title,
            location=LOCATION,
            score=float(hit.score),
            text=hit.text,
            url=_url(title),
            chunk_id=hit.chunk_id,
            found_by=hit.found_by,
        )

    def __len__(self) -> int:
        """Number of summaries indexed."""
        return int(self.manifest["documents"])

    def stats(self) -> CorpusStats:
        s = self.store.stats()
        m = self.manifest
        return CorpusStats(
            documents=s.documents,
            chunks=s.chunks,
            bytes_on_disk=s.bytes_on_disk,
            source_version=m["recipe"]["source"]["version"],
            source_sha256=m["recipe"]["source"]["sha256"],
            limit=m["recipe"]["limit"],
            built_at=float(m["built_at"]),
            build_seconds=float(m["build_seconds"]),
            folder=self.store.root,
        )

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> PublicCorpus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- CLI


def write_shipped_vectors(
    path: Path, embedder_dir: Path, threads: int | None = None, limit: int | None = None
) -> dict[str, Any]:
    """Chunk and embed the corpus with this machine's embedder, as a default build does, and
    write the shipped vectors' file; returns what was written."""
    started = time.perf_counter()
    embedder = OnnxEmbedder(prepare_onnx_embedder(Path(embedder_dir)), threads=threads)
    texts = corpus_texts(limit)
    vectors = embedder.embed(texts)
    info = {
        **source_info(),
        "limit": limit,
        "embedder_model_file": embedder.model_file.name,
        "embedder_model_sha256": sha256_file(embedder.model_file),
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "embed_seconds": round(time.perf_counter() - started, 1),
    }
    return {"chunks": len(texts), **corpus_vectors.write(path, texts, vectors, info)}


def main(argv: Sequence[str] | None = None) -> None:
    """Build (or open) the corpus, report how long it took, and answer queries."""
    parser = argparse.ArgumentParser(description="Build and query the cloud's public corpus.")
    parser.add_argument("--root", type=Path, default=None, help="cache folder")
    parser.add_argument("--embedder-dir", type=Path, default=None, help="prepared ONNX MiniLM")
    parser.add_argument("--limit", type=int, default=None, help="first N titles only")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument(
        "--write-vectors",
        action="store_true",
        help=f"embed every chunk here, write the shipped vectors ({corpus_vectors.SHIPPED.name})",
    )
    parser.add_argument("query", nargs="*", help="queries to run after opening")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.write_vectors:
        written = write_shipped_vectors(
            corpus_vectors.SHIPPED,
            args.embedder_dir or default_embedder_dir(),
            args.threads,
            args.limit,
        )
        log.info("wrote %s: %s", corpus_vectors.SHIPPED, written)
        return
    started = time.perf_counter()
    with PublicCorpus.open(
        args.root or default_corpus_dir(),
        args.embedder_dir or default_embedder_dir(),
        limit=args.limit,
        threads=args.threads,
    ) as corpus:
        stats = corpus.stats()
        log.info(
            "opened in %.2f s: %d summaries, %d chunks, %.1f MB in %s (built in %.1f s)",
            time.perf_counter() - started,
            stats.documents,
            stats.chunks,
            stats.bytes_on_disk / 1e6,
            stats.folder,
            stats.build_seconds,
        )
        for query in args.query:
            for hit in corpus.search(query, args.k):
                log.info("%-40s %.3f  %s", hit.title[:40], hit.score, hit.text[:100])


if __name__ == "__main__":
    main()
