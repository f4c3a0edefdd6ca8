"""A document as located text sections: what parsers produce and chunkers cut.

Shared by the private index (files the user adds) and the cloud's public corpus (Wikipedia
summaries), so both are chunked, embedded and cited the same way."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

HEADING_SEPARATOR = " › "


@dataclass(frozen=True)
class Section:
    """A contiguous piece of a document that chunks never straddle (a page, a heading section).

    `line_start` is the 1-based line of the section's first character in the source file (txt
    and md only); `char_start` is its offset in the document's extracted text
    (`ParsedDocument.text`), so `doc.text[s.char_start:s.char_start + len(s.text)] == s.text`.
    `headings` is the chain of headings the section sits under, outermost first, ending with
    its own `title` (`("Install", "On Debian")`): what a chunk's heading path is made of.
    """

    text: str
    page: int | None
    title: str | None
    line_start: int | None
    char_start: int
    headings: tuple[str, ...] = ()


class HeadingTrail:
    """The open headings while a parser walks a document: a heading of level n closes every
    open heading of level n or deeper (Markdown, HTML and Word all nest this way)."""

    def __init__(self) -> None:
        self._open: list[tuple[int, str]] = []

    def enter(self, level: int, text: str) -> tuple[str, ...]:
        """Open a heading; returns the chain from the outermost open heading to this one."""
        while self._open and self._open[-1][0] >= level:
            self._open.pop()
        self._open.append((level, text))
        return tuple(t for _, t in self._open)


@dataclass(frozen=True)
class ParsedDocument:
    """A parsed file: `kind` is one of txt, md, pdf, docx, html, image; `title` is None if it
    has none. `ocr_pages` (1-based) were read by OCR; `unread_pages` gave no text at all, for
    the reason `unread_why` (an image is page 1)."""

    path: Path
    kind: str
    title: str | None
    sections: tuple[Section, ...]
    ocr_pages: tuple[int, ...] = ()
    unread_pages: tuple[int, ...] = ()
    unread_why: str | None = None

    @cached_property
    def text(self) -> str:
        """The document's extracted text, in which every `char_start` is an offset.

        Rebuilt from the sections (gaps between them, whitespace the parser dropped, are
        filled with newlines of the same length), computed once on first use.
        For txt and md the offsets are those of the decoded, newline-normalised file.
        """
        parts: list[str] = []
        pos = 0
        for s in self.sections:
            if s.char_start > pos:
                parts.append("\n" * (s.char_start - pos))
            parts.append(s.text)
            pos = s.char_start + len(s.text)
        return "".join(parts)

    def heading_path(self, section: Section) -> str:
        """`document title › section › subsection` for a chunk of `section`: what is embedded,
        searched and shown with it. The document is named by its title, else its file name; a
        first heading that repeats the title is not repeated."""
        parts = [self.title or self.path.name]
        for heading in section.headings or ((section.title,) if section.title else ()):
            if heading != parts[-1]:
                parts.append(heading)
        return HEADING_SEPARATOR.join(p.strip() for p in parts if p.strip())
