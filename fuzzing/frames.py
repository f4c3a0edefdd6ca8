"""The frame decoder on arbitrary bytes. Whatever comes in, `decode` returns a message or raises
ProtocolError (the one documented exception), within the limits it was given; and a frame it
reads encodes back to bytes that decode to the same frame (encode∘decode is a fixed point)."""

from __future__ import annotations

from typing import Any

import atheris

with atheris.instrument_imports(include=["collab"]):
    from collab import protocol as p

LIMITS = p.Limits(max_frame_bytes=1 << 20)


def seeds() -> list[bytes]:
    """One valid frame of every kind (libFuzzer mutates from these)."""
    import numpy as np

    from collab.sources import Source

    def a(values: Any, dtype: Any = None) -> np.ndarray:
        return np.asarray(values, dtype=dtype)

    h: dict[str, Any] = {"request_id": 3, "epoch": 1, "step": 2}
    rows = np.full((2, 4), 0.25, dtype=np.float16)
    msgs: list[p.Message] = [
        p.Hello(b"\x01" * 32, p.Mode.SPLIT, "tk-slt", model_name="d"),
        p.HelloAck(True, p.DEFAULT_LIMITS, "", "cloud"),
        p.Generate("What is a KV cache?", 16, 0.7, 5, 0.9, 7, ("hi", "hello"), True, 0.5, **h),
        p.TokenChunk(np.asarray([1, 2, 3]), "abc", **h),
        p.DsdDraft(a([1, 2]), rows, **h, more=1),
        p.DssdDraft(a([1, 2]), a([0.5, 0.25], np.float16), **h, ahead=True),
        p.TopKDraft(a([1, 2]), a([[1, 5], [2, 6]]), a([[0.5, 0.5], [0.75, 0.25]]), **h),
        p.Verdict(1, 5, compute_s=0.1, **h),
        p.Verdict(0, p_probs=np.full(8, 0.125, dtype=np.float16), **h),
        p.CloudDecode(4, **h),
        p.DragonSetup(2, p.AggregatorPolicy.AUTO, p.Side.CLOUD, **h),
        p.DragonDraft(1, a([1, 2]), a([0.75, 0.25]), -0.5, 0.01, **h),
        p.DragonTarget(1, True, False, p.Side.DEVICE, **h),
        p.DragonScore(np.asarray([1, 2, 3]), **h),
        p.DragonSequence(np.asarray([1, 2]), np.asarray([-0.1, -0.2]), 0.3, 0.5, **h),
        p.Ping(12345, **h),
        p.Pong(1, 2, 3, **h),
        p.Error(p.ErrorCode.MALFORMED, "bad", **h),
        p.Cancel(**h),
        p.Done(p.FinishReason.STOP, 3, 1, 2, 1, 100, 200, 0.5, **h),
        p.Citations((Source("Title", "Lead", 0.5, "a passage"),), **h),
    ]
    return [p.encode(m) for m in msgs]


def test_one(data: bytes) -> None:
    try:
        msg = p.decode(data, LIMITS)
    except p.ProtocolError:
        return
    again = p.encode(msg)
    assert p.encode(p.decode(again, LIMITS)) == again, (data, again)
