"""The binary wire protocol shared by device and cloud (DESIGN.md §4).

A frame is a fixed little-endian header followed by a compact `struct` body. Per-token traffic
never goes through pickle, JSON or msgpack: token ids are uint32 (Qwen has 151,936 ids) and
probabilities are float16 unless the frame's F32 flag says float32.

`decode` parses untrusted bytes: it raises only `ProtocolError`, checks every announced length
and count against `Limits` before reading, and never allocates more than the frame it was given
(arrays are views into the frame, read-only when it is `bytes`). Decoding is canonical: a
frame that decodes re-encodes to the same bytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, ClassVar

import numpy as np

PROTOCOL_VERSION = 1
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


class Mode(IntEnum):
    LOCAL = 0
    CLOUD = 1
    DRAGON = 2
    SPLIT = 3


class Side(IntEnum):
    DEVICE = 0
    CLOUD = 1


class FinishReason(IntEnum):
    STOP = 0
    LENGTH = 1
    CANCELLED = 2
    ERROR = 3


class ErrorCode(IntEnum):
    """Well-known codes; `Error.code` may carry any uint16."""

    MALFORMED = 1
    UNSUPPORTED_VERSION = 2
    AUTH = 3
    TOKENIZER_MISMATCH = 4
    LIMIT = 5
    BUSY = 6
    STALE_EPOCH = 7
    INTERNAL = 8
    EVICTED = 9


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
        return self.unpack(_U32)[0]

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


# ---------------------------------------------------------------------------- messages


@dataclass(frozen=True, eq=False, kw_only=True)
class Message:
    """Common base: every frame carries (request_id, epoch, step) so stale frames can be dropped."""

    TYPE: ClassVar[MsgType]
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

    def body(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        return cls(**hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        """Value checks (ids < vocab, probabilities in [0, 1], counts); raises ProtocolError."""


_message = dataclass(frozen=True, eq=False)


@_message
class Hello(Message):
    """Handshake: both sides must share protocol version and tokenizer (vocabulary)."""

    TYPE = MsgType.HELLO
    tokenizer_hash: bytes
    mode: Mode
    variant: str = ""
    auth_token: str = ""
    protocol_version: int = PROTOCOL_VERSION
    model_name: str = ""

    _ST = struct.Struct("<B32sB")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.tokenizer_hash, bytes) or len(self.tokenizer_hash) != 32:
            raise ProtocolError("tokenizer_hash must be 32 bytes")
        self._set("mode", _enum(Mode, int(self.mode), "mode"))
        _uint(self.protocol_version, 8, "protocol_version")

    def body(self) -> bytes:
        head = self._ST.pack(self.protocol_version, self.tokenizer_hash, self.mode)
        return head + _str(self.variant) + _str(self.auth_token) + _str(self.model_name)

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        version, thash, mode = r.unpack(cls._ST)
        variant, auth = r.string("variant"), r.string("auth_token")
        model = r.string("model_name")
        mode = _enum(Mode, mode, "mode")
        return cls(thash, mode, variant, auth, version, model, **hdr)


@_message
class HelloAck(Message):
    """The server's answer: accepted or not (with a reason) and the limits it enforces."""

    TYPE = MsgType.HELLO_ACK
    accepted: bool
    limits: Limits = DEFAULT_LIMITS
    reason: str = ""
    model_name: str = ""

    _ST = struct.Struct("<B7I")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._set("accepted", bool(self.accepted))
        for f in fields(Limits):
            _uint(getattr(self.limits, f.name), 32, f"limits.{f.name}")

    def body(self) -> bytes:
        lim = [getattr(self.limits, f.name) for f in fields(Limits)]
        return (
            self._ST.pack(int(bool(self.accepted)), *lim)
            + _str(self.reason)
            + _str(self.model_name)
        )

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        accepted, *lim = r.unpack(cls._ST)
        if accepted > 1:
            raise ProtocolError("accepted must be 0 or 1")
        reason = r.string("reason")
        return cls(bool(accepted), Limits(*lim), reason, r.string("model_name"), **hdr)


@_message
class Generate(Message):
    """Start a request: in cloud mode the cloud generates the whole answer and streams
    TokenChunks; in split mode it prepares its prompt and waits for drafts. `history` is the
    earlier conversation as alternating user/assistant texts (only turns the cloud may see);
    `retrieve` asks the cloud to ground its prompt in the public corpus."""

    TYPE = MsgType.GENERATE
    question: str
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    history: tuple[str, ...] = ()
    retrieve: bool = True

    _ST = struct.Struct("<IfIfBQB")
    MAX_HISTORY = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        _uint(self.max_new_tokens, 32, "max_new_tokens")
        _uint(self.top_k, 32, "top_k")
        self._set("temperature", _f32(self.temperature))
        self._set("top_p", _f32(self.top_p))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ProtocolError("temperature must be finite and ≥ 0")
        if not 0 < self.top_p <= 1:
            raise ProtocolError("top_p must be in (0, 1]")
        if self.seed is not None:
            _uint(self.seed, 64, "seed")
        self._set("history", tuple(self.history))
        self._set("retrieve", bool(self.retrieve))
        if len(self.history) % 2 or len(self.history) > self.MAX_HISTORY:
            raise ProtocolError("history must be user/assistant pairs (at most 128)")
        if not all(isinstance(h, str) for h in self.history):
            raise ProtocolError("history entries must be strings")

    def body(self) -> bytes:
        has_seed = self.seed is not None
        head = self._ST.pack(
            self.max_new_tokens, self.temperature, self.top_k, self.top_p, has_seed,
            self.seed or 0, self.retrieve,
        )  # fmt: skip
        turns = struct.pack("<I", len(self.history)) + b"".join(_str(h) for h in self.history)
        return head + _str(self.question) + turns

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        max_new, temp, top_k, top_p, has_seed, seed, retrieve = r.unpack(cls._ST)
        if has_seed > 1 or (not has_seed and seed):
            raise ProtocolError("bad seed presence")
        if retrieve > 1:
            raise ProtocolError("retrieve must be 0 or 1")
        q = r.string("question")
        n = r.u32()
        _check_count(n, 0, cls.MAX_HISTORY, "history entries")
        history = tuple(r.string("history") for _ in range(n))
        seed = seed if has_seed else None
        return cls(q, max_new, temp, top_k, top_p, seed, history, bool(retrieve), **hdr)


@_message
class TokenChunk(Message):
    """Cloud stream: a few new token ids and, optionally, their detokenised text."""

    TYPE = MsgType.TOKEN_CHUNK
    token_ids: np.ndarray
    text: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._set("token_ids", _ids(self.token_ids, "token_ids").reshape(-1))

    def body(self) -> bytes:
        ids = self.token_ids
        text = b"\x00" if self.text is None else b"\x01" + _str(self.text)
        return struct.pack("<I", ids.size) + ids.tobytes() + text

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        n = r.u32()
        _check_count(n, 0, r.limits.max_chunk_tokens, "chunk tokens")
        ids = r.array("<u4", n)
        return cls(ids, r.optional_string("text"), **hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        _check_count(self.token_ids.size, 0, limits.max_chunk_tokens, "chunk tokens")
        _check_ids(self.token_ids, limits.vocab_size, "token_ids")


@_message
class Draft(Message):
    """Base of the split-speculation uplinks: γ drafted token ids plus what the cloud needs of Q."""

    HAS_PROBS = True
    token_ids: np.ndarray

    def _norm_ids(self) -> None:
        self._set("token_ids", _ids(self.token_ids, "token_ids").reshape(-1))

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        _check_count(self.token_ids.size, 1, limits.max_draft_tokens, "draft tokens")
        _check_ids(self.token_ids, limits.vocab_size, "token_ids")


@_message
class DsdDraft(Draft):
    """DSD baseline: ids plus the dense draft distributions Q_1..Q_γ, shape (γ, |V|)."""

    TYPE = MsgType.DSD_DRAFT
    probs: np.ndarray
    f32: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._norm_ids()
        probs = np.asarray(self.probs, dtype=_pdtype(self.f32))
        if probs.ndim != 2 or probs.shape[0] != self.token_ids.size:
            raise ProtocolError("probs must have shape (len(token_ids), vocab)")
        self._set("probs", probs)

    def body(self) -> bytes:
        n, v = self.probs.shape
        return struct.pack("<II", n, v) + self.token_ids.tobytes() + self.probs.tobytes()

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        n, v = r.unpack(_II)
        _check_count(n, 1, r.limits.max_draft_tokens, "draft tokens")
        _check_count(v, 1, r.limits.vocab_size, "vocab")
        ids = r.array("<u4", n)
        probs = r.array(_pdtype(f32), n * v).reshape(n, v)
        return cls(ids, probs, f32, **hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        super().check(limits)
        _check_count(self.probs.shape[1], 1, limits.vocab_size, "vocab")
        _check_ids(self.token_ids, self.probs.shape[1], "token_ids")
        _check_probs(self.probs, "probs")


@_message
class DssdDraft(Draft):
    """DSSD: ids plus q_i(x_i) only; the count is implied by the body length (6 B per token)."""

    TYPE = MsgType.DSSD_DRAFT
    q: np.ndarray
    f32: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._norm_ids()
        q = np.asarray(self.q, dtype=_pdtype(self.f32)).reshape(-1)
        if q.size != self.token_ids.size:
            raise ProtocolError("q must have one value per token")
        self._set("q", q)

    def body(self) -> bytes:
        return self.token_ids.tobytes() + self.q.tobytes()

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        per = 8 if f32 else 6
        n, rest = divmod(r.remaining(), per)
        if rest:
            raise ProtocolError("DSSD body length is not a whole number of tokens")
        _check_count(n, 1, r.limits.max_draft_tokens, "draft tokens")
        return cls(r.array("<u4", n), r.array(_pdtype(f32), n), f32, **hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        super().check(limits)
        _check_probs(self.q, "q")


@_message
class TopKDraft(Draft):
    """TK-SLT: ids plus, per position, the top-K (id, prob) pairs the draft was sampled from.

    Each drafted id must be inside its own row: a draft outside the transmitted support would
    get q = 0 and be wrongly accepted (DESIGN.md §5.1)."""

    TYPE = MsgType.TOPK_DRAFT
    topk_ids: np.ndarray
    topk_probs: np.ndarray
    f32: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._norm_ids()
        tids = _ids(self.topk_ids, "topk_ids")
        tprobs = np.asarray(self.topk_probs, dtype=_pdtype(self.f32))
        n = self.token_ids.size
        if tids.ndim != 2 or tids.shape[0] != n or tprobs.shape != tids.shape:
            raise ProtocolError("topk_ids/topk_probs must have shape (len(token_ids), K)")
        self._set("topk_ids", tids)
        self._set("topk_probs", tprobs)

    def body(self) -> bytes:
        n, k = self.topk_ids.shape
        ids = self.token_ids.tobytes()
        return struct.pack("<II", n, k) + ids + self.topk_ids.tobytes() + self.topk_probs.tobytes()

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        n, k = r.unpack(_II)
        _check_count(n, 1, r.limits.max_draft_tokens, "draft tokens")
        _check_count(k, 1, r.limits.max_top_k, "top-K")
        ids = r.array("<u4", n)
        tids = r.array("<u4", n * k).reshape(n, k)
        return cls(ids, tids, r.array(_pdtype(f32), n * k).reshape(n, k), f32, **hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        super().check(limits)
        _check_count(self.topk_ids.shape[1], 1, limits.max_top_k, "top-K")
        _check_ids(self.topk_ids, limits.vocab_size, "topk_ids")
        _check_unique_rows(self.topk_ids, "topk_ids")
        _check_probs(self.topk_probs, "topk_probs")
        if not bool(np.all(np.any(self.topk_ids == self.token_ids[:, None], axis=1))):
            raise ProtocolError("a drafted token is outside its transmitted top-K")


_II = struct.Struct("<II")


@_message
class Verdict(Message):
    """Cloud → device after verifying a draft: accepted count, then the correction or bonus token
    (None in DSSD, where the device resamples), or P_j dense (`p_ids` None) or top-K sparse."""

    TYPE = MsgType.VERDICT
    HAS_PROBS = True
    accepted: int
    token: int | None = None
    p_ids: np.ndarray | None = None
    p_probs: np.ndarray | None = None
    f32: bool = False
    compute_s: float = 0.0  # the cloud's compute time for this round: the device's cost model

    _ST = struct.Struct("<HBIf")

    def __post_init__(self) -> None:
        super().__post_init__()
        _uint(self.accepted, 16, "accepted")
        if self.token is not None:
            _uint(self.token, 32, "token")
        self._set("compute_s", _f32(self.compute_s))
        if not (math.isfinite(self.compute_s) and self.compute_s >= 0):
            raise ProtocolError("compute_s must be finite and ≥ 0")
        if self.p_probs is None:
            if self.p_ids is not None or self.f32:
                raise ProtocolError("p_ids or f32 without p_probs")
            return
        probs = np.asarray(self.p_probs, dtype=_pdtype(self.f32))
        if probs.ndim != 1 or probs.size == 0:
            raise ProtocolError("p_probs must be a non-empty vector")
        self._set("p_probs", probs)
        if self.p_ids is not None:
            ids = _ids(self.p_ids, "p_ids")
            if ids.shape != probs.shape:
                raise ProtocolError("p_ids and p_probs must have the same shape")
            self._set("p_ids", ids)

    def body(self) -> bytes:
        pj = 0 if self.p_probs is None else (1 if self.p_ids is None else 2)
        kind = (self.token is not None) | (pj << 1)
        out = self._ST.pack(self.accepted, kind, self.token or 0, self.compute_s)
        if pj:
            out += struct.pack("<I", self.p_probs.size)
            if pj == 2:
                out += self.p_ids.tobytes()
            out += self.p_probs.tobytes()
        return out

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        accepted, kind, token, compute_s = r.unpack(cls._ST)
        has_token, pj = kind & 1, kind >> 1
        if pj > 2 or (not has_token and token):
            raise ProtocolError("bad verdict kind")
        ids = probs = None
        if pj:
            n = r.u32()
            hi = r.limits.vocab_size if pj == 1 else r.limits.max_top_k
            _check_count(n, 1, hi, "P_j size")
            ids = r.array("<u4", n) if pj == 2 else None
            probs = r.array(_pdtype(f32), n)
        elif f32:
            raise ProtocolError("F32 flag without probabilities")
        token = token if has_token else None
        return cls(accepted, token, ids, probs, f32, compute_s, **hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        _check_count(self.accepted, 0, limits.max_draft_tokens, "accepted")
        if self.token is not None and self.token >= limits.vocab_size:
            raise ProtocolError("token ≥ vocab")
        if self.p_probs is not None:
            hi = limits.vocab_size if self.p_ids is None else limits.max_top_k
            _check_count(self.p_probs.size, 1, hi, "P_j size")
            _check_probs(self.p_probs, "p_probs")
        if self.p_ids is not None:
            _check_ids(self.p_ids, limits.vocab_size, "p_ids")
            _check_unique_rows(self.p_ids, "p_ids")


@_message
class DragonDraft(Message):
    """DRAGON: a side's draft token, its (truncated) local mixture p^s as ids+probs, its side
    weight h^s (float64; −inf when it retrieved nothing) and its decode time in seconds."""

    TYPE = MsgType.DRAGON_DRAFT
    HAS_PROBS = True
    token: int
    ids: np.ndarray
    probs: np.ndarray
    h: float
    decode_time: float
    f32: bool = False

    _ST = struct.Struct("<IdfI")

    def __post_init__(self) -> None:
        super().__post_init__()
        _uint(self.token, 32, "token")
        ids = _ids(self.ids, "ids").reshape(-1)
        probs = np.asarray(self.probs, dtype=_pdtype(self.f32)).reshape(-1)
        if ids.size != probs.size:
            raise ProtocolError("ids and probs must have the same length")
        self._set("ids", ids)
        self._set("probs", probs)
        self._set("h", float(self.h))
        self._set("decode_time", _f32(self.decode_time))

    def body(self) -> bytes:
        head = self._ST.pack(self.token, self.h, self.decode_time, self.ids.size)
        return head + self.ids.tobytes() + self.probs.tobytes()

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        token, h, dt, n = r.unpack(cls._ST)
        _check_count(n, 1, r.limits.max_sparse, "sparse size")
        ids = r.array("<u4", n)
        return cls(token, ids, r.array(_pdtype(f32), n), h, dt, f32, **hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        _check_count(self.ids.size, 1, limits.max_sparse, "sparse size")
        _check_ids(self.ids, limits.vocab_size, "ids")
        _check_unique_rows(self.ids, "ids")
        _check_probs(self.probs, "probs")
        if not bool(np.any(self.ids == self.token)):
            raise ProtocolError("draft token outside its transmitted distribution")
        if math.isnan(self.h) or self.h == math.inf:
            raise ProtocolError("h must be finite or −inf")
        if not (math.isfinite(self.decode_time) and self.decode_time >= 0):
            raise ProtocolError("decode_time must be finite and ≥ 0")


@_message
class DragonTarget(Message):
    """DRAGON: the aggregator's target token, which sides' drafts it accepted, next aggregator."""

    TYPE = MsgType.DRAGON_TARGET
    token: int
    device_accepted: bool
    cloud_accepted: bool
    next_aggregator: Side

    _ST = struct.Struct("<IBB")

    def __post_init__(self) -> None:
        super().__post_init__()
        _uint(self.token, 32, "token")
        self._set("device_accepted", bool(self.device_accepted))
        self._set("cloud_accepted", bool(self.cloud_accepted))
        self._set("next_aggregator", _enum(Side, int(self.next_aggregator), "side"))

    def body(self) -> bytes:
        flags = bool(self.device_accepted) | (bool(self.cloud_accepted) << 1)
        return self._ST.pack(self.token, flags, self.next_aggregator)

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        token, flags, side = r.unpack(cls._ST)
        if flags > 3:
            raise ProtocolError("bad acceptance flags")
        return cls(token, bool(flags & 1), bool(flags & 2), _enum(Side, side, "side"), **hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        if self.token >= limits.vocab_size:
            raise ProtocolError("token ≥ vocab")


@_message
class Ping(Message):
    """Application-level RTT probe (monotonic nanoseconds of the sender)."""

    TYPE = MsgType.PING
    sent_ns: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _uint(self.sent_ns, 64, "sent_ns")

    def body(self) -> bytes:
        return struct.pack("<Q", self.sent_ns)

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        return cls(*r.unpack(_Q), **hdr)


@_message
class Pong(Message):
    """Echoes the ping's timestamp with the responder's receive and send times."""

    TYPE = MsgType.PONG
    ping_sent_ns: int
    received_ns: int
    sent_ns: int

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("ping_sent_ns", "received_ns", "sent_ns"):
            _uint(getattr(self, name), 64, name)

    def body(self) -> bytes:
        return struct.pack("<QQQ", self.ping_sent_ns, self.received_ns, self.sent_ns)

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        return cls(*r.unpack(_QQQ), **hdr)


_Q = struct.Struct("<Q")
_QQQ = struct.Struct("<QQQ")


@_message
class Error(Message):
    """A peer's complaint; the session survives a malformed frame (DESIGN.md §4)."""

    TYPE = MsgType.ERROR
    code: int
    message: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._set("code", _uint(self.code, 16, "code"))

    def body(self) -> bytes:
        return struct.pack("<H", self.code) + _str(self.message)

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        (code,) = r.unpack(_H)
        return cls(code, r.string("message"), **hdr)


_H = struct.Struct("<H")


@_message
class Cancel(Message):
    """Stop the request named in the header."""

    TYPE = MsgType.CANCEL


@_message
class Done(Message):
    """End of a request, with why and what it cost (tokens, rounds, bytes per direction)."""

    TYPE = MsgType.DONE
    reason: FinishReason
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    elapsed_s: float = 0.0

    _ST = struct.Struct("<BIIIIQQd")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._set("reason", _enum(FinishReason, int(self.reason), "finish reason"))
        for name in ("tokens", "rounds", "drafted", "accepted"):
            _uint(getattr(self, name), 32, name)
        for name in ("bytes_up", "bytes_down"):
            _uint(getattr(self, name), 64, name)
        self._set("elapsed_s", float(self.elapsed_s))
        if not (math.isfinite(self.elapsed_s) and self.elapsed_s >= 0):
            raise ProtocolError("elapsed_s must be finite and ≥ 0")

    def body(self) -> bytes:
        return self._ST.pack(
            self.reason, self.tokens, self.rounds, self.drafted, self.accepted,
            self.bytes_up, self.bytes_down, self.elapsed_s,
        )  # fmt: skip

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        reason, *rest = r.unpack(cls._ST)
        return cls(_enum(FinishReason, reason, "finish reason"), *rest, **hdr)


@dataclass(frozen=True)
class Source:
    """One retrieved passage as a citation shows it: where it lives, how relevant, an excerpt."""

    title: str
    location: str = ""
    score: float = 0.0
    excerpt: str = ""


@_message
class Citations(Message):
    """The cloud's public sources for a request (public text only: private text never
    travels), numbered in the order given, before the first token."""

    TYPE = MsgType.CITATIONS
    sources: tuple[Source, ...] = ()
    MAX_SOURCES = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.sources) > self.MAX_SOURCES:
            raise ProtocolError(f"at most {self.MAX_SOURCES} sources")
        self._set(
            "sources",
            tuple(Source(s.title, s.location, _f32(s.score), s.excerpt) for s in self.sources),
        )

    def body(self) -> bytes:
        out = [struct.pack("<I", len(self.sources))]
        for s in self.sources:
            out += [_str(s.title), _str(s.location), struct.pack("<f", s.score), _str(s.excerpt)]
        return b"".join(out)

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        n = r.u32()
        _check_count(n, 0, cls.MAX_SOURCES, "sources")
        sources = []
        for _ in range(n):
            title, location = r.string("title"), r.string("location")
            (score,) = r.unpack(_F32)
            sources.append(Source(title, location, score, r.string("excerpt")))
        return cls(tuple(sources), **hdr)


_F32 = struct.Struct("<f")


@_message
class CloudDecode(Message):
    """Split mode, AS² fallback: the cloud decodes the next `n_tokens` itself (0 = to the end)
    and streams them as TokenChunks, then waits for drafts again."""

    TYPE = MsgType.CLOUD_DECODE
    n_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _uint(self.n_tokens, 32, "n_tokens")

    def body(self) -> bytes:
        return struct.pack("<I", self.n_tokens)

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        return cls(r.u32(), **hdr)


MESSAGE_TYPES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, HelloAck, Generate, TokenChunk, DsdDraft, DssdDraft, TopKDraft, Verdict,
                DragonDraft, DragonTarget, Ping, Pong, Error, Cancel, Done, Citations,
                CloudDecode)
}  # fmt: skip


# ---------------------------------------------------------------------------- codec


@dataclass(frozen=True)
class Header:
    msg_type: MsgType
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
    magic, version, mtype, flags, rid, epoch, step, blen = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ProtocolError("bad magic")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version}")
    msg_type = _enum(MsgType, mtype, "message type")
    if flags & ~FLAG_F32 or (flags and not MESSAGE_TYPES[msg_type].HAS_PROBS):
        raise ProtocolError(f"bad flags {flags:#x}")
    if blen > limits.max_frame_bytes - HEADER_SIZE:
        raise ProtocolError(f"body length {blen} exceeds max_frame_bytes")
    return Header(msg_type, flags, rid, epoch, step, blen)


def encode(msg: Message) -> bytes:
    """One frame: header + body. Structure is validated at construction; values are not (use
    `msg.check(limits)` to vet before sending)."""
    body = msg.body()
    flags = FLAG_F32 if msg.f32_flag else 0
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
    ids = {"request_id": hdr.request_id, "epoch": hdr.epoch, "step": hdr.step}
    msg = MESSAGE_TYPES[hdr.msg_type].parse(reader, bool(hdr.flags & FLAG_F32), ids)
    if reader.remaining():
        raise ProtocolError("trailing bytes after body")
    msg.check(limits)
    return msg
