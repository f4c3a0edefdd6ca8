"""DRAGON messages: how a request is set up, each side's draft with its local mixture and side
weight, and the aggregator's target token (docs/math.md#dragon).

The header's epoch on a draft is its *sender's* draft epoch (bumped each time that side's draft
is rejected); on a target it is 0. The step is the answer position the token is for."""

from __future__ import annotations

import math
import struct
from enum import IntEnum

import numpy as np

from collab.protocol.codec import (
    DEFAULT_LIMITS,
    Limits,
    Message,
    MsgType,
    ProtocolError,
    _check_count,
    _check_finite,
    _check_finite_array,
    _check_ids,
    _check_probs,
    _check_unique_rows,
    _enum,
    _f32,
    _ids,
    _message,
    _pdtype,
    _Reader,
    _uint,
)
from collab.protocol.modes import ModeMessages, declare
from collab.protocol.session import Mode


class Side(IntEnum):
    DEVICE = 0
    CLOUD = 1

    @property
    def other(self) -> Side:
        return Side.CLOUD if self is Side.DEVICE else Side.DEVICE

    @property
    def label(self) -> str:
        return self.name.lower()


class AggregatorPolicy(IntEnum):
    """Where Speculative Aggregation runs: pinned to one side, or chosen before every token by
    the greedy scheduler (DRAGON eq. 6–7); or, for the sequence-wise baseline, nowhere."""

    DEVICE = 0
    CLOUD = 1
    AUTO = 2
    # The baseline DRDG/SW (DRAGON §2.2): no token-wise aggregation; each side answers alone
    # from its own mixture, and the device aggregates the two whole answers once.
    SEQUENCE = 3
    # Teacher forcing (perplexity, DRAGON §7.3): no answer; the cloud scores the device's
    # DragonScore tokens under its mixture (max_new_tokens reserves their room).
    SCORE = 4


@_message
class DragonSetup(Message):
    """DRAGON: the device's settings for one request, sent right after its Generate: documents
    per side, aggregator policy and first aggregator, the wire truncation of p^s (top-p with a
    cap), the lookahead bound (0: synchronous DRDG/TW, the baseline), and dynamic re-ranking
    every n tokens (0 = off)."""

    TYPE = MsgType.DRAGON_SETUP
    k: int = 2
    policy: AggregatorPolicy = AggregatorPolicy.AUTO
    first: Side = Side.DEVICE
    top_p: float = 0.8  # collab.dragon.ledger.DRAGON_TOP_P
    max_sparse: int = 32  # collab.dragon.ledger.DRAGON_MAX_SPARSE
    lookahead: int = 4  # collab.dragon.ledger.DRAGON_LOOKAHEAD
    rerank_every: int = 0

    _ST = struct.Struct("<BBBfHBH")

    def __post_init__(self) -> None:
        super().__post_init__()
        _uint(self.k, 8, "k")
        self._set("policy", _enum(AggregatorPolicy, int(self.policy), "aggregator policy"))
        self._set("first", _enum(Side, int(self.first), "side"))
        self._set("top_p", _f32(self.top_p))
        _uint(self.max_sparse, 16, "max_sparse")
        _uint(self.lookahead, 8, "lookahead")
        _uint(self.rerank_every, 16, "rerank_every")
        if not 0 < self.top_p <= 1:
            raise ProtocolError("top_p must be in (0, 1]")

    def body(self) -> bytes:
        return self._ST.pack(
            self.k,
            self.policy,
            self.first,
            self.top_p,
            self.max_sparse,
            self.lookahead,
            self.rerank_every,
        )

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        k, policy, first, top_p, max_sparse, lookahead, rerank = r.unpack(cls._ST)
        policy = _enum(AggregatorPolicy, policy, "aggregator policy")
        first = _enum(Side, first, "side")
        return cls(k, policy, first, top_p, max_sparse, lookahead, rerank, **hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        _check_count(self.k, 0, 16, "documents per side")
        _check_count(self.max_sparse, 1, limits.max_sparse, "sparse size")
        _check_count(self.lookahead, 0, limits.max_draft_tokens, "lookahead")


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
        if not bool(np.any((self.ids == self.token) & (self.probs > 0))):
            raise ProtocolError("draft token outside its transmitted distribution, or at 0")
        if math.isnan(self.h) or self.h == math.inf:
            raise ProtocolError("h must be finite or −inf")
        if not (math.isfinite(self.decode_time) and self.decode_time >= 0):
            raise ProtocolError("decode_time must be finite and ≥ 0")

    def check_finite(self) -> None:
        _check_finite(self.h, "h", minus_inf=True)
        _check_finite(self.decode_time, "decode_time")
        _check_finite_array(self.probs, "probs")


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
class DragonScore(Message):
    """DRAGON, sequence-wise (DRDG/SW) and teacher forcing: answer tokens the other side is to
    score under its own mixture (it replies with a scored `DragonSequence`)."""

    TYPE = MsgType.DRAGON_SCORE
    tokens: np.ndarray

    def __post_init__(self) -> None:
        super().__post_init__()
        self._set("tokens", _ids(self.tokens, "tokens").reshape(-1))

    def body(self) -> bytes:
        return struct.pack("<I", self.tokens.size) + self.tokens.tobytes()

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        n = r.u32()
        _check_count(n, 0, r.limits.max_chunk_tokens, "tokens")
        return cls(r.array("<u4", n), **hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        _check_count(self.tokens.size, 0, limits.max_chunk_tokens, "tokens")
        _check_ids(self.tokens, limits.vocab_size, "tokens")


@_message
class DragonSequence(Message):
    """DRAGON, sequence-wise: a whole answer with the log-probability of each of its tokens
    under the sender's mixture p^s (float32), the sender's side weight h^s and the seconds it
    spent decoding (not prefilling). `scored`: the tokens are the receiver's own answer, sent
    back scored (a reply to `DragonScore`); else they are the sender's answer."""

    TYPE = MsgType.DRAGON_SEQUENCE
    tokens: np.ndarray
    logprobs: np.ndarray
    h: float
    decode_time: float
    scored: bool = False

    _ST = struct.Struct("<dfBI")

    def __post_init__(self) -> None:
        super().__post_init__()
        tokens = _ids(self.tokens, "tokens").reshape(-1)
        logprobs = np.asarray(self.logprobs, dtype="<f4").reshape(-1)
        if tokens.size != logprobs.size:
            raise ProtocolError("tokens and logprobs must have the same length")
        self._set("tokens", tokens)
        self._set("logprobs", logprobs)
        self._set("h", float(self.h))
        self._set("decode_time", _f32(self.decode_time))
        self._set("scored", bool(self.scored))

    def body(self) -> bytes:
        head = self._ST.pack(self.h, self.decode_time, self.scored, self.tokens.size)
        return head + self.tokens.tobytes() + self.logprobs.tobytes()

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        h, dt, scored, n = r.unpack(cls._ST)
        if scored > 1:
            raise ProtocolError("bad scored flag")
        _check_count(n, 0, r.limits.max_chunk_tokens, "tokens")
        tokens = r.array("<u4", n)
        return cls(tokens, r.array("<f4", n), h, dt, bool(scored), **hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        _check_count(self.tokens.size, 0, limits.max_chunk_tokens, "tokens")
        _check_ids(self.tokens, limits.vocab_size, "tokens")
        if self.logprobs.size and not bool(np.all(self.logprobs <= 0)):  # NaN fails too
            raise ProtocolError("logprobs must be ≤ 0 (−inf allowed), not NaN")
        if math.isnan(self.h) or self.h == math.inf:
            raise ProtocolError("h must be finite or −inf")
        if not (math.isfinite(self.decode_time) and self.decode_time >= 0):
            raise ProtocolError("decode_time must be finite and ≥ 0")

    def check_finite(self) -> None:
        _check_finite(self.h, "h", minus_inf=True)
        _check_finite(self.decode_time, "decode_time")
        _check_finite_array(self.logprobs, "logprobs", minus_inf=True)


DRAGON_MESSAGES = declare(
    ModeMessages(
        Mode.DRAGON,
        messages=(DragonSetup, DragonDraft, DragonTarget, DragonScore, DragonSequence),
        to_cloud=(DragonSetup, DragonDraft, DragonTarget, DragonScore),
    )
)
"""DRAGON's messages: setup, both sides' drafts and targets, the scored tokens (perplexity),
the sequence-wise baseline's whole answer."""
