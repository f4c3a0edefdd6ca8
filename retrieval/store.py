"""Crash-safe document/chunk store: SQLite is the source of truth, FAISS a derived cache.

Used for the user's private documents on the device and, with the same code, for the cloud's
public corpus (docs/architecture.md#layers). The store takes vectors; it never parses files or
runs models.

Why it survives ``kill -9`` at any point:

* Every document change is one SQLite transaction (WAL mode): the old version's chunks and the
  new document row, chunks and vectors appear or vanish together.
* Each chunk row keeps its float32 vector, so the FAISS index can always be rebuilt.
* Chunk ids come from ``AUTOINCREMENT`` and chunk rows are never updated, only inserted and
  deleted, so an id always names the same vector: equal id sets mean equal indexes.
* The keyword index (``chunks_fts``, SQLite FTS5 with BM25) is kept by triggers on ``chunks``,
  so it changes in the same transaction as the chunk rows and can never disagree with them.
* ``vectors.faiss`` is written atomically (``collab.plumbing.files.atomic_write``); its sha256
  and the fingerprint of its id set are then recorded in the ``meta`` table. At open the file is
  checked against that checksum and its ids against the ``chunks`` table; a missing, corrupt
  or stale file is rebuilt from SQLite.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from sqlite_utils import Database

from collab.plumbing.files import (
    PRIVATE_FILE_MODE,
    atomic_write,
    discard_temp_files,
    make_private_dir,
    private_sqlite_file,
    tighten,
)
from retrieval import scrub
from retrieval.keywords import match_expression
from retrieval.store_keywords import QueryWords
from retrieval.store_records import (
    CHUNK_FORMAT,
    ChunkRecord,
    DocumentMeta,
    DocumentRow,
    FolderRow,
    FoundBy,
    Hit,
    IndexKind,
    Status,
    StoredChunk,
    StoreStats,
)
from retrieval.store_schema import FTS_TOKENIZER, SCHEMA_VERSION, migrate, schema_version

__all__ = [
    "CHUNK_FORMAT",
    "DB_NAME",
    "FAISS_NAME",
    "FTS_TOKENIZER",
    "SCHEMA_VERSION",
    "ChunkRecord",
    "DocumentMeta",
    "DocumentRow",
    "FolderRow",
    "FoundBy",
    "Hit",
    "IndexKind",
    "IndexStore",
    "Status",
    "StoreStats",
    "StoredChunk",
    "migrate",
    "schema_version",
]

log = logging.getLogger(__name__)

DB_NAME = "index.sqlite"
FAISS_NAME = "vectors.faiss"
_BATCH = 8192


# --------------------------------------------------------------------------- helpers


def _fingerprint(ids: np.ndarray) -> str:
    """Count, max id and a checksum of the sorted id set: equal fingerprints mean the same
    chunks, because ids are never reused (AUTOINCREMENT) and chunk rows never change."""
    ids = np.sort(np.asarray(ids, dtype="<i8"))
    top = int(ids[-1]) if len(ids) else -1
    return f"{len(ids)}:{top}:{hashlib.sha256(ids.tobytes()).hexdigest()[:32]}"


def _normalise(vectors: np.ndarray, what: str) -> np.ndarray:
    """Unit-normalise rows so inner product is cosine; reject NaN/inf and zero vectors."""
    if not np.all(np.isfinite(vectors)):
        raise ValueError(f"{what} contains NaN or infinite values")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise ValueError(f"{what} contains a zero vector (cosine is undefined)")
    return np.ascontiguousarray(vectors / norms, dtype=np.float32)


def _check_k(k: object) -> None:
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise TypeError(f"k must be an integer, got {type(k).__name__}")
    if k <= 0:
        raise ValueError(f"k must be a positive number of results, got {k}")


def _folder_prefix(folder: str | os.PathLike[str]) -> tuple[str, str]:
    """(exact path, prefix) for matching everything under a folder without LIKE wildcards."""
    text = os.fspath(folder)
    stripped = text.rstrip("/" + os.sep) or text[:1]
    prefix = stripped if stripped.endswith(("/", os.sep)) else stripped + os.sep
    return stripped, prefix


_DOC_COLUMNS = (
    "id, path, size, mtime, sha256, status, error, title, kind, chunk_count, indexed_at, "
    "chunk_format, ocr_pages, unread_pages"
)


def _pages_text(pages: Sequence[int]) -> str:
    return ",".join(str(p) for p in pages)


def _pages(text: str | None) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(",") if p) if text else ()


_CHUNK_COLUMNS = (
    "c.id, c.document_id, d.path, c.ordinal, c.text, c.page, c.title, "
    "c.line_start, c.line_end, c.char_start, c.char_end, c.heading, d.title"
)


# --------------------------------------------------------------------------- store


class IndexStore:
    """Documents, chunks and vectors under ``root``: ``index.sqlite`` + ``vectors.faiss``.

    Thread-safe (one lock); single writer process. Vectors are normalised on the way in, so
    scores are cosine similarities. ``hnsw_threshold``: above this many chunks the FAISS index
    is HNSW (approximate, faster at large sizes); removals then rebuild it lazily (at the next
    search, flush or consistency check), since HNSW cannot delete. ``None`` = always exact.
    ``faiss_threads`` sets FAISS's (process-wide) OpenMP thread count.
    """

    def __init__(
        self,
        root: Path,
        dim: int,
        *,
        hnsw_threshold: int | None = None,
        hnsw_m: int = 32,
        hnsw_ef_construction: int = 80,
        hnsw_ef_search: int = 256,
        faiss_threads: int | None = 1,
    ) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self.root = Path(root)
        self.dim = int(dim)
        self.hnsw_threshold = hnsw_threshold
        self.hnsw_m = hnsw_m
        self.hnsw_ef_construction = hnsw_ef_construction
        self.hnsw_ef_search = hnsw_ef_search
        if faiss_threads is not None:
            # Process-wide. One query against a flat index is memory-bound: on this 2-core
            # machine under load, OpenMP's 2 threads took 48 ms per query at 100k x 384, one
            # thread 7.3 ms. None leaves FAISS's default.
            faiss.omp_set_num_threads(faiss_threads)
        self._lock = threading.RLock()
        self._data_version: int | None = None  # SQLite's, when FAISS last matched the chunks
        self._dirty = False
        self._needs_rebuild = False
        self._closed = False
        self._query_words = QueryWords()  # the keyword search's budget, per connection
        self._make_private()
        conn = sqlite3.connect(str(self.root / DB_NAME), check_same_thread=False)
        self.db = Database(conn)
        try:
            # Deleted chunks are overwritten, not just unlinked from the b-tree: a removed
            # document's text must not stay readable in the file. Per connection, so it covers
            # every table of this file, present and future.
            self.db.execute("PRAGMA secure_delete = ON")
            self.db.enable_wal()
            # WAL + NORMAL: a killed process loses nothing committed; a power cut may lose the
            # last commits but never leaves a half-written transaction.
            self.db.execute("PRAGMA synchronous = NORMAL")
            self.db.execute("PRAGMA foreign_keys = ON")
            migrate(self.db)
            if scrub.fts_secure_delete():  # a deleted chunk's terms overwritten at once
                with self.db.atomic():
                    self.db.conn.execute(
                        "INSERT INTO chunks_fts(chunks_fts, rank) VALUES ('secure-delete', 1)"
                    )
            self._check_dim()
            scrub.compact(self.db.conn, str(self.root))  # once, after an upgrade
            self._scrub()  # what a killed process owed
            discard_temp_files(self.root / FAISS_NAME)
            self._data_version = self._version()
            self._index = self._load_or_rebuild()
        except BaseException:
            self.db.close()
            raise

    # ----------------------------------------------------------------- lifecycle

    def _make_private(self) -> None:
        """The folder 0700 and every file in it 0600, from creation: the database is created
        0600 before SQLite opens it (its -wal and -shm copy its mode), ``vectors.faiss`` is
        written 0600. Files an older Tandem left readable are tightened (logged once)."""
        make_private_dir(self.root)
        changed = tighten([self.root])
        changed += private_sqlite_file(self.root / DB_NAME)
        with os.scandir(self.root) as entries:
            changed += tighten(Path(e.path) for e in entries if e.is_file(follow_symlinks=False))
        if changed:
            log.warning(
                "made %d files of the index at %s private to this user (they were readable by "
                "other local users): %s",
                len(changed),
                self.root,
                ", ".join(p.name for p in changed),
            )

    def _scrub(self, keywords: bool = True) -> None:
        """Pay the scrub owed in the file, if any (`retrieval.scrub`)."""
        scrub.scrub(self.db.conn, str(self.root), keywords=keywords)

    def __enter__(self) -> IndexStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush the FAISS file and close SQLite; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            try:
                self.flush()
            finally:
                self._closed = True
                self.db.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the index store is closed")

    # ----------------------------------------------------------------- meta

    def _meta_get(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
        return None if row is None else str(row[0])

    def _meta_set(self, key: str, value: str) -> None:
        self.db.conn.execute(
            "INSERT INTO meta(key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            [key, value],
        )

    def _check_dim(self) -> None:
        stored = self._meta_get("dim")
        if stored is None:
            with self.db.atomic():
                self._meta_set("dim", str(self.dim))
        elif int(stored) != self.dim:
            raise ValueError(
                f"store at {self.root} holds {stored}-dimensional vectors, not {self.dim}; "
                "it was built with another embedding model (remove it to re-index)"
            )

    # ----------------------------------------------------------------- FAISS

    def _chunk_ids(self) -> np.ndarray:
        rows = self.db.execute("SELECT id FROM chunks").fetchall()
        return np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))

    def _wanted_kind(self, count: int) -> IndexKind:
        if self.hnsw_threshold is not None and count > self.hnsw_threshold:
            return "hnsw"
        return "flat"

    @staticmethod
    def _kind_of(index: faiss.IndexIDMap2) -> IndexKind:
        inner = faiss.downcast_index(index.index)
        return "hnsw" if isinstance(inner, faiss.IndexHNSW) else "flat"

    def _new_index(self, kind: IndexKind) -> faiss.IndexIDMap2:
        inner: faiss.Index
        if kind == "hnsw":
            inner = faiss.IndexHNSWFlat(self.dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efConstruction = self.hnsw_ef_construction
            inner.hnsw.efSearch = self.hnsw_ef_search
        else:
            inner = faiss.IndexFlatIP(self.dim)
        return faiss.IndexIDMap2(inner)

    def _configure(self, index: faiss.IndexIDMap2) -> None:
        inner = faiss.downcast_index(index.index)
        if isinstance(inner, faiss.IndexHNSW):
            inner.hnsw.efSearch = self.hnsw_ef_search

    def _load_or_rebuild(self) -> faiss.IndexIDMap2:
        """Use ``vectors.faiss`` only if its checksum matches the one recorded at flush and its
        ids are exactly the chunk ids in SQLite; otherwise rebuild it from the chunks table."""
        path = self.root / FAISS_NAME
        ids = self._chunk_ids()
        index, reason = self._try_load(path, ids)
        if index is not None:
            return index
        new_store = len(ids) == 0 and self._meta_get("faiss_sha256") is None
        log.log(
            logging.DEBUG if new_store else logging.WARNING,
            "rebuilding %s from SQLite (%d chunks): %s",
            path,
            len(ids),
            reason,
        )
        self._index = self._build_from_sqlite(self._wanted_kind(len(ids)))
        self._dirty = True
        self.flush()
        return self._index

    def _try_load(self, path: Path, ids: np.ndarray) -> tuple[faiss.IndexIDMap2 | None, str]:
        """The saved index if it is intact and current, else None and why not."""
        if not path.exists():
            return None, "file missing"
        data = path.read_bytes()
        known = {self._meta_get("faiss_sha256"), self._meta_get("faiss_sha256_pending")}
        if hashlib.sha256(data).hexdigest() not in known:
            return None, "checksum differs from the last flush (corrupt or interrupted write)"
        try:
            index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
        except RuntimeError as exc:
            return None, f"unreadable: {exc}"
        if not isinstance(index, faiss.IndexIDMap2) or index.d != self.dim:
            return None, "unexpected index type or dimension"
        file_ids = faiss.vector_to_array(index.id_map)
        if _fingerprint(file_ids) != _fingerprint(ids):
            return None, f"index holds {len(file_ids)} vectors, SQLite {len(ids)} chunks (stale)"
        if self._kind_of(index) != self._wanted_kind(len(ids)):
            return None, "index kind does not match hnsw_threshold"
        self._configure(index)
        return index, ""

    def _build_from_sqlite(self, kind: IndexKind) -> faiss.IndexIDMap2:
        index = self._new_index(kind)
        cursor = self.db.execute("SELECT id, vector FROM chunks ORDER BY id")
        while rows := cursor.fetchmany(_BATCH):
            ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
            vecs = np.frombuffer(b"".join(r[1] for r in rows), dtype="<f4").reshape(-1, self.dim)
            index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), ids)
        return index

    def _version(self) -> int:
        """SQLite's data_version: it changes when another connection (another process: a CLI
        ingest while the app is open) commits, never for this connection's own commits."""
        return int(self.db.conn.execute("PRAGMA data_version").fetchone()[0])

    def _catch_up(self) -> None:
        """If another process changed the chunks since we last looked, bring the in-memory
        FAISS index level with SQLite: add the chunks it wrote, drop the ones it removed.
        One PRAGMA when nothing changed; the id sets and the new vectors when something did."""
        version = self._version()
        if version == self._data_version:
            return
        self._data_version = version
        if self._needs_rebuild:
            return
        ids = self._chunk_ids()
        have = faiss.vector_to_array(self._index.id_map)
        gone, new = np.setdiff1d(have, ids), np.setdiff1d(ids, have)
        if not len(gone) and not len(new):
            return
        log.info("index changed by another process: +%d -%d chunks", len(new), len(gone))
        try:
            vectors = self._vectors_by_id([int(i) for i in new])
        except KeyError:  # removed again meanwhile: rebuild from what SQLite holds now
            self._dirty = self._needs_rebuild = True
            return
        self._apply_to_faiss(gone, new, vectors)

    def _ensure_index(self) -> None:
        """Catch up with other processes' commits, then apply a pending rebuild (HNSW removals,
        crossing the HNSW threshold)."""
        self._catch_up()
        if self._needs_rebuild:
            count = self.db.execute("SELECT count(*) FROM chunks").fetchone()[0]
            kind = self._wanted_kind(count)
            started = time.perf_counter()
            self._index = self._build_from_sqlite(kind)
            self._needs_rebuild = False
            self._dirty = True
            log.info(
                "rebuilt %s index of %d vectors in %.2f s",
                kind,
                count,
                time.perf_counter() - started,
            )

    def _apply_to_faiss(
        self, removed: np.ndarray, added_ids: np.ndarray, added: np.ndarray
    ) -> None:
        """Mirror a committed SQLite change in memory. Any failure only forces a rebuild: SQLite
        already holds the truth."""
        self._dirty = True
        if self._needs_rebuild:
            return
        try:
            count_after = self._index.ntotal - len(removed) + len(added_ids)
            kind = self._kind_of(self._index)
            if self._wanted_kind(count_after) != kind or (kind == "hnsw" and len(removed)):
                self._needs_rebuild = True
                return
            if len(removed):
                # faiss's stub lists only the IDSelector form; its wrapper also takes an id array
                self._index.remove_ids(np.ascontiguousarray(removed, dtype=np.int64))  # type: ignore[arg-type]
            if len(added_ids):
                self._index.add_with_ids(added, np.ascontiguousarray(added_ids, dtype=np.int64))
        except RuntimeError:
            log.exception("FAISS update failed; the index will be rebuilt from SQLite")
            self._needs_rebuild = True

    def flush(self, *, final: bool = True) -> None:
        """Write ``vectors.faiss`` atomically (temp file, fsync, rename) and record its checksum
        and id fingerprint. Until then a crash costs only a rebuild at the next open. Called by
        the ingester every few documents (``final=False``: the keyword index's deleted terms
        wait for the ingest's last flush) and by ``close``."""
        with self._lock:
            self._check_open()
            self._ensure_index()
            self._scrub(keywords=final)
            if not self._dirty:
                return
            data = faiss.serialize_index(self._index).tobytes()
            digest = hashlib.sha256(data).hexdigest()
            # Announce the checksum first: a kill right after the rename then still finds the
            # new file acceptable (its ids are checked against SQLite anyway).
            with self.db.atomic():
                self._meta_set("faiss_sha256_pending", digest)
            atomic_write(self.root / FAISS_NAME, data, mode=PRIVATE_FILE_MODE)
            with self.db.atomic():
                self._meta_set("faiss_sha256", digest)
                self.db.conn.execute("DELETE FROM meta WHERE key = 'faiss_sha256_pending'")
                self._meta_set(
                    "faiss_fingerprint", _fingerprint(faiss.vector_to_array(self._index.id_map))
                )
            self._dirty = False

    # ----------------------------------------------------------------- writes

    def _ids_of_documents(self, where: str, params: Sequence[Any]) -> tuple[list[int], np.ndarray]:
        doc_ids = [r[0] for r in self.db.conn.execute(f"SELECT id FROM documents {where}", params)]
        if not doc_ids:
            return [], np.empty(0, dtype=np.int64)
        chunk_ids: list[int] = []
        for start in range(0, len(doc_ids), 500):
            part = doc_ids[start : start + 500]
            marks = ",".join("?" * len(part))
            chunk_ids.extend(
                r[0]
                for r in self.db.conn.execute(
                    f"SELECT id FROM chunks WHERE document_id IN ({marks})", part
                )
            )
        return doc_ids, np.asarray(chunk_ids, dtype=np.int64)

    def _delete_documents(self, doc_ids: list[int]) -> None:
        """Delete documents and their chunks (in the caller's transaction, which also owes the
        scrub that takes their text out of the files: at once for a removal, at the next flush
        for a new version, at the next open after a kill)."""
        if doc_ids:
            scrub.owe(self.db.conn)
        for start in range(0, len(doc_ids), 500):
            part = doc_ids[start : start + 500]
            marks = ",".join("?" * len(part))
            self.db.conn.execute(f"DELETE FROM chunks WHERE document_id IN ({marks})", part)
            self.db.conn.execute(f"DELETE FROM documents WHERE id IN ({marks})", part)

    def replace_document(
        self, meta: DocumentMeta, chunks: Sequence[ChunkRecord], vectors: np.ndarray
    ) -> int:
        """Store a document's new version in one transaction (old chunks out, new in), then
        mirror it in FAISS. Returns the document id. ``vectors[i]`` belongs to ``chunks[i]``."""
        vectors = np.asarray(vectors, dtype=np.float32)
        if len(chunks) == 0:
            vectors = np.empty((0, self.dim), dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape != (len(chunks), self.dim):
            raise ValueError(
                f"vectors must have shape ({len(chunks)}, {self.dim}), got {vectors.shape}"
            )
        ordinals = [c.ordinal for c in chunks]
        if len(set(ordinals)) != len(ordinals):
            raise ValueError(f"duplicate chunk ordinals in {meta.path}")
        if len(chunks):
            vectors = _normalise(vectors, "vectors")
        position = {o: i for i, o in enumerate(ordinals)}
        with self._lock:
            self._check_open()
            with self.db.atomic():
                old_docs, old_chunk_ids = self._ids_of_documents("WHERE path = ?", [meta.path])
                self._delete_documents(old_docs)
                doc_id = self._insert_document(meta, "indexed", None, len(chunks))
                self.db.conn.executemany(
                    "INSERT INTO chunks (document_id, ordinal, text, page, title, line_start, "
                    "line_end, char_start, char_end, heading, vector) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        (
                            doc_id,
                            c.ordinal,
                            c.text,
                            c.page,
                            c.title,
                            c.line_start,
                            c.line_end,
                            c.char_start,
                            c.char_end,
                            c.heading,
                            vectors[i].astype("<f4").tobytes(),
                        )
                        for i, c in enumerate(chunks)
                    ),
                )
                rows = self.db.conn.execute(
                    "SELECT id, ordinal FROM chunks WHERE document_id = ?", [doc_id]
                ).fetchall()
            new_ids = np.asarray([r[0] for r in rows], dtype=np.int64)
            order = [position[r[1]] for r in rows]
            added = np.ascontiguousarray(vectors[order]) if rows else vectors
            self._apply_to_faiss(old_chunk_ids, new_ids, added)
            return doc_id

    def _insert_document(
        self, meta: DocumentMeta, status: Status, error: str | None, n: int
    ) -> int:
        cursor = self.db.conn.execute(
            "INSERT INTO documents (path, size, mtime, sha256, status, error, title, kind, "
            "chunk_count, indexed_at, chunk_format, ocr_pages, unread_pages) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            [
                meta.path,
                int(meta.size),
                float(meta.mtime),
                meta.sha256,
                status,
                error,
                meta.title,
                meta.kind,
                n,
                time.time(),
                CHUNK_FORMAT,
                _pages_text(meta.ocr_pages),
                _pages_text(meta.unread_pages),
            ],
        )
        return int(cursor.lastrowid)  # type: ignore[arg-type]

    def mark_failed(self, path: str, size: int, mtime: float, sha256: str, error: str) -> int:
        """Record that a file could not be indexed (and why); its previous chunks are dropped so
        the listing never shows stale text for a file that now fails."""
        meta = DocumentMeta(path=path, size=size, mtime=mtime, sha256=sha256)
        with self._lock:
            self._check_open()
            with self.db.atomic():
                old_docs, old_chunk_ids = self._ids_of_documents("WHERE path = ?", [path])
                self._delete_documents(old_docs)
                doc_id = self._insert_document(meta, "failed", error, 0)
            empty = np.empty((0, self.dim), dtype=np.float32)
            self._apply_to_faiss(old_chunk_ids, np.empty(0, dtype=np.int64), empty)
            return doc_id

    def touch(self, path: str, size: int, mtime: float) -> None:
        """Record a new size/mtime for a file whose content (sha256) did not change, so the
        next ingest skips it on the cheap check."""
        with self._lock:
            self._check_open()
            with self.db.atomic():
                self.db.execute(
                    "UPDATE documents SET size = ?, mtime = ? WHERE path = ?", [size, mtime, path]
                )

    def _remove_where(self, where: str, params: Sequence[Any]) -> int:
        with self._lock:
            self._check_open()
            with self.db.atomic():
                doc_ids, chunk_ids = self._ids_of_documents(where, params)
                self._delete_documents(doc_ids)
            if doc_ids:
                empty = np.empty((0, self.dim), dtype=np.float32)
                self._apply_to_faiss(chunk_ids, np.empty(0, dtype=np.int64), empty)
                self._scrub()  # a removal is a promise: the text is gone when it returns
            return len(doc_ids)

    def remove_paths(self, paths: Iterable[str | os.PathLike[str]]) -> int:
        """Delete these documents and their vectors; returns how many documents were removed."""
        items = [os.fspath(p) for p in paths]
        removed = 0
        for start in range(0, len(items), 500):
            part = items[start : start + 500]
            marks = ",".join("?" * len(part))
            removed += self._remove_where(f"WHERE path IN ({marks})", part)
        return removed

    def remove_prefix(self, folder: str | os.PathLike[str]) -> int:
        """Delete every document at or under ``folder``; returns how many were removed."""
        exact, prefix = _folder_prefix(folder)
        return self._remove_where(
            "WHERE path = ? OR substr(path, 1, ?) = ?", [exact, len(prefix), prefix]
        )

    # ----------------------------------------------------------------- synced folders

    def add_folder(self, folder: str | os.PathLike[str]) -> None:
        """Keep `folder` in sync from now on (the app watches it); adding it again is a no-op."""
        with self._lock:
            self._check_open()
            with self.db.atomic():
                self.db.conn.execute(
                    "INSERT INTO folders (path, added_at) VALUES (?, ?) ON CONFLICT DO NOTHING",
                    [os.fspath(folder), time.time()],
                )

    def folder_synced(self, folder: str | os.PathLike[str], when: float | None = None) -> None:
        """Record that `folder` and the index agree as of `when` (now)."""
        with self._lock:
            self._check_open()
            with self.db.atomic():
                self.db.conn.execute(
                    "UPDATE folders SET synced_at = ? WHERE path = ?",
                    [time.time() if when is None else when, os.fspath(folder)],
                )

    def remove_folder(self, folder: str | os.PathLike[str]) -> bool:
        """Stop keeping `folder` in sync (its documents stay until removed); False if unknown."""
        with self._lock:
            self._check_open()
            with self.db.atomic():
                cursor = self.db.conn.execute(
                    "DELETE FROM folders WHERE path = ?", [os.fspath(folder)]
                )
            return cursor.rowcount > 0

    def folders(self) -> list[FolderRow]:
        """The folders kept in sync, by path."""
        with self._lock:
            self._check_open()
            rows = self.db.execute("SELECT path, added_at, synced_at FROM folders ORDER BY path")
            return [FolderRow(*r) for r in rows.fetchall()]

    # ----------------------------------------------------------------- reads

    @staticmethod
    def _doc_row(r: Sequence[Any]) -> DocumentRow:
        (doc_id, path, size, mtime, sha, status, error, title, kind, n, at, fmt, ocr, unread) = r
        ocr_pages = None if ocr is None else _pages(ocr)
        return DocumentRow(
            doc_id,
            path,
            size,
            mtime,
            sha,
            status,
            error,
            title,
            kind,
            n,
            at,
            fmt,
            ocr_pages,
            _pages(unread),
        )

    def documents(self) -> list[DocumentRow]:
        """All documents (indexed and failed), by path."""
        with self._lock:
            self._check_open()
            rows = self.db.execute(f"SELECT {_DOC_COLUMNS} FROM documents ORDER BY path")
            return [self._doc_row(r) for r in rows.fetchall()]

    def document(self, path: str | os.PathLike[str]) -> DocumentRow | None:
        """The stored row for a path (the ingester compares size, mtime and sha256)."""
        with self._lock:
            self._check_open()
            row = self.db.execute(
                f"SELECT {_DOC_COLUMNS} FROM documents WHERE path = ?", [os.fspath(path)]
            ).fetchone()
            return None if row is None else self._doc_row(row)

    def has_chunks(self) -> bool:
        """Whether any chunk is stored (one indexed lookup, whatever the size)."""
        with self._lock:
            self._check_open()
            return self.db.execute("SELECT 1 FROM chunks LIMIT 1").fetchone() is not None

    def stats(self) -> StoreStats:
        """Indexed and failed document counts, chunk count, bytes on disk and index kind."""
        with self._lock:
            self._check_open()
            indexed, failed = self.db.execute(
                "SELECT coalesce(sum(status = 'indexed'), 0), coalesce(sum(status = 'failed'), 0)"
                " FROM documents"
            ).fetchone()
            chunks = self.db.execute("SELECT count(*) FROM chunks").fetchone()[0]
            names = (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", FAISS_NAME)
            size = sum((self.root / n).stat().st_size for n in names if (self.root / n).exists())
            return StoreStats(int(indexed), int(failed), int(chunks), size, self.index_kind)

    @property
    def index_kind(self) -> IndexKind:
        """Which FAISS index serves searches now (after any pending rebuild)."""
        with self._lock:
            if self._needs_rebuild:
                count = self.db.execute("SELECT count(*) FROM chunks").fetchone()[0]
                return self._wanted_kind(count)
            return self._kind_of(self._index)

    def _chunk_rows(self, ids: Sequence[int]) -> dict[int, tuple[Any, ...]]:
        found: dict[int, tuple[Any, ...]] = {}
        for start in range(0, len(ids), 500):
            part = [int(i) for i in ids[start : start + 500]]
            marks = ",".join("?" * len(part))
            for r in self.db.execute(
                f"SELECT {_CHUNK_COLUMNS} FROM chunks c JOIN documents d ON d.id = c.document_id "
                f"WHERE c.id IN ({marks})",
                part,
            ):
                found[int(r[0])] = tuple(r)
        return found

    def get_chunks(self, ids: Iterable[int]) -> list[StoredChunk]:
        """Chunks by id, in the order asked; unknown ids are skipped."""
        wanted = [int(i) for i in ids]
        with self._lock:
            self._check_open()
            rows = self._chunk_rows(wanted)
        return [StoredChunk(*rows[i][:12]) for i in wanted if i in rows]

    def document_chunks(self, path: str | os.PathLike[str]) -> list[StoredChunk]:
        """A document's chunks in their order (its text as indexed: the built-in pager's view
        of a file no terminal tool can show); none for a path not indexed."""
        with self._lock:
            self._check_open()
            rows = self.db.execute(
                f"SELECT {_CHUNK_COLUMNS} FROM chunks c JOIN documents d ON d.id = c.document_id "
                "WHERE d.path = ? ORDER BY c.ordinal",
                [os.fspath(path)],
            ).fetchall()
        return [StoredChunk(*r[:12]) for r in rows]

    def stored_chunks(self, ids: Iterable[int]) -> set[int]:
        """Which of `ids` are still stored (chunk ids are never reused: a removed or
        re-ingested document's chunks are gone for good)."""
        wanted = [int(i) for i in ids]
        found: set[int] = set()
        with self._lock:
            self._check_open()
            for start in range(0, len(wanted), 500):
                part = wanted[start : start + 500]
                marks = ",".join("?" * len(part))
                rows = self.db.execute(f"SELECT id FROM chunks WHERE id IN ({marks})", part)
                found.update(cid for (cid,) in rows)
        return found

    def get_vectors(self, ids: Iterable[int]) -> np.ndarray:
        """Stored (normalised) vectors by id, in the order asked, for rescoring without
        re-embedding; unknown ids raise KeyError."""
        with self._lock:
            self._check_open()
            return self._vectors_by_id([int(i) for i in ids])

    def _vectors_by_id(self, wanted: list[int]) -> np.ndarray:
        with self._lock:
            found: dict[int, bytes] = {}
            for start in range(0, len(wanted), 500):
                part = wanted[start : start + 500]
                marks = ",".join("?" * len(part))
                for cid, blob in self.db.execute(
                    f"SELECT id, vector FROM chunks WHERE id IN ({marks})", part
                ):
                    found[int(cid)] = blob
        missing = [i for i in wanted if i not in found]
        if missing:
            raise KeyError(f"unknown chunk ids: {missing[:10]}")
        out = np.empty((len(wanted), self.dim), dtype=np.float32)
        for row, i in enumerate(wanted):
            out[row] = np.frombuffer(found[i], dtype="<f4")
        return out

    def search(self, query_vec: np.ndarray, k: int, min_score: float | None = None) -> list[Hit]:
        """The k chunks most similar (cosine) to ``query_vec``, best first; fewer if the store
        holds fewer or ``min_score`` filters them."""
        _check_k(k)
        query = np.asarray(query_vec, dtype=np.float32).reshape(1, -1)
        if query.shape[1] != self.dim:
            raise ValueError(f"query vector has dimension {query.shape[1]}, expected {self.dim}")
        query = _normalise(query, "query vector")
        with self._lock:
            self._check_open()
            self._ensure_index()
            if self._index.ntotal == 0:
                return []
            scores, ids = self._index.search(query, min(int(k), self._index.ntotal))
            pairs = [
                (int(i), float(s))
                for i, s in zip(ids[0], scores[0], strict=True)
                if i >= 0 and (min_score is None or s >= min_score)
            ]
            return self.hits(pairs, found_by="meaning")

    def chunk_ids_under(self, paths: Sequence[str | os.PathLike[str]]) -> list[int]:
        """The chunks of the documents at or under each of `paths` (a scoped question's)."""
        where, params = [], []
        for path in paths:
            exact, prefix = _folder_prefix(path)
            where.append("d.path = ? OR substr(d.path, 1, ?) = ?")
            params += [exact, len(prefix), prefix]
        if not where:
            return []
        with self._lock:
            self._check_open()
            rows = self.db.execute(
                "SELECT c.id FROM chunks c JOIN documents d ON d.id = c.document_id WHERE "
                + " OR ".join(f"({w})" for w in where),
                params,
            ).fetchall()
        return [int(r[0]) for r in rows]

    def search_among(self, query_vec: np.ndarray, k: int, ids: Sequence[int]) -> list[Hit]:
        """`search` over the chunks `ids` only, exactly (a scoped question: its scope's vectors
        against the question, however few of them FAISS would rank in the whole index)."""
        _check_k(k)
        if not ids:
            return []
        query = _normalise(np.asarray(query_vec, dtype=np.float32).reshape(1, -1), "query vector")
        with self._lock:
            self._check_open()
            scores = self._vectors_by_id([int(i) for i in ids]) @ query[0]
        best = np.argsort(-scores, kind="stable")[: int(k)]
        return self.hits([(int(ids[i]), float(scores[i])) for i in best], found_by="meaning")

    def keyword_search(self, query: str, k: int, among: Sequence[int] | None = None) -> list[Hit]:
        """The k chunks that best match `query`'s words (BM25 over heading path and text, the
        heading weighted double), best first; `score` and `bm25` are BM25 (higher is better).
        Identifiers in the query (`max_file_mb`, `os.path.join`, `--flag`) match as phrases.
        `among`: only these chunks (a scoped question's)."""
        _check_k(k)
        with self._lock:
            self._check_open()
            match = match_expression(self._affordable_words(query))
            if match is None or (among is not None and not among):
                return []
            self._check_open()
            scoped = "" if among is None else " AND rowid IN (SELECT value FROM json_each(?))"
            params: list[Any] = [match] if among is None else [match, json.dumps(list(among))]
            rows = self.db.execute(
                "SELECT rowid, bm25(chunks_fts, 2.0, 1.0) FROM chunks_fts WHERE chunks_fts MATCH ?"
                f"{scoped} ORDER BY rank LIMIT ?",
                [*params, int(k)],
            ).fetchall()
            return self.hits([(int(r[0]), -float(r[1])) for r in rows], found_by="keyword")

    def _affordable_words(self, query: str) -> list[str]:
        """The question's words the keyword search can afford to read on this index."""
        return self._query_words.affordable(self.db, query)

    def hits(self, scored: Sequence[tuple[int, float]], found_by: FoundBy = "meaning") -> list[Hit]:
        """Hits for (chunk id, score) pairs, in that order; the score is also recorded as the
        hit's cosine (found by meaning) or BM25 (found by keyword). Unknown ids are skipped."""
        with self._lock:
            self._check_open()
            rows = self._chunk_rows([i for i, _ in scored])
        hits = []
        for cid, score in scored:
            r = rows.get(cid)
            if r is None:  # removed meanwhile (or FAISS behind SQLite): never cite a ghost
                continue
            _, _, path, ordinal, text, page, title, ls, le, cs, ce, heading, doc_title = r
            cosine, bm25 = (score, None) if found_by == "meaning" else (None, score)
            title = title or doc_title
            where = (page, ls, le, cs, ce, ordinal)
            hits.append(Hit(cid, score, text, path, title, *where, heading, found_by, cosine, bm25))
        return hits

    # ----------------------------------------------------------------- checks

    def check_consistency(self, deep: bool = False) -> list[str]:
        """Problems that a crash must never leave behind; an empty list means consistent.
        ``deep`` also compares every FAISS vector with the one stored in SQLite."""
        problems: list[str] = []
        with self._lock:
            self._check_open()
            self._ensure_index()
            q = self.db.execute
            ids = self._chunk_ids()
            faiss_ids = faiss.vector_to_array(self._index.id_map)
            orphan = np.setdiff1d(faiss_ids, ids)
            missing = np.setdiff1d(ids, faiss_ids)
            if len(orphan):
                problems.append(f"{len(orphan)} orphan vectors in FAISS: {orphan[:10].tolist()}")
            if len(missing):
                problems.append(f"{len(missing)} chunks without vectors: {missing[:10].tolist()}")
            if len(faiss_ids) != len(np.unique(faiss_ids)):
                problems.append("duplicate ids in FAISS")
            (n,) = q(
                "SELECT count(*) FROM chunks c LEFT JOIN documents d ON d.id = c.document_id "
                "WHERE d.id IS NULL"
            ).fetchone()
            if n:
                problems.append(f"{n} chunks without a document")
            (n,) = q(
                "SELECT count(*) FROM (SELECT 1 FROM chunks GROUP BY document_id, ordinal "
                "HAVING count(*) > 1)"
            ).fetchone()
            if n:
                problems.append(f"{n} duplicate (document, ordinal) pairs")
            bad = q(
                "SELECT d.path, d.chunk_count, count(c.id) FROM documents d "
                "LEFT JOIN chunks c ON c.document_id = d.id GROUP BY d.id "
                "HAVING d.chunk_count != count(c.id) LIMIT 10"
            ).fetchall()
            for path, want, have in bad:
                problems.append(f"{path}: chunk_count {want} but {have} chunks stored")
            (n,) = q(
                "SELECT count(*) FROM chunks WHERE length(vector) != ?", [self.dim * 4]
            ).fetchone()
            if n:
                problems.append(f"{n} chunks with a vector of the wrong size")
            try:  # rank 1: FTS5 also compares its index with the chunks it was built from
                with self.db.atomic():
                    self.db.conn.execute(
                        "INSERT INTO chunks_fts(chunks_fts, rank) VALUES ('integrity-check', 1)"
                    )
            except sqlite3.DatabaseError as exc:
                problems.append(f"keyword index disagrees with the chunks: {exc}")
            if deep and not problems and self._kind_of(self._index) == "flat":
                problems.extend(self._compare_vectors())
        return problems

    def _compare_vectors(self) -> list[str]:
        id_map = faiss.vector_to_array(self._index.id_map)
        position = {int(i): p for p, i in enumerate(id_map)}
        stored = faiss.rev_swig_ptr(
            # downcast_index returns the concrete IndexFlat, which has get_xb
            faiss.downcast_index(self._index.index).get_xb(),  # type: ignore[attr-defined]
            self._index.ntotal * self.dim,
        ).reshape(-1, self.dim)
        wrong = 0
        for cid, blob in self.db.execute("SELECT id, vector FROM chunks"):
            if not np.array_equal(stored[position[int(cid)]], np.frombuffer(blob, dtype="<f4")):
                wrong += 1
        return [f"{wrong} FAISS vectors differ from SQLite"] if wrong else []
