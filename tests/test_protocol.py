"""The wire codec: round trips for every message, and hostile bytes yield only ProtocolError."""

from __future__ import annotations

import random
import struct
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collab import protocol as p

# A small vocabulary keeps dense distributions cheap; the full one is tested explicitly below.
SMALL = p.Limits(vocab_size=1000, max_top_k=64, max_sparse=256, max_text_bytes=4096)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
text = st.text(max_size=40)
f32 = st.booleans()


@st.composite
def header_ids(draw) -> dict[str, int]:
    return {"request_id": draw(u32), "epoch": draw(u32), "step": draw(u32)}


def _rng(draw) -> np.random.Generator:
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


def _probs(rng: np.random.Generator, shape, f32: bool) -> np.ndarray:
    a = rng.random(shape)
    return (a / max(a.sum(axis=-1).max(), 1e-9)).astype(np.float32 if f32 else np.float16)


def _distinct(rng: np.random.Generator, n: int, k: int, vocab: int) -> np.ndarray:
    return np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(n)])


@st.composite
def messages(draw, kind: p.MsgType) -> p.Message:
    hdr = draw(header_ids())
    rng = _rng(draw)
    v = SMALL.vocab_size
    n = draw(st.integers(1, SMALL.max_draft_tokens))
    wide = draw(f32)
    if kind is p.MsgType.HELLO:
        thash = draw(st.binary(min_size=32, max_size=32))
        mode = draw(st.sampled_from(p.Mode))
        return p.Hello(thash, mode, draw(text), draw(text), model_name=draw(text), **hdr)
    if kind is p.MsgType.HELLO_ACK:
        lim = p.Limits(*draw(st.lists(u32, min_size=7, max_size=7)))
        return p.HelloAck(draw(st.booleans()), lim, draw(text), draw(text), **hdr)
    if kind is p.MsgType.GENERATE:
        return p.Generate(
            draw(text),
            draw(u32),
            draw(st.just(0.0) | st.floats(0.0010000000474974513, 10, width=32)),  # 0 = greedy
            draw(u32),
            draw(st.floats(0, 1, exclude_min=True, width=32)),
            draw(st.none() | u64),
            tuple(draw(st.lists(text, max_size=3).map(lambda t: t + t))),
            draw(st.booleans()),
            draw(st.just(0.0) | st.floats(0, 100, width=32)),
            **hdr,
        )
    if kind is p.MsgType.TOKEN_CHUNK:
        ids = rng.integers(0, v, size=draw(st.integers(0, 20)))
        return p.TokenChunk(ids, draw(st.none() | text), **hdr)
    more = draw(st.integers(0, SMALL.max_draft_tokens))
    batch = {"more": more, "ahead": more == 0 and draw(st.booleans())}  # a draft's flags
    if kind is p.MsgType.DSD_DRAFT:
        width = draw(st.integers(1, v))
        return p.DsdDraft(
            rng.integers(0, width, n), _probs(rng, (n, width), wide), wide, **hdr, **batch
        )
    if kind is p.MsgType.DSSD_DRAFT:
        return p.DssdDraft(rng.integers(0, v, n), _probs(rng, n, wide), wide, **hdr, **batch)
    if kind is p.MsgType.TOPK_DRAFT:
        k = draw(st.integers(1, SMALL.max_top_k))
        tids = _distinct(rng, n, k, v)
        drafted = tids[np.arange(n), rng.integers(0, k, n)]
        return p.TopKDraft(drafted, tids, _probs(rng, (n, k), wide), wide, **hdr, **batch)
    if kind is p.MsgType.VERDICT:
        token = draw(st.none() | st.integers(0, v - 1))
        pj = draw(st.sampled_from(["none", "dense", "topk"]))
        accepted = draw(st.integers(0, SMALL.max_draft_tokens))
        if pj == "none":
            compute_s, scored = draw(st.floats(0, 10, width=32)), min(n, accepted)
            return p.Verdict(accepted, token, compute_s=compute_s, scored=scored, **hdr)
        size = draw(st.integers(1, v if pj == "dense" else SMALL.max_top_k))
        ids = None if pj == "dense" else rng.choice(v, size, replace=False)
        return p.Verdict(accepted, token, ids, _probs(rng, size, wide), wide, **hdr)
    if kind is p.MsgType.DRAGON_DRAFT:
        size = draw(st.integers(1, SMALL.max_sparse))
        ids = rng.choice(v, size, replace=False)
        h = draw(st.floats(allow_nan=False, allow_infinity=False) | st.just(-np.inf))
        dt = draw(st.floats(0, 10, width=32))
        return p.DragonDraft(int(ids[0]), ids, _probs(rng, size, wide), h, dt, wide, **hdr)
    if kind is p.MsgType.DRAGON_TARGET:
        b = draw(st.lists(st.booleans(), min_size=2, max_size=2))
        side = draw(st.sampled_from(p.Side))
        return p.DragonTarget(draw(st.integers(0, v - 1)), b[0], b[1], side, **hdr)
    if kind is p.MsgType.DRAGON_SETUP:
        return p.DragonSetup(
            draw(st.integers(0, 16)),
            draw(st.sampled_from(p.AggregatorPolicy)),
            draw(st.sampled_from(p.Side)),
            draw(st.floats(0.0625, 1.0, width=32)),
            draw(st.integers(1, SMALL.max_sparse)),
            draw(st.integers(0, SMALL.max_draft_tokens)),
            draw(st.integers(0, 1000)),
            **hdr,
        )
    if kind is p.MsgType.DRAGON_SCORE:
        return p.DragonScore(rng.integers(0, v, draw(st.integers(0, 40))), **hdr)
    if kind is p.MsgType.DRAGON_SEQUENCE:
        size = draw(st.integers(0, 40))
        logprobs = -rng.exponential(3.0, size)
        if size:
            logprobs[0] = draw(st.sampled_from([0.0, -np.inf, float(logprobs[0])]))
        h = draw(st.floats(allow_nan=False, allow_infinity=False) | st.just(-np.inf))
        dt = draw(st.floats(0, 10, width=32))
        return p.DragonSequence(
            rng.integers(0, v, size), logprobs, h, dt, draw(st.booleans()), **hdr
        )
    if kind is p.MsgType.PING:
        return p.Ping(draw(u64), **hdr)
    if kind is p.MsgType.PONG:
        return p.Pong(draw(u64), draw(u64), draw(u64), **hdr)
    if kind is p.MsgType.ERROR:
        return p.Error(draw(st.integers(0, 2**16 - 1)), draw(text), **hdr)
    if kind is p.MsgType.CANCEL:
        return p.Cancel(**hdr)
    if kind is p.MsgType.CITATIONS:
        score = st.floats(-1, 1, width=32)
        found = st.sampled_from(["", "meaning", "keyword", "both"])
        src = st.builds(p.Source, text, text, score, text, found_by=found)
        return p.Citations(tuple(draw(st.lists(src, max_size=4))), **hdr)
    if kind is p.MsgType.CLOUD_DECODE:
        return p.CloudDecode(draw(u32), **hdr)
    assert kind is p.MsgType.DONE
    counts = draw(st.lists(u32, min_size=4, max_size=4))
    return p.Done(
        draw(st.sampled_from(p.FinishReason)),
        *counts,
        draw(u64),
        draw(u64),
        draw(st.floats(0, 1e9)),
        **hdr,
    )


@pytest.mark.parametrize("kind", list(p.MsgType), ids=lambda k: k.name)
def test_round_trip_every_message_type(kind: p.MsgType) -> None:
    @settings(max_examples=60, deadline=None)
    @given(messages(kind))
    def round_trip(msg: p.Message) -> None:
        assert msg.TYPE is kind
        frame = p.encode(msg)
        out = p.decode(frame, SMALL)
        assert type(out) is type(msg)
        assert out == msg
        assert p.encode(out) == frame  # canonical

    round_trip()


def test_probabilities_keep_their_stated_dtype() -> None:
    q = np.array([0.1, 0.2, 0.3], dtype=np.float64)
    half = p.decode(p.encode(p.DssdDraft([1, 2, 3], q)))
    full = p.decode(p.encode(p.DssdDraft([1, 2, 3], q, f32=True)))
    assert half.q.dtype == np.float16 and full.q.dtype == np.float32
    np.testing.assert_array_equal(half.q, q.astype(np.float16))
    np.testing.assert_array_equal(full.q, q.astype(np.float32))


def test_full_vocabulary_dense_distributions_fit_the_default_frame() -> None:
    rng = np.random.default_rng(0)
    v = p.DEFAULT_LIMITS.vocab_size
    probs = rng.dirichlet(np.ones(v), size=4).astype(np.float16)
    msg = p.DsdDraft(np.array([0, 151_935, 7, 151_645]), probs, step=3)
    frame = p.encode(msg)
    assert len(frame) <= p.DEFAULT_LIMITS.max_frame_bytes
    assert p.decode(frame) == msg
    verdict = p.Verdict(2, None, None, probs[2])
    assert p.decode(p.encode(verdict)) == verdict


def test_dssd_body_is_at_most_six_bytes_per_drafted_token() -> None:
    gamma = 4
    msg = p.DssdDraft([151_935, 3, 151_645, 9], [0.9, 0.5, 0.25, 0.01])
    body = len(p.encode(msg)) - p.HEADER_SIZE
    assert body <= 6 * gamma


# --------------------------------------------------------------------------- rejection


def _frame(mtype: int, body: bytes, *, flags: int = 0, version: int = p.PROTOCOL_VERSION) -> bytes:
    return struct.pack("<2sBBHIIII", p.MAGIC, version, mtype, flags, 1, 0, 0, len(body)) + body


def test_every_message_type_is_registered_by_its_family() -> None:
    assert set(p.MESSAGE_TYPES) == set(p.MsgType)
    assert all(t == cls.TYPE for t, cls in p.MESSAGE_TYPES.items())


def test_peek_reads_the_header_of_a_frame_that_does_not_decode() -> None:
    frame = _frame(p.MsgType.TOKEN_CHUNK, b"\x01", version=9)[:-1]
    with pytest.raises(p.ProtocolError):
        p.decode(frame)
    assert p.peek_version(frame) == 9
    raw = p.peek_header(frame)
    assert raw == p.RawHeader(9, p.MsgType.TOKEN_CHUNK, 0, 1, 0, 0, 1)
    assert p.peek_version(frame[:3]) == 9  # magic and version suffice, whatever the version
    assert p.peek_header(frame[:3]) is None  # too short for a header
    not_ours = b"XX" + frame[2:]
    assert p.peek_version(not_ours) is None and p.peek_header(not_ours) is None
    assert p.peek_version(b"TD") is None


def test_header_announcing_a_huge_body_is_refused_without_allocating() -> None:
    head = struct.pack(
        "<2sBBHIIII", p.MAGIC, p.PROTOCOL_VERSION, p.MsgType.DSD_DRAFT, 0, 1, 0, 0, 2**32 - 1
    )
    with pytest.raises(p.ProtocolError, match="max_frame_bytes"):
        p.decode_header(head)
    tracemalloc.start()
    try:
        with pytest.raises(p.ProtocolError):
            p.decode(head + b"\x00" * 64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_announced_counts_are_checked_before_reading() -> None:
    # A DSD draft claiming 32 × 151,936 float16 values in a 40-byte body: refused as truncated
    # (the bytes are not there) without allocating the announced 9.7 MB.
    body = struct.pack("<II", 32, 151_936) + b"\x00" * 32
    tracemalloc.start()
    try:
        with pytest.raises(p.ProtocolError):
            p.decode(_frame(p.MsgType.DSD_DRAFT, body))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    with pytest.raises(p.ProtocolError, match="draft tokens"):
        p.decode(_frame(p.MsgType.DSD_DRAFT, struct.pack("<II", 2**32 - 1, 1)))
    with pytest.raises(p.ProtocolError, match="top-K"):
        p.decode(_frame(p.MsgType.TOPK_DRAFT, struct.pack("<II", 1, 2**31)))
    with pytest.raises(p.ProtocolError, match="max_text_bytes"):
        p.decode(_frame(p.MsgType.ERROR, struct.pack("<HI", 1, 2**32 - 1)))


def _valid(msg: p.Message) -> bytes:
    return p.encode(msg)


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"", "shorter than header"),
        (b"XX" + _valid(p.Cancel())[2:], "magic"),
        (_frame(p.MsgType.CANCEL, b"", version=99), "version"),
        (_frame(200, b""), "message type"),
        (_frame(p.MsgType.PING, struct.pack("<Q", 1), flags=p.FLAG_F32), "flags"),
        (_frame(p.MsgType.DSSD_DRAFT, b"\x00" * 6, flags=0x8), "flags"),
        (_valid(p.Ping(5)) + b"\x00", "disagrees"),
        (_frame(p.MsgType.PING, struct.pack("<Q", 1) + b"\x00"), "trailing"),
        (_valid(p.Ping(5))[:-1], "disagrees"),
        (_frame(p.MsgType.DSSD_DRAFT, b"\x00" * 7), "whole number"),
        (_frame(p.MsgType.DSSD_DRAFT, b""), "draft tokens"),
        (_frame(p.MsgType.DSSD_DRAFT, struct.pack("<Ie", 151_936, 0.5)), "token id"),
        (_frame(p.MsgType.DSSD_DRAFT, struct.pack("<Ie", 1, float("nan"))), "NaN"),
        (_frame(p.MsgType.DSSD_DRAFT, struct.pack("<Ie", 1, -0.5)), "outside"),
        (_frame(p.MsgType.DSSD_DRAFT, struct.pack("<Ie", 1, 1.5)), "outside"),
        (_frame(p.MsgType.ERROR, struct.pack("<HI", 1, 2) + b"\xff\xfe"), "UTF-8"),
        (_frame(p.MsgType.HELLO, struct.pack("<B32sB", 1, b"h" * 32, 9) + b"\0" * 12), "mode"),
        (_frame(p.MsgType.DONE, struct.pack("<BIIIIQQd", 0, 0, 0, 0, 0, 0, 0, -1.0)), "elapsed"),
        (_frame(p.MsgType.DRAGON_TARGET, struct.pack("<IBB", 5, 4, 0)), "flags"),
        (_frame(p.MsgType.DRAGON_TARGET, struct.pack("<IBB", 5, 0, 2)), "side"),
        (_frame(p.MsgType.VERDICT, struct.pack("<HBIfB", 1, 0, 5, 0, 0)), "kind"),
        (_frame(p.MsgType.VERDICT, struct.pack("<HBIfB", 1, 6, 0, 0, 0)), "kind"),
    ],
)
def test_malformed_frames_are_refused_with_a_reason(frame: bytes, reason: str) -> None:
    with pytest.raises(p.ProtocolError, match=reason) as info:
        p.decode(frame)
    assert reason.lower() in info.value.reason.lower()


def test_drafts_outside_their_transmitted_support_are_refused() -> None:
    tids = np.array([[3, 4, 5]])
    bad = p.TopKDraft([9], tids, [[0.5, 0.25, 0.25]])
    with pytest.raises(p.ProtocolError, match="outside its transmitted top-K"):
        p.decode(p.encode(bad))
    dup = p.TopKDraft([3], [[3, 3, 5]], [[0.5, 0.25, 0.25]])
    with pytest.raises(p.ProtocolError, match="duplicate"):
        p.decode(p.encode(dup))
    dragon = p.DragonDraft(9, [1, 2], [0.5, 0.5], h=0.0, decode_time=0.01)
    with pytest.raises(p.ProtocolError, match="outside its transmitted"):
        p.decode(p.encode(dragon))
    nan_h = p.DragonDraft(1, [1, 2], [0.5, 0.5], h=float("nan"), decode_time=0.01)
    with pytest.raises(p.ProtocolError, match="h must"):
        p.decode(p.encode(nan_h))


NAN, INF = float("nan"), float("inf")


def _nonfinite_messages() -> dict[str, p.Message]:
    """A message per float a frame carries (score, probability, weight, time), holding NaN or
    an infinity the peer could not use; −inf where it means something (h, log-probabilities)
    is allowed and not here."""
    src = p.Source("Ada", "Lead", NAN, "text")
    hot = np.asarray([0.5, NAN], dtype=np.float16)
    return {
        "citation score NaN": p.Citations((src,)),
        "citation score inf": p.Citations((p.Source("Ada", "Lead", -INF, "text"),)),
        "dsd probs": p.DsdDraft([1], hot.reshape(1, 2)),
        "dssd q": p.DssdDraft([1], [INF]),
        "dssd q f32": p.DssdDraft([1], [NAN], f32=True),
        "top-K probs": p.TopKDraft([1], [[1, 2]], [[0.5, INF]], f32=True),
        "verdict P_j": p.Verdict(0, None, None, hot),
        "verdict sparse P_j": p.Verdict(0, None, [3, 4], [NAN, 0.5], f32=True),
        "dragon h NaN": p.DragonDraft(1, [1], [1.0], NAN, 0.01),
        "dragon h +inf": p.DragonDraft(1, [1], [1.0], INF, 0.01),
        "dragon decode_time": p.DragonDraft(1, [1], [1.0], 0.0, INF),
        "dragon probs": p.DragonDraft(1, [1, 2], hot, 0.0, 0.01),
        "sequence h": p.DragonSequence([1], [-0.5], NAN, 0.1),
        "sequence logprob NaN": p.DragonSequence([1, 2], [-0.5, NAN], 0.0, 0.1),
        "sequence logprob +inf": p.DragonSequence([1], [INF], 0.0, 0.1),
        "sequence decode_time": p.DragonSequence([1], [-0.5], 0.0, NAN),
    }


def _unchecked(msg: p.Message) -> bytes:
    """The frame `encode` would write if it did not refuse: what a lying peer sends."""
    body = msg.body()
    head = struct.pack(
        "<2sBBHIIII",
        p.MAGIC,
        p.PROTOCOL_VERSION,
        msg.TYPE,
        msg.header_flags(),
        msg.request_id,
        msg.epoch,
        msg.step,
        len(body),
    )
    return head + body


@pytest.mark.parametrize("case", list(_nonfinite_messages()))
def test_non_finite_numbers_are_refused_by_encode_and_by_decode(case: str) -> None:
    msg = _nonfinite_messages()[case]
    with pytest.raises(p.ProtocolError, match=r"finite|NaN") as sent:
        p.encode(msg)
    with pytest.raises(p.ProtocolError, match=r"finite|NaN") as read:
        p.decode(_unchecked(msg))
    assert sent.value.reason == read.value.reason  # the same words, safe for an Error frame


def test_minus_infinity_stays_allowed_where_it_means_something() -> None:
    """h = −inf: the side retrieved nothing; a log-probability of −inf: probability 0."""
    for msg in (
        p.DragonDraft(1, [1], [1.0], -INF, 0.01),
        p.DragonSequence([1, 2], [-INF, -0.5], -INF, 0.1),
    ):
        assert p.decode(p.encode(msg)) == msg


def test_construction_rejects_bad_structure() -> None:
    with pytest.raises(p.ProtocolError):
        p.DssdDraft([1, 2], [0.5])
    with pytest.raises(p.ProtocolError):
        p.DsdDraft([1], np.ones(4))
    with pytest.raises(p.ProtocolError):
        p.Hello(b"short", p.Mode.SPLIT)
    with pytest.raises(p.ProtocolError):
        p.Ping(-1)
    with pytest.raises(p.ProtocolError):
        p.Cancel(request_id=2**32)
    with pytest.raises(p.ProtocolError):
        p.TokenChunk([-1])
    with pytest.raises(p.ProtocolError):
        p.Verdict(1, f32=True)
    assert issubclass(p.ProtocolError, ValueError)


# --------------------------------------------------------------------------- fuzzing


def _corpus(rng: np.random.Generator) -> list[bytes]:
    thash = bytes(range(32))
    v = SMALL.vocab_size
    probs = rng.dirichlet(np.ones(v), size=2).astype(np.float16)
    tids = _distinct(rng, 3, 8, v)
    sparse = rng.choice(v, 40, replace=False)
    msgs: list[p.Message] = [
        p.Hello(thash, p.Mode.SPLIT, "tkslt", "secret-token", request_id=1),
        p.HelloAck(True, SMALL, "welcome"),
        p.Generate("What is DRAGON?", 128, 0.7, 20, 0.9, seed=42),
        p.Generate("And then?", 64, history=("Hi", "Hello!"), retrieve=False),
        p.Generate("Split, RAPID", 32, retrieve=False, eta=0.5),
        p.Citations((p.Source("Ada Lovelace", "Wikipedia", 0.71, "Ada was…"),)),
        p.Citations((p.Source("Ada", "Wikipedia", 0.5, "x", found_by="keyword"),)),
        p.Citations(()),
        p.CloudDecode(16, request_id=3, step=12),
        p.Verdict(4, 99, compute_s=0.061),
        p.TokenChunk([1, 2, 3], "héllo"),
        p.TokenChunk([7]),
        p.DsdDraft([1, 2], probs, epoch=2, step=5),
        p.DssdDraft([5, 6, 7, 8], [0.5, 0.25, 0.125, 1.0]),
        p.DssdDraft([5, 6], [0.5, 0.25], f32=True),
        p.DssdDraft([5], [0.5], more=3, step=7),
        p.DssdDraft([5, 6], [0.5, 0.25], ahead=True, f32=True),
        p.TopKDraft(tids[:, 0], tids, _probs(rng, (3, 8), False)),
        p.TopKDraft(tids[:, 1], tids, _probs(rng, (3, 8), True), f32=True),
        p.Verdict(2, 17),
        p.Verdict(3, None, compute_s=0.2, scored=1),
        p.Verdict(1, None, None, probs[0]),
        p.Verdict(3, None, sparse[:8], _probs(rng, 8, True), f32=True),
        p.DragonDraft(int(sparse[3]), sparse, _probs(rng, 40, False), -1.5, 0.02),
        p.DragonTarget(99, True, False, p.Side.CLOUD),
        p.Ping(123456789),
        p.Pong(1, 2, 3),
        p.Error(p.ErrorCode.MALFORMED, "bad frame"),
        p.Cancel(request_id=9),
        p.Done(p.FinishReason.STOP, 10, 3, 12, 9, 400, 200, 1.25),
    ]
    return [p.encode(m) for m in msgs]


def _mutate(frame: bytes, corpus: list[bytes], r: random.Random) -> bytes:
    op = r.randrange(8)
    b = bytearray(frame)
    if op == 0:  # bit flips
        for _ in range(r.randint(1, 8)):
            i = r.randrange(len(b))
            b[i] ^= 1 << r.randrange(8)
        return bytes(b)
    if op == 1:  # bit flips confined to the body, length kept consistent
        if len(b) > p.HEADER_SIZE:
            for _ in range(r.randint(1, 4)):
                i = r.randrange(p.HEADER_SIZE, len(b))
                b[i] ^= 1 << r.randrange(8)
        return bytes(b)
    if op == 2:  # truncation
        return bytes(b[: r.randrange(len(b))])
    if op == 3:  # splice two frames
        other = r.choice(corpus)
        return bytes(b[: r.randrange(len(b) + 1)] + other[r.randrange(len(other) + 1) :])
    if op == 4:  # random bytes
        return r.randbytes(r.randrange(64))
    if op == 5:  # valid header, random body of the announced length
        body = r.randbytes(r.choice([0, 1, 4, 6, 8, 12, 24, r.randrange(200)]))
        mtype = r.randrange(1, len(p.MsgType) + 2)
        return _frame(mtype, body, flags=r.choice([0, 0, p.FLAG_F32]))
    if op == 6:  # overwrite one header field with a random value
        field = r.choice([(4, "<H"), (6, "<I"), (10, "<I"), (14, "<I"), (18, "<I"), (3, "<B")])
        size = struct.calcsize(field[1])
        struct.pack_into(field[1], b, field[0], r.randrange(2 ** (8 * size)))
        return bytes(b)
    # op 7: random bytes appended, header length patched to match
    b += r.randbytes(r.randrange(1, 16))
    struct.pack_into("<I", b, 18, len(b) - p.HEADER_SIZE)
    return bytes(b)


@pytest.mark.timeout(60)
def test_random_and_mutated_frames_decode_or_raise_protocol_error() -> None:
    r = random.Random(1234)
    corpus = _corpus(np.random.default_rng(1234))
    for frame in corpus:  # the corpus itself is valid
        assert p.encode(p.decode(frame, SMALL)) == frame
    start = time.perf_counter()
    decoded = refused = 0
    for i in range(10_000):
        frame = _mutate(r.choice(corpus), corpus, r)
        limits = SMALL if i % 2 else p.DEFAULT_LIMITS
        try:
            msg = p.decode(frame, limits)
        except p.ProtocolError as e:
            assert e.reason
            refused += 1
        else:
            assert isinstance(msg, p.Message)
            assert p.encode(msg) == frame  # whatever decodes is canonical
            decoded += 1
    assert refused > 1000 and decoded > 100, (refused, decoded)
    assert time.perf_counter() - start < 20


def test_non_bytes_input_is_a_protocol_error() -> None:
    with pytest.raises(p.ProtocolError):
        p.decode(np.zeros((3, 30), dtype=np.uint8)[:, ::2])  # non-contiguous buffer
    with pytest.raises(p.ProtocolError):
        p.decode(12345)  # type: ignore[arg-type]


def test_draft_frames_carry_the_pipeline_flags_and_refuse_unknown_bits():
    """A draft frame's header flags say how many drafts of its batch are still to come (bits
    8-15) and whether the device drafts on past it (bit 1): the cloud's fast verification and
    the bonus token depend on them. Other bits, `ahead` with drafts still to come, or these
    bits on a frame that is not a draft are malformed frames, not silently ignored wishes."""
    part = p.TopKDraft([4], [[4, 9]], np.array([[0.75, 0.25]]), more=2, request_id=1, step=3)
    last = p.DssdDraft([5, 6], [0.5, 0.25], ahead=True, request_id=1, step=4)
    for frame, flags in ((part, 2 << 8), (last, p.FLAG_AHEAD)):
        raw = p.encode(frame)
        assert p.peek_header(raw).flags == flags
        assert p.decode(raw) == frame
    with pytest.raises(p.ProtocolError, match="last part"):
        p.DssdDraft([5], [0.5], more=1, ahead=True)
    bad = (
        (p.MsgType.DSSD_DRAFT, last.body(), p.FLAG_AHEAD | 1 << 8),  # ahead, and more to come
        (p.MsgType.DSSD_DRAFT, last.body(), 0x0004),  # a bit nobody defined
        (p.MsgType.VERDICT, p.Verdict(1, 2).body(), p.FLAG_AHEAD),  # not a draft
        (p.MsgType.DSSD_DRAFT, last.body(), 33 << 8),  # more than a batch can hold
    )
    for mtype, body, flags in bad:
        with pytest.raises(p.ProtocolError):
            p.decode(_frame(mtype, body, flags=flags))


def test_generate_refuses_an_unknown_retrieve_byte():
    gen = p.Generate("q", 8, retrieve=False, request_id=1)
    body = bytearray(gen.body())
    retrieve = p.Generate._ST.size - 5  # the byte before η (float32)
    assert body[retrieve] == 0
    body[retrieve] = 2
    with pytest.raises(p.ProtocolError, match="retrieve"):
        p.decode(_frame(p.MsgType.GENERATE, bytes(body)))


def test_a_citation_with_an_unknown_found_by_code_is_refused() -> None:
    frame = bytearray(p.encode(p.Citations((p.Source("Ada", "W", 0.5, "x", found_by="both"),))))
    code_at = frame.rindex(struct.pack("<fB", np.float32(0.5), 3)) + 4
    frame[code_at] = 9
    with pytest.raises(p.ProtocolError, match="found-by"):
        p.decode(bytes(frame))
