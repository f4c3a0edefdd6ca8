"""The public corpus as the server uses it from the moment it starts: by keyword at once on a
first start, by meaning too once the full corpus is built (issue 46: a first start answers
within two minutes).

A cache that is already built opens in about a second and is served as it is; a build that
can take the vectors shipped with the project (their spot check passes on this machine,
`cloud_backend.corpus_vectors`) takes seconds and is waited for. Otherwise the build embeds
every summary: minutes on one core. So `ServingCorpus` first stores the summaries' words alone
(`corpus_build.build_keywords`, seconds), answers from them, and builds the full corpus on a
thread; then it switches. A keyword hit is judged as every
public passage is, by its cosine with the question against the same floor: here the query
embedder scores the candidates at search time, as a keyword store holds no vectors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from cloud_backend.corpus import PublicCorpus, PublicHit
from cloud_backend.corpus_build import build_keywords, is_built, shipped_vectors_pass
from retrieval.chunking import DEFAULT_CHUNK_TOKENS, DEFAULT_OVERLAP_TOKENS
from retrieval.embedder import OnnxEmbedder, prepare_onnx_embedder
from retrieval.search import SearchMode
from retrieval.store import Hit, IndexStore

log = logging.getLogger("tandem.cloud.corpus")  # an operator's line: `tandem serve` logs it

KEYWORD_DEPTH = 20  # BM25 candidates a keyword-only search embeds and judges
KEYWORDS_PREFIX = ".keywords-"  # + the pid of the server whose keyword store it is
MEANING = "meaning"  # status once the full corpus serves

OnStatus = Callable[[str], None]


class _Stopped(Exception):
    """The server is closing: the background build ends (it resumes on the next start)."""


class KeywordCorpus:
    """The summaries' chunks searched by keyword alone, each candidate then scored by its
    cosine with the question (the embedder reads the chunk as a build embeds it)."""

    def __init__(self, store: IndexStore, embedder: OnnxEmbedder) -> None:
        self.store = store
        self.embedder = embedder
        self._vectors: dict[int, np.ndarray] = {}  # chunk id -> its vector, embedded once
        self._lock = threading.Lock()

    def warm_up(self) -> None:
        self.embedder.embed(["warm up"])

    def search(
        self, query: str, k: int = 5, min_score: float | None = None, *, mode: SearchMode = "hybrid"
    ) -> list[PublicHit]:
        """The k best-scoring of the BM25 candidates, none below `min_score` (`mode` is
        accepted for `PublicCorpus.search`'s signature: keywords are all there is)."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("empty query: nothing to search the public corpus for")
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        found = self.store.keyword_search(query, max(k, KEYWORD_DEPTH))
        if not found:
            return []
        cosines = self._vectors_of(found) @ self.embedder.embed([query])[0]
        ranked = sorted(zip(cosines.tolist(), found, strict=True), key=lambda c: -c[0])
        kept = [
            replace(h, score=c, cosine=c) for c, h in ranked if min_score is None or c >= min_score
        ]
        return [replace(PublicCorpus._public(h), vector_stored=False) for h in kept[:k]]

    def rescore(self, hits: Sequence[PublicHit], text: str) -> np.ndarray:
        """As `PublicCorpus.rescore`, from the vectors embedded when the hits were found."""
        if not hits:
            return np.empty(0, dtype=np.float32)
        with self._lock:
            vectors = np.stack([self._vectors[h.chunk_id] for h in hits])
        return vectors @ self.embedder.embed([text])[0]

    def _vectors_of(self, hits: Sequence[Hit]) -> np.ndarray:
        """The hits' vectors, each chunk embedded as a build embeds it, and only once: a
        question's clauses and the next questions find many of the same chunks."""
        with self._lock:
            missing = [h for h in hits if h.chunk_id not in self._vectors]
        if missing:
            vectors = self.embedder.embed([_embedded_text(h) for h in missing])
            with self._lock:
                self._vectors.update(zip((h.chunk_id for h in missing), vectors, strict=True))
        with self._lock:
            return np.stack([self._vectors[h.chunk_id] for h in hits])

    def close(self) -> None:
        self.store.close()


def _embedded_text(hit: Hit) -> str:
    return f"{hit.heading}\n{hit.text}" if hit.heading else hit.text


class ServingCorpus:
    """`search` and `rescore` of whichever corpus serves now; `status()` says which. Start with
    `start()`; `close()` ends a build still running (it resumes on the next start)."""

    def __init__(self, corpus: PublicCorpus | KeywordCorpus, on_status: OnStatus | None = None):
        self._full = corpus if isinstance(corpus, PublicCorpus) else None
        self._keywords = corpus if isinstance(corpus, KeywordCorpus) else None
        self._on_status = on_status
        self._status = MEANING if self._full is not None else "keywords; meaning 0 %"
        self._said_tenth = -1
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._keywords_dir: Path | None = None
        self.ready = threading.Event()  # set once the full corpus serves (or its build failed)
        if self._full is not None:
            self.ready.set()

    @property
    def _current(self) -> PublicCorpus | KeywordCorpus:
        current = self._full if self._full is not None else self._keywords
        assert current is not None
        return current

    @classmethod
    def start(
        cls,
        root: Path,
        embedder_dir: Path,
        limit: int | None = None,
        *,
        threads: int | None = None,
        on_status: OnStatus | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        overlap_tokens: int = DEFAULT_OVERLAP_TOKENS,
        shipped_vectors: bool = True,
        before_build: Callable[[], None] | None = None,
    ) -> ServingCorpus:
        """The built corpus under `root`, opened (built first when the shipped vectors serve
        for it); else a keyword store serving at once while a thread builds the full corpus.
        `on_status(text)` hears the status as it changes (every tenth of the build);
        `before_build` runs on the thread first (tests hold it)."""
        root = Path(root)
        embedder_dir = prepare_onnx_embedder(Path(embedder_dir))
        root.mkdir(parents=True, exist_ok=True)
        _remove_dead_keyword_stores(root)
        open_full = partial(
            PublicCorpus.open,
            root,
            embedder_dir,
            limit,
            False,
            chunk_tokens=chunk_tokens,
            overlap_tokens=overlap_tokens,
            threads=threads,
            shipped_vectors=shipped_vectors,
        )
        recipe = (root, embedder_dir, limit, chunk_tokens, overlap_tokens)
        if is_built(*recipe) or (shipped_vectors and shipped_vectors_pass(*recipe, threads)):
            return cls(open_full(), on_status)
        started = time.perf_counter()
        folder = root / f"{KEYWORDS_PREFIX}{os.getpid()}"
        store = build_keywords(folder, limit, chunk_tokens, overlap_tokens)
        keywords = KeywordCorpus(store, OnnxEmbedder(embedder_dir, threads=threads))
        log.info(
            "public search: keywords (%d chunks indexed in %.1f s); the meaning index is being "
            "built",
            store.stats().chunks,
            time.perf_counter() - started,
        )
        serving = cls(keywords, on_status)
        serving._keywords_dir = folder
        serving._thread = threading.Thread(
            target=serving._build,
            args=(open_full, before_build),
            name="public-corpus-build",
            daemon=True,
        )
        serving._say(serving._status)
        serving._thread.start()
        return serving

    # ---- use ------------------------------------------------------------------------------

    def status(self) -> str:
        """What public search can do now: "meaning", or "keywords; meaning 42 %"."""
        return self._status

    def warm_up(self) -> None:
        self._current.warm_up()

    def search(
        self, query: str, k: int = 5, min_score: float | None = None, *, mode: SearchMode = "hybrid"
    ) -> list[PublicHit]:
        return self._current.search(query, k, min_score, mode=mode)

    def rescore(self, hits: Sequence[PublicHit], text: str) -> np.ndarray:
        """DRAGON's re-ranking, by the corpus that found the hits (a request that began on
        the keyword store keeps its hits when the full corpus takes over)."""
        if hits and not hits[0].vector_stored and self._keywords is not None:
            return self._keywords.rescore(hits, text)
        return self._current.rescore(hits, text)

    def close(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30.0)
        for corpus in (self._full, self._keywords):
            if corpus is not None:
                corpus.close()
        if self._keywords_dir is not None:
            shutil.rmtree(self._keywords_dir, ignore_errors=True)

    def __enter__(self) -> ServingCorpus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the background build -------------------------------------------------------------

    def _build(
        self, open_full: Callable[..., PublicCorpus], before_build: Callable[[], None] | None
    ) -> None:
        try:
            if before_build is not None:
                before_build()
            full = open_full(on_progress=self._progress)
            full.warm_up()
        except _Stopped:
            log.info("public corpus build stopped with the server; it resumes on the next start")
            return
        except Exception as exc:  # keyword search keeps serving; say why meaning does not
            log.exception("building the public corpus failed; public search stays by keyword")
            self._say(f"keywords (the meaning index failed: {exc})")
            self.ready.set()
            return
        self._full = full  # the keyword store stays open: a search on it may be running
        log.info("public search: meaning and keywords over %d chunks", full.manifest["chunks"])
        self._say(MEANING)
        self.ready.set()

    def _progress(self, done: int, total: int) -> None:
        if self._stopping.is_set():
            raise _Stopped
        tenth = 10 * done // max(total, 1)
        if tenth > self._said_tenth and done < total:
            self._said_tenth = tenth
            self._say(f"keywords; meaning {100 * done // max(total, 1)} %")

    def _say(self, status: str) -> None:
        self._status = status
        log.info("public search: %s", status)
        if self._on_status is not None:
            with contextlib.suppress(Exception):  # a report that fails never stops the build
                self._on_status(status)


def _remove_dead_keyword_stores(root: Path) -> None:
    """Keyword stores left by servers that were killed (each is named by its server's pid)."""
    for path in root.glob(f"{KEYWORDS_PREFIX}*"):
        pid = path.name.removeprefix(KEYWORDS_PREFIX)
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
