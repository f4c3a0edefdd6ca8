"""A real cloud session driven by Hypothesis (issue 16): random sequences of valid, invalid,
out-of-order, stale-epoch, wrong-request-id, truncated, wrong-direction and oversized frames,
in every mode. After every step: the session still answers a Ping (no crash, no hang), every
frame it sent is a typed frame this device can read, it never reports an internal error or
logs one, and a bystander session on the same server is unaffected.

The server runs on its own thread (benchmarks/wire.py); Hypothesis drives the client synchronously,
one rule at a time."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import aiohttp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from benchmarks.wire import Link, ServerThread
from collab import protocol as p
from collab.variants import variant_names
from tests import test_server
from tests.test_protocol import messages

engine = test_server.engine  # the tiny float32 cloud model, shared by the module
MAX_FRAME = 256 * 1024  # small, so that an oversized frame is cheap to send
LIMITS = p.Limits(max_frame_bytes=MAX_FRAME)
# examples per mode: 10 in the suite; a deeper hunt with TANDEM_STATEFUL_EXAMPLES=500
EXAMPLES = int(os.environ.get("TANDEM_STATEFUL_EXAMPLES", "10"))
# every kind of frame the Hypothesis codec strategy builds, in both directions
KINDS = [k for k in p.MsgType if k is not p.MsgType.HELLO]
MODES = [("cloud", ""), *(("split", v) for v in variant_names()), ("dragon", "")]


@pytest.fixture(scope="module")
def server(engine) -> Iterator[ServerThread]:
    srv = ServerThread(engine, LIMITS)
    yield srv
    srv.stop()


ids = st.integers(0, 151_935)
small = st.integers(0, 6)


class SessionMachine(RuleBasedStateMachine):
    """One device session doing what it likes; a bystander session doing nothing wrong."""

    server: ServerThread
    loop: asyncio.AbstractEventLoop
    bystander: Link
    mode: tuple[str, str]

    def __init__(self) -> None:
        super().__init__()
        self.link = Link(self.loop, self.server)
        self.rid = 0  # the newest Generate's request id
        self.step = self.epoch = 0  # the newest step and epoch the cloud has stated
        self.pings = 0
        self.seen: list[p.Message] = []

    @initialize()
    def open(self) -> None:
        ack = self.link.open(*self.mode)
        assert ack.accepted, ack.reason

    # ---- what the device sends -------------------------------------------------------------
    def _sent(self, frames: list[p.Message]) -> None:
        for msg in frames:
            if msg.request_id == self.rid and not isinstance(msg, p.Error | p.Pong):
                self.step, self.epoch = msg.step, msg.epoch
        self.seen += frames
        if self.link.closed_with == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
            self._reconnect()  # a frame past the transport's limit (a wide dense draft too)

    def _send(self, msg: p.Message) -> None:
        self._sent(self.link.send(p.encode(msg)))

    def _reconnect(self) -> None:
        self.link.close()
        self.link = Link(self.loop, self.server)
        self.open()
        self.rid = self.step = self.epoch = 0

    def _rid(self, data: st.DataObject) -> int:
        """Mostly the running request's id; sometimes an old one or one never started."""
        rid = self.rid
        return data.draw(st.sampled_from([rid, rid, rid, max(0, rid - 1), rid + 1, 0]))

    def _header(self, data: st.DataObject) -> dict[str, int]:
        """Where the cloud is now, or somewhere stale or ahead of it."""
        epoch = data.draw(st.sampled_from([self.epoch, self.epoch, self.epoch + 1, 0]))
        step = data.draw(st.sampled_from([self.step, self.step + 1, self.step]) | small)
        return {"request_id": self._rid(data), "epoch": max(0, epoch), "step": max(0, step)}

    @rule(
        n=st.integers(0, 5),
        temperature=st.sampled_from([0.0, 0.8]),
        retrieve=st.booleans(),
        reuse=st.booleans(),
    )
    def generate(self, n: int, temperature: float, retrieve: bool, reuse: bool) -> None:
        if not reuse:
            self.rid += 1
            self.step = self.epoch = 0
        rid = max(self.rid, 1)
        self._send(
            p.Generate(
                "Hi there",
                max_new_tokens=n,
                temperature=temperature,
                retrieve=retrieve,
                seed=7,
                request_id=rid,
            )
        )
        self.rid = rid
        if self.mode[0] == "dragon":
            self._send(p.DragonSetup(1, p.AggregatorPolicy.CLOUD, lookahead=2, request_id=rid))

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        self._send(p.Cancel(request_id=self._rid(data)))

    @rule(data=st.data(), n=st.integers(1, 3), more=st.integers(0, 3), ahead=st.booleans())
    def draft(self, data: st.DataObject, n: int, more: int, ahead: bool) -> None:
        """The mode's own draft frame with tokens it may or may not have sampled."""
        hdr = self._header(data)
        tokens = data.draw(st.lists(ids, min_size=n, max_size=n))
        flags = {"more": more, "ahead": ahead and more == 0}
        variant = self.mode[1] or "tk-slt"
        if variant == "tk-slt" or self.mode[0] != "split":
            msg: p.Message = p.TopKDraft(tokens, [[t] for t in tokens], [[1.0]] * n, **hdr, **flags)
        elif variant == "dsd":
            width = max(tokens) + 1
            rows = np.zeros((n, width), dtype=np.float16)
            rows[np.arange(n), tokens] = 1.0
            msg = p.DsdDraft(tokens, rows, **hdr, **flags)
        else:
            msg = p.DssdDraft(tokens, np.ones(n, dtype=np.float16), **hdr, **flags)
        self._send(msg)

    @rule(data=st.data(), token=ids, accepted=st.booleans())
    def dragon(self, data: st.DataObject, token: int, accepted: bool) -> None:
        hdr = self._header(data)
        if data.draw(st.booleans()):
            self._send(p.DragonDraft(token, [token], [1.0], 0.0, 0.01, **hdr))
        else:
            self._send(p.DragonTarget(token, accepted, True, p.Side.CLOUD, **hdr))

    @rule(data=st.data(), n=st.integers(0, 4))
    def cloud_decode_or_correction(self, data: st.DataObject, n: int) -> None:
        hdr = self._header(data)
        if data.draw(st.booleans()):
            self._send(p.CloudDecode(n, **hdr))
        else:
            self._send(p.TokenChunk(np.asarray(data.draw(st.lists(ids, max_size=2))), **hdr))

    @rule(data=st.data(), kind=st.sampled_from(KINDS))
    def any_frame(self, data: st.DataObject, kind: p.MsgType) -> None:
        """A frame of any kind with random fields: wrong direction, wrong ids, wrong mode."""
        self._send(data.draw(messages(kind)))

    @rule(junk=st.binary(max_size=64))
    def garbage(self, junk: bytes) -> None:
        self._sent(self.link.send(junk))

    @rule(data=st.data(), kind=st.sampled_from(KINDS))
    def truncated(self, data: st.DataObject, kind: p.MsgType) -> None:
        frame = p.encode(data.draw(messages(kind)))
        cut = data.draw(st.integers(0, len(frame) - 1))
        self._sent(self.link.send(frame[:cut]))

    @rule(junk=st.binary(max_size=16))
    def text_frame(self, junk: bytes) -> None:
        self._sent(self.link.send(junk, text=True))

    @rule()
    def hello_again(self) -> None:
        self._send(p.Hello(self.server.tokenizer_hash, p.Mode.CLOUD))

    @rule()
    def oversized(self) -> None:
        """Past the transport's limit: the cloud closes with 1009; the device reconnects."""
        frames = self.link.send(p.encode(p.Ping(1)) + bytes(MAX_FRAME))
        assert self.link.closed_with == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
        self._sent(frames)

    # ---- what must hold after every step ---------------------------------------------------
    @invariant()
    def the_session_answers_and_nothing_failed_inside(self) -> None:
        self.pings += 1
        self._sent(self.link.ping(self.pings))
        internal = [
            m for m in self.seen if isinstance(m, p.Error) and m.code == p.ErrorCode.INTERNAL
        ]
        assert not internal, internal
        assert all(not isinstance(m, p.Error) or m.code in set(p.ErrorCode) for m in self.seen), (
            self.seen
        )
        assert not self.server.errors, [r.getMessage() for r in self.server.errors]

    def teardown(self) -> None:
        self.bystander.ping(10_000 + self.pings)  # the other session never noticed
        self.link.close()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(filter(None, m)))
def test_random_frame_sequences_never_break_a_session(server, mode):
    loop = asyncio.new_event_loop()
    bystander = Link(loop, server)
    try:
        assert bystander.open("cloud", "").accepted
        machine = type(
            "Machine",
            (SessionMachine,),
            {"server": server, "loop": loop, "bystander": bystander, "mode": mode},
        )
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=15,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        bystander.close()
        loop.close()
