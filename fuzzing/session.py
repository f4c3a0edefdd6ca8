"""The cloud's session handling on arbitrary frame sequences: a real server (tiny model, its
own thread) gets, per input, a fresh session in the mode the input's first byte picks and then
the input's frames. The session must answer a Ping after them (no crash, no hang; only an
oversized frame may close it, with 1009), send only frames a device can read, never report
an internal error or log one; a bystander session must answer too.

An input is: one byte (the mode), then frames as [u16 big-endian length | bytes]; a length
with its top bit set sends the bytes as a text frame."""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
from pathlib import Path
from typing import Any

import aiohttp
import atheris

with atheris.instrument_imports(include=["cloud_backend", "collab"]):
    from benchmarks.wire import Link, ServerThread
    from collab import protocol as p
    from collab.variants import variant_names

MODES = [("cloud", ""), *(("split", v) for v in variant_names()), ("dragon", "")]
LIMITS = p.Limits(max_frame_bytes=64 * 1024)
MAX_FRAMES = 16
METRICS_TOKEN = "fuzz-metrics-token"  # /healthz names the open sessions to its holder


def frames_of(data: bytes) -> tuple[tuple[str, str], list[tuple[bytes, bool]]]:
    mode = MODES[data[0] % len(MODES)] if data else MODES[0]
    out: list[tuple[bytes, bool]] = []
    at = 1
    while at + 2 <= len(data) and len(out) < MAX_FRAMES:
        (n,) = struct.unpack_from(">H", data, at)
        text, n = bool(n & 0x8000), n & 0x7FFF
        out.append((data[at + 2 : at + 2 + n], text))
        at += 2 + n
    return mode, out


def pack(mode: int, frames: list[p.Message]) -> bytes:
    out = bytes([mode])
    for msg in frames:
        frame = p.encode(msg)
        out += struct.pack(">H", len(frame)) + frame
    return out


def seeds() -> list[bytes]:
    """A valid opening of a request in every mode, with a draft and a Cancel."""
    import numpy as np

    def a(values: Any, dtype: Any = None) -> np.ndarray:
        return np.asarray(values, dtype=dtype)

    gen = p.Generate("Hi there", max_new_tokens=4, seed=1, request_id=1)
    cancel = p.Cancel(request_id=1)
    h: dict[str, Any] = {"request_id": 1, "step": 1}
    drafts: dict[str, p.Message] = {
        "tk-slt": p.TopKDraft(a([11, 12]), a([[11], [12]]), a([[1.0], [1.0]]), **h),
        "dssd": p.DssdDraft(a([11, 12]), a([0.5, 0.5], np.float16), **h),
        "dsd": p.DsdDraft(a([1, 2]), np.full((2, 4), 0.25, dtype=np.float16), **h),
    }
    drafts["dssd-topk"] = drafts["dssd"]
    out = []
    for i, (mode, variant) in enumerate(MODES):
        if mode == "dragon":
            setup = p.DragonSetup(1, p.AggregatorPolicy.CLOUD, request_id=1)
            draft = p.DragonDraft(11, a([11]), a([1.0]), 0.0, 0.01, request_id=1)
            out.append(pack(i, [gen, setup, draft, cancel]))
        elif mode == "split":
            out.append(pack(i, [gen, drafts[variant], p.CloudDecode(2, **h), cancel]))
        else:
            out.append(pack(i, [gen, cancel, p.Generate("Again", 2, request_id=2)]))
    return out


class Harness:
    """The server, the bystander and the client's loop, alive across inputs."""

    def __init__(self, cache: Path) -> None:
        from benchmarks.tiny_models import build_all, builder_version
        from cloud_backend.engine import LLMEngine
        from model_runtime.tokenizer import load_tokenizer
        from model_runtime.torch_runtime import TorchCausalLM

        logging.getLogger("tandem").setLevel(logging.WARNING)  # a line per session is noise here
        tiny = build_all(cache / f"tiny-qwen2-{builder_version()}")
        engine = LLMEngine(TorchCausalLM(tiny["hf"]), load_tokenizer(tiny["hf"]), "tiny-cloud")
        self.server = ServerThread(engine, LIMITS, metrics_token=METRICS_TOKEN)
        self.loop = asyncio.new_event_loop()
        self.bystander = Link(self.loop, self.server)
        assert self.bystander.open("cloud", "").accepted
        self.pings = itertools.count(1)

    async def _session_ends(self, within: float = 10.0) -> None:
        """The input's session is gone from the server soon after its socket closed (a
        teardown that hangs would hold a slot, and capacity, for ever)."""
        health = self.server.url.replace("ws://", "http://").replace("/v1/session", "/healthz")
        deadline = self.loop.time() + within
        headers = {"Authorization": f"Bearer {METRICS_TOKEN}"}  # the session count with it
        async with aiohttp.ClientSession(headers=headers) as http:
            while True:
                async with http.get(health) as resp:
                    sessions = (await resp.json())["sessions"]
                if sessions <= 1:  # the bystander
                    return
                assert self.loop.time() < deadline, f"{sessions - 1} session(s) never ended"
                await asyncio.sleep(0.005)

    def test_one(self, data: bytes) -> None:
        mode, frames = frames_of(data)
        link = Link(self.loop, self.server, drain_s=0.001)  # (0 would mean no timeout)
        try:
            assert link.open(*mode).accepted
            seen: list[p.Message] = []
            for frame, text in frames:
                seen += link.send(frame, text=text)
                if link.closed_with is not None:
                    break
            if link.closed_with is None:
                seen += link.ping(next(self.pings))
            else:
                assert link.closed_with == 1009, link.closed_with
            internal = [
                m for m in seen if isinstance(m, p.Error) and m.code == p.ErrorCode.INTERNAL
            ]
            assert not internal, internal
        finally:
            link.close()
        self.loop.run_until_complete(self._session_ends())
        self.bystander.ping(next(self.pings))
        assert not self.server.errors, [r.getMessage() for r in self.server.errors]
