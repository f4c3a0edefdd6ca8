"""How a document's pages were read, in words: which OCR read, which gave no text (issue 47).

Light on purpose (no numpy, no store): the TUI's Documents screen and `tandem docs list`
import it to label rows, the ingester to word a file's result."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from retrieval.document import ParsedDocument
    from retrieval.store import DocumentRow

__all__ = ["NO_TEXT", "nothing_read", "page_ranges", "read_pages", "unread_note"]

NO_TEXT = "no text found"
"""How a file that gave no text at all fails: the same bytes give the same result, so such a
file is not read again (nor OCR run again) until it changes."""


def unread_note(doc: ParsedDocument) -> str | None:
    """What to tell the user about the pages of `doc` that gave no text, or None if every page
    did ("no text on pages 3–4: OCR found no text on it")."""
    pages = doc.unread_pages
    if not pages:
        return None
    why = doc.unread_why or "no text layer"
    if doc.kind == "image":
        return nothing_read(doc)
    if len(pages) == 1:
        return f"no text on page {pages[0]}: {why}"
    return f"no text on pages {page_ranges(pages)}: {why}"


def nothing_read(doc: ParsedDocument) -> str:
    """Why a file that gave no text at all fails ("no text found on its 3 pages: …")."""
    why = doc.unread_why or "no text layer"
    pages = len(doc.unread_pages)
    return f"{NO_TEXT}: {why}" if pages <= 1 else f"{NO_TEXT} on its {pages} pages: {why}"


def read_pages(row: DocumentRow) -> str:
    """How a stored document's pages were read, for listings ("OCR p. 1–3, 5; no text p. 4");
    "" for a document read from its text alone."""
    parts = []
    if row.ocr_pages and row.kind == "image":
        parts.append("read by OCR")
    elif row.ocr_pages:
        parts.append(f"OCR p. {page_ranges(row.ocr_pages)}")
    if row.unread_pages and row.kind != "image":
        parts.append(f"no text p. {page_ranges(row.unread_pages)}")
    return "; ".join(parts)


def page_ranges(pages: Iterable[int]) -> str:
    """1, 2, 3, 5 as "1–3, 5": how page lists are shown."""
    runs: list[list[int]] = []
    for page in sorted(set(pages)):
        if runs and page == runs[-1][1] + 1:
            runs[-1][1] = page
        else:
            runs.append([page, page])
    return ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in runs)
