"""The cloud locked down (issue 16): TLS with a certificate the device verifies (a custom CA
can be given), no ws:// to another machine unless the user allows it, wrong tokens throttled
per address, each access token held to its own request rate, /metrics and /healthz free of
session content, and no session able to touch another's request."""

from __future__ import annotations

import ssl

import aiohttp
import numpy as np
import pytest
import trustme

from cloud_backend import admission
from cloud_backend.admission import RequestRate
from collab.protocol import (
    Cancel,
    Done,
    Error,
    ErrorCode,
    FinishReason,
    Generate,
    Mode,
    TokenChunk,
)
from edge_runtime.client import CloudClient, CloudUntrusted
from edge_runtime.events import Failure
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions
from tests import test_server
from tests.test_modes import QUESTIONS, ask, context
from tests.test_server import METRICS_TOKEN, TOKEN, raw

engine, start_cloud, cloud = test_server.engine, test_server.start_cloud, test_server.cloud
ALICE = "alice-" + "s" * 20  # a second user's access token


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def tls_cloud(start_cloud, ca, tmp_path):
    cert = ca.issue_cert("127.0.0.1", "localhost")
    chain, key = tmp_path / "chain.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(chain))
    cert.private_key_pem.write_to_path(str(key))
    return await start_cloud(tls_cert=chain, tls_key=key)


def device(url: str, tokenizer_hash: bytes = b"\x01" * 32, **kw) -> CloudClient:
    return CloudClient(url, TOKEN, Mode.CLOUD, "", tokenizer_hash, "d", **kw)


async def test_tls_with_a_custom_ca_and_the_bytes_on_the_wire_are_not_plain(
    tls_cloud, ca, tmp_path
):
    assert tls_cloud.url.startswith("wss://")
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    sent: list[bytes] = []
    client = device(tls_cloud.url, tls_cloud.engine.tokenizer_hash, ca_file=str(bundle))
    client.on_frame_sent = sent.append
    async with client:
        await client.send(Generate("a very private question", max_new_tokens=3, request_id=1))
        while not isinstance(await client.recv(timeout=30), Done):
            pass
    assert any(b"a very private question" in f for f in sent)  # before encryption
    # the same server refuses a client that speaks plain websocket to it
    plain = device(tls_cloud.url.replace("wss://", "ws://"), tls_cloud.engine.tokenizer_hash)
    with pytest.raises(Exception, match="cloud"):
        await plain.connect()
    await plain.close()


async def test_a_certificate_that_does_not_verify_is_refused_in_plain_words(tls_cloud):
    client = device(tls_cloud.url)  # the system's trust store does not know the test CA
    with pytest.raises(CloudUntrusted, match="did not prove who it is"):
        await client.connect(retries=3)  # and it is not retried
    await client.close()


@pytest.mark.parametrize("host", ["10.255.255.1", "example.org", "[2001:db8::1]"])
async def test_plain_ws_to_another_machine_is_refused_unless_allowed(host):
    client = device(f"ws://{host}:8765/v1/session", connect_timeout=0.5)
    with pytest.raises(CloudUntrusted, match="unencrypted"):
        await client.connect()
    allowed = device(f"ws://{host}:8765/v1/session", connect_timeout=0.5, allow_insecure=True)
    with pytest.raises(Exception) as tried:  # it tries (and cannot reach it from here)
        await allowed.connect()
    assert not isinstance(tried.value, CloudUntrusted)


async def test_each_access_token_has_its_own_request_rate(start_cloud):
    """Past its rate a token's Generate gets RATE_LIMITED (saying when to retry) and its Done,
    and the session goes on; another user's token is not held back by it."""
    cloud = await start_cloud(tokens={"alice": ALICE}, requests_per_minute=2)
    async with raw(cloud) as s:
        for rid in (1, 2):
            await s.send(Generate("hi", max_new_tokens=1, request_id=rid))
            assert (await s.recv_until(Done))[-1].reason == FinishReason.LENGTH
        await s.send(Generate("hi", max_new_tokens=1, request_id=3))
        error, done = await s.recv_until(Done)
        assert isinstance(error, Error) and error.code == ErrorCode.RATE_LIMITED
        assert "2 requests per minute" in error.message and "retry in" in error.message
        assert isinstance(done, Done) and done.reason == FinishReason.ERROR
        assert done.request_id == error.request_id == 3
        await s.ping_pong()  # the session survives
        async with raw(cloud, token=ALICE) as alice:
            await alice.send(Generate("hi", max_new_tokens=1, request_id=1))
            assert (await alice.recv_until(Done))[-1].reason == FinishReason.LENGTH
        metrics = await cloud.metrics()
        assert metrics[("tandem_handshake_refusals_total", (("reason", "rate"),))] == 1


def test_the_request_rate_refills_at_its_rate(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: now[0])
    rate = RequestRate(per_minute=6)  # one every 10 s, bursts of 6
    assert [rate.take("a") for _ in range(6)] == [0.0] * 6
    assert rate.take("a") == pytest.approx(10.0)
    assert rate.take("b") == 0.0  # each name its own
    now[0] += 4.0
    assert rate.take("a") == pytest.approx(6.0)  # nothing spent by a refusal
    now[0] += 6.0
    assert rate.take("a") == 0.0 and rate.take("a") > 0
    now[0] += 3600.0  # a long pause refills one burst, not more
    assert [rate.take("a") for _ in range(7)].count(0.0) == 6
    assert RequestRate(per_minute=0).take("a") == 0.0  # off


@pytest.mark.parametrize("mode", ["cloud", "split", "dragon"])
async def test_a_rate_limited_question_is_answered_on_the_device(start_cloud, near_drafter, mode):
    cloud = await start_cloud(requests_per_minute=1, corpus_enabled=False)
    assistant = build_mode(mode, context(near_drafter, cloud.url))
    options = AnswerOptions(max_new_tokens=4, temperature=0.0)
    _, first, events = await ask(assistant, QUESTIONS[0], options)
    assert not any(isinstance(e, Failure) for e in events) and first.tokens > 0
    _, second, events = await ask(assistant, QUESTIONS[1], options)
    failures = [e for e in events if isinstance(e, Failure)]
    assert len(failures) == 1 and failures[0].recoverable, failures
    assert "turned the question down" in failures[0].message
    assert "requests per minute" in failures[0].message
    assert second.tokens > 0  # the device answered
    await assistant.close()


async def test_metrics_and_healthz_reveal_no_session_content(cloud):
    secret = "my bank PIN is qzvx-4711"  # a word no metric's name or value can hold
    async with raw(cloud) as s:
        await s.send(Generate(secret, max_new_tokens=4, request_id=1))
        await s.recv_until(Done)
        async with aiohttp.ClientSession() as http:
            bodies = []
            for path in ("/metrics", "/healthz"):
                headers = cloud.headers(METRICS_TOKEN)  # /healthz asks none
                async with http.get(cloud.http + path, headers=headers) as resp:
                    assert resp.status == 200
                    bodies.append(await resp.text())
    for body in bodies:
        # not "4711": a byte count or a duration can hold those digits by chance (it did)
        assert "qzvx" not in body and "bank" not in body and TOKEN not in body
        assert "127.0.0.1" not in body  # no peer addresses either


async def test_a_session_cannot_touch_another_sessions_request(cloud):
    """B sends a Cancel and a correction with A's request id: B gets an error, A's answer
    runs to its end."""
    async with raw(cloud) as a, raw(cloud) as b:
        await a.send(Generate("Tell me a long story.", max_new_tokens=60, request_id=1))
        first = await a.recv()
        assert isinstance(first, TokenChunk)
        await b.send(Cancel(request_id=1))
        await b.send(TokenChunk(np.asarray([5]), request_id=1))
        errors = [await b.recv(), await b.recv()]
        assert all(isinstance(e, Error) and "no active request 1" in e.message for e in errors)
        done = (await a.recv_until(Done, timeout=60))[-1]
        assert done.reason == FinishReason.LENGTH and done.tokens == 60


def test_the_servers_tls_context_refuses_old_protocols(tmp_path, ca):
    from cloud_backend.config import ServerConfig
    from cloud_backend.server import tls_context

    cert = ca.issue_cert("localhost")
    chain, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(chain))
    cert.private_key_pem.write_to_path(str(key))
    ctx = tls_context(ServerConfig(token="t", tls_cert=chain, tls_key=key))
    assert ctx is not None and ctx.minimum_version == ssl.TLSVersion.TLSv1_2


async def test_the_token_is_never_logged(start_cloud, caplog):
    caplog.set_level("DEBUG", logger="tandem")
    cloud = await start_cloud(tokens={"alice": ALICE})
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await http.ws_connect(cloud.url, headers={"Authorization": "Bearer guess-1234"})
    for token in (TOKEN, ALICE):
        async with raw(cloud, token=token) as s:
            await s.send(Generate("hello", max_new_tokens=2, request_id=1))
            await s.recv_until(Done)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "auth_refused" in text and "session_open" in text  # the log did run
    assert "user=alice" in text and "user=default" in text  # who, by name
    assert TOKEN not in text and "guess-1234" not in text and ALICE not in text
