"""A document as located text sections: what parsers produce and chunkers cut.

Shared by the private index (files the user adds) and the cloud's public corpus (Wikipedia
summaries), so both are chunked, embedded and cited the same way."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path


@dataclass(frozen=True)
class Section:
    """A contiguous piece of a document that chunks never straddle (a page, a heading section).

    `line_start` is the 1-based line of the section's first character in the source file (txt
    and md only); `char_start` is its offset in the document's extracted text
    (`ParsedDocument.text`), so `doc.text[s.char_start:s.char_start + len(s.text)] == s.text`.
    """

    text: str
    page: int | None
    title: str | None
    line_start: int | None
    char_start: int


@dataclass(frozen=True)
class ParsedDocument:
    """A parsed file: `kind` is one of txt, md, pdf, docx, html; `title` is None if it has none."""

    path: Path
    kind: str
    title: str | None
    sections: tuple[Section, ...]

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
