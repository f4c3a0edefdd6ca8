"""The private index as the modes use it: ingest, search with citations, rescore."""

from __future__ import annotations

import fcntl
import os
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from collab.plumbing.files import private_opener
from personal_index.ingest import FileResult, Ingestor, Progress
from personal_index.parse_worker import DEFAULT_PARSE_TIMEOUT_S, ParseWorker
from personal_index.safe_read import DEFAULT_MAX_FILE_MB
from retrieval.chunking import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_OVERLAP_TOKENS,
    Chunker,
    load_embedding_tokenizer,
)
from retrieval.embedder import OnnxEmbedder, prepare_onnx_embedder
from retrieval.search import Searcher, SearchMode
from retrieval.store import DocumentRow, FolderRow, Hit, IndexStore, StoreStats


class IngestBusyError(RuntimeError):
    """Two ingests on one index would embed the same files twice."""


class IndexWriteError(RuntimeError):
    """The index could not be written (a full disk, a failing one); what was stored before the
    failing write is kept, and an ingest run again once there is room finishes the job."""

    def __init__(self, root: Path, exc: BaseException) -> None:
        super().__init__(
            f"could not write the index in {root} ({exc}): is the disk full? The documents "
            "already stored are kept; ingest again once there is room"
        )


class PersonalIndex:
    """Documents under `root` (SQLite + FAISS), embedded with all-MiniLM-L6-v2 on ONNX Runtime
    (prepared once into `embedder_dir`). The same class indexes the cloud's public corpus."""

    def __init__(
        self,
        root: Path,
        embedder_dir: Path,
        *,
        chunk_tokens: int | None = None,
        overlap_tokens: int | None = None,
        hnsw_threshold: int | None = None,
        threads: int | None = None,
    ) -> None:
        self.embedder = OnnxEmbedder(prepare_onnx_embedder(Path(embedder_dir)), threads=threads)
        self.store = IndexStore(Path(root), self.embedder.dim, hnsw_threshold=hnsw_threshold)
        self.searcher = Searcher(self.store, self.embedder.embed)
        self.chunker = Chunker(
            load_embedding_tokenizer(),
            DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens,
            DEFAULT_OVERLAP_TOKENS if overlap_tokens is None else overlap_tokens,
        )

    def __enter__(self) -> PersonalIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.store.close()
        except (OSError, sqlite3.OperationalError) as exc:
            raise IndexWriteError(self.store.root, exc) from exc

    def ingest(
        self,
        paths: Sequence[str | Path],
        progress: Callable[[Progress], None] | None = None,
        *,
        max_file_mb: float = DEFAULT_MAX_FILE_MB,
        parse_timeout_s: float = DEFAULT_PARSE_TIMEOUT_S,
    ) -> list[FileResult]:
        """Index files and folders (see `Ingestor.ingest`); a file over `max_file_mb` MB (the
        `ingest_max_mb` setting) is not read, one whose parsing takes longer than
        `parse_timeout_s` seconds is stopped; both fail with the reason."""
        with open(self.store.root / ".ingest.lock", "w", opener=private_opener) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise IngestBusyError(
                    "another ingest is running on this index; wait for it"
                ) from exc
            try:
                return Ingestor(
                    self.store,
                    self.embedder,
                    self.chunker,
                    progress,
                    max_file_mb=max_file_mb,
                    worker=ParseWorker(parse_timeout_s),
                ).ingest(paths)
            except (OSError, sqlite3.OperationalError) as exc:
                raise IndexWriteError(self.store.root, exc) from exc

    def search(
        self,
        query: str,
        k: int = 5,
        min_score: float | None = None,
        *,
        mode: SearchMode = "hybrid",
    ) -> list[Hit]:
        """The k passages that best answer `query`, best first, none below the relevance floor
        `min_score` (`retrieval.search`: hybrid by default)."""
        if not query or not query.strip():
            raise ValueError("empty query: type what you are looking for")
        if k <= 0:
            raise ValueError(f"k must be at least 1 (got {k})")
        return self.searcher.search(query, k, mode=mode, floor=min_score)

    def rescore(self, hits: Sequence[Hit], text: str) -> np.ndarray:
        """Cosine of each hit's chunk with `text` (DRAGON's dynamic re-ranking: the query plus
        the text generated so far), from the stored vectors: nothing is re-embedded but `text`."""
        if not hits:
            return np.empty(0, dtype=np.float32)
        vectors = self.store.get_vectors([h.chunk_id for h in hits])
        return vectors @ self.embedder.embed([text])[0]

    def stored_chunks(self, ids: Iterable[int]) -> set[int]:
        """Which of these chunk ids are still indexed (here or by another process)."""
        return self.store.stored_chunks(ids)

    def remove(self, path: str | Path) -> int:
        """Forget a file, or every document under a folder; returns how many were removed."""
        return self.store.remove_prefix(os.path.abspath(os.path.expanduser(os.fspath(path))))

    def documents(self) -> list[DocumentRow]:
        return self.store.documents()

    def has_documents(self) -> bool:
        """Whether any chunk is indexed (cheap: asked before every answer, since another
        process may have ingested or removed documents meanwhile)."""
        return self.store.has_chunks()

    def watch(self, folder: str | Path) -> str:
        """Keep `folder` in sync from now on (`personal_index.watch`); returns its full path."""
        path = os.path.abspath(os.path.expanduser(os.fspath(folder)))
        self.store.add_folder(path)
        return path

    def sync_folder(
        self,
        folder: str | Path,
        progress: Callable[[Progress], None] | None = None,
        *,
        max_file_mb: float = DEFAULT_MAX_FILE_MB,
    ) -> list[FileResult]:
        """Bring a watched folder and the index level (an incremental ingest; a folder that is
        gone takes its documents with it) and record the time of the sync."""
        path = os.path.abspath(os.path.expanduser(os.fspath(folder)))
        results: list[FileResult] = []
        if os.path.isdir(path):
            results = self.ingest([path], progress, max_file_mb=max_file_mb)
        elif self.remove(path):
            results = [FileResult(path, "removed", reason="folder no longer exists")]
        self.store.folder_synced(path)
        return results

    def unwatch(self, folder: str | Path) -> bool:
        """Stop keeping `folder` in sync; its documents stay. False if it was not watched."""
        return self.store.remove_folder(os.path.abspath(os.path.expanduser(os.fspath(folder))))

    def folders(self) -> list[FolderRow]:
        """The folders kept in sync, with their last sync time."""
        return self.store.folders()

    def stats(self) -> StoreStats:
        return self.store.stats()
