"""What left this device for one answer: a ledger written at the one place frames are sent
(`CloudClient._send_frame`), from the message and the size of the frame that went out; never
reconstructed afterwards.

Each frame is split by its fields into the kinds it carries (`edge_runtime.sent_kinds`):
question text, earlier turns' text, answer text, token ids, probabilities, weights. Each of
those gets the bytes of its own fields (a text with its 4-byte length prefix, an array its
elements), and control gets the rest of the frame: the 22-byte header, counts, flags, sampling
settings, times, and every frame that carries nothing else (Hello, Ping, Pong, Cancel,
DragonSetup, CloudDecode). So the bytes of a ledger's rows add up to the frames' bytes exactly,
and control's frame count is every frame (but those of a type the ledger does not know, a mode
added outside Tandem: listed whole, as unclassified). Text kinds keep the texts themselves.

What the ledger does not list: a frame whose send failed (it did not leave: the connection was
gone), the websocket's own keep-alive pings (empty control frames below the protocol), and
the HTTP upgrade that opens a session (it carries the access token, never a question). A frame
sent while no answer holds the session (a Pong between answers) belongs to no answer. The Hello
that opens a session is held until an answer takes the session and then listed with it: the
answer that made the session, or the first to use one opened at start."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from collab.protocol import (
    MESSAGE_TYPES,
    Cancel,
    CloudDecode,
    DragonDraft,
    DragonScore,
    DragonSequence,
    DragonSetup,
    DragonTarget,
    DsdDraft,
    DssdDraft,
    Error,
    Generate,
    Hello,
    Message,
    MsgType,
    Ping,
    Pong,
    TokenChunk,
    TopKDraft,
)
from edge_runtime.sent_kinds import (
    ANSWER,
    CONTROL,
    HISTORY,
    KINDS,
    PROBABILITIES,
    QUESTION,
    TEXT_KINDS,
    TOKEN_IDS,
    UNCLASSIFIED,
    WEIGHTS,
)

log = logging.getLogger("tandem.edge.sent")

_ID = 4  # bytes of a token id on the wire (uint32)
_H = 8  # bytes of a side weight (float64)


class Part(NamedTuple):
    """What one frame carries of one kind: its bytes, how many items (texts, ids, values)
    and, for a text kind, the texts."""

    kind: str
    nbytes: int
    items: int
    texts: tuple[str, ...] = ()


def _text(text: str) -> int:
    return 4 + len(text.encode("utf-8"))


def _control(msg: Any) -> list[Part]:
    return []


def _generate(msg: Generate) -> list[Part]:
    parts = [Part(QUESTION, _text(msg.question), 1, (msg.question,))]
    if msg.history:  # the entry count stays control: it is sent with no history too
        size = sum(_text(h) for h in msg.history)
        parts.append(Part(HISTORY, size, len(msg.history), tuple(msg.history)))
    return parts


def _token_chunk(msg: TokenChunk) -> list[Part]:
    parts = [Part(TOKEN_IDS, _ID * msg.token_ids.size, msg.token_ids.size)]
    if msg.text is not None:
        parts.append(Part(ANSWER, _text(msg.text), 1, (msg.text,)))
    return parts


def _dsd(msg: DsdDraft) -> list[Part]:
    n = msg.token_ids.size
    return [Part(TOKEN_IDS, _ID * n, n), Part(PROBABILITIES, msg.probs.nbytes, msg.probs.size)]


def _dssd(msg: DssdDraft) -> list[Part]:
    n = msg.token_ids.size
    return [Part(TOKEN_IDS, _ID * n, n), Part(PROBABILITIES, msg.q.nbytes, msg.q.size)]


def _topk(msg: TopKDraft) -> list[Part]:
    ids = msg.token_ids.size + msg.topk_ids.size  # the drafts, and each position's support
    return [
        Part(TOKEN_IDS, _ID * ids, ids),
        Part(PROBABILITIES, msg.topk_probs.nbytes, msg.topk_probs.size),
    ]


def _dragon_draft(msg: DragonDraft) -> list[Part]:
    ids = 1 + msg.ids.size  # the draft token, and its mixture's support
    return [
        Part(TOKEN_IDS, _ID * ids, ids),
        Part(PROBABILITIES, msg.probs.nbytes, msg.probs.size),
        Part(WEIGHTS, _H, 1),
    ]


def _dragon_target(msg: DragonTarget) -> list[Part]:
    return [Part(TOKEN_IDS, _ID, 1)]


def _dragon_score(msg: DragonScore) -> list[Part]:
    return [Part(TOKEN_IDS, _ID * msg.tokens.size, msg.tokens.size)]


def _dragon_sequence(msg: DragonSequence) -> list[Part]:
    n = msg.tokens.size
    return [
        Part(TOKEN_IDS, _ID * n, n),
        Part(PROBABILITIES, msg.logprobs.nbytes, n),
        Part(WEIGHTS, _H, 1),
    ]


CLASSIFY: dict[type[Message], Callable[[Any], list[Part]]] = {
    Hello: _control,
    Ping: _control,
    Pong: _control,
    Cancel: _control,
    Error: _control,
    CloudDecode: _control,
    DragonSetup: _control,
    Generate: _generate,
    TokenChunk: _token_chunk,
    DsdDraft: _dsd,
    DssdDraft: _dssd,
    TopKDraft: _topk,
    DragonDraft: _dragon_draft,
    DragonTarget: _dragon_target,
    DragonScore: _dragon_score,
    DragonSequence: _dragon_sequence,
}
"""What each message type a device may send carries, beyond control (the rest of its frame).
A type not here (a mode added outside Tandem) is listed whole as "unclassified"."""

CLOUD_ONLY: frozenset[type[Message]] = frozenset(
    MESSAGE_TYPES[code]
    for code in (MsgType.HELLO_ACK, MsgType.VERDICT, MsgType.CITATIONS, MsgType.DONE)
)
"""Types only the cloud sends (tests: every registered type is here or in CLASSIFY)."""


def parts(msg: Message, nbytes: int) -> list[Part]:
    """The kinds a frame of `nbytes` holding `msg` carries; their bytes add up to `nbytes`."""
    classify = CLASSIFY.get(type(msg))
    if classify is None:
        return [Part(UNCLASSIFIED, nbytes, 1)]
    data = classify(msg)
    return [*data, Part(CONTROL, nbytes - sum(p.nbytes for p in data), 1)]


class SentLedger:
    """One answer's ledger. `rows` is the list the answer's `Stats.sent` holds, kept up to
    date as frames leave; once `close`d (the answer ended) nothing more is written."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.open = True
        self._rows: dict[str, dict[str, Any]] = {}
        self._texts: dict[str, set[str]] = {}

    def record(self, msg: Message, nbytes: int) -> bool:
        """Add a frame of `nbytes` that left holding `msg`; False if the answer had ended."""
        if not self.open:
            return False
        name = type(msg).__name__
        for part in parts(msg, nbytes):
            row = self._row(part.kind)
            row["frames"] += 1
            row["bytes"] += part.nbytes
            row["items"] += part.items
            row["messages"][name] = row["messages"].get(name, 0) + 1
            seen = self._texts.get(part.kind)
            for text in part.texts:
                if seen is not None and text not in seen:
                    seen.add(text)
                    row["texts"].append(text)
        return True

    def close(self) -> None:
        self.open = False

    @property
    def nbytes(self) -> int:
        return sum(int(r["bytes"]) for r in self.rows)

    def _row(self, kind: str) -> dict[str, Any]:
        row = self._rows.get(kind)
        if row is None:
            row = {"kind": kind, "frames": 0, "bytes": 0, "items": 0, "messages": {}}
            if kind in TEXT_KINDS:
                row["texts"] = []
                self._texts[kind] = set()
            self._rows[kind] = row
            self.rows[:] = [self._rows[k] for k in KINDS if k in self._rows]
        return row
