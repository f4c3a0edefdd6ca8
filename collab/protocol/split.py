"""Split-speculation messages: the device's drafts (DSD, DSSD, TK-SLT), the cloud's Verdict,
and CloudDecode, AS²'s fallback to the cloud decoding alone (docs/math.md#math)."""

from __future__ import annotations

import math
import struct
from dataclasses import KW_ONLY
from typing import Any

import numpy as np

from collab.protocol.codec import (
    DEFAULT_LIMITS,
    FLAG_F32,
    Limits,
    Message,
    MsgType,
    ProtocolError,
    _check_count,
    _check_finite_array,
    _check_ids,
    _check_probs,
    _check_unique_rows,
    _f32,
    _ids,
    _message,
    _pdtype,
    _Reader,
    _uint,
)
from collab.protocol.modes import ModeMessages, declare
from collab.protocol.session import Mode

FLAG_AHEAD = 0x0002  # a draft frame's batch is followed by drafts made from its tail
MORE_SHIFT = 8  # flag bits 8-15: drafts of the frame's batch still to come


@_message
class Draft(Message):
    """Base of the split-speculation uplinks: drafted token ids plus what the cloud needs of Q.

    A batch may come in parts (PicoSpec's pipeline streams each draft as it is made,
    docs/math.md#picospec): `more` > 0 says how many drafts of this batch the device still means to
    send, so the
    cloud may verify what it holds first; 0 ends the batch. `ahead` (on a batch's last part)
    says the device drafts on from the batch's tail: accepted whole, it gets no bonus token and
    the next batch's first draft is verified at that position. Both travel in header flags."""

    HAS_PROBS = True
    token_ids: np.ndarray
    _: KW_ONLY
    more: int = 0
    ahead: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _uint(self.more, 8, "more")
        self._set("ahead", bool(self.ahead))
        if self.ahead and self.more:
            raise ProtocolError("ahead is said on a batch's last part only")

    @classmethod
    def allowed_flags(cls) -> int:
        return FLAG_F32 | FLAG_AHEAD | 0xFF << MORE_SHIFT

    def header_flags(self) -> int:
        return super().header_flags() | FLAG_AHEAD * self.ahead | self.more << MORE_SHIFT

    @classmethod
    def flag_fields(cls, flags: int) -> dict[str, Any]:
        return {"more": flags >> MORE_SHIFT, "ahead": bool(flags & FLAG_AHEAD)}

    def _norm_ids(self) -> None:
        self._set("token_ids", _ids(self.token_ids, "token_ids").reshape(-1))

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        _check_count(self.token_ids.size, 1, limits.max_draft_tokens, "draft tokens")
        _check_count(self.more, 0, limits.max_draft_tokens, "drafts still to come")
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
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, Any]) -> Message:
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

    def check_finite(self) -> None:
        _check_finite_array(self.probs, "probs")


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
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, Any]) -> Message:
        per = 8 if f32 else 6
        n, rest = divmod(r.remaining(), per)
        if rest:
            raise ProtocolError("DSSD body length is not a whole number of tokens")
        _check_count(n, 1, r.limits.max_draft_tokens, "draft tokens")
        return cls(r.array("<u4", n), r.array(_pdtype(f32), n), f32, **hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        super().check(limits)
        _check_probs(self.q, "q")

    def check_finite(self) -> None:
        _check_finite_array(self.q, "q")


@_message
class TopKDraft(Draft):
    """TK-SLT: ids plus, per position, the top-K (id, prob) pairs the draft was sampled from.

    Each drafted id must be inside its own row with a probability above 0: a draft outside the
    transmitted support would get q = 0 and be wrongly accepted
    (docs/math.md#speculative-verification)."""

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
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, Any]) -> Message:
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
        listed = (self.topk_ids == self.token_ids[:, None]) & (self.topk_probs > 0)
        if not bool(np.all(np.any(listed, axis=1))):
            raise ProtocolError("a drafted token is outside its transmitted top-K, or listed at 0")

    def check_finite(self) -> None:
        _check_finite_array(self.topk_probs, "topk_probs")


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
    scored: int = 0  # drafts the pass that took compute_s scored (0: the whole batch)

    _ST = struct.Struct("<HBIfB")

    def __post_init__(self) -> None:
        super().__post_init__()
        _uint(self.accepted, 16, "accepted")
        _uint(self.scored, 8, "scored")
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
        out = self._ST.pack(self.accepted, kind, self.token or 0, self.compute_s, self.scored)
        if self.p_probs is not None:
            out += struct.pack("<I", self.p_probs.size)
            if self.p_ids is not None:
                out += self.p_ids.tobytes()
            out += self.p_probs.tobytes()
        return out

    @classmethod
    def parse(cls, r: _Reader, f32: bool, hdr: dict[str, int]) -> Message:
        accepted, kind, token, compute_s, scored = r.unpack(cls._ST)
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
        return cls(accepted, token, ids, probs, f32, compute_s, scored, **hdr)

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        _check_count(self.accepted, 0, limits.max_draft_tokens, "accepted")
        _check_count(self.scored, 0, limits.max_draft_tokens, "scored")
        if self.token is not None and self.token >= limits.vocab_size:
            raise ProtocolError("token ≥ vocab")
        if self.p_probs is not None:
            hi = limits.vocab_size if self.p_ids is None else limits.max_top_k
            _check_count(self.p_probs.size, 1, hi, "P_j size")
            _check_probs(self.p_probs, "p_probs")
        if self.p_ids is not None:
            _check_ids(self.p_ids, limits.vocab_size, "p_ids")
            _check_unique_rows(self.p_ids, "p_ids")

    def check_finite(self) -> None:  # compute_s: at construction
        if self.p_probs is not None:
            _check_finite_array(self.p_probs, "p_probs")


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


SPLIT_MESSAGES = declare(
    ModeMessages(
        Mode.SPLIT,
        messages=(DsdDraft, DssdDraft, TopKDraft, Verdict, CloudDecode),
        to_cloud=(DsdDraft, DssdDraft, TopKDraft, CloudDecode),
    )
)
"""split's messages: the device's drafts and its AS² hand-over; the cloud's verdicts."""
