"""auto end to end over a real aiohttp cloud on loopback (tiny models, the real embedder, a real
public corpus of 60 Wikipedia summaries and a real private index): the choice comes first and
the answer is the chosen mode's own; the policy "questions stay on this device" opens no
socket; a cloud that does not answer leaves the question local; the relevance query carries
the bare question and nothing private."""

from __future__ import annotations

import socket
from functools import partial

import pytest

from benchmarks.auto import counting_sockets
from cloud_backend.config import ServerConfig
from edge_runtime.events import Citation, ModeChoice, Stats, TextDelta
from edge_runtime.mode_choice import CONSULTED
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext, Turn
from retrieval.embedder import question_cosines
from tests.cloud import TOKEN
from tests.test_modes import WireTap

PRIVATE_Q = "What is my locker code?"
PUBLIC_Q = "In which city was the pop group ABBA formed?"
BOTH_Q = "What is my locker code, and in which city was the pop group ABBA formed?"
CHAT_Q = "Please say hello back to me."
OPTIONS = AnswerOptions(max_new_tokens=12, temperature=0.0, k=2)


@pytest.fixture
def cloud_corpus(public_corpus):
    return public_corpus


@pytest.fixture
def cloud_config():
    return ServerConfig(token=TOKEN, corpus_enabled=False, corpus_k=2)


def context(device, index, url: str | None, *, embedded: bool = True, **settings) -> ModeContext:
    """A loopback cloud standing in for the embedded one (on-device: no consent needed) unless
    told; public passages judged by the private index's embedder, as the Assistant does."""
    cloud = (
        CloudSettings(url, TOKEN, retries=0, connect_timeout_s=2.0, embedded=embedded)
        if url
        else None
    )
    judge = partial(question_cosines, index.embedder.embed) if index is not None else None
    return ModeContext(device=device, index=index, cloud=cloud, settings=settings, judge=judge)


async def ask(mode, question, history=(), options=OPTIONS):
    events = [e async for e in mode.answer(question, list(history), options)]
    stats = events[-1]
    assert isinstance(stats, Stats)
    return events, stats


def choice_of(events) -> ModeChoice:
    choices = [e for e in events if isinstance(e, ModeChoice)]
    assert len(choices) == 1
    first_other = next(i for i, e in enumerate(events) if isinstance(e, (TextDelta, Citation)))
    assert events.index(choices[0]) < first_other, "the choice is said before the answer"
    return choices[0]


EXPECTED = [(PRIVATE_Q, "local"), (PUBLIC_Q, "cloud"), (CHAT_Q, "split")]  # split: exact


@pytest.mark.parametrize(("question", "expected"), EXPECTED)
async def test_auto_says_its_choice_first_and_answers_as_that_mode(
    question, expected, device, private_index, cloud_url
):
    ctx = context(device, private_index, cloud_url)
    auto = build_mode("auto", ctx)
    events, stats = await ask(auto, question)
    choice = choice_of(events)
    assert choice.mode == expected, choice
    assert stats.mode == "auto" and stats.auto_mode == expected
    assert stats.auto_reason == choice.reason
    _, alone = await ask(build_mode(expected, ctx), question)
    assert stats.token_ids == alone.token_ids  # greedy: the chosen mode's very answer
    assert stats.bytes_up > alone.bytes_up  # the relevance query is counted too
    await auto.close()


async def test_a_question_both_sides_match_is_answered_by_dragon(device, private_index, cloud_url):
    auto = build_mode("auto", context(device, private_index, cloud_url))
    events, stats = await ask(auto, BOTH_Q)
    assert choice_of(events).mode == "dragon" and stats.auto_mode == "dragon"
    assert stats.tokens > 0 and stats.aggregator in ("device", "cloud")
    sides = {e.side for e in events if isinstance(e, Citation)}
    assert sides == {"device", "cloud"}
    # the policy "private passages stay out of cloud answers" keeps it local
    strict_ctx = context(device, private_index, cloud_url, auto_private_in_cloud=False)
    strict = build_mode("auto", strict_ctx)
    events, stats = await ask(strict, BOTH_Q)
    assert choice_of(events).mode == "local" and stats.bytes_down > 0  # it asked, then stayed
    await auto.close()
    await strict.close()


async def test_questions_kept_on_the_device_open_no_socket(device, private_index):
    # a cloud is configured (and would answer at this address): the policy alone keeps it out
    ctx = context(device, private_index, "ws://127.0.0.1:9/v1/session", auto_cloud_questions=False)
    auto = build_mode("auto", ctx)
    with counting_sockets() as opened:  # every connect, blocking or the event loop's
        for question in (PRIVATE_Q, PUBLIC_Q, BOTH_Q, CHAT_Q):
            events, stats = await ask(auto, question)
            assert choice_of(events).reason == "your policy keeps questions on this device"
            assert stats.auto_mode == "local" and stats.bytes_up == stats.bytes_down == 0
    assert opened == []


async def test_a_cloud_that_does_not_answer_leaves_the_question_local(device, private_index):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    auto = build_mode("auto", context(device, private_index, f"ws://127.0.0.1:{port}/v1/session"))
    events, stats = await ask(auto, PUBLIC_Q)
    assert choice_of(events) == ModeChoice("local", "the cloud did not answer")
    assert stats.tokens > 0
    # the next questions do not wait on that cloud again for a while...
    tries = []
    real_connect = auto.mode("cloud").client
    auto.mode("cloud").client = lambda: tries.append(1) or real_connect()
    events, _ = await ask(auto, PUBLIC_Q)
    assert choice_of(events).mode == "local" and tries == []
    # ...unless the link is set up anew (the app reconnected)
    auto.ctx.cloud = CloudSettings(auto.ctx.cloud.url, TOKEN, retries=0, connect_timeout_s=2.0)
    events, _ = await ask(auto, PUBLIC_Q)
    assert choice_of(events).mode == "local" and tries == [1]
    await auto.close()
    no_cloud = build_mode("auto", context(device, private_index, None))
    events, _ = await ask(no_cloud, PUBLIC_Q)
    assert choice_of(events) == ModeChoice("local", "no cloud")
    no_cloud.ctx.cloud_starting = True  # what the app says while its cloud starts
    events, _ = await ask(no_cloud, PUBLIC_Q)
    assert choice_of(events) == ModeChoice("local", "the cloud is still starting")


def test_the_modes_hear_that_the_cloud_is_starting():
    from app.assistant import Assistant
    from app.settings import Settings

    assistant = Assistant(Settings())
    assert not assistant.context().cloud_starting
    assistant.cloud_expected()  # the app's start: the cloud is connected after the device model
    assert assistant.context().cloud_starting
    assistant.cloud_skipped()
    assert not assistant.context().cloud_starting


async def test_the_relevance_query_carries_the_bare_question_only(device, private_index, cloud_url):
    port = int(cloud_url.split(":")[2].split("/")[0])
    tap = WireTap(port)
    url = f"ws://127.0.0.1:{await tap.start()}/v1/session"
    auto = build_mode("auto", context(device, private_index, url))
    secret_turn = Turn("What did my doctor write?", "Your blood count is 81,250.", "local")
    events, _ = await ask(auto, PRIVATE_Q, [secret_turn])
    assert choice_of(events).mode == "local"
    wire = b"".join(tap.payloads())  # the websocket payloads, unmasked
    assert PRIVATE_Q.encode() in wire  # the question went (the policy lets it)...
    for private in (b"4417", b"flowerpot", b"81,250", secret_turn.question.encode()):
        assert private not in wire  # ...and nothing else: no passage, no earlier turn
    # a follow-up to that private turn with nothing to retrieve stays on the device
    events, _ = await ask(auto, "And what did she say about next year?", [secret_turn])
    said = "follows an answer only this device has seen" + CONSULTED  # the policy lets it ask
    assert choice_of(events) == ModeChoice("local", said)
    await auto.close()
    await tap.close()
