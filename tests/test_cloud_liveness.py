"""The cloud stays responsive for everyone (issue 33): one session's huge question does not
stall the others' heartbeats and tokens, and an engine thread that fails says so at once
instead of leaving every session waiting for its idle timeout."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from cloud_backend.engine import LLMEngine
from collab.protocol import Done, Error, ErrorCode, FinishReason, Generate, Ping, Pong, TokenChunk
from model_runtime.tokenizer import load_tokenizer
from model_runtime.torch_runtime import TorchCausalLM
from tests import test_server
from tests.test_server import raw

engine, start_cloud = test_server.engine, test_server.start_cloud

# a question and history filling most of a 4 MiB frame (each text at most 256 KiB); the
# prompt is tokenised several times while old exchanges are left out to fit the context
TEXT = "word " * (250 * 1024 // 5)
HUGE = Generate(TEXT, history=[TEXT] * 14, max_new_tokens=8, request_id=1)
STALL_BOUND_S = 1.0


async def test_a_4_mib_question_does_not_stall_other_sessions(start_cloud):
    cloud = await start_cloud(heartbeat_s=None)  # the Pings below measure the loop instead
    async with raw(cloud) as huge, raw(cloud) as other:
        await other.send(Generate("Tell me everything.", max_new_tokens=400, request_id=1))
        assert isinstance(await other.recv(), TokenChunk)  # the other answer is streaming
        await huge.send(HUGE)
        start, gaps, rtts = time.monotonic(), [], []
        last = start
        huge_done = asyncio.create_task(huge.recv_until(Done))
        answered = False
        while not huge_done.done() or not answered:
            sent = time.monotonic()
            await other.send(Ping(time.monotonic_ns()))
            while True:  # this session's frames: its tokens, then the Pong
                msg = await other.recv(timeout=30)
                now = time.monotonic()
                if isinstance(msg, Pong):
                    rtts.append(now - sent)
                    break
                gaps.append(now - last)
                last = now
                if isinstance(msg, Done):
                    answered = True
            await asyncio.sleep(0.05)
        frames = await huge_done
    took = time.monotonic() - start
    error = next(f for f in frames if isinstance(f, Error))  # it cannot fit the context
    assert error.code == ErrorCode.LIMIT and "fills the context" in error.message
    assert frames[-1].reason == FinishReason.ERROR
    assert took > STALL_BOUND_S  # the huge question's work overlapped the measurement
    assert max(rtts) < STALL_BOUND_S, (max(rtts), took)
    assert max(gaps) < STALL_BOUND_S, (max(gaps), took)


class Boom(RuntimeError):
    pass


def boom(kind: str, positions: int, seconds: float) -> None:
    raise Boom("an observer failed on the engine thread")


@pytest.mark.timeout(60)  # before the guard, the steps waited for ever
async def test_a_failing_engine_thread_fails_its_steps_and_says_so(tiny, caplog):
    engine = LLMEngine(TorchCausalLM(tiny["hf"]), load_tokenizer(tiny["hf"]), "tiny", on_step=boom)
    try:
        a, b = engine.open_session(), engine.open_session()
        with caplog.at_level(logging.CRITICAL, "tandem.cloud"):
            results = await asyncio.wait_for(
                asyncio.gather(a.prefill([1, 2, 3]), b.prefill([4, 5]), return_exceptions=True),
                timeout=10,
            )  # nothing left waiting
        assert all(isinstance(r, RuntimeError) and "engine stopped" in str(r) for r in results)
        assert not engine.alive
        assert any("engine_failed" in r.message and "Boom" in r.message for r in caplog.records)
        with pytest.raises(RuntimeError, match="engine stopped"):
            await a.forward([7])  # refused at once, not queued for ever
    finally:
        engine.close()


@pytest.mark.timeout(60)
async def test_a_failed_engine_answers_with_an_error_and_health_503(start_cloud, tiny):
    engine = LLMEngine(TorchCausalLM(tiny["hf"]), load_tokenizer(tiny["hf"]), "tiny")
    try:
        cloud = await start_cloud(engine=engine)
        await cloud.health(200)
        engine.on_step = boom  # (the server's metrics observer, replaced by a failing one)
        async with raw(cloud) as s:
            await s.send(Generate("hello", max_new_tokens=4, request_id=1))
            frames = await s.recv_until(Done, timeout=10)
            error = next(f for f in frames if isinstance(f, Error))
            assert error.code == ErrorCode.INTERNAL and frames[-1].reason == FinishReason.ERROR
            await s.send(Generate("again", max_new_tokens=4, request_id=2))
            frames = await s.recv_until(Done, timeout=10)
            assert frames[-1].reason == FinishReason.ERROR
        assert (await cloud.health(503))["status"] == "engine down"
    finally:
        engine.close()
