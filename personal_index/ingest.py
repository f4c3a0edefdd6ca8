"""Ingesting files and folders into an `IndexStore`: incremental, visible and crash-safe.

The main thread owns the store (every document is written in one SQLite transaction); a
worker thread reads, hashes, parses and chunks the next files while the main thread embeds, so
the CPU-heavy embedding (ONNX Runtime releases the GIL) overlaps parsing. Progress goes to a
callback so the CLI can draw a bar and the TUI a per-file table.

Hostile folders (issue 28): only regular files are read (FIFOs, devices, sockets are skipped
with a reason), a symlink never leads outside the folder being ingested, a file over the size
cap is not read, each file is read once and those bytes are both hashed and parsed, and the
parsing runs in a worker process (`parse_worker`) that is killed past the parse deadline.

Paths the user removed from a watched folder (`personal_index.watched`) are excluded: they and
whatever lies under them are skipped with the reason, and a stored one leaves the index."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from personal_index.pages import NO_TEXT, nothing_read, unread_note
from personal_index.parse_worker import ParseWorker
from personal_index.parsers import DEFAULT_LIMITS, ParseError, ParseLimits, is_supported
from personal_index.safe_read import DEFAULT_MAX_FILE_MB, MB, Refused, read_document, refusal
from personal_index.watched import EXCLUDED_REASON, is_under
from retrieval.chunking import Chunk, Chunker
from retrieval.store import CHUNK_FORMAT, ChunkRecord, DocumentMeta, DocumentRow, IndexStore

log = logging.getLogger(__name__)

Outcome = Literal["indexed", "unchanged", "failed", "skipped", "removed"]

# Write the FAISS file after this many documents (and at the end): a kill in between costs
# only a rebuild of the derived index at the next open, never data.
FLUSH_EVERY = 25


class Embedder(Protocol):
    @property
    def dim(self) -> int: ...

    def embed(self, texts: list[str]) -> np.ndarray: ...


@dataclass(frozen=True)
class FileResult:
    """What happened to one file: the per-file summary line."""

    path: str
    outcome: Outcome
    chunks: int = 0
    reason: str | None = None


@dataclass
class Progress:
    """Posted after every file; `result` is that file's outcome."""

    done: int
    total: int
    chunks: int
    result: FileResult


@dataclass
class _Work:
    """One file on its way through the pipeline: `root` is the folder it was found in (a
    symlink must not lead out of it), `stored` its row in the store, if any."""

    path: Path
    root: Path
    stored: DocumentRow | None
    meta: DocumentMeta | None = None
    chunks: list[Chunk] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None
    unchanged: bool = False
    note: str | None = None
    """Said with an indexed file: the pages that gave no text."""


def _walk(target: Path, pruned: Callable[[str], bool] = lambda _path: False) -> Iterator[Path]:
    """`target` itself unless it is a folder (a FIFO or device named on the command line gets
    its reason too); else the files under it, symlinked folders not followed. A folder that is
    `pruned` (excluded) is yielded itself, not entered."""
    if not target.is_dir():
        yield target
        return
    for root, dirs, files in os.walk(target):
        visible = sorted(d for d in dirs if not d.startswith("."))
        dirs[:] = [d for d in visible if not pruned(os.path.join(root, d))]
        for name in sorted(files):
            if not name.startswith("."):
                yield Path(root) / name
        yield from (Path(root) / d for d in visible if d not in dirs)


class Ingestor:
    def __init__(
        self,
        store: IndexStore,
        embedder: Embedder,
        chunker: Chunker,
        progress: Callable[[Progress], None] | None = None,
        batch_chunks: int = 64,
        *,
        max_file_mb: float = DEFAULT_MAX_FILE_MB,
        limits: ParseLimits = DEFAULT_LIMITS,
        worker: ParseWorker | None = None,
        exclusions: Sequence[str] = (),
        on_removed: Callable[[list[str]], None] | None = None,
    ) -> None:
        if not max_file_mb > 0:
            raise ValueError(f"max_file_mb must be positive (got {max_file_mb!r})")
        self.store = store
        self.embedder = embedder
        self.chunker = chunker
        self.progress = progress
        self.batch_chunks = batch_chunks
        self.max_bytes = int(max_file_mb * MB)
        self.limits = limits
        self.worker = worker if worker is not None else ParseWorker()
        """Parses in a child process, started by the first file to parse and stopped when
        `ingest` returns."""
        self.exclusions = tuple(exclusions)
        """Paths the user removed from a watched folder: skipped, with what lies under them."""
        self.on_removed = on_removed
        """Told the paths of documents this ingest removed (gone, excluded, now refused)."""

    def ingest(self, targets: Sequence[str | Path]) -> list[FileResult]:
        """Index every supported file under `targets` (files or folders). Unchanged files are
        skipped; changed ones re-chunked and re-embedded; documents under a given folder whose
        file is gone (deleted or renamed) are purged. Files that are not read (see the module
        docstring) get a result with the reason."""
        self.worker.open()
        try:
            return self._ingest(targets)
        finally:
            self.worker.close()

    def _ingest(self, targets: Sequence[str | Path]) -> list[FileResult]:
        results: list[FileResult] = []
        todo: list[_Work] = []
        seen: set[str] = set()
        for target in (Path(t).expanduser().resolve() for t in targets):
            if not target.exists():
                results.append(FileResult(str(target), "failed", reason="no such file or folder"))
                continue
            if target.is_dir():
                results.extend(self._purge_missing(target))
            for path in _walk(target, self._excluded):
                key = str(path)
                if key in seen:
                    continue
                seen.add(key)
                if self._excluded(key):
                    results.append(self._skip(key, EXCLUDED_REASON, folder=path.is_dir()))
                    continue
                if (reason := refusal(path, target)) is not None:
                    results.append(self._skip(key, reason))
                    continue
                if not is_supported(path):
                    results.append(
                        FileResult(
                            key, "skipped", reason=f"unsupported type {path.suffix or '(none)'}"
                        )
                    )
                    continue
                work = self._needs_work(path, target)
                if work is None:
                    row = self.store.document(key)
                    results.append(FileResult(key, "unchanged", reason=row.error if row else None))
                else:
                    todo.append(work)
        total = len(results) + len(todo)
        for i, r in enumerate(results):
            self._post(i + 1, total, 0, r)
        done = len(results)
        for result in self._index(todo):
            results.append(result)
            done += 1
            self._post(done, total, result.chunks, result)
        self.store.flush()
        return results

    # ---- pipeline ---------------------------------------------------------------------------
    def _excluded(self, path: str) -> bool:
        return any(is_under(path, e) for e in self.exclusions)

    def _skip(self, key: str, reason: str, *, folder: bool = False) -> FileResult:
        """A path that is not a document of the folder; one indexed before (a file since
        replaced by a FIFO, or by a symlink leading out; an excluded file, or what an
        excluded `folder` holds) leaves the index."""
        if folder:
            if self.store.remove_prefix(key):
                self._removed([key])
        elif self.store.document(key) is not None:
            self.store.remove_paths([key])
            self._removed([key])
        return FileResult(key, "skipped", reason=reason)

    def _removed(self, paths: list[str]) -> None:
        if self.on_removed is not None and paths:
            try:
                self.on_removed(paths)
            except Exception:  # a listener's failure must not stop the ingest
                log.exception("removal listener failed")

    def _needs_work(self, path: Path, root: Path) -> _Work | None:
        """None if the stored version is current by size + mtime; else work for the pipeline,
        which reads the file once and compares checksums (a touched file is not re-parsed).
        A file indexed by an older chunk format is indexed again even if unchanged."""
        st = path.stat()
        row = self.store.document(str(path))
        if row and row.chunk_format < CHUNK_FORMAT:
            return _Work(path, root, None)
        if row and row.ocr_pages is None and row.chunk_count == 0 and row.kind == "pdf":
            return _Work(path, root, None)  # a scan indexed before OCR: read it now
        same = (st.st_size, st.st_mtime)
        if row and row.status == "indexed" and (row.size, row.mtime) == same:
            return None
        if row and (row.error or "").startswith(NO_TEXT) and (row.size, row.mtime) == same:
            return None  # a photo with no text: not OCR'd again at each sync
        return _Work(path, root, row)

    def _parse(self, work: _Work) -> _Work:
        """Read, hash and parse one file (in the parsing thread; the store is not touched)."""
        try:
            data, st = read_document(work.path, work.root, self.max_bytes)
        except Refused as exc:
            if exc.skip:
                work.skipped = exc.reason
                return work
            work.error = exc.reason
            size, mtime = 0, 0.0
            with contextlib.suppress(OSError):
                now = os.stat(work.path)
                size, mtime = now.st_size, now.st_mtime
            work.meta = DocumentMeta(str(work.path), size, mtime, "")  # never read: no checksum
            return work
        sha = hashlib.sha256(data).hexdigest()
        work.meta = DocumentMeta(str(work.path), st.st_size, st.st_mtime, sha)
        stored = work.stored
        if stored and stored.status == "indexed" and stored.sha256 == sha:
            work.unchanged = True  # touched, not changed
            return work
        try:
            doc = self.worker.parse(work.path, data, self.limits)
            work.meta = DocumentMeta(
                work.meta.path,
                work.meta.size,
                work.meta.mtime,
                work.meta.sha256,
                doc.title,
                doc.kind,
                doc.ocr_pages,
                doc.unread_pages,
            )
            work.chunks = self.chunker.chunk(doc)
            work.note = unread_note(doc)
            if not work.chunks and doc.unread_pages:  # never "indexed, 0 chunks" unexplained
                work.error = nothing_read(doc)
        except ParseError as exc:
            work.error = exc.reason
        except Exception as exc:  # a chunker or library bug must not stop the other files
            log.exception("unexpected error parsing %s", work.path)
            work.error = f"unexpected error: {exc}"
        return work

    def _parsed(self, todo: list[_Work]) -> Iterator[_Work]:
        """Parse in a worker thread, at most a few files ahead of the embedder."""
        ready: queue.Queue[_Work | None] = queue.Queue(maxsize=4)
        stop = threading.Event()

        def produce() -> None:
            for work in todo:
                if stop.is_set():
                    break
                ready.put(self._parse(work))
            ready.put(None)

        worker = threading.Thread(target=produce, name="tandem-parse", daemon=True)
        worker.start()
        try:
            while (work := ready.get()) is not None:
                yield work
        finally:
            stop.set()
            self.worker.close()  # a producer waiting on the parse child returns at once
            while worker.is_alive():  # unblock a producer waiting on a full queue
                try:
                    ready.get_nowait()
                except queue.Empty:
                    worker.join(0.05)

    def _index(self, todo: list[_Work]) -> Iterator[FileResult]:
        pending: list[_Work] = []
        written = 0
        for work in self._parsed(todo):
            key = str(work.path)
            if work.skipped is not None:
                yield self._skip(key, work.skipped)
                continue
            m = work.meta
            assert m is not None  # set for every file read or failed
            if work.unchanged:
                self.store.touch(key, m.size, m.mtime)
                yield FileResult(key, "unchanged")
                continue
            if work.error is not None:
                self.store.mark_failed(m.path, m.size, m.mtime, m.sha256, work.error)
                yield FileResult(m.path, "failed", reason=work.error)
                continue
            pending.append(work)
            if sum(len(w.chunks) for w in pending) >= self.batch_chunks:
                yield from self._write(pending)
                written += len(pending)
                pending = []
                if written >= FLUSH_EVERY:
                    self.store.flush(final=False)
                    written = 0
        if pending:
            yield from self._write(pending)

    def _write(self, batch: list[_Work]) -> Iterator[FileResult]:
        """Embed the chunks of several documents in one call, then store each document."""
        texts = [c.embedded_text for w in batch for c in w.chunks]
        vectors = self.embedder.embed(texts) if texts else np.empty((0, self.embedder.dim))
        start = 0
        for work in batch:
            assert work.meta is not None
            n = len(work.chunks)
            records = [
                ChunkRecord(
                    c.ordinal,
                    c.text,
                    c.page,
                    c.title,
                    c.line_start,
                    c.line_end,
                    c.char_start,
                    c.char_end,
                    c.heading or None,
                )
                for c in work.chunks
            ]
            self.store.replace_document(work.meta, records, vectors[start : start + n])
            start += n
            yield FileResult(work.meta.path, "indexed", chunks=n, reason=work.note)

    def _purge_missing(self, folder: Path) -> Iterable[FileResult]:
        prefix = str(folder) + os.sep
        gone = [
            d.path
            for d in self.store.documents()
            if d.path.startswith(prefix) and not Path(d.path).exists()
        ]
        if gone:
            self.store.remove_paths(gone)
            self._removed(gone)
        return [FileResult(p, "removed", reason="file no longer exists") for p in gone]

    def _post(self, done: int, total: int, chunks: int, result: FileResult) -> None:
        if self.progress is not None:
            self.progress(Progress(done, total, chunks, result))
