"""What an answer's ledger of sent frames holds (`edge_runtime.sent`), in words: the kinds,
their labels and the lines the TUI, `tandem ask` and the conversation exports show.

Apart from the ledger itself on purpose: it imports nothing (the protocol brings numpy), so the
TUI and the conversation store read a stored ledger without the model stack.

A ledger is a list of rows, one per kind that left, in `KINDS` order:
`{"kind", "frames", "bytes", "items", "messages"}` and, for the text kinds, `"texts"` (each
distinct text once, in the order it first left). `None` instead of a list: not recorded (an
answer stored before Tandem kept a ledger)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

QUESTION = "question"
HISTORY = "history"
ANSWER = "answer"
TOKEN_IDS = "token_ids"
PROBABILITIES = "probabilities"
WEIGHTS = "weights"
CONTROL = "control"
UNCLASSIFIED = "unclassified"

KINDS = (QUESTION, HISTORY, ANSWER, TOKEN_IDS, PROBABILITIES, WEIGHTS, CONTROL, UNCLASSIFIED)
"""Every kind, in the order a ledger lists them."""
TEXT_KINDS = frozenset({QUESTION, HISTORY, ANSWER})
"""The kinds whose text itself is kept in the ledger."""

LABELS = {
    QUESTION: "question text",
    HISTORY: "earlier turns' text",
    ANSWER: "answer text",
    TOKEN_IDS: "token ids",
    PROBABILITIES: "probabilities",
    WEIGHTS: "weights",
    CONTROL: "control",
    UNCLASSIFIED: "unclassified frames",
}
_UNITS = {
    QUESTION: "text",
    HISTORY: "text",
    ANSWER: "text",
    TOKEN_IDS: "id",
    PROBABILITIES: "value",
    WEIGHTS: "weight",
    CONTROL: "frame",
    UNCLASSIFIED: "frame",
}

NOT_RECORDED = "not recorded (this answer was stored before Tandem kept a record of what it sent)"
NOTHING_SENT = "nothing left this device for this answer"


def _count(n: int, unit: str) -> str:
    return f"{n:,} {unit}" + ("" if n == 1 else "s")


def totals(rows: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """Frames and bytes in all. Every classified frame's header is control, so control counts
    every frame but the unclassified ones (listed whole)."""
    frames = sum(int(r.get("frames", 0)) for r in rows if r.get("kind") in (CONTROL, UNCLASSIFIED))
    return frames, sum(int(r.get("bytes", 0)) for r in rows)


def summary(rows: Sequence[Mapping[str, Any]] | None) -> str:
    """One line: how much left, and of which kinds."""
    if rows is None:
        return NOT_RECORDED
    if not rows:
        return NOTHING_SENT
    frames, nbytes = totals(rows)
    kinds = [label(r) for r in rows]
    what = " and ".join([", ".join(kinds[:-1]), kinds[-1]] if len(kinds) > 1 else kinds)
    return f"{_count(frames, 'frame')}, {_count(nbytes, 'byte')}: {what}"


def label(row: Mapping[str, Any]) -> str:
    kind = str(row.get("kind", ""))
    return LABELS.get(kind, kind)


def row_line(row: Mapping[str, Any]) -> str:
    """`question text: 1 text, 47 bytes in 1 frame (Generate)`."""
    kind = str(row.get("kind", ""))
    nbytes = _count(int(row.get("bytes", 0)), "byte")
    frames = _count(int(row.get("frames", 0)), "frame")
    head = f"{label(row)}: "
    if kind not in (CONTROL, UNCLASSIFIED):
        head += _count(int(row.get("items", 0)), _UNITS.get(kind, "item")) + ", "
    messages = row.get("messages") or {}
    by = ", ".join(str(name) if n == 1 else f"{name} ×{n}" for name, n in messages.items())
    return f"{head}{nbytes} in {frames}" + (f" ({by})" if by else "")


def texts(row: Mapping[str, Any]) -> list[str]:
    """The texts of a text kind's row, as they left (none for the other kinds)."""
    return [str(t) for t in row.get("texts") or ()]
