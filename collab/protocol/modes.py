"""What each mode adds to the wire, declared by the mode: its message types (each a `Message`
subclass: a code, `body` to encode, `parse` to decode) and which of them the device sends inside
a request. The cloud's session routes a request's frames by the table assembled here
(`request_frames`), so a new mode's messages need no edit of the session or the codec.

Tandem's own modes declare theirs in their family modules (`split`, `dragon`); a mode added
outside Tandem calls `declare` once (its codes in `codec.EXTENSION_CODES`) and `withdraw` to
forget it."""

from __future__ import annotations

from dataclasses import dataclass

from collab.protocol.codec import (
    EXTENSION_CODES,
    MESSAGE_TYPES,
    Message,
    MsgType,
    register_message,
)
from collab.protocol.session import Cancel, Mode, TokenChunk


@dataclass(frozen=True)
class ModeMessages:
    """One mode's messages: `messages` are every type it adds (both directions); `to_cloud`
    those the device sends while a request runs (the session hands them to that request)."""

    mode: Mode
    messages: tuple[type[Message], ...] = ()
    to_cloud: tuple[type[Message], ...] = ()

    def __post_init__(self) -> None:
        stray = [m.__name__ for m in self.to_cloud if m not in self.messages]
        if stray:
            raise TypeError(f"to_cloud names messages the mode does not declare: {stray}")


SESSION_TO_CLOUD: tuple[type[Message], ...] = (Cancel, TokenChunk)
"""What the device may send inside any mode's request: a cancel, and tokens."""

_DECLARED: dict[Mode, ModeMessages] = {}
_frames: tuple[type[Message], ...] = SESSION_TO_CLOUD


def declare(decl: ModeMessages) -> ModeMessages:
    """Add a mode's messages to the codec and to the session's table. A mode outside Tandem
    must use codes in EXTENSION_CODES; a code another class holds is refused (TypeError)."""
    for cls in decl.messages:
        if int(cls.TYPE) not in MsgType.__members__.values() and int(cls.TYPE) not in (
            EXTENSION_CODES
        ):
            raise TypeError(f"{cls.__name__}: code {int(cls.TYPE)} is not an extension code")
    for cls in decl.messages:
        register_message(cls)
    _DECLARED[decl.mode] = decl
    _rebuild()
    return decl


def withdraw(mode: Mode) -> None:
    """Forget a mode's messages (tests): `decode` refuses them again."""
    decl = _DECLARED.pop(mode, None)
    if decl is not None:
        for cls in decl.messages:
            if MESSAGE_TYPES.get(cls.TYPE) is cls and int(cls.TYPE) in EXTENSION_CODES:
                del MESSAGE_TYPES[cls.TYPE]
    _rebuild()


def declared() -> dict[Mode, ModeMessages]:
    return dict(_DECLARED)


def request_frames() -> tuple[type[Message], ...]:
    """The frames the cloud's session routes to the running request, assembled from every
    declared mode (and the session's own: Cancel, TokenChunk)."""
    return _frames


def _rebuild() -> None:
    global _frames
    extra = [m for d in _DECLARED.values() for m in d.to_cloud if m not in SESSION_TO_CLOUD]
    _frames = SESSION_TO_CLOUD + tuple(dict.fromkeys(extra))
