"""The cloud server on loopback with the tiny model: auth, handshake, malformed frames, limits,
metrics, eviction and a cloud-mode answer equal to plain greedy decoding."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloud_backend.config import ConfigError, ServerConfig, load_config
from cloud_backend.engine import Evicted, LLMEngine
from cloud_backend.loading import build_engine
from cloud_backend.server import create_app, run_server
from collab.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    CloudDecode,
    Done,
    Error,
    ErrorCode,
    FinishReason,
    Generate,
    Hello,
    HelloAck,
    Limits,
    Message,
    Mode,
    Ping,
    Pong,
    TokenChunk,
    TopKDraft,
    Verdict,
    decode,
    encode,
)
from collab.sampling import SamplingParams
from model_runtime.generate import generate
from model_runtime.prompting import prompt_ids
from model_runtime.tokenizer import load_tokenizer
from model_runtime.torch_runtime import TorchCausalLM

TOKEN = "test-token-0123456789"
METRICS_TOKEN = "test-metrics-token-0123"
ENGINE_NAME = "tiny-cloud"


@pytest.fixture(scope="module")
def engine(tiny) -> LLMEngine:
    """The tiny model in float32 torch (fast, exact), shared by a module's servers."""
    eng = LLMEngine(TorchCausalLM(tiny["hf"]), load_tokenizer(tiny["hf"]), ENGINE_NAME)
    yield eng
    eng.close()


@dataclass
class Cloud:
    url: str  # ws://host:port/v1/session
    http: str  # http://host:port
    engine: LLMEngine
    config: ServerConfig

    def headers(self, token: str | None = TOKEN) -> dict[str, str]:
        return {} if token is None else {"Authorization": f"Bearer {token}"}

    async def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics as {(name, sorted labels): value}."""
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{self.http}/metrics", headers=self.headers(METRICS_TOKEN)) as resp,
        ):
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = await resp.text()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    async def health(self, status: int = 200, token: str | None = METRICS_TOKEN) -> dict:
        """/healthz, by default with the metrics token: its detail (sessions, model) too."""
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{self.http}/healthz", headers=self.headers(token)) as resp,
        ):
            assert resp.status == status
            return await resp.json()


StartCloud = Callable[..., Awaitable[Cloud]]


@pytest.fixture
async def start_cloud(engine) -> AsyncIterator[StartCloud]:
    """Start real servers (run_server on port 0); all are stopped at the end of the test."""
    tasks: list[asyncio.Task] = []

    async def start(engine: LLMEngine = engine, **overrides) -> Cloud:
        config = ServerConfig(
            **{"port": 0, "token": TOKEN, "metrics_token": METRICS_TOKEN, **overrides}
        )
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(run_server(config, engine, ready=ready.set_result))
        tasks.append(task)
        await asyncio.wait([ready, task], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raises the startup error
        url = ready.result()
        http = url.replace("ws://", "http://").removesuffix("/v1/session")
        return Cloud(url, http, engine, config)

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
async def cloud(start_cloud) -> Cloud:
    return await start_cloud()


# ---------------------------------------------------------------------------- raw sessions


class Raw:
    """A bare websocket speaking frames, to send what a well-behaved client never would."""

    def __init__(self, http: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse):
        self.http, self.ws = http, ws

    async def send(self, msg: Message) -> None:
        await self.ws.send_bytes(encode(msg))

    async def recv(self, timeout: float = 10.0) -> Message:
        wsmsg = await self.ws.receive(timeout=timeout)
        assert wsmsg.type == aiohttp.WSMsgType.BINARY, wsmsg
        return decode(wsmsg.data)

    async def recv_until(self, kind: type[Message], timeout: float = 30.0) -> list[Message]:
        """Frames up to and including the first of `kind`."""
        out: list[Message] = []
        while not out or not isinstance(out[-1], kind):
            out.append(await self.recv(timeout))
        return out

    async def expect_closed(self, timeout: float = 10.0) -> None:
        wsmsg = await self.ws.receive(timeout=timeout)
        assert wsmsg.type in (
            aiohttp.WSMsgType.CLOSE,
            aiohttp.WSMsgType.CLOSING,
            aiohttp.WSMsgType.CLOSED,
        ), wsmsg

    async def ping_pong(self, sent_ns: int = 42) -> Pong:
        await self.send(Ping(sent_ns))
        pong = await self.recv()
        assert isinstance(pong, Pong) and pong.ping_sent_ns == sent_ns
        return pong

    async def close(self) -> None:
        await self.ws.close()
        await self.http.close()


def hello(engine: LLMEngine, mode: Mode = Mode.CLOUD, variant: str = "", **kw) -> Hello:
    return Hello(engine.tokenizer_hash, mode, variant, model_name="tiny-device", **kw)


@contextlib.asynccontextmanager
async def raw(
    cloud: Cloud, greet: Hello | bool | None = True, token: str = TOKEN
) -> AsyncIterator[Raw]:
    """Open a websocket; send Hello (and expect an accepted HelloAck) unless greet is False."""
    http = aiohttp.ClientSession()
    ws = await http.ws_connect(cloud.url, headers=cloud.headers(token))
    session = Raw(http, ws)
    try:
        if greet is not False:
            await session.send(hello(cloud.engine) if greet is True else greet)
            if greet is True:
                ack = await session.recv()
                assert isinstance(ack, HelloAck) and ack.accepted, ack
        yield session
    finally:
        await session.close()


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------------- config


def test_load_config_file_env_and_overrides(tmp_path, monkeypatch):
    path = tmp_path / "tandem.toml"
    path.write_text(
        '[cloud]\nport = 9000\ntoken = "from-file"\nengine = "torch"\nidle_timeout_s = 5\n'
        'model_dir = "~/models/x"\n[cloud.limits]\nmax_draft_tokens = 8\n'
    )
    monkeypatch.delenv("TANDEM_CLOUD_TOKEN", raising=False)
    cfg = load_config(path)
    assert (cfg.port, cfg.token, cfg.engine) == (9000, "from-file", "torch")
    assert cfg.idle_timeout_s == 5.0
    assert cfg.limits.max_draft_tokens == 8 and cfg.limits.max_top_k == Limits().max_top_k
    assert cfg.model_dir is not None and "~" not in str(cfg.model_dir)
    monkeypatch.setenv("TANDEM_CLOUD_TOKEN", "from-env")
    assert load_config(path).token == "from-env"
    assert load_config(path, port=1234, host=None).port == 1234


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[cloud]\nmax_sesions = 3\n", "max_sesions"),
        ('[cloud]\nengine = "tensorrt"\n', "engine"),
        ("[cloud.limits]\nmax_frames = 3\n", r"limits\.max_frames"),
        ('[cloud]\nport = "80"\n', "port"),
        ("[cloud]\ntokens = 5\n", r"\[cloud.tokens\]"),
        ("[cloud]\nrequests_per_minute = -1\n", "requests_per_minute"),
        ("[cloud]\nvllm = 5\n", r"\[cloud.vllm\]"),
    ],
)
def test_load_config_rejects_unknown_and_bad_values(tmp_path, text, match):
    path = tmp_path / "tandem.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)


def test_the_deployment_config_loads(monkeypatch):
    """deploy/cloud.toml (the container's) is a valid config, vLLM arguments included."""
    monkeypatch.setenv("TANDEM_CLOUD_TOKEN", "from-the-secret")
    cfg = load_config(Path(__file__).resolve().parents[1] / "deploy" / "cloud.toml")
    assert (cfg.host, cfg.port, cfg.engine) == ("0.0.0.0", 8765, "ort")
    assert cfg.token == "from-the-secret"
    assert cfg.vllm == {"gpu_memory_utilization": 0.85}
    assert load_config(None, engine="vllm").engine == "vllm"


def test_access_tokens_by_name_from_the_file(tmp_path, monkeypatch, engine):
    monkeypatch.delenv("TANDEM_CLOUD_TOKEN", raising=False)
    path = tmp_path / "tandem.toml"
    path.write_text(
        '[cloud]\nrequests_per_minute = 60\n[cloud.tokens]\nalice = "a-secret"\nbob = "b-secret"\n'
    )
    cfg = load_config(path)
    assert cfg.access_tokens() == {"alice": "a-secret", "bob": "b-secret"}
    assert cfg.requests_per_minute == 60
    create_app(cfg, engine)  # named tokens alone are enough to serve
    assert load_config(path, token="main").access_tokens()["default"] == "main"
    path.write_text('[cloud.tokens]\nalice = "same"\nbob = "same"\n')
    with pytest.raises(ConfigError, match="same"):
        load_config(path).access_tokens()


def test_server_refuses_to_start_without_token(engine):
    for token in (None, ""):
        with pytest.raises(ConfigError, match="TANDEM_CLOUD_TOKEN"):
            create_app(ServerConfig(token=token), engine)


async def test_build_engine_loads_either_runtime(tiny, engine):
    torch_engine = build_engine(
        ServerConfig(engine="torch", torch_dtype="float32", model_dir=tiny["hf"])
    )
    ort_engine = build_engine(
        ServerConfig(engine="ort", model_dir=tiny["onnx-fp32"], model_name="tiny-ort")
    )
    try:
        assert torch_engine.name == "hf" and ort_engine.name == "tiny-ort"
        assert torch_engine.tokenizer_hash == ort_engine.tokenizer_hash == engine.tokenizer_hash
        a = await torch_engine.open_session().prefill([1, 2, 3])
        b = await ort_engine.open_session().prefill([1, 2, 3])
        assert int(np.argmax(a)) == int(np.argmax(b))
    finally:
        torch_engine.close()
        ort_engine.close()
    with pytest.raises(ConfigError, match="does not exist"):
        build_engine(ServerConfig(engine="torch", model_dir=tiny["hf"] / "missing"))


# ---------------------------------------------------------------------------- HTTP endpoints


async def test_healthz(cloud):
    health = await cloud.health()
    assert health["status"] == "ok"
    assert health["model"] == ENGINE_NAME
    assert health["sessions"] == 0
    assert health["uptime_s"] >= 0


@pytest.mark.parametrize("token", [None, TOKEN, "wrong"])
async def test_healthz_says_only_its_status_without_the_metrics_token(cloud, token):
    """The public frontend's /healthz (a balancer's check needs only its status code) names
    neither the model nor the load; an access token is not the metrics token."""
    assert await cloud.health(token=token) == {"status": "ok"}


async def test_healthz_has_its_detail_on_the_metrics_bind(start_cloud, caplog):
    """With a metrics bind and no metrics token, the detail is on that bind alone."""
    with caplog.at_level(logging.INFO, logger="tandem.cloud"):
        cloud = await start_cloud(metrics_token=None, metrics_port=0)
    serving = next(r.getMessage() for r in caplog.records if "metrics_serving" in r.getMessage())
    bind = re.search(r"url=(http://\S+)/metrics", serving)
    assert bind is not None, serving
    assert await cloud.health(token=None) == {"status": "ok"}
    async with aiohttp.ClientSession() as http, http.get(bind[1] + "/healthz") as resp:
        assert resp.status == 200
        detail = await resp.json()
    assert detail["status"] == "ok" and detail["model"] == ENGINE_NAME
    assert detail["sessions"] == 0


async def test_healthz_says_503_once_the_engine_is_down(start_cloud, tiny):
    engine = LLMEngine(TorchCausalLM(tiny["hf"]), load_tokenizer(tiny["hf"]), ENGINE_NAME)
    cloud = await start_cloud(engine)
    assert (await cloud.health())["status"] == "ok"
    engine.close()  # as a crashed engine: the replica must leave the load balancer's pool
    await asyncio.sleep(0.05)
    assert (await cloud.health(503))["status"] == "engine down"


async def test_metrics_are_prometheus_text_and_move(cloud):
    before = await cloud.metrics()
    for name in (
        "tandem_sessions",
        "tandem_kv_cache_bytes",
        "tandem_rounds_total",
        "tandem_drafted_tokens_total",
        "tandem_accepted_tokens_total",
        "tandem_evictions_total",
        "tandem_round_seconds_count",
        "tandem_ttft_seconds_count",
    ):
        assert (name, ()) in before, name
    up = ("tandem_bytes_total", (("direction", "up"),))
    assert before[up] == 0
    async with raw(cloud) as s:
        await s.ping_pong()
        await s.ws.send_bytes(b"junk")
        assert isinstance(await s.recv(), Error)
        await s.send(Generate("hi", max_new_tokens=3, request_id=1))
        await s.recv_until(Done)
        during = await cloud.metrics()
        assert during[("tandem_sessions", ())] == 1
        assert (await cloud.health())["sessions"] == 1
    after = await cloud.metrics()
    assert after[up] > 0
    assert after[("tandem_bytes_total", (("direction", "down"),))] > 0
    assert after[("tandem_errors_total", (("code", "MALFORMED"),))] == 1
    assert after[("tandem_tokens_total", (("mode", "cloud"),))] >= 1
    assert after[("tandem_ttft_seconds_count", ())] == 1
    assert after[("tandem_step_seconds_count", (("kind", "prefill"),))] >= 1
    await wait_for(lambda: _sessions_now(cloud, 0))


async def _sessions_now(cloud: Cloud, n: int) -> bool:
    return (await cloud.metrics())[("tandem_sessions", ())] == n


# ---------------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    ("token", "reason"), [(None, "missing access token"), ("wrong", "wrong access token")]
)
async def test_bad_token_gets_401_before_upgrade(cloud, token, reason):
    url = cloud.url.replace("ws://", "http://")
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers=cloud.headers(token)) as r:
            assert r.status == 401
            assert reason in await r.text()
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await http.ws_connect(cloud.url, headers=cloud.headers(token))
        assert info.value.status == 401
    metrics = await cloud.metrics()
    assert metrics[("tandem_errors_total", (("code", "AUTH"),))] == 2


async def test_right_token_without_upgrade_is_400(cloud):
    async with aiohttp.ClientSession() as http:
        url = cloud.url.replace("ws://", "http://")
        async with http.get(url, headers=cloud.headers()) as r:
            assert r.status == 400


# ---------------------------------------------------------------------------- handshake


async def test_tokenizer_mismatch_refused_naming_both_models(cloud):
    other = Hello(b"\x01" * 32, Mode.SPLIT, "tk-slt", model_name="smollm2-135m")
    async with raw(cloud, greet=other) as s:
        ack = await s.recv()
        assert isinstance(ack, HelloAck) and not ack.accepted
        assert "smollm2-135m" in ack.reason and ENGINE_NAME in ack.reason
        assert "vocabulary" in ack.reason
        await s.expect_closed()


@pytest.mark.parametrize(
    ("mode", "variant", "needle"),
    [
        (Mode.LOCAL, "", "local"),
        (Mode.EXPERIMENTAL, "", "experimental"),
        (Mode.SPLIT, "medusa", "medusa"),
    ],
)
async def test_unsupported_mode_or_variant_refused(cloud, mode, variant, needle):
    async with raw(cloud, greet=hello(cloud.engine, mode, variant)) as s:
        ack = await s.recv()
        assert isinstance(ack, HelloAck) and not ack.accepted
        assert needle in ack.reason and "split" in ack.reason
        await s.expect_closed()


async def test_split_with_default_variant_accepted(cloud):
    async with raw(cloud, greet=hello(cloud.engine, Mode.SPLIT, "")) as s:
        ack = await s.recv()
        assert isinstance(ack, HelloAck) and ack.accepted
        assert ack.model_name == ENGINE_NAME and ack.limits == cloud.config.limits


async def test_other_protocol_version_refused(cloud):
    frame = bytearray(encode(hello(cloud.engine)))
    frame[2] = PROTOCOL_VERSION + 1
    async with raw(cloud, greet=False) as s:
        await s.ws.send_bytes(bytes(frame))
        ack = await s.recv()
        assert isinstance(ack, HelloAck) and not ack.accepted
        assert f"version {PROTOCOL_VERSION + 1}" in ack.reason


async def test_frames_before_hello_get_errors_then_hello_works(cloud):
    async with raw(cloud, greet=False) as s:
        await s.send(Ping(1))
        err = await s.recv()
        assert isinstance(err, Error) and err.code == ErrorCode.MALFORMED
        assert "Hello" in err.message
        await s.ws.send_str("hello?")
        assert isinstance(await s.recv(), Error)
        await s.send(hello(cloud.engine))
        ack = await s.recv()
        assert isinstance(ack, HelloAck) and ack.accepted


async def test_max_sessions(start_cloud):
    """Past capacity the upgrade itself is refused: 503 with Retry-After, before any websocket
    (a socket that has not said Hello yet holds a slot too); the device's client says so."""
    from edge_runtime.client import CloudBusy, CloudClient

    cloud = await start_cloud(max_sessions=2)
    async with raw(cloud), raw(cloud, greet=False):  # one session, one socket before Hello
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(cloud.url, headers=cloud.headers())
        assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "5"
        device = CloudClient(cloud.url, TOKEN, Mode.CLOUD, "", cloud.engine.tokenizer_hash, "d")
        with pytest.raises(CloudBusy, match=r"overloaded .*try again in 5 s") as busy:
            await device.connect(retries=3)  # not retried: the cloud said when
        assert busy.value.retry_after_s == 5
        metrics = await cloud.metrics()
        assert metrics[("tandem_handshake_refusals_total", (("reason", "busy"),))] == 2
    await wait_for(lambda: _sessions_now(cloud, 0))
    async with raw(cloud) as again:  # capacity is back
        await again.ping_pong()


# ---------------------------------------------------------------------------- robustness


async def test_malformed_frames_get_errors_and_the_session_survives(cloud):
    async with raw(cloud) as s:
        truncated = encode(Ping(5, request_id=7))[:-3]
        verdict = Verdict(0, 1, request_id=3)  # a cloud→device frame
        cases = [
            (b"\x00garbage\xff" * 3, 0, ""),
            (truncated, 7, "body length"),
            (encode(verdict), 3, "Verdict"),
            (encode(TopKDraft([1], [[1]], [[1.0]], request_id=99)), 99, "no active request 99"),
        ]
        for frame, rid, needle in cases:
            await s.ws.send_bytes(frame)
            err = await s.recv()
            assert isinstance(err, Error) and err.code == ErrorCode.MALFORMED, err
            assert err.request_id == rid and needle in err.message
            await s.ping_pong()
        await s.ws.send_str("not binary")
        err = await s.recv()
        assert isinstance(err, Error) and err.code == ErrorCode.MALFORMED
        assert "binary" in err.message
        pong = await s.ping_pong(sent_ns=123)
        assert pong.sent_ns >= pong.received_ns


async def test_malformed_dragon_frames_get_errors_and_the_answer_goes_on(cloud):
    """A device that sends broken DRAGON frames mid-answer gets an Error for each; the cloud's
    answer (it aggregates) goes on with the valid drafts that follow, to its Done."""
    from collab.protocol import AggregatorPolicy, DragonDraft, DragonSetup, DragonTarget, Side

    def draft(step: int, epoch: int, token: int = 1000) -> DragonDraft:
        return DragonDraft(
            token, [token, 1001], [0.75, 0.25], 0.0, 0.01, request_id=1, epoch=epoch, step=step
        )

    async with raw(cloud, greet=hello(cloud.engine, Mode.DRAGON)) as s:
        await s.send(Generate("Hi", max_new_tokens=4, retrieve=False, request_id=1))
        await s.send(DragonSetup(2, AggregatorPolicy.CLOUD, Side.CLOUD, request_id=1))
        bad_token = encode(draft(0, 0, token=5))[:-12] + encode(draft(0, 0))[-12:]
        cases = [
            (encode(draft(0, 0))[:-3], "body length"),  # truncated
            (bad_token, "outside its transmitted distribution"),
            (encode(DragonTarget(7, True, True, Side.CLOUD, request_id=1)), "not aggregating"),
        ]
        for frame, needle in cases:
            await s.ws.send_bytes(frame)
            frames = await s.recv_until(Error)
            assert frames[-1].code == ErrorCode.MALFORMED and needle in frames[-1].message
        step = epoch = 0
        done = None
        await s.send(draft(0, 0))
        while done is None:
            msg = await s.recv()
            if isinstance(msg, DragonTarget):
                assert msg.step == step
                epoch += not msg.device_accepted
                step += 1
                await s.send(draft(step, epoch))
            elif isinstance(msg, Done):
                done = msg
        assert done.reason in (FinishReason.STOP, FinishReason.LENGTH) and step >= 1
        await s.ping_pong()


async def test_idle_timeout_closes_with_an_error(start_cloud):
    cloud = await start_cloud(idle_timeout_s=0.3)
    async with raw(cloud) as s:
        err = await s.recv(timeout=5)
        assert isinstance(err, Error) and err.code == ErrorCode.LIMIT
        assert "idle timeout" in err.message
        await s.expect_closed()
    async with raw(cloud, greet=False) as s:  # also before the handshake
        err = await s.recv(timeout=5)
        assert isinstance(err, Error) and err.code == ErrorCode.LIMIT
        await s.expect_closed()


async def test_streaming_is_activity_but_a_silent_split_request_is_idle(start_cloud, engine):
    cloud = await start_cloud(idle_timeout_s=0.15)
    async with raw(cloud) as s:
        await s.send(Generate("Tell me everything.", max_new_tokens=200, request_id=1))
        frames = await s.recv_until(Done)
        assert frames[-1].elapsed_s > 0.15  # longer than the idle timeout, yet not cut off
        assert not any(isinstance(f, Error) for f in frames)
    async with raw(cloud, greet=hello(engine, Mode.SPLIT, "tk-slt")) as s:
        assert (await s.recv()).accepted
        await s.send(Generate("hello", request_id=1))  # then no drafts ever come
        first = await s.recv(timeout=5)  # the first token, straight from the prefill
        assert isinstance(first, TokenChunk) and first.step == 0
        err = await s.recv(timeout=5)
        assert isinstance(err, Error) and err.code == ErrorCode.LIMIT
        await s.expect_closed()


async def test_oversized_frames_close_with_1009(start_cloud):
    """The transport takes the largest legal frame and no more: one byte past it closes the
    connection with 1009 (message too big) before it is buffered."""
    cloud = await start_cloud(limits=Limits(max_frame_bytes=4096))
    async with raw(cloud) as s:
        await s.send(TokenChunk(np.arange(900), request_id=1))  # ~3.6 KB: read, then refused
        err = await s.recv()
        assert isinstance(err, Error) and "no active request 1" in err.message
        await s.ws.send_bytes(encode(Ping(1)) + bytes(4096))  # over the limit
        wsmsg = await s.ws.receive(timeout=5)
        assert wsmsg.type == aiohttp.WSMsgType.CLOSE and wsmsg.data == 1009


# ---------------------------------------------------------------------------- requests


async def test_cloud_mode_greedy_equals_plain_greedy(cloud, tiny):
    question = "What is a KV cache?"
    async with raw(cloud) as s:
        await s.send(Generate(question, max_new_tokens=24, temperature=0.0, request_id=1))
        frames = await s.recv_until(Done)
    chunks = [f for f in frames if isinstance(f, TokenChunk)]
    assert chunks and all(f.request_id == 1 for f in frames)
    done = frames[-1]
    assert isinstance(done, Done) and done.reason in (FinishReason.STOP, FinishReason.LENGTH)
    got = [int(t) for c in chunks for t in c.token_ids]
    assert done.tokens == len(got)
    assert done.bytes_up == len(encode(Generate(question, 24, 0.0, request_id=1)))
    assert done.bytes_down == sum(len(encode(f)) for f in frames[:-1])
    lm = TorchCausalLM(tiny["hf"])
    ids = prompt_ids(cloud.engine.tokenizer, question)
    want = list(generate(lm, ids, SamplingParams(temperature=0.0), np.random.default_rng(0), 24))
    assert got == want


async def test_ping_answered_while_a_request_runs_and_busy_and_cancel(cloud):
    async with raw(cloud) as s:
        await s.send(Generate("Tell me a long story.", max_new_tokens=200, request_id=5))
        first = await s.recv()
        assert isinstance(first, TokenChunk)
        await s.send(Ping(77))
        await s.send(Generate("another", request_id=6))
        seen: list[Message] = []
        while not (
            any(isinstance(m, Pong) for m in seen) and any(isinstance(m, Done) for m in seen)
        ):
            seen.append(await s.recv())
        # the second request is turned down, and ended (its Done), while the first runs on
        busy = next(m for m in seen if isinstance(m, Error))
        assert busy.code == ErrorCode.BUSY and busy.request_id == 6
        ended = next(m for m in seen if isinstance(m, Done))
        assert ended.reason == FinishReason.ERROR and ended.request_id == 6
        await s.send(Cancel(request_id=5))
        done = (await s.recv_until(Done))[-1]
        assert done.request_id == 5
        assert done.reason == FinishReason.CANCELLED and done.tokens < 200
        # a late frame for the finished request is dropped silently, not an error
        await s.send(Cancel(request_id=5))
        await s.ping_pong(9)
        # request ids must increase (the refused 6 counts)
        await s.send(Generate("again", request_id=6))
        err = await s.recv()
        assert isinstance(err, Error) and "not newer" in err.message


async def test_cancel_stops_a_long_prefill_at_once(start_cloud, tiny):
    """A Cancel interrupts the engine step in flight (here a prefill made slow by sleeping in
    each layer: 1 s) instead of waiting for it; the session then answers the next request."""
    lm = TorchCausalLM(tiny["hf"])
    slow = LLMEngine(lm, load_tokenizer(tiny["hf"]), ENGINE_NAME)
    for layer in lm.model.model.layers:  # after the runtime's own stop checks
        layer.register_forward_pre_hook(lambda module, args: time.sleep(0.5))
    cloud = await start_cloud(engine=slow)
    try:
        async with raw(cloud) as s:
            await s.send(Generate("Tell me a story.", max_new_tokens=2, request_id=1))
            await asyncio.sleep(0.15)
            cancelled_at = time.perf_counter()
            await s.send(Cancel(request_id=1))
            done = (await s.recv_until(Done))[-1]
            waited = time.perf_counter() - cancelled_at
            assert done.reason == FinishReason.CANCELLED and done.tokens == 0
            assert waited < 0.6, f"the prefill ran on for {waited:.2f} s after the Cancel"
            await s.send(Generate("hi", max_new_tokens=1, request_id=2))
            done = (await s.recv_until(Done, timeout=30))[-1]
            assert done.reason in (FinishReason.STOP, FinishReason.LENGTH) and done.tokens == 1
    finally:
        slow.close()


async def test_split_session_routes_cloud_decode_to_the_request(start_cloud, engine):
    cloud = await start_cloud()
    async with raw(cloud, greet=hello(engine, Mode.SPLIT, "tk-slt")) as s:
        assert (await s.recv()).accepted
        await s.send(Generate("hello", max_new_tokens=50, request_id=1))
        first = await s.recv()  # the first token comes from the prefill
        assert isinstance(first, TokenChunk) and first.step == 0
        await s.send(CloudDecode(4, request_id=1, step=1))
        chunks = [await s.recv() for _ in range(4)]
        assert all(isinstance(c, TokenChunk) and c.token_ids.size == 1 for c in chunks)
        assert [c.step for c in chunks] == [1, 2, 3, 4]
        await s.send(Cancel(request_id=1))
        done = (await s.recv_until(Done))[-1]
        assert done.reason == FinishReason.CANCELLED and done.tokens == 5


async def test_disconnect_mid_request_closes_the_engine_session(cloud):
    async with raw(cloud) as s:
        await s.send(Generate("a story", max_new_tokens=200, request_id=1))
        assert isinstance(await s.recv(), TokenChunk)
    await wait_for(lambda: _sessions_now(cloud, 0))
    assert cloud.engine.cache_bytes == 0
    async with raw(cloud) as s:  # the engine still serves
        await s.send(Generate("hi", max_new_tokens=2, request_id=1))
        assert isinstance((await s.recv_until(Done))[-1], Done)


# ---------------------------------------------------------------------------- eviction


async def test_engine_evicts_the_least_recently_used_session(tiny):
    lm = TorchCausalLM(tiny["hf"])
    engine = LLMEngine(lm, load_tokenizer(tiny["hf"]), "tiny", kv_budget_bytes=1)
    evicted: list[str] = []
    try:
        a = engine.open_session(on_evict=lambda: evicted.append("a"))
        b = engine.open_session(on_evict=lambda: evicted.append("b"))
        await a.prefill([1, 2, 3])
        await b.prefill([4, 5, 6])  # over budget: a (least recently used) loses its cache
        assert evicted == ["a"] and engine.evictions == 1
        with pytest.raises(Evicted):
            await a.forward([7])
        await b.forward([7])  # b is untouched
        assert b.length == 4
    finally:
        engine.close()


async def test_eviction_is_counted_and_reported_to_its_session(start_cloud, tiny):
    engine = LLMEngine(
        TorchCausalLM(tiny["hf"]), load_tokenizer(tiny["hf"]), "tiny", kv_budget_bytes=1
    )
    try:
        cloud = await start_cloud(engine=engine)
        async with raw(cloud) as a, raw(cloud) as b:
            await a.send(Generate("first question", max_new_tokens=60, request_id=1))
            await b.send(Generate("second question", max_new_tokens=60, request_id=1))
            fa, fb = await asyncio.gather(a.recv_until(Done), b.recv_until(Done))
        errors = [f for f in fa + fb if isinstance(f, Error)]
        assert any(e.code == ErrorCode.EVICTED for e in errors), errors
        assert any(f.reason == FinishReason.ERROR for f in (fa[-1], fb[-1]))
        metrics = await cloud.metrics()
        assert metrics[("tandem_evictions_total", ())] >= 1
    finally:
        engine.close()
