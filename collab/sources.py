"""A source: one retrieved passage, the same type from the search to the saved answer.

The device's private search, the cloud's public corpus, the prompt builder, the wire's
Citations frame, the answer events, the TUI, `tandem ask` and the conversation store all pass
this one type, so a passage's location is formatted once (`format_location`) and a citation is
written one way (`Source.line`). Private ("device") text never leaves the device: only the
cloud's public sources cross the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

Side = Literal["device", "cloud"]
FoundBy = Literal["meaning", "keyword", "both", ""]
FOUND_BY: tuple[FoundBy, ...] = ("", "meaning", "keyword", "both")
"""Which search found a passage ("" = not recorded: older rows); its index is its wire code."""
_FOUND_LABEL = {"meaning": "meaning", "keyword": "keyword", "both": "keyword + meaning"}

RELEVANCE_FLOOR = 0.30
"""The relevance (cosine) below which a passage is neither put in a prompt nor cited, on either
side (the device's `relevance_floor` setting, the cloud's `corpus_floor`). Calibrated by
`benchmarks.retrieval` (results/retrieval/python311-reference.json, "margin_floor" of
hybrid-rrf, rounded): halfway between the best passage of 95 % of off-topic questions and 95 %
of the passages that answer."""

PUBLIC_FLOOR = 0.54
"""The relevance below which a public passage (a Wikipedia lead summary) does not count as
answering, on either side (the cloud's `corpus_floor`, the device's check of what it returns).
An encyclopedia matches a question about the user's life a little everywhere: at 0.30 a
summary was cited for 82 % of such questions ("When is my dentist appointment?" → *Dentistry*).
Chosen on held-out questions only (benchmarks/data/relevance/heldout.toml, by
`benchmarks.public_relevance`: the floor keeping the most held-out public articles with held-out
questions about the user, chat and off-topic citing ≤ 5 %). A compound question is judged
clause by clause too (`retrieval.search.clauses`), so its private half does not dilute its
public one: on the evaluation's questions, public articles kept 97 % as at 0.30, questions
about the user citing a summary 0 % (results/relevance/public.json)."""

EXCERPT_CHARS = 300
"""What a citation previews (tooltip, sources panel, stored "excerpt")."""
SOURCE_CHARS = 2000
"""How much of a public chunk (a Wikipedia lead summary) the cloud sends, for "open source"."""


def format_location(page: int | None, line_start: int | None, line_end: int | None) -> str:
    """Where a chunk is in its file, as every citation shows it: "p. 3, lines 4–9"."""
    parts = []
    if page:
        parts.append(f"p. {page}")
    if line_start:
        single = not line_end or line_end == line_start
        parts.append(f"line {line_start}" if single else f"lines {line_start}–{line_end}")
    return ", ".join(parts)


def excerpt(text: str, chars: int = EXCERPT_CHARS) -> str:
    """The start of a passage, for a preview or to bound what is sent."""
    return text[:chars]


@dataclass(frozen=True)
class Source:
    """One numbered passage: its title and where in it, how relevant, the text.

    The defaults describe a public source as the wire carries it, before the device numbers
    it; `side` says which side holds the text ("device" text never left the device). The
    `excerpt` previewed is the text's start unless a stored row says otherwise. `score` is the
    passage's relevance; `found_by` which search found it (by meaning, by keyword, both).
    """

    title: str
    location: str = ""
    score: float = 0.0
    text: str = ""
    number: int = 0
    side: Side = "cloud"
    path: str | None = None
    excerpt: str = ""
    found_by: FoundBy = ""

    def __post_init__(self) -> None:
        if not self.excerpt:
            object.__setattr__(self, "excerpt", excerpt(self.text))

    def clipped(self, chars: int) -> Source:
        """The same source with its text cut to `chars` (what a sender puts on the wire)."""
        return replace(self, text=excerpt(self.text, chars), excerpt="")

    # -- rendering: one form, used by the prompt, the CLI, the TUI and the export -------------

    @property
    def heading(self) -> str:
        """`notes.md (lines 3–9)`: the title and where in it."""
        where = f"({self.location})" if self.location else ""
        return " ".join(p for p in (self.title, where) if p)

    @property
    def score_label(self) -> str:
        """The relevance, and what found the passage when known: `0.82 keyword + meaning`."""
        found = _FOUND_LABEL.get(self.found_by, "")
        return f"{self.score:.2f} {found}".rstrip()

    @property
    def detail(self) -> str:
        """What follows the side: `notes.md (lines 3–9) · 0.82 meaning`."""
        return " · ".join(p for p in (self.heading, self.score_label) if p)

    def line(self) -> str:
        """The citation as one line of text: `[1] device · notes.md (lines 3–9) · 0.82`."""
        return f"[{self.number}] {self.side} · {self.detail}"

    # -- the conversation store's JSON rows -----------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The row the conversation store keeps (and `tandem ask --json` prints)."""
        return {
            "number": self.number,
            "side": self.side,
            "title": self.title,
            "location": self.location,
            "score": self.score,
            "excerpt": self.excerpt,
            "path": self.path,
            "text": self.text,
            "found_by": self.found_by,
        }

    @classmethod
    def from_dict(cls, row: Mapping[str, Any], number: int = 0) -> Source:
        """A stored row back (rows of every earlier version load: a row without "text" shows
        its "excerpt" in full). `number` is used if the row has none."""
        return cls(
            title=str(row.get("title") or ""),
            location=str(row.get("location") or ""),
            score=float(row.get("score") or 0.0),
            text=str(row.get("text") or row.get("excerpt") or ""),
            number=int(row.get("number", number)),
            side=row.get("side") or "cloud",
            path=row.get("path"),
            excerpt=str(row.get("excerpt") or ""),
            found_by=next((f for f in FOUND_BY if f == row.get("found_by")), ""),
        )
