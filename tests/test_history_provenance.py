"""History by provenance (issue 28, item 4): what the device wrote alone never reaches the cloud.

A DRAGON or split answer whose cloud vanishes mid-answer is finished by the device from its
private passages. That continuation may quote them, so the next questions, in cloud, split and
dragon mode, must not carry it: the bytes the device sends (read off the wire) hold the part of
the answer the cloud saw and nothing of the rest, neither as text nor as token ids. A negative
control shows the same check finds the continuation when it is sent.

Provenance names the cloud (issue 44, item 7): a turn goes back only to the cloud that saw it,
by its identity (URL and server name, never the token). A turn the embedded cloud saw never
reaches a remote cloud configured later (a second loopback server, read at its socket); a turn
stored before clouds were named is sent to none."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
from collections.abc import AsyncIterator

import numpy as np
import pytest

from cloud_backend.config import ServerConfig
from cloud_backend.server import run_server
from collab.protocol import Generate, ProtocolError, decode
from edge_runtime.cloud_identity import EMBEDDED, cloud_identity
from edge_runtime.events import Failure, ModeChoice, Notice, TextDelta
from edge_runtime.modes.base import CloudSettings, Turn, cloud_history
from tests import test_modes
from tests.test_modes import WireTap, client_frames

TOKEN = test_modes.TOKEN
QUESTION = "Where is the spare key hidden, and what is my locker code?"


@contextlib.asynccontextmanager
async def _tapped(cloud_engine) -> AsyncIterator[tuple[str, WireTap]]:
    """A real cloud server on loopback behind a tap that keeps what the device sends."""
    config = ServerConfig(port=0, token=TOKEN, corpus_enabled=False)
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(run_server(config, cloud_engine, ready=ready.set_result))
    url = await asyncio.wait_for(ready, 30)
    tap = WireTap(int(url.rsplit(":", 1)[1].split("/")[0]))
    port = await tap.start()
    try:
        yield f"ws://127.0.0.1:{port}/v1/session", tap
    finally:
        await tap.close()
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


@pytest.fixture
async def tapped_cloud(cloud_engine) -> AsyncIterator[tuple[str, WireTap]]:
    async with _tapped(cloud_engine) as cloud:
        yield cloud


@pytest.fixture
async def other_cloud(cloud_engine) -> AsyncIterator[tuple[str, WireTap]]:
    """A second cloud: a remote one the user configures later (another URL, another tap)."""
    async with _tapped(cloud_engine) as cloud:
        yield cloud


def _absent(secret: bytes, wire: bytes, allowed: bytes, width: int = 12) -> list[bytes]:
    """Every `width`-byte window of `secret` found in `wire`, except windows that also occur
    in `allowed` (what may legitimately travel: the shared prefix, the questions)."""
    found = []
    for i in range(max(1, len(secret) - width + 1)):
        window = secret[i : i + width]
        if window in wire and window not in allowed:
            found.append(window)
    return found


def _ids_found(ids: list[int], wire: bytes, width: int = 3) -> list[list[int]]:
    """Runs of `width` consecutive token ids of `ids` found in `wire` as uint32 (the codec's)."""
    return [
        ids[i : i + width]
        for i in range(max(1, len(ids) - width + 1))
        if np.asarray(ids[i : i + width], dtype="<u4").tobytes() in wire
    ]


@pytest.mark.parametrize("first", ["dragon", "split"])
async def test_the_device_only_continuation_never_reaches_the_cloud(
    first, tapped_cloud, near_drafter, private_index, tmp_path, monkeypatch
):
    from app.assistant import Assistant
    from app.settings import Settings

    url, tap = tapped_cloud
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    assistant = Assistant(Settings(), device=near_drafter, index=private_index)
    assistant.context().cloud = CloudSettings(url, TOKEN, heartbeat_s=0.3)
    try:
        # 1. the cloud vanishes mid-answer; the device finishes from its private passages
        # (the user lets this cloud take part in answers shaped by them: edge_runtime.consent)
        options = assistant.options(
            max_new_tokens=48, temperature=1.0, seed=7, k=1, allow_private_in_cloud=True
        )
        exchange = assistant.exchange(QUESTION, first, options=options)
        events, deltas = [], 0
        async for event in exchange.events():
            events.append(event)
            if isinstance(event, TextDelta):
                deltas += 1
                if deltas == 3:
                    tap.cut()
        assert any(isinstance(e, Failure) and e.recoverable for e in events)
        assert any(isinstance(e, Notice) and "on the device" in e.text for e in events)
        cid = exchange.conversation_id
        assert cid is not None
        stored = assistant.conversations.messages(cid)[-1]
        shared = stored.shared_chars
        assert shared is not None and 0 < shared < len(stored.text), (shared, stored.text)
        assert stored.stats["shared_tokens"] == exchange.shared_tokens
        assert exchange.stats is not None and exchange.shared_tokens is not None
        continuation_ids = exchange.stats.token_ids[exchange.shared_tokens :]
        continuation = stored.text[shared:]
        assert len(continuation_ids) >= 8, "the device wrote too little to test"

        # 2. the next questions, in every cloud-backed mode
        before = len(tap.connections)
        questions = []
        for mode in ("cloud", "split", "dragon"):
            questions.append(f"And what does that mean? ({mode})")
            options = assistant.options(
                max_new_tokens=6, temperature=0.0, k=1, allow_private_in_cloud=True
            )
            ex = assistant.exchange(questions[-1], mode, conversation_id=cid, options=options)
            later = [e async for e in ex.events()]
            assert not [e for e in later if isinstance(e, Failure)], mode
            assert ex.shared_chars == len(ex.text)  # a whole cloud answer: all shared
    finally:
        assistant.index = None  # the module's index outlives this assistant
        await assistant.close()
    wire = tap.sent_since(before)
    allowed = "\n".join([QUESTION, stored.text[:shared], *questions]).encode()
    assert QUESTION.encode() in wire  # the turn's question and its shared part do travel
    assert stored.text[:shared].encode() in wire
    assert _absent(continuation.encode(), wire, allowed) == []
    assert _ids_found(continuation_ids, wire) == []


async def test_the_check_finds_a_continuation_that_is_sent(
    tapped_cloud, near_drafter, private_index
):
    """Negative control: the old policy (by mode: a dragon turn is sent whole) puts the
    device's continuation on the wire, and the same check sees it."""
    from edge_runtime.modes import build_mode
    from edge_runtime.modes.base import ModeContext

    url, tap = tapped_cloud
    continuation = " and the spare key hides under the blue flowerpot, code 4417."
    answer = "I will look it up" + continuation
    this_cloud = CloudSettings(url, TOKEN).identity("tiny-cloud")
    old_policy = Turn(QUESTION, answer, "dragon", shared=answer, shared_with=this_cloud)
    turn = Turn(QUESTION, answer, "dragon", shared="I will look it up", shared_with=this_cloud)
    assert cloud_history([turn], this_cloud) == [QUESTION, "I will look it up"]
    ctx = ModeContext(near_drafter, private_index, CloudSettings(url, TOKEN))
    cloud = build_mode("cloud", ctx)
    options = test_modes.AnswerOptions(max_new_tokens=4, temperature=0.0)
    async for _ in cloud.answer("And then?", [old_policy], options):
        pass
    await cloud.close()
    wire = tap.sent_since(0)
    assert _absent(continuation.encode(), wire, QUESTION.encode()) != []


def test_a_turn_is_private_unless_its_provenance_says_otherwise():
    """Local turns, turns whose question never reached the cloud, and legacy turns (no
    provenance recorded) are never sent; a finished cloud turn is sent whole."""
    turns = [
        Turn("local question", "local answer", "local"),
        Turn("unreached", "device answer", "cloud", shared=None, shared_with=EMBEDDED),
        Turn("empty", "all device", "dragon", shared="", shared_with=EMBEDDED),
        Turn("legacy", "stored before clouds were named", "cloud", shared="stored before"),
        Turn("whole", "cloud answer", "cloud", shared="cloud answer", shared_with=EMBEDDED),
    ]
    assert cloud_history(turns, EMBEDDED) == ["whole", "cloud answer"]


# ---------------------------------------------------------------------------- which cloud saw it

FOLLOW_UP = "And why is that?"


def _generates(tap: WireTap) -> list[Generate]:
    """Every Generate the device sent through `tap`, decoded from the websocket payloads."""
    found = []
    for sent, _ in tap.connections:
        for frame in client_frames(bytes(sent)):
            with contextlib.suppress(ProtocolError):  # a websocket ping, close: not a message
                if isinstance(message := decode(frame), Generate):
                    found.append(message)
    return found


def _history_of(tap: WireTap, question: str) -> tuple[str, ...]:
    """The history sent with `question` (its one Generate through `tap`)."""
    [message] = [m for m in _generates(tap) if m.question == question]
    return tuple(message.history)


async def test_a_turn_goes_back_to_the_cloud_that_saw_it_and_to_no_other(
    tapped_cloud, other_cloud, near_drafter, tmp_path, monkeypatch
):
    """The embedded cloud saw the first turn: the next question sends it back there. The user
    then configures a remote cloud (its URL carrying the token in its query):
    no question in cloud, split or dragon mode sends it either turn (read at its socket, as
    text and in each Generate's history), while its own turns do go back to it; no stored
    provenance, and nothing in the history file, holds the token."""
    from app.assistant import Assistant
    from app.settings import Settings
    from collab.plumbing.paths import conversations_path

    (embedded_url, embedded_tap), (remote_url, remote_tap) = tapped_cloud, other_cloud
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    for name in ("TANDEM_CLOUD_URL", "TANDEM_CLOUD_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assistant = Assistant(Settings(), device=near_drafter)
    # what connect_cloud sets for the cloud Tandem starts on this device
    assistant.context().cloud = CloudSettings(embedded_url, TOKEN, embedded=True)
    options = assistant.options(max_new_tokens=8, temperature=0.0, k=0)
    remote_texts: list[str] = []
    try:
        first = assistant.exchange(QUESTION, "cloud", options=options)
        assert not [e async for e in first.events() if isinstance(e, Failure)]
        assert first.shared_with == EMBEDDED and first.shared_chars == len(first.text) > 0
        cid = first.conversation_id
        second = assistant.exchange(FOLLOW_UP, "cloud", conversation_id=cid, options=options)
        assert not [e async for e in second.events() if isinstance(e, Failure)]
        assert _history_of(embedded_tap, FOLLOW_UP) == (QUESTION, first.text)  # back to it

        token_url = f"{remote_url}?token={TOKEN}"  # (user info: aiohttp refuses it with a token)
        assert await assistant.apply_settings(Settings(cloud_url=token_url, cloud_token=TOKEN))
        status = await assistant.connect_cloud()
        assert status.state == "ready" and not status.embedded, status
        remote = cloud_identity(remote_url, "tiny-cloud")
        # even where the user lets this cloud take part in answers shaped by private turns
        # (split's drafts, dragon's), their text is not sent to it
        consented = dataclasses.replace(options, allow_private_in_cloud=True)
        questions = []
        for mode in ("cloud", "split", "dragon"):
            questions.append(f"And what does that mean? ({mode})")
            ex = assistant.exchange(questions[-1], mode, conversation_id=cid, options=consented)
            assert not [e async for e in ex.events() if isinstance(e, Failure)], mode
            assert ex.shared_with == remote, mode
            remote_texts += [questions[-1], ex.text]
        stored = assistant.conversations.messages(cid)
    finally:
        await assistant.close()
    # each question reached the remote cloud, and its own turns went back to it: history is
    # sent, only not what another cloud saw
    assert _history_of(remote_tap, questions[0]) == ()
    assert _history_of(remote_tap, questions[1]) == (questions[0], remote_texts[1])
    assert _history_of(remote_tap, questions[2]) == tuple(remote_texts[:4])
    wire = remote_tap.sent_since(0)
    assert questions[0].encode() in wire  # the tap does see the text the device sends
    allowed = "\n".join(remote_texts).encode()
    for text in (QUESTION, first.text, FOLLOW_UP, second.text):
        assert _absent(text.encode(), wire, allowed) == [], text
    for message in _generates(remote_tap):
        assert not {QUESTION, first.text, FOLLOW_UP, second.text} & set(message.history)
    answers = [m for m in stored if m.role == "assistant"]
    assert [m.shared_with for m in answers[:2]] == [EMBEDDED, EMBEDDED]
    assert answers[2].shared_with == remote
    assert not any(TOKEN in (m.shared_with or "") for m in answers)
    assert TOKEN.encode() not in conversations_path().read_bytes()


OLD_QUESTION = "What did the doctor say about my test results?"
OLD_ANSWER = "Your cholesterol is 7.9 and the biopsy is booked for Tuesday."


@pytest.mark.parametrize("embedded", [True, False])
async def test_turns_stored_before_clouds_were_named_are_sent_to_none(
    embedded, tapped_cloud, near_drafter, tmp_path, monkeypatch
):
    """A version-2 history recorded that the cloud saw an answer, not which cloud: whichever
    was configured then is unknown, so after the migration the turn goes to no cloud, not even
    the embedded one."""
    from app.assistant import Assistant
    from app.conversations import MIGRATIONS, SCHEMA_VERSION
    from app.settings import Settings
    from collab.plumbing.migrations import migrate, user_version
    from collab.plumbing.paths import conversations_path

    url, tap = tapped_cloud
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    path = conversations_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None)
    migrate(conn, MIGRATIONS[:2], name="v2")
    conn.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('t', 0, 0)")
    conn.execute(
        "INSERT INTO messages (conversation_id, role, text, mode, created_at, shared_chars) "
        "VALUES (1, 'user', ?, 'cloud', 0, NULL), (1, 'assistant', ?, 'cloud', 0, ?)",
        (OLD_QUESTION, OLD_ANSWER, len(OLD_ANSWER)),  # all of it shared, with some cloud
    )
    conn.close()
    assistant = Assistant(Settings(), device=near_drafter)
    assistant.context().cloud = CloudSettings(url, TOKEN, embedded=embedded)
    try:
        assert user_version(assistant.conversations.conn) == SCHEMA_VERSION
        assert assistant.conversations.turns(1) == [
            (OLD_QUESTION, OLD_ANSWER, "cloud", OLD_ANSWER, None)
        ]
        options = assistant.options(max_new_tokens=4, temperature=0.0, k=0)
        ex = assistant.exchange(FOLLOW_UP, "cloud", conversation_id=1, options=options)
        assert not [e async for e in ex.events() if isinstance(e, Failure)]
    finally:
        await assistant.close()
    assert _history_of(tap, FOLLOW_UP) == ()
    wire = tap.sent_since(0)
    assert FOLLOW_UP.encode() in wire
    assert OLD_QUESTION.encode() not in wire and b"7.9" not in wire and b"biopsy" not in wire


@pytest.mark.parametrize(
    "url",
    [
        "wss://tandem:{}@cloud.example/v1/session",
        "wss://cloud.example/v1/session?token={}",
        "wss://{}@Cloud.Example:443/v1/session?access_token={}#{}",
        "wss://cloud.example:443?token={}",  # no path: the session path, as the client adds it
    ],
)
def test_a_cloud_identity_never_holds_the_token(url):
    """The identity is the URL without user info, query or fragment, and the server's name."""
    secret = "Zq8vT3kR9mW2xY7pL4nB6cD1"
    settings = CloudSettings(url.format(secret, secret, secret), secret)
    assert settings.identity("tiny-cloud") == "wss://cloud.example:443/v1/session [tiny-cloud]"
    settings.embedded = True  # the cloud this device started: one identity, whatever its port
    assert settings.identity("tiny-cloud") == EMBEDDED


async def test_auto_treats_a_turn_another_cloud_saw_as_private(other_cloud, near_drafter):
    """auto's follow-up rule: a last turn only another cloud saw (the embedded one, before a
    remote cloud was configured) is one this cloud never saw, so the follow-up stays on the
    device; the same turn seen by this cloud goes to it (split: chat, drafted here)."""
    from edge_runtime.modes import build_mode
    from edge_runtime.modes.base import ModeContext

    url, _ = other_cloud
    auto = build_mode("auto", ModeContext(near_drafter, None, CloudSettings(url, TOKEN)))
    options = test_modes.AnswerOptions(max_new_tokens=4, temperature=0.0, k=0)
    here = cloud_identity(url, "tiny-cloud")
    try:
        # (chat goes to the cloud's model through split: exact, until split is measured)
        for seen, expected in ((EMBEDDED, "local"), (here, "split")):
            turn = Turn("Hi", "Hello there!", "cloud", shared="Hello there!", shared_with=seen)
            events = [e async for e in auto.answer("And then what?", [turn], options)]
            [choice] = [e for e in events if isinstance(e, ModeChoice)]
            assert choice.mode == expected, (seen, choice)
    finally:
        await auto.close()
