"""Session messages: the handshake, requests and their answers, pings, errors, the end of a
request and the cloud's citations; what every cloud-backed mode sends."""

from __future__ import annotations

import math
import struct
from dataclasses import fields
from enum import IntEnum

import numpy as np

from collab.protocol.codec import (
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    Limits,
    Message,
    MsgType,
    ProtocolError,
    _check_count,
    _check_finite,
    _check_ids,
    _enum,
    _f32,
    _ids,
    _message,
    _Reader,
    _str,
    _uint,
)
from collab.sources import FOUND_BY, Source
from collab.temperature import eta_problem, temperature_problem

# Where the cloud serves sessions: the server routes it, and a device given a bare
# ws://host:port completes its URL with it.
SESSION_PATH = "/v1/session"


class Mode(IntEnum):
    LOCAL = 0
    CLOUD = 1
    DRAGON = 2
    SPLIT = 3
    EXPERIMENTAL = 15  # for a mode added outside Tandem (tests/toy_extensions rides it)


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
    RATE_LIMITED = 10  # this access token's request rate is spent; the message says when


# ---------------------------------------------------------------------------- helpers


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
    `retrieve` asks the cloud to ground its prompt in the public corpus, searched by `search`
    (empty: by the question)."""

    TYPE = MsgType.GENERATE
    question: str
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    history: tuple[str, ...] = ()
    retrieve: bool = True
    # split: RAPID's η, the cloud verifies against p̂ (0 = exact, docs/math.md#rapid)
    eta: float = 0.0
    # what the public corpus is searched by, when not the question itself: a follow-up's
    # standalone search, built on the device from turns this cloud saw (edge_runtime.turns)
    search: str = ""

    _ST = struct.Struct("<IfIfBQBf")
    MAX_HISTORY = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        _uint(self.max_new_tokens, 32, "max_new_tokens")
        _uint(self.top_k, 32, "top_k")
        self._set("temperature", _f32(self.temperature))
        self._set("top_p", _f32(self.top_p))
        problem = temperature_problem(self.temperature)
        if problem:
            raise ProtocolError(problem)
        if not 0 < self.top_p <= 1:
            raise ProtocolError("top_p must be in (0, 1]")
        if self.seed is not None:
            _uint(self.seed, 64, "seed")
        self._set("eta", _f32(self.eta))
        if problem := eta_problem(self.eta):
            raise ProtocolError(problem)
        self._set("history", tuple(self.history))
        self._set("retrieve", bool(self.retrieve))
        if not isinstance(self.search, str):
            raise ProtocolError("search must be a string")
        if len(self.history) % 2 or len(self.history) > self.MAX_HISTORY:
            raise ProtocolError("history must be user/assistant pairs (at most 128)")
        if not all(isinstance(h, str) for h in self.history):
            raise ProtocolError("history entries must be strings")

    def body(self) -> bytes:
        has_seed = self.seed is not None
        head = self._ST.pack(
            self.max_new_tokens,
            self.temperature,
            self.top_k,
            self.top_p,
            has_seed,
            self.seed or 0,
            self.retrieve,
            self.eta,
        )
        turns = struct.pack("<I", len(self.history)) + b"".join(_str(h) for h in self.history)
        return head + _str(self.question) + turns + _str(self.search)

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        max_new, temp, top_k, top_p, has_seed, seed, retrieve, eta = r.unpack(cls._ST)
        if has_seed > 1 or (not has_seed and seed):
            raise ProtocolError("bad seed presence")
        if retrieve > 1:
            raise ProtocolError("bad retrieve byte")
        q = r.string("question")
        n = r.u32()
        _check_count(n, 0, cls.MAX_HISTORY, "history entries")
        history = tuple(r.string("history") for _ in range(n))
        search = r.string("search")
        seed = seed if has_seed else None
        return cls(
            q, max_new, temp, top_k, top_p, seed, history, bool(retrieve), eta, search, **hdr
        )


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
    """A peer's complaint; the session survives a malformed frame (docs/protocol.md#design)."""

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
            self.reason,
            self.tokens,
            self.rounds,
            self.drafted,
            self.accepted,
            self.bytes_up,
            self.bytes_down,
            self.elapsed_s,
        )

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        reason, *rest = r.unpack(cls._ST)
        return cls(_enum(FinishReason, reason, "finish reason"), *rest, **hdr)


@_message
class Citations(Message):
    """The cloud's public sources for a request (public text only: private text never
    travels), numbered in the order given, before the first token. Each carries its title,
    location, relevance, what found it (a byte: `collab.sources.FOUND_BY`) and text (cut by
    the sender, `collab.sources.SOURCE_CHARS`). No sources: nothing public was relevant."""

    TYPE = MsgType.CITATIONS
    sources: tuple[Source, ...] = ()
    MAX_SOURCES = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.sources) > self.MAX_SOURCES:
            raise ProtocolError(f"at most {self.MAX_SOURCES} sources")
        self._set(
            "sources",
            tuple(
                Source(s.title, s.location, _f32(s.score), s.text, found_by=s.found_by)
                for s in self.sources
            ),
        )

    def body(self) -> bytes:
        out = [struct.pack("<I", len(self.sources))]
        for s in self.sources:
            found = FOUND_BY.index(s.found_by) if s.found_by in FOUND_BY else 0
            out += [_str(s.title), _str(s.location), _SCORE.pack(s.score, found), _str(s.text)]
        return b"".join(out)

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        n = r.u32()
        _check_count(n, 0, cls.MAX_SOURCES, "sources")
        sources = []
        for _ in range(n):
            title, location = r.string("title"), r.string("location")
            score, found = r.unpack(_SCORE)
            if found >= len(FOUND_BY):
                raise ProtocolError(f"unknown found-by code {found}")
            text = r.string("text")
            sources.append(Source(title, location, score, text, found_by=FOUND_BY[found]))
        return cls(tuple(sources), **hdr)

    def check_finite(self) -> None:
        for n, s in enumerate(self.sources, 1):
            _check_finite(s.score, f"source {n}'s score")


_F32 = struct.Struct("<f")
_SCORE = struct.Struct("<fB")  # a source's relevance and what found it
