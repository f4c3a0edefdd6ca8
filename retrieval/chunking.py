"""Cut parsed documents into overlapping windows of embedding-model tokens (issue 4 item 2).

Chunks are measured in the embedding model's own word pieces, so a chunk always fits the
model instead of being silently truncated, and cut with the fast tokenizer's character offsets,
so a chunk's text is an exact slice of the document text (what a citation shows is what was
embedded). Windows never cross a section (page, heading section), so every chunk has one
page/heading/line range to cite.

Each chunk also carries its heading path (`document title › section › subsection`), which is
embedded and keyword-indexed with it: a passage that never names its subject ("It returns
None.") is still found by the section that does. The heading's tokens come out of the
chunk's budget, so heading + text always fit the embedder's window.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from retrieval.document import ParsedDocument, Section

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_OVERLAP_TOKENS",
    "EMBEDDING_MAX_TOKENS",
    "Chunk",
    "Chunker",
    "load_embedding_tokenizer",
]

# all-MiniLM-L6-v2 reads at most 256 word pieces (sentence_bert_config.json: max_seq_length),
# and that count includes the [CLS] and [SEP] it adds, so a chunk may hold 254 of its own.
EMBEDDING_MAX_TOKENS = 256
DEFAULT_CHUNK_TOKENS = EMBEDDING_MAX_TOKENS - 2
# ≈ 12.5 % of a chunk: a sentence cut at a boundary is still whole in one of the two chunks.
DEFAULT_OVERLAP_TOKENS = 32
# At most this many of a chunk's tokens go to its heading path (a deeper path is cut at a word).
MAX_HEADING_TOKENS = 48


@dataclass(frozen=True)
class Chunk:
    """One window of a document, with everything a citation needs.

    `ordinal` is 0-based within the document; `line_start`/`line_end` are the 1-based lines of
    the chunk's first and last characters (txt and md, else None); `char_start`/`char_end`
    delimit it in `ParsedDocument.text`, so `doc.text[c.char_start:c.char_end] == c.text`.
    `heading` is its heading path, `document › section › subsection` ("" when not wanted).
    """

    text: str
    ordinal: int
    page: int | None
    title: str | None
    line_start: int | None
    line_end: int | None
    char_start: int
    char_end: int
    heading: str = ""

    @property
    def embedded_text(self) -> str:
        """What the embedder reads: the heading path, a newline, the text (never over its
        window: the chunker counted the heading's tokens)."""
        return f"{self.heading}\n{self.text}" if self.heading else self.text


def load_embedding_tokenizer() -> Any:
    """The (fast) tokenizer of all-MiniLM-L6-v2, loaded from the local package: no network."""
    from transformers import AutoTokenizer

    from retrieval.embedder import minilm_source_dir

    return AutoTokenizer.from_pretrained(str(minilm_source_dir()), local_files_only=True)


class Chunker:
    """Splits each section into windows of at most `chunk_tokens` tokens, consecutive windows
    sharing `overlap_tokens` tokens.

    Window edges are moved back to the nearest word boundary (the pre-tokenizer's words) when
    they would fall inside a word: a chunk that starts mid-word ("##ing") would be re-tokenised
    differently by the embedder and could exceed the model's limit. So a chunk never has more
    than `chunk_tokens` tokens, and the overlap is exactly `overlap_tokens` unless that would
    split a word, in which case it grows by the rest of that word. A single "word" longer than
    a window (a long URL, base64) is cut inside it, as there is no better place.
    With `headings`, each chunk's heading path and its text together hold at most
    `chunk_tokens` tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        overlap_tokens: int = DEFAULT_OVERLAP_TOKENS,
        *,
        headings: bool = True,
    ) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("Chunker needs a fast tokenizer (for character offsets)")
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
        if (
            isinstance(overlap_tokens, bool)
            or not isinstance(overlap_tokens, int)
            or overlap_tokens <= 0
        ):
            raise ValueError(f"overlap_tokens must be a positive integer, got {overlap_tokens!r}")
        if overlap_tokens >= chunk_tokens:
            raise ValueError(
                f"overlap_tokens ({overlap_tokens}) must be smaller than "
                f"chunk_tokens ({chunk_tokens})"
            )
        self.tokenizer = tokenizer
        self.chunk_tokens = chunk_tokens
        self.overlap_tokens = overlap_tokens
        # A heading never squeezes the text below twice the overlap (tiny test windows).
        self.heading_tokens = (
            min(MAX_HEADING_TOKENS, (chunk_tokens - 2 * overlap_tokens) // 2) if headings else 0
        )

    def chunk(self, doc: ParsedDocument) -> list[Chunk]:
        """All chunks of `doc`, in document order."""
        chunks: list[Chunk] = []
        for section in doc.sections:
            newlines = None
            if section.line_start is not None:
                newlines = [i for i, ch in enumerate(section.text) if ch == "\n"]
            heading, used = self._heading(doc.heading_path(section))
            for start, end in self._windows(section.text, self.chunk_tokens - used):
                chunks.append(_make_chunk(section, start, end, len(chunks), newlines, heading))
        return chunks

    def _heading(self, path: str) -> tuple[str, int]:
        """The heading path cut (at a word) to the heading budget, and its token count."""
        if self.heading_tokens <= 0 or not path:
            return "", 0
        enc = self._encode(path)
        offsets: list[tuple[int, int]] = enc["offset_mapping"]
        if len(offsets) <= self.heading_tokens:
            return path, len(offsets)
        words = enc.word_ids()
        end = self.heading_tokens
        while end > 1 and words[end] is not None and words[end] == words[end - 1]:
            end -= 1
        return path[: offsets[end - 1][1]], end

    def _encode(self, text: str) -> Any:
        return self.tokenizer(
            text,
            add_special_tokens=False,
            return_offsets_mapping=True,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,  # no "sequence longer than model_max_length" warning: we cut it
        )

    def _windows(self, text: str, window: int) -> list[tuple[int, int]]:
        """Character spans (within `text`) of the section's windows of `window` tokens."""
        enc = self._encode(text)
        offsets: list[tuple[int, int]] = enc["offset_mapping"]
        n = len(offsets)
        if n == 0:
            return []
        words = enc.word_ids()
        # word_start[i]: token i begins a word (so a window may start at i or end just before i).
        word_start = [i == 0 or words[i] is None or words[i] != words[i - 1] for i in range(n)]

        spans: list[tuple[int, int]] = []
        start = 0
        while True:
            end = min(start + window, n)
            if end < n:
                snapped = end
                while snapped > start and not word_start[snapped]:
                    snapped -= 1
                if snapped > start:
                    end = snapped  # else one word fills the window: cut inside it
            spans.append((offsets[start][0], offsets[end - 1][1]))
            if end >= n:
                return spans
            nxt = end - self.overlap_tokens
            while nxt > start and not word_start[nxt]:
                nxt -= 1
            if nxt <= start:  # the overlap would not move forward (very long words)
                nxt = max(end - self.overlap_tokens, start + 1)
            start = nxt


def _make_chunk(
    section: Section,
    start: int,
    end: int,
    ordinal: int,
    newlines: list[int] | None,
    heading: str,
) -> Chunk:
    """The chunk for `section.text[start:end]`, located in the document; `newlines` (offsets of
    newline in the section, for sections with line numbers) keeps line numbering O(log n)."""
    line_start = line_end = None
    if section.line_start is not None and newlines is not None:
        line_start = section.line_start + bisect.bisect_left(newlines, start)
        line_end = section.line_start + bisect.bisect_left(newlines, end - 1)
    return Chunk(
        text=section.text[start:end],
        ordinal=ordinal,
        page=section.page,
        title=section.title,
        line_start=line_start,
        line_end=line_end,
        char_start=section.char_start + start,
        char_end=section.char_start + end,
        heading=heading,
    )
