"""A toy mode, the wire (shared by both sides, as collab.protocol is): its own message, the
device's ShoutSetup that follows its Generate, saying how many exclamation marks to add."""

from __future__ import annotations

import struct

from collab.protocol import Message, Mode, ModeMessages, message
from collab.protocol.codec import _Reader, _uint

SHOUT_SETUP = 200  # a code in collab.protocol.EXTENSION_CODES
MAX_MARKS = 5


@message
class ShoutSetup(Message):
    """device → cloud, right after the Generate: the exclamation marks to end the answer with."""

    TYPE = SHOUT_SETUP
    marks: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _uint(self.marks, 8, "marks")

    def body(self) -> bytes:
        return struct.pack("<B", self.marks)

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        (marks,) = r.unpack(_B)
        return cls(marks, **hdr)


_B = struct.Struct("<B")

SHOUT_MESSAGES = ModeMessages(Mode.EXPERIMENTAL, messages=(ShoutSetup,), to_cloud=(ShoutSetup,))
