"""The frame codec every message family shares: header, limits, errors, the message base
and the registry of message types by type id (docs/protocol.md#design).

A frame is a fixed little-endian header followed by a compact `struct` body. Per-token traffic
never goes through pickle, JSON or msgpack: token ids are uint32 (Qwen has 151,936 ids) and
probabilities are float16 unless the frame's F32 flag says float32.

`decode` parses untrusted bytes: it raises only `ProtocolError`, checks every announced length
and count against `Limits` before reading, and never allocates more than the frame it was given
(arrays are views into the frame, read-only when it is `bytes`). Decoding is canonical: a
frame that decodes re-encodes to the same bytes.

The message families (`session`, `split`, `dragon`) import this module and register their
classes here with `@_message`; this module never imports them, so there is no import circle.
The package's `__init__` imports every family, so the registry is complete before any decode.
A mode added outside Tandem declares its own messages (`collab.protocol.modes`) with codes in
`EXTENSION_CODES`; `decode` knows them once they are declared, and refuses them after.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, ClassVar, TypeVar, dataclass_transform

import numpy as np

# 2: Generate carries RAPID's η; 4: draft frames carry the pipeline's flags; 5: each citation
# says what found it; 6: Generate carries the public search (a follow-up's standalone one)
PROTOCOL_VERSION = 6
MAGIC = b"TD"
# magic, version, message type, flags, request id, epoch, step, body length
_HEADER = struct.Struct("<2sBBHIIII")
HEADER_SIZE = _HEADER.size  # 22 bytes
FLAG_F32 = 0x0001  # probabilities in the body are float32 (else float16)
_U32_MAX = 2**32 - 1


class ProtocolError(ValueError):
    """The only exception `decode` raises; `.reason` is safe to send back in an Error frame."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    """Bounds on what a peer may announce; checked before anything is read or allocated."""

    max_frame_bytes: int = 4 * 1024 * 1024  # ≥ 13 dense float16 rows of 151,936
    max_draft_tokens: int = 32
    max_top_k: int = 1024
    max_sparse: int = 16384  # DRAGON's top-p supports can be wider than a top-K
    max_chunk_tokens: int = 4096
    vocab_size: int = 151_936
    max_text_bytes: int = 256 * 1024


DEFAULT_LIMITS = Limits()


class MsgType(IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    GENERATE = 3
    TOKEN_CHUNK = 4
    DSD_DRAFT = 5
    DSSD_DRAFT = 6
    TOPK_DRAFT = 7
    VERDICT = 8
    DRAGON_DRAFT = 9
    DRAGON_TARGET = 10
    PING = 11
    PONG = 12
    ERROR = 13
    CANCEL = 14
    DONE = 15
    CITATIONS = 16
    CLOUD_DECODE = 17
    DRAGON_SETUP = 18
    DRAGON_SCORE = 19
    DRAGON_SEQUENCE = 20


EXTENSION_CODES = range(64, 256)
"""Message type codes for modes added outside Tandem (`collab.protocol.modes.declare`); Tandem's
own stay below (`MsgType`). The header's type is one byte."""


# ---------------------------------------------------------------------------- helpers


def _enum(cls: type[IntEnum], value: int, what: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        raise ProtocolError(f"unknown {what} {value}") from None


def _uint(value: int, bits: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ProtocolError(f"{what} must be an integer")
    if not 0 <= int(value) < 2**bits:
        raise ProtocolError(f"{what} out of uint{bits} range")
    return int(value)


def _ids(value: Any, what: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size == 0:
        return np.zeros(arr.shape, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise ProtocolError(f"{what} must be integers")
    if arr.min() < 0 or arr.max() > _U32_MAX:
        raise ProtocolError(f"{what} out of uint32 range")
    return arr.astype("<u4", copy=False)


def _pdtype(f32: bool) -> str:
    return "<f4" if f32 else "<f2"


def _check_ids(arr: np.ndarray, limit: int, what: str) -> None:
    if arr.size and int(arr.max()) >= limit:
        raise ProtocolError(f"{what}: token id ≥ {limit}")


def _check_probs(arr: np.ndarray, what: str) -> None:
    # One vectorised pass; NaN fails both comparisons.
    if arr.size and not bool(np.all((arr >= 0) & (arr <= 1))):
        raise ProtocolError(f"{what}: probability NaN or outside [0, 1]")


def _check_finite(value: float, what: str, minus_inf: bool = False) -> None:
    """A score, weight or time must be a number: NaN and ±inf (−inf where `minus_inf` says
    it means something) would reach sums, sorts and JSON on the other side."""
    if not (math.isfinite(value) or (minus_inf and value == -math.inf)):
        raise ProtocolError(f"{what} must be finite{' or −inf' if minus_inf else ''}, not {value}")


def _check_finite_array(arr: np.ndarray, what: str, minus_inf: bool = False) -> None:
    """`_check_finite` for every element, in one pass (float16 by its exponent bits: a tenth
    of the time `np.isfinite` takes on a dense draft's rows)."""
    if not arr.size:
        return
    if arr.dtype == np.float16 and not minus_inf:
        ok = int((arr.view("<u2") & 0x7FFF).max()) < 0x7C00  # exponent all ones: inf or NaN
    elif minus_inf:
        ok = not bool(np.any(np.isnan(arr) | (arr == np.inf)))
    else:
        ok = bool(np.isfinite(arr).all())
    if not ok:
        extra = " (−inf allowed)" if minus_inf else ""
        raise ProtocolError(f"{what}: NaN or infinite values{extra}")


def _check_unique_rows(arr: np.ndarray, what: str) -> None:
    if arr.shape[-1] > 1 and bool(np.any(np.diff(np.sort(arr, axis=-1), axis=-1) == 0)):
        raise ProtocolError(f"{what}: duplicate token ids")


def _check_count(n: int, lo: int, hi: int, what: str) -> None:
    if not lo <= n <= hi:
        raise ProtocolError(f"{what} {n} outside [{lo}, {hi}]")


def _f32(value: float) -> float:
    """Round to float32 now so that a decoded message equals the one encoded."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


class _Reader:
    """Bounds-checked cursor over a body; every read checks the remaining length first."""

    def __init__(self, buf: memoryview, limits: Limits) -> None:
        self.buf, self.pos, self.limits = buf, 0, limits

    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def _need(self, n: int) -> int:
        if n > self.remaining():
            raise ProtocolError("body truncated")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, st: struct.Struct) -> tuple[Any, ...]:
        return st.unpack_from(self.buf, self._need(st.size))

    def u32(self) -> int:
        return int(self.unpack(_U32)[0])

    def array(self, dtype: str, count: int) -> np.ndarray:
        start = self._need(count * np.dtype(dtype).itemsize)
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start)

    def string(self, what: str) -> str:
        n = self.u32()
        if n > self.limits.max_text_bytes:
            raise ProtocolError(f"{what}: {n} bytes exceeds max_text_bytes")
        start = self._need(n)
        try:
            return str(self.buf[start : start + n], "utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"{what}: invalid UTF-8") from None

    def optional_string(self, what: str) -> str | None:
        (present,) = self.unpack(_U8)
        if present > 1:
            raise ProtocolError(f"{what}: bad presence byte")
        return self.string(what) if present else None


_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")


# ---------------------------------------------------------------------------- message base


@dataclass(frozen=True, eq=False, kw_only=True)
class Message:
    """Common base: every frame carries (request_id, epoch, step) so stale frames can be dropped."""

    TYPE: ClassVar[int]  # a MsgType, or a code in EXTENSION_CODES
    HAS_PROBS: ClassVar[bool] = False

    request_id: int = 0
    epoch: int = 0
    step: int = 0

    def __post_init__(self) -> None:
        for name in ("request_id", "epoch", "step"):
            _uint(getattr(self, name), 32, name)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
                    return False
                if a.dtype != b.dtype or not np.array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True

    @property
    def f32_flag(self) -> bool:
        return bool(getattr(self, "f32", False))

    @classmethod
    def allowed_flags(cls) -> int:
        """The header flag bits this type may carry."""
        return FLAG_F32 if cls.HAS_PROBS else 0

    def header_flags(self) -> int:
        return FLAG_F32 if self.f32_flag else 0

    @classmethod
    def flag_fields(cls, flags: int) -> dict[str, Any]:
        """Fields a type keeps in header flags (beside F32), as constructor arguments."""
        return {}

    def body(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        return cls(**hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        """Value checks (ids < vocab, probabilities in [0, 1], counts); raises ProtocolError."""

    def check_finite(self) -> None:
        """Refuse NaN and infinities wherever the frame carries a score, probability, weight or
        time (ProtocolError): `encode` and `decode` both run it, so neither side ever puts one
        on the wire or acts on one."""


MESSAGE_TYPES: dict[int, type[Message]] = {}
M = TypeVar("M", bound=Message)


@dataclass_transform(frozen_default=True, eq_default=False)
def message(cls: type[M]) -> type[M]:
    """Make a message class a frozen dataclass (the way a mode outside Tandem writes one; it is
    known to `decode` once its mode declares it, `collab.protocol.modes.declare`)."""
    return dataclass(frozen=True, eq=False)(cls)


def register_message(cls: type[Message]) -> None:
    """Make `decode` know `cls` under its TYPE; a code already taken by another class is
    refused (TypeError), the same class again is a no-op."""
    known = MESSAGE_TYPES.get(cls.TYPE)
    if known is not None and known is not cls:
        raise TypeError(f"message type {int(cls.TYPE)} is already {known.__name__}")
    if not 0 < int(cls.TYPE) < 256:
        raise TypeError(f"message type {int(cls.TYPE)} is not a one-byte code")
    MESSAGE_TYPES[cls.TYPE] = cls


@dataclass_transform(frozen_default=True, eq_default=False)
def _message(cls: type[M]) -> type[M]:
    """Make a message class a frozen dataclass and register it under its own TYPE (a base such
    as Draft has none and is not registered)."""
    cls = message(cls)
    if "TYPE" in cls.__dict__:
        register_message(cls)
    return cls


# ---------------------------------------------------------------------------- codec


@dataclass(frozen=True)
class RawHeader:
    """A header's fields as a peer sent them, unvetted (the type may be unknown)."""

    version: int
    msg_type: int
    flags: int
    request_id: int
    epoch: int
    step: int
    body_length: int


def peek_version(data: bytes | memoryview) -> int | None:
    """The protocol version a frame announces, or None if it is not a Tandem frame. Magic and
    version lead the header of every version, so this reads a frame of any version."""
    if len(data) >= len(MAGIC) + 1 and data[: len(MAGIC)] == MAGIC:
        return data[len(MAGIC)]
    return None


def peek_header(data: bytes | memoryview) -> RawHeader | None:
    """The header of a frame that may not decode (to answer it under its request id), or None
    when it is too short or its magic is not ours."""
    if len(data) < HEADER_SIZE:
        return None
    magic, *rest = _HEADER.unpack_from(data, 0)
    return RawHeader(*rest) if magic == MAGIC else None


@dataclass(frozen=True)
class Header:
    """A vetted header (`decode_header`)."""

    msg_type: int  # a MsgType, or a declared extension's code
    flags: int
    request_id: int
    epoch: int
    step: int
    body_length: int


def decode_header(data: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Parse and vet the first HEADER_SIZE bytes, so a stream reader can refuse a frame whose
    announced body is too large before reading (or allocating) it."""
    if len(data) < HEADER_SIZE:
        raise ProtocolError("frame shorter than header")
    raw = peek_header(data)
    if raw is None:
        raise ProtocolError("bad magic")
    if raw.version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {raw.version}")
    cls = MESSAGE_TYPES.get(raw.msg_type)
    if cls is None:
        raise ProtocolError(f"unknown message type {raw.msg_type}")
    msg_type = cls.TYPE
    flags = raw.flags
    if flags & ~cls.allowed_flags():
        raise ProtocolError(f"bad flags {flags:#x}")
    if raw.body_length > limits.max_frame_bytes - HEADER_SIZE:
        raise ProtocolError(f"body length {raw.body_length} exceeds max_frame_bytes")
    return Header(msg_type, flags, raw.request_id, raw.epoch, raw.step, raw.body_length)


def encode(msg: Message) -> bytes:
    """One frame: header + body. Structure is validated at construction and non-finite numbers
    here; other values are not (use `msg.check(limits)` to vet before sending)."""
    msg.check_finite()
    body = msg.body()
    flags = msg.header_flags()
    if len(body) > _U32_MAX:
        raise ProtocolError("body too large")
    head = _HEADER.pack(
        MAGIC, PROTOCOL_VERSION, msg.TYPE, flags, msg.request_id, msg.epoch, msg.step, len(body)
    )
    return head + body


def decode(frame: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse one untrusted frame. Raises only ProtocolError; arrays are views into `frame`."""
    try:
        view = memoryview(frame).cast("B")
    except TypeError:
        raise ProtocolError("frame must be a bytes-like object") from None
    hdr = decode_header(view, limits)
    if hdr.body_length != len(view) - HEADER_SIZE:
        raise ProtocolError("body length disagrees with frame size")
    reader = _Reader(view[HEADER_SIZE:], limits)
    cls = MESSAGE_TYPES[hdr.msg_type]
    ids = {"request_id": hdr.request_id, "epoch": hdr.epoch, "step": hdr.step}
    msg = cls.parse(reader, bool(hdr.flags & FLAG_F32), ids | cls.flag_fields(hdr.flags))
    if reader.remaining():
        raise ProtocolError("trailing bytes after body")
    msg.check_finite()
    msg.check(limits)
    return msg
