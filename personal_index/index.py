"""The private index as the modes use it: ingest, search with citations, rescore."""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from collab.plumbing.files import private_opener
from personal_index.ingest import FileResult, Ingestor, Progress
from personal_index.parse_worker import DEFAULT_PARSE_TIMEOUT_S, ParseWorker
from personal_index.safe_read import DEFAULT_MAX_FILE_MB
from personal_index.watched import (
    FolderCheck,
    FolderMovedError,
    Removal,
    WatchBook,
    WatchNeedsConfirmation,
    absolute,
    is_under,
    remove_documents,
    unwatch,
    watch_guard,
)
from retrieval.chunking import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_OVERLAP_TOKENS,
    Chunker,
    load_embedding_tokenizer,
)
from retrieval.embedder import OnnxEmbedder, prepare_onnx_embedder
from retrieval.search import Searcher, SearchMode
from retrieval.store import DocumentRow, FolderRow, Hit, IndexStore, StoreStats

log = logging.getLogger(__name__)

RemovalListener = Callable[[list[str]], None]
"""Told the paths that left the index (documents, or folders: everything under them)."""


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
        self.watches = WatchBook(self.store.root)
        """Watched folders' records and exclusions (`personal_index.watched`)."""
        self._removal_listeners: list[RemovalListener] = []

    def __enter__(self) -> PersonalIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.watches.close()
        try:
            self.store.close()
        except (OSError, sqlite3.OperationalError) as exc:
            raise IndexWriteError(self.store.root, exc) from exc

    def on_removed(self, listener: RemovalListener) -> None:
        """Call `listener` with the paths of documents whenever they leave the index, however
        (a removal, a sync that found the file gone): the app drops their text from stored
        citations. Called in the removing thread; its failure is logged, not raised."""
        self._removal_listeners.append(listener)

    def _removed(self, paths: list[str]) -> None:
        for listener in self._removal_listeners:
            try:
                listener(paths)
            except Exception:
                log.exception("removal listener failed for %d paths", len(paths))

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
                    exclusions=self.watches.excluded_paths(),
                    on_removed=self._removed,
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
        within: Sequence[str] = (),
    ) -> list[Hit]:
        """The k passages that best answer `query`, best first, none below the relevance floor
        `min_score` (`retrieval.search`: hybrid by default); `within`: only from the documents
        at or under these paths."""
        if not query or not query.strip():
            raise ValueError("empty query: type what you are looking for")
        if k <= 0:
            raise ValueError(f"k must be at least 1 (got {k})")
        return self.searcher.search(query, k, mode=mode, floor=min_score, within=within)

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
        return self.forget(path).documents

    def forget(self, path: str | Path) -> Removal:
        """Remove the documents at or under `path`; inside a watched folder it stays removed
        (excluded from its syncs), and a watched folder removed whole is no longer watched
        (`personal_index.watched.remove_documents`)."""
        removal = remove_documents(self.store, self.watches, path)
        if removal.documents:
            self._removed([removal.path])
        return removal

    def include(self, path: str | Path) -> list[str]:
        """Undo exclusions at or under `path`; returns the watched folders to sync again."""
        return sorted({e.folder for e in self.watches.include(os.fspath(path))})

    def documents(self) -> list[DocumentRow]:
        return self.store.documents()

    def has_documents(self) -> bool:
        """Whether any chunk is indexed (cheap: asked before every answer, since another
        process may have ingested or removed documents meanwhile)."""
        return self.store.has_chunks()

    def watch(self, folder: str | Path, *, confirmed: bool = False) -> str:
        """Keep `folder` in sync from now on (`personal_index.watch`); returns its full path.
        Its real path and device/inode are recorded: a sync reads it only while it is still
        that folder. Watching it again records where it leads now, and the documents of
        where it led before leave the index (their paths no longer name its files). `/`, the
        home folder and very large trees raise `WatchNeedsConfirmation` unless `confirmed`."""
        path = absolute(folder)
        if not os.path.isdir(path):
            raise NotADirectoryError(f"{path} is not a folder")
        if not confirmed and (reason := watch_guard(path)) is not None:
            raise WatchNeedsConfirmation(path, reason)
        before = self.watches.get(path)
        now = self.watches.record(path)
        self.store.add_folder(path)
        if before is not None and not is_under(before.real_path, now.real_path):
            others = [self.watches.real_path(f.path) for f in self.store.folders()]
            held = any(is_under(before.real_path, o) for o in others if o != now.real_path)
            if not held and self.store.remove_prefix(before.real_path):
                log.info(
                    "%s now leads to %s: dropped the documents of %s",
                    path,
                    now.real_path,
                    before.real_path,
                )
                self._removed([before.real_path])
        return path

    def sync_folder(
        self,
        folder: str | Path,
        progress: Callable[[Progress], None] | None = None,
        *,
        max_file_mb: float = DEFAULT_MAX_FILE_MB,
    ) -> list[FileResult]:
        """Bring a watched folder and the index level (an incremental ingest; a folder that is
        gone takes its documents with it) and record the time of the sync. A folder that now
        resolves elsewhere, or is another folder, raises `FolderMovedError` with the notice:
        nothing is read or changed (`check_folder`)."""
        path = absolute(folder)
        check = self.check_folder(path)
        if check.state == "moved":
            raise FolderMovedError(check.notice)
        results: list[FileResult] = []
        if check.state == "ok":
            results = self.ingest([check.real_path], progress, max_file_mb=max_file_mb)
        else:
            gone = sorted({path, check.real_path})
            if sum(self.store.remove_prefix(p) for p in gone):
                self._removed(gone)
                results = [FileResult(path, "removed", reason="folder no longer exists")]
        self.store.folder_synced(path)
        return results

    def check_folder(self, folder: str | Path) -> FolderCheck:
        """Whether `folder` is still where the user watched it (`WatchBook.check`); an older
        Tandem's watched folder is recorded as it resolves now."""
        path = absolute(folder)
        watched = any(f.path == path for f in self.store.folders())
        return self.watches.check(path, upgrade=watched)

    def unwatch(self, folder: str | Path) -> bool:
        """Stop keeping `folder` in sync; its documents stay, its exclusions go. False if it
        was not watched."""
        return unwatch(self.store, self.watches, folder) is not None

    def folders(self) -> list[FolderRow]:
        """The folders kept in sync, with their last sync time."""
        return self.store.folders()

    def stats(self) -> StoreStats:
        return self.store.stats()
