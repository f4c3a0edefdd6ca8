"""History by provenance (issue 28, item 4): what the device wrote alone never reaches the cloud.

A DRAGON or split answer whose cloud vanishes mid-answer is finished by the device from its
private passages. That continuation may quote them, so the next questions, in cloud, split and
dragon mode, must not carry it: the bytes the device sends (read off the wire) hold the part of
the answer the cloud saw and nothing of the rest, neither as text nor as token ids. A negative
control shows the same check finds the continuation when it is sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from cloud_backend.config import ServerConfig
from cloud_backend.server import run_server
from edge_runtime.events import Failure, Notice, TextDelta
from edge_runtime.modes.base import CloudSettings, Turn, cloud_history
from tests import test_modes
from tests.test_modes import WireTap

cloud_engine, near_drafter = test_modes.cloud_engine, test_modes.near_drafter
TOKEN = test_modes.TOKEN
QUESTION = "Where is the spare key hidden, and what is my locker code?"


@pytest.fixture
async def tapped_cloud(cloud_engine) -> AsyncIterator[tuple[str, WireTap]]:
    config = ServerConfig(port=0, token=TOKEN, corpus_enabled=False)
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(run_server(config, cloud_engine, ready=ready.set_result))
    url = await asyncio.wait_for(ready, 30)
    tap = WireTap(int(url.rsplit(":", 1)[1].split("/")[0]))
    port = await tap.start()
    yield f"ws://127.0.0.1:{port}/v1/session", tap
    await tap.close()
    server.cancel()
    await asyncio.gather(server, return_exceptions=True)


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
        options = assistant.options(max_new_tokens=48, temperature=1.0, seed=7, k=1)
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
            options = assistant.options(max_new_tokens=6, temperature=0.0, k=1)
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
    old_policy = Turn(QUESTION, answer, "dragon", shared=answer)
    assert cloud_history([Turn(QUESTION, answer, "dragon", shared="I will look it up")]) == [
        QUESTION,
        "I will look it up",
    ]
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
        Turn("unreached", "device answer", "cloud", shared=None),
        Turn("empty", "all device", "dragon", shared=""),
        Turn("whole", "cloud answer", "cloud", shared="cloud answer"),
    ]
    assert cloud_history(turns) == ["whole", "cloud answer"]
