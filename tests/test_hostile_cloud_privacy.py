"""A cloud the user does not control, checked at the socket: a real server (real engine, real
public corpus) wrapped to lie, and a device that must not send it anything shaped by private
passages unless the user agreed (edge_runtime.consent), nor let its claims decide that.

- Inflated relevance: every public passage it returns claims 0.99. The device judges the
  returned texts with its own embedder, so a question only the notes answer stays on the
  device, even with consent; taken at its word, the same lie would have moved it off.
- Forged citations: a "passage" that echoes the question back scores near 1 with any
  embedder; the device counts it as no evidence.
- No consent: dragon answers on the device and sends no request; split drafts from a prompt
  without the private passages (its frames are byte for byte those of a device with no
  documents); auto keeps a question both sides match local, and says why. With consent the
  same frames do carry drafts shaped by the passages: the checks can fail.
- Turns it never saw: a turn answered locally, or seen by another cloud (the embedded one),
  is never in its history; a turn it saw itself is."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from cloud_backend.config import ServerConfig
from cloud_backend.corpus import PublicHit
from cloud_backend.server import create_app
from collab.protocol import (
    Cancel,
    DragonDraft,
    DragonSetup,
    DragonTarget,
    Generate,
    Hello,
    Message,
    Ping,
    Pong,
    decode,
    encode,
)
from edge_runtime.cloud_identity import EMBEDDED, cloud_identity
from edge_runtime.consent import Consent
from edge_runtime.events import Notice
from edge_runtime.mode_choice import Policy, Signals, choose
from edge_runtime.modes import build_mode
from edge_runtime.modes.auto import public_scores
from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext, Turn
from retrieval.embedder import question_cosines
from tests.test_auto_mode import BOTH_Q, PRIVATE_Q, TOKEN, ask, choice_of
from tests.test_modes import WireTap, client_frames

OPTIONS = AnswerOptions(max_new_tokens=8, temperature=0.0, k=2)
SECRETS = (b"4417", b"flowerpot", b"81,250", b"Jordan")  # what the two private notes say
SHAPED = (DragonSetup, DragonDraft, DragonTarget)  # frames only a dragon answer sends


class LyingCorpus:
    """The real public corpus, wrapped: its passages for any question (the floor ignored), each
    claiming `claim` relevance, after a forged one that echoes the question if `forge`."""

    def __init__(self, corpus: Any, claim: float | None, forge: bool = False) -> None:
        self.corpus, self.claim, self.forge = corpus, claim, forge

    def search(self, query: str, k: int = 5, min_score: float | None = None, **kw: Any) -> list:
        honest = self.claim is None and not self.forge
        hits = self.corpus.search(query, k, min_score if honest else None, **kw)
        if self.claim is not None:
            hits = [dataclasses.replace(h, score=self.claim) for h in hits]
        if self.forge:
            hits = [PublicHit("Locker codes", score=self.claim or 0.99, text=query), *hits][:k]
        return hits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.corpus, name)


@pytest.fixture
async def remote_cloud(cloud_engine, public_corpus) -> AsyncIterator[Callable[..., Any]]:
    """`start(claim=None, forge=False)`: a real cloud (honest unless told to lie) behind a tap
    that keeps every byte the device sends; returns (url, tap)."""
    running: list[tuple[TestServer, WireTap]] = []

    async def start(claim: float | None = None, forge: bool = False) -> tuple[str, WireTap]:
        config = ServerConfig(token=TOKEN, corpus_enabled=False, corpus_k=2)
        corpus = LyingCorpus(public_corpus, claim, forge)
        server = TestServer(create_app(config, cloud_engine, corpus), host="127.0.0.1")
        await server.start_server()
        tap = WireTap(server.port)
        running.append((server, tap))
        return f"ws://127.0.0.1:{await tap.start()}/v1/session", tap

    yield start
    for server, tap in running:
        await tap.close()
        await server.close()


def remote(device, index, url: str, consent: Consent | None = None) -> ModeContext:
    """A context for a cloud that is not this device's own: nothing shaped by private passages
    goes to it without `consent`; public passages judged by the device's embedder."""
    judge = partial(question_cosines, index.embedder.embed) if index is not None else None
    # no websocket heartbeat: every frame on the tap is then one of the protocol's
    cloud = CloudSettings(url, TOKEN, retries=0, connect_timeout_s=2.0, heartbeat_s=None)
    return ModeContext(
        device=device, index=index, cloud=cloud, judge=judge, consent=consent or Consent()
    )


def sent(tap: WireTap, since: int = 0) -> list[Message]:
    """Every protocol frame the device sent on the connections opened after the `since`-th,
    decoded (the pings aside)."""
    frames = [
        decode(f)
        for data, _ in tap.connections[since:]
        for f in client_frames(bytes(data), binary_only=True)
    ]
    return [m for m in frames if not isinstance(m, Ping | Pong)]


def no_secret_in(tap: WireTap) -> None:
    wire = b"".join(tap.payloads())
    for secret in SECRETS:
        assert secret not in wire


def always(url: str) -> Consent:
    return Consent({cloud_identity(url, "tiny-cloud"): "always"})


# ---------------------------------------------------------------------------- lies


async def test_inflated_relevance_cannot_move_a_private_question_off_the_device(
    remote_cloud, device, private_index
):
    url, tap = await remote_cloud(claim=0.99)
    auto = build_mode("auto", remote(device, private_index, url, always(url)))  # consent given
    events, _ = await ask(auto, PRIVATE_Q, options=OPTIONS)
    await auto.close()
    choice = choice_of(events)
    assert choice.mode == "local" and "public sources consulted" in choice.reason
    messages = sent(tap)
    asked = [m for m in messages if isinstance(m, Generate)]
    assert [(g.question, g.max_new_tokens, g.history) for g in asked] == [(PRIVATE_Q, 0, ())]
    assert not [m for m in messages if isinstance(m, SHAPED)]
    no_secret_in(tap)
    # negative control: taken at its word, the lie would have moved the question off the
    # device (to the cloud, whose passages would outweigh the notes)
    private = [h.score for h in private_index.search(PRIVATE_Q, 2, OPTIONS.min_score)]
    lie = Signals(private=private, public=[0.99, 0.99], consulted=True)
    assert private and choose(lie, Policy()).mode != "local"


async def test_a_forged_citation_echoing_the_question_is_no_evidence(
    remote_cloud, device, private_index
):
    url, tap = await remote_cloud(claim=0.99, forge=True)
    auto = build_mode("auto", remote(device, private_index, url, always(url)))
    events, _ = await ask(auto, PRIVATE_Q, options=OPTIONS)
    await auto.close()
    assert choice_of(events).mode == "local"
    assert not [m for m in sent(tap) if isinstance(m, SHAPED)]
    # negative control: by meaning alone, the echo is the best "passage" there is
    judge = partial(question_cosines, private_index.embedder.embed)
    assert judge(PRIVATE_Q, [PRIVATE_Q])[0] > 0.9
    echo = PublicHit("Locker codes", score=0.99, text=PRIVATE_Q)
    assert public_scores(judge, PRIVATE_Q, [echo]) == [0.0]


# ---------------------------------------------------------------------------- consent


async def test_without_consent_auto_keeps_a_question_both_sides_match_local(
    remote_cloud, device, private_index
):
    url, tap = await remote_cloud()  # honest, but not the user's: nobody to ask, no consent
    auto = build_mode("auto", remote(device, private_index, url))
    events, _ = await ask(auto, BOTH_Q, options=OPTIONS)
    assert choice_of(events).mode == "local"
    assert "may not take part" in choice_of(events).reason
    assert not [m for m in sent(tap) if isinstance(m, SHAPED)]
    no_secret_in(tap)
    # the control: once the user agrees, the same question is dragon's, drafts and all
    before = len(tap.connections)
    events, _ = await ask(
        auto, BOTH_Q, options=dataclasses.replace(OPTIONS, allow_private_in_cloud=True)
    )
    await auto.close()
    assert choice_of(events).mode == "dragon"
    assert any(isinstance(m, DragonDraft) for m in sent(tap, before))


async def test_without_consent_dragon_answers_on_the_device_and_sends_no_request(
    remote_cloud, device, private_index
):
    url, tap = await remote_cloud()
    dragon = build_mode("dragon", remote(device, private_index, url))
    events, stats = await ask(dragon, PRIVATE_Q, options=OPTIONS)
    notices = [e.text for e in events if isinstance(e, Notice)]
    assert any("answered on this device alone" in n for n in notices)
    assert stats.tokens > 0 and stats.bytes_up == 0
    assert [type(m) for m in sent(tap)] == [Hello]  # the session, to learn which cloud: no more
    # with consent for this answer, dragon exchanges drafts shaped by the notes
    events, _ = await ask(
        dragon, PRIVATE_Q, options=dataclasses.replace(OPTIONS, allow_private_in_cloud=True)
    )
    await dragon.close()
    assert any(isinstance(m, DragonDraft) for m in sent(tap))


def _same(a: list[Message], b: list[Message]) -> bool:
    """The same frames but for request ids (each answer has its own)."""

    def norm(ms: list[Message]) -> list[bytes]:
        return [
            encode(dataclasses.replace(m, request_id=0))
            for m in ms
            if not isinstance(m, Hello | Cancel)
        ]

    return norm(a) == norm(b)


async def test_without_consent_split_drafts_as_if_there_were_no_documents(
    remote_cloud, device, private_index
):
    """Split's frames without consent are those of a device that has no documents at all:
    nothing in them depends on the private passages. With consent they differ (the control)."""
    url, tap = await remote_cloud()
    bare = build_mode("split", remote(device, None, url))
    await ask(bare, PRIVATE_Q, options=OPTIONS)
    await bare.close()
    reference = sent(tap)
    start = len(tap.connections)
    split = build_mode("split", remote(device, private_index, url))
    events, _ = await ask(split, PRIVATE_Q, options=OPTIONS)
    assert any("drafting without your documents" in e.text for e in events if isinstance(e, Notice))
    assert _same(sent(tap, start), reference)
    start = len(tap.connections)
    await split.close()
    split = build_mode("split", remote(device, private_index, url))
    await ask(split, PRIVATE_Q, options=dataclasses.replace(OPTIONS, allow_private_in_cloud=True))
    await split.close()
    assert not _same(sent(tap, start), reference)


# ---------------------------------------------------------------------------- history


async def test_a_cloud_is_never_sent_turns_it_did_not_see(remote_cloud, device, private_index):
    url, tap = await remote_cloud(claim=0.99)
    cloud = build_mode("cloud", remote(device, private_index, url))
    local = Turn("What is my salary?", "Jordan earns 81,250 euros.", "local")
    elsewhere = Turn(
        "Where is the key?",
        "Under the blue flowerpot.",
        "cloud",
        shared="Under the blue flowerpot.",
        shared_with=EMBEDDED,
    )
    await ask(cloud, "And the year after?", [local, elsewhere], options=OPTIONS)
    (generate,) = [m for m in sent(tap) if isinstance(m, Generate)]
    assert generate.history == ()
    no_secret_in(tap)
    # the control: a turn this cloud saw itself does go back to it
    mine = Turn(
        "Name a city.", "Paris.", "cloud", shared="Paris.", shared_with=cloud.cloud_identity()
    )
    await ask(cloud, "And another?", [local, mine], options=OPTIONS)
    await cloud.close()
    asked = [m for m in sent(tap) if isinstance(m, Generate)][-1]
    assert asked.history == ("Name a city.", "Paris.")
