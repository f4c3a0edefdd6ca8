"""The store's records: what a caller hands `IndexStore` (a document's metadata, its chunks)
and what it gets back (rows, stored chunks, search hits, statistics)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from collab.sources import Side, Source, format_location

Status = Literal["indexed", "failed"]
IndexKind = Literal["flat", "hnsw"]
FoundBy = Literal["meaning", "keyword", "both"]

#: How documents are cut and embedded now; rows written by an older recipe are re-indexed by
#: the next ingest even if the file did not change. 2: heading paths embedded and indexed.
CHUNK_FORMAT = 2


@dataclass(frozen=True)
class DocumentMeta:
    """What the ingester knows about a file before its chunks are stored."""

    path: str
    size: int
    mtime: float
    sha256: str
    title: str | None = None
    kind: str | None = None
    ocr_pages: tuple[int, ...] = ()
    unread_pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk of a document and where it came from, so answers can cite it."""

    ordinal: int
    text: str
    page: int | None = None
    title: str | None = None
    line_start: int | None = None
    line_end: int | None = None
    char_start: int | None = None
    char_end: int | None = None
    heading: str | None = None

    @property
    def embedded_text(self) -> str:
        """What the embedder reads for this chunk: heading path, newline, text."""
        return f"{self.heading}\n{self.text}" if self.heading else self.text


@dataclass(frozen=True)
class DocumentRow:
    """A row of the ``documents`` table."""

    id: int
    path: str
    size: int
    mtime: float
    sha256: str
    status: Status
    error: str | None
    title: str | None
    kind: str | None
    chunk_count: int
    indexed_at: float
    chunk_format: int = CHUNK_FORMAT
    ocr_pages: tuple[int, ...] | None = ()
    """Pages read by OCR; None for a row written before OCR existed (read again at the next
    ingest if it holds no chunk: a scan indexed as "0 chunks" then gets its text)."""
    unread_pages: tuple[int, ...] = ()
    """Pages that gave no text at all (no text layer, and OCR found none)."""


@dataclass(frozen=True)
class StoredChunk:
    """A chunk as stored, with its document's path (for rescoring and citations)."""

    chunk_id: int
    document_id: int
    path: str
    ordinal: int
    text: str
    page: int | None
    title: str | None
    line_start: int | None
    line_end: int | None
    char_start: int | None
    char_end: int | None
    heading: str | None = None


@dataclass(frozen=True)
class Hit:
    """A search result: the chunk text, its score and its location.

    `score` is the relevance the caller acts on: the cosine with the question, whichever search
    found it (`retrieval.search` fills it in for keyword hits; a bare `keyword_search` leaves
    BM25 there). `found_by` says which search found it;
    `cosine` and `bm25` are the raw scores of each search (None where it did not find it).
    """

    chunk_id: int
    score: float
    text: str
    path: str
    title: str | None
    page: int | None
    line_start: int | None
    line_end: int | None
    char_start: int | None
    char_end: int | None
    ordinal: int
    heading: str | None = None
    found_by: FoundBy = "meaning"
    cosine: float | None = None
    bm25: float | None = None

    @property
    def location(self) -> str:
        """Where the chunk is in its file, as its citation shows it ("p. 3, lines 4–9")."""
        return format_location(self.page, self.line_start, self.line_end)

    @property
    def label(self) -> str:
        """How the hit is titled: its heading path, else its title, else its file name."""
        return self.heading or self.title or os.path.basename(self.path)

    def source(self, number: int, side: Side) -> Source:
        """This hit as citation `number`, titled by its heading path."""
        return Source(
            self.label,
            self.location,
            float(self.score),
            self.text,
            number,
            side,
            self.path,
            found_by=self.found_by,
        )


@dataclass(frozen=True)
class FolderRow:
    """A folder kept in sync with the index, and when it was last synced (None: not yet)."""

    path: str
    added_at: float
    synced_at: float | None


@dataclass(frozen=True)
class StoreStats:
    """Counts for ``tandem docs list`` and the TUI."""

    documents: int
    failed: int
    chunks: int
    bytes_on_disk: int
    index_kind: IndexKind
