"""What left this device, per answer (issue 44, item 4): the ledger written where frames are sent
(`edge_runtime.sent`) against what crossed the socket.

Every mode answers two questions (the second with the first as a turn the cloud saw) over a
real aiohttp cloud on loopback with tiny models, through a TCP relay that keeps every byte the
device sends: the websocket's binary payloads are read back from those bytes (RFC 6455, the
relay knows nothing of Tandem) and decoded with the protocol's own codec. Each answer's
ledger must add up to exactly the bytes of the binary frames its answer sent, name the same
frames, and hold exactly the texts those frames carried."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import fields, replace
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestServer

from benchmarks.auto import counting_sockets
from cloud_backend.config import ServerConfig
from cloud_backend.server import create_app
from collab.protocol import (
    HEADER_SIZE,
    MESSAGE_TYPES,
    AggregatorPolicy,
    Cancel,
    CloudDecode,
    DragonDraft,
    DragonScore,
    DragonSequence,
    DragonSetup,
    DragonTarget,
    DsdDraft,
    DssdDraft,
    Error,
    Generate,
    Hello,
    Message,
    Mode,
    Ping,
    Pong,
    Side,
    TokenChunk,
    TopKDraft,
    decode,
    encode,
    message,
)
from collab.protocol.modes import SESSION_TO_CLOUD, declared
from edge_runtime.events import Stats, TextDelta
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext, Turn
from edge_runtime.sent import CLASSIFY, CLOUD_ONLY, SentLedger, parts
from edge_runtime.sent_kinds import (
    CONTROL,
    HISTORY,
    NOT_RECORDED,
    NOTHING_SENT,
    PROBABILITIES,
    QUESTION,
    TOKEN_IDS,
    UNCLASSIFIED,
    WEIGHTS,
    row_line,
    summary,
    totals,
)
from tests.test_modes import WireTap

TOKEN = "test-token-0123456789"
HASH = bytes(range(32))

# ---------------------------------------------------------------------------- classification


def samples(n: int) -> dict[type[Message], Message]:
    """One message of each type the ledger classifies, with `n` items of data (`n` ≥ 1)."""
    ids = np.arange(n, dtype=np.uint32)
    probs = np.full(n, 0.5, dtype=np.float16)
    text = "ü" * n
    return {
        Hello: Hello(HASH, Mode.SPLIT, "tk-slt", model_name="tiny-device"),
        Ping: Ping(123),
        Pong: Pong(1, 2, 3),
        Cancel: Cancel(request_id=4),
        Error: Error(1, "bad frame"),
        CloudDecode: CloudDecode(5),
        DragonSetup: DragonSetup(2, AggregatorPolicy.AUTO, Side.DEVICE),
        Generate: Generate("q" + text, history=(text, "a" * n), request_id=1),
        TokenChunk: TokenChunk(ids, text),
        DsdDraft: DsdDraft(ids, np.full((n, 64), 1 / 64, dtype=np.float16)),
        DssdDraft: DssdDraft(ids, probs),
        TopKDraft: TopKDraft(
            ids, np.stack([ids, ids + 1000], axis=1), np.stack([probs, probs], axis=1)
        ),
        DragonDraft: DragonDraft(0, ids, probs, -1.5, 0.01),
        DragonTarget: DragonTarget(7, True, False, Side.CLOUD),
        DragonScore: DragonScore(ids),
        DragonSequence: DragonSequence(ids, np.full(n, -0.5, dtype=np.float32), 0.3, 0.2),
    }


def test_every_message_type_a_device_may_send_is_classified() -> None:
    """A message type added to the protocol fails here until the ledger says what it carries
    (or that only the cloud sends it); what any mode sends inside a request is classified."""
    for code, cls in MESSAGE_TYPES.items():
        assert (cls in CLASSIFY) != (cls in CLOUD_ONLY), f"type {code} {cls.__name__}"
    sent_by_device = {Hello, Ping, Pong, Cancel, Generate, *SESSION_TO_CLOUD}
    sent_by_device |= {m for decl in declared().values() for m in decl.to_cloud}
    assert sent_by_device <= set(CLASSIFY), sent_by_device - set(CLASSIFY)
    assert set(samples(1)) == set(CLASSIFY), "every classified type has a sample here"


@pytest.mark.parametrize("cls", list(CLASSIFY), ids=lambda c: c.__name__)
def test_a_frames_bytes_are_shared_out_by_its_fields(cls: type[Message]) -> None:
    """The kinds' bytes add up to the frame; control holds the header and stays the same size
    however much data the frame carries (the data's growth is all counted as that data)."""
    small, large = samples(1)[cls], samples(9)[cls]
    controls = []
    for msg in (small, large):
        frame = encode(msg)
        split = parts(msg, len(frame))
        assert sum(p.nbytes for p in split) == len(frame)
        assert [p.kind for p in split].count(CONTROL) == 1
        assert len({p.kind for p in split}) == len(split)  # one part per kind
        control = next(p for p in split if p.kind == CONTROL)
        assert control.nbytes >= HEADER_SIZE
        controls.append(control.nbytes)
    assert controls[0] == controls[1]


def test_text_is_counted_by_its_own_bytes_and_kept() -> None:
    msg = Generate("Wo ist der Schlüssel?", history=("Hi", "Hallo!"), request_id=3)
    frame = encode(msg)
    without = len(encode(replace(msg, question="")))
    split = {p.kind: p for p in parts(msg, len(frame))}
    assert split[QUESTION].nbytes == len(frame) - without + 4  # the text and its length
    assert split[QUESTION].texts == ("Wo ist der Schlüssel?",)
    assert split[HISTORY].texts == ("Hi", "Hallo!") and split[HISTORY].items == 2
    assert len(encode(replace(msg, history=()))) == len(frame) - split[HISTORY].nbytes


def test_a_ledger_adds_frames_up_by_kind_and_ends_with_its_answer() -> None:
    ledger = SentLedger()
    frames = [
        Generate("Why?", request_id=1),
        Generate("Why?", history=("a", "b"), request_id=2),
        DragonDraft(3, np.array([3, 4]), np.array([0.5, 0.5]), 0.25, 0.01),
        Ping(1),
    ]
    for msg in frames:
        assert ledger.record(msg, len(encode(msg)))
    rows = {r["kind"]: r for r in ledger.rows}
    assert [r["kind"] for r in ledger.rows] == [
        QUESTION,
        HISTORY,
        TOKEN_IDS,
        PROBABILITIES,
        WEIGHTS,
        CONTROL,
    ]
    assert rows[QUESTION]["texts"] == ["Why?"] and rows[QUESTION]["items"] == 2  # sent twice
    assert rows[TOKEN_IDS]["items"] == 3 and rows[WEIGHTS]["bytes"] == 8
    assert rows[CONTROL]["frames"] == 4 and rows[CONTROL]["messages"]["Generate"] == 2
    assert totals(ledger.rows) == (4, sum(len(encode(m)) for m in frames))
    ledger.close()
    assert not ledger.record(Ping(2), 30) and totals(ledger.rows)[0] == 4
    assert "token ids: 3 ids, 12 bytes in 1 frame (DragonDraft)" in [
        row_line(r) for r in ledger.rows
    ]
    assert summary([]) == NOTHING_SENT and summary(None) == NOT_RECORDED
    assert summary(ledger.rows).endswith(
        ": question text, earlier turns' text, token ids, probabilities, weights and control"
    )


@message
class Unknown(Message):
    """A mode added outside Tandem (its code an extension's): the ledger cannot say what it
    carries, so it is listed whole."""

    TYPE = 200
    text: str = ""

    def body(self) -> bytes:
        return self.text.encode()


def test_a_frame_of_a_type_the_ledger_does_not_know_is_listed_whole() -> None:
    msg = Unknown("private?")
    assert type(msg) not in CLASSIFY and type(msg) not in CLOUD_ONLY
    ledger = SentLedger()
    ledger.record(msg, len(encode(msg)))
    ledger.record(Ping(1), len(encode(Ping(1))))
    assert [(r["kind"], r["frames"]) for r in ledger.rows] == [(CONTROL, 1), (UNCLASSIFIED, 1)]
    assert totals(ledger.rows) == (2, len(encode(msg)) + len(encode(Ping(1))))
    assert summary(ledger.rows).endswith(": control and unclassified frames")


def test_stats_carry_the_ledger_and_read_it_back() -> None:
    stats = Stats(
        "cloud",
        sent=[{"kind": CONTROL, "frames": 1, "bytes": 30, "items": 1, "messages": {"Ping": 1}}],
    )
    row = stats.as_dict()
    assert row["sent"] == stats.sent
    assert Stats.from_dict(row).sent == stats.sent
    assert Stats.from_dict({"mode": "cloud"}).sent is None  # stored before the ledger
    snap = stats.__copy__()
    assert snap.sent == stats.sent and snap.sent is not stats.sent
    assert "sent" in {f.name for f in fields(Stats)}


# ---------------------------------------------------------------------------- at the socket


def binary_payloads(data: bytes) -> list[bytes]:
    """The payloads of the complete binary frames a client sent (RFC 6455 §5.2), after the
    HTTP upgrade; the websocket's own control frames (ping, pong, close) are skipped."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return []
    pos, out = end + 4, []
    while pos + 2 <= len(data):
        b0, b1 = data[pos], data[pos + 1]
        assert b1 & 0x80, "client frames are masked"
        n, head = b1 & 0x7F, 2
        if n == 126:
            n, head = int.from_bytes(data[pos + 2 : pos + 4], "big"), 4
        elif n == 127:
            n, head = int.from_bytes(data[pos + 2 : pos + 10], "big"), 10
        start = pos + head + 4
        if start + n > len(data):
            break  # not all here yet
        mask = np.frombuffer(data[pos + head : start], dtype=np.uint8)
        body = np.frombuffer(data[start : start + n], dtype=np.uint8)
        opcode = b0 & 0x0F
        if opcode == 0x2:
            assert b0 & 0x80 and not b0 & 0x70, "one whole, uncompressed frame per message"
            out.append((body ^ np.resize(mask, n)).tobytes())
        else:
            assert opcode in (0x8, 0x9, 0xA), f"unexpected websocket opcode {opcode}"
        pos = start + n
    return out


class Wire:
    """What the relay saw the device send, per connection, and what of it is new."""

    def __init__(self, tap: WireTap) -> None:
        self.tap = tap
        self.seen: list[int] = []  # binary frames already taken, per connection

    def frames(self) -> list[list[bytes]]:
        return [binary_payloads(bytes(sent)) for sent, _ in self.tap.connections]

    async def take(self, expected_bytes: int) -> list[bytes]:
        """The binary payloads sent since the last call, once the relay has passed on at
        least `expected_bytes` of them (and a moment more, for anything beyond)."""
        deadline = time.monotonic() + 10
        while True:
            now = self.frames()
            new = [f for conn, frames in enumerate(now) for f in frames[self._seen(conn) :]]
            if sum(map(len, new)) >= expected_bytes or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        now = self.frames()
        new = [f for conn, frames in enumerate(now) for f in frames[self._seen(conn) :]]
        self.seen = [len(frames) for frames in now]
        return new

    def _seen(self, conn: int) -> int:
        return self.seen[conn] if conn < len(self.seen) else 0


def check_against_the_wire(sent: list[dict[str, Any]], payloads: list[bytes]) -> None:
    """The ledger and the frames that crossed: the same bytes in all, the same frames by type,
    the very texts the frames carried."""
    frames, nbytes = totals(sent)
    assert nbytes == sum(map(len, payloads)), (nbytes, sum(map(len, payloads)))
    assert frames == len(payloads)
    messages = [decode(p) for p in payloads]
    control = next((r for r in sent if r["kind"] == CONTROL), {"messages": {}})
    assert control["messages"] == dict(Counter(type(m).__name__ for m in messages))
    rows = {r["kind"]: r for r in sent}
    generates = [m for m in messages if isinstance(m, Generate)]
    asked = list(dict.fromkeys(m.question for m in generates))
    turns = list(dict.fromkeys(h for m in generates for h in m.history))
    assert rows.get(QUESTION, {}).get("texts", []) == asked
    assert rows.get(HISTORY, {}).get("texts", []) == turns
    for row in sent:
        assert row["bytes"] > 0 and row["frames"] > 0


QUESTIONS = ("What is a tandem bicycle?", "Where is the spare key hidden?")
OPTIONS = AnswerOptions(max_new_tokens=10, temperature=0.0, k=2, allow_private_in_cloud=True)


@pytest.fixture
async def tapped_cloud(cloud_engine, public_corpus):
    """A cloud with a public corpus, reached through a relay that keeps what the device sends."""
    config = ServerConfig(token=TOKEN, corpus_enabled=False, corpus_k=2)
    server = TestServer(create_app(config, cloud_engine, public_corpus), host="127.0.0.1")
    await server.start_server()
    tap = WireTap(server.port)
    port = await tap.start()
    yield f"ws://127.0.0.1:{port}/v1/session", tap
    await tap.close()
    await server.close()


async def answer(mode, question: str, history: list[Turn]) -> tuple[str, Stats]:
    events = [e async for e in mode.answer(question, history, OPTIONS)]
    stats = events[-1]
    assert isinstance(stats, Stats)
    return "".join(e.text for e in events if isinstance(e, TextDelta)), stats


def identity(mode) -> str | None:
    """The identity of the cloud `mode` answered with (auto: its cloud mode's)."""
    inner = mode.mode("cloud") if mode.name == "auto" else mode
    return inner.cloud_identity()


@pytest.mark.parametrize("name", ["cloud", "split", "dragon", "auto"])
async def test_the_ledger_is_what_crossed_the_socket(name, device, private_index, tapped_cloud):
    url, tap = tapped_cloud
    cloud = CloudSettings(url, TOKEN, retries=0)
    mode = build_mode(name, ModeContext(device=device, index=private_index, cloud=cloud))
    wire = Wire(tap)
    history: list[Turn] = []
    ledgers = []
    try:
        for question in QUESTIONS:
            text, stats = await answer(mode, question, history)
            assert stats.sent is not None
            ledgers.append(stats.sent)
            check_against_the_wire(stats.sent, await wire.take(totals(stats.sent)[1]))
            history.append(Turn(question, text, name, shared=text, shared_with=identity(mode)))
    finally:
        await mode.close()
    first, second = ({r["kind"]: r for r in sent} for sent in ledgers)
    assert "Hello" in first[CONTROL]["messages"]  # the session opened for the first answer
    assert "Hello" not in second[CONTROL]["messages"]  # ... and served the second
    if name != "auto":  # auto may answer either question on the device alone
        assert first[QUESTION]["texts"] == [QUESTIONS[0]]
        assert second[HISTORY]["texts"] == [QUESTIONS[0], history[0].answer]
    if name in ("split", "dragon"):
        assert {TOKEN_IDS, PROBABILITIES} <= set(first)
    if name == "dragon":
        assert WEIGHTS in first


async def test_a_local_answer_sent_nothing_and_opened_no_socket(device, private_index):
    ctx = ModeContext(device, private_index, CloudSettings("ws://127.0.0.1:9/x", TOKEN))
    with counting_sockets() as opened:
        _, stats = await answer(build_mode("local", ctx), QUESTIONS[1], [])
    assert stats.sent == [] and stats.as_dict()["sent"] == []
    assert opened == []


# ---------------------------------------------------------------------------- exports


def test_conversation_exports_include_what_was_sent(tmp_path) -> None:
    from app.conversations import ConversationStore

    ledger = SentLedger()
    asked = Generate("Wer fährt Tandem?\n> zu zweit", history=("Hi", "Hallo!"), request_id=1)
    for msg in (Hello(HASH, Mode.CLOUD), asked):
        ledger.record(msg, len(encode(msg)))
    with ConversationStore(tmp_path / "c.sqlite") as store:
        cid = store.create("Tandem").id
        store.add_message(cid, "user", asked.question, "cloud")
        store.add_message(cid, "assistant", "Zwei.", "cloud", stats={"sent": ledger.rows})
        store.add_message(cid, "user", "Und lokal?", "local")
        store.add_message(cid, "assistant", "Hier.", "local", stats={"sent": []})
        store.add_message(cid, "user", "Früher?", "cloud")
        store.add_message(cid, "assistant", "Alt.", "cloud", stats={"tokens": 2})
        md = store.export_markdown(cid)
        data = store.export_json(cid)
    assert data["messages"][1]["stats"]["sent"] == ledger.rows
    assert data["messages"][3]["stats"]["sent"] == []
    assert f"What was sent: {summary(ledger.rows)}" in md
    assert "- question text: 1 text, " in md and "  > Wer fährt Tandem?\n  > > zu zweit" in md
    assert "- earlier turns' text: 2 texts, " in md and "  > Hallo!" in md
    assert f"What was sent: {NOTHING_SENT}" in md and f"What was sent: {NOT_RECORDED}" in md
    assert md.index("Zwei.") < md.index("Wer fährt Tandem?\n  >") < md.index("Und lokal?")
