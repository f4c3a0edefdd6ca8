"""A new mode or split variant is one module per side plus one registry line: the toy
extensions in tests/toy_extensions/ are registered here, from outside the packages, and then
show up everywhere the user picks a mode or variant and work end to end over a real server
on loopback (tiny models)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestServer

from app.cli import build_parser
from app.settings import Settings, settings_problems
from cloud_backend.config import ServerConfig
from cloud_backend.engine import LLMEngine
from cloud_backend.server import create_app
from collab import variants
from edge_runtime import modes as device_modes
from edge_runtime.device import DeviceModel
from edge_runtime.events import Stats, TextDelta
from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext
from model_runtime.ort_runtime import OrtCausalLM
from model_runtime.torch_runtime import TorchCausalLM
from tests import toy_extensions

TOKEN = "test-token-0123456789"


@pytest.fixture
def registered():
    with toy_extensions.registered():
        yield


@pytest.fixture
async def cloud_url(tiny, tiny_tokenizer):
    engine = LLMEngine(TorchCausalLM(tiny["hf"]), tiny_tokenizer, "tiny-cloud")
    server = TestServer(create_app(ServerConfig(token=TOKEN, corpus_enabled=False), engine),
                        host="127.0.0.1")  # fmt: skip
    await server.start_server()
    yield f"ws://127.0.0.1:{server.port}/v1/session"
    await server.close()


@pytest.fixture(scope="module")
def device(tiny, tiny_tokenizer) -> DeviceModel:
    return DeviceModel(OrtCausalLM(tiny["onnx-quant"]), tiny_tokenizer, "tiny-device")


def choices(option: str) -> list[str]:
    ask = build_parser()._subparsers._group_actions[0].choices["ask"]  # type: ignore[union-attr]
    return next(a for a in ask._actions if option in a.option_strings).choices


def test_registered_mode_and_variant_are_offered_everywhere(registered):
    assert "shout" in choices("--mode") and "toy-argmax" in choices("--variant")
    assert settings_problems(Settings(variant="toy-argmax", default_mode="shout")) == []


def test_unregistered_names_are_refused():
    assert "shout" not in choices("--mode") and "toy-argmax" not in choices("--variant")
    assert any("variant" in p for p in settings_problems(Settings(variant="toy-argmax")))
    with pytest.raises(ValueError, match="unknown split variant"):
        variants.get_variant("toy-argmax")


async def answer(mode, question: str, options: AnswerOptions) -> tuple[str, Stats]:
    events = [e async for e in mode.answer(question, [], options)]
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return text, next(e for e in events if isinstance(e, Stats))


async def test_a_registered_mode_answers_through_both_of_its_sides(registered, device, cloud_url):
    ctx = ModeContext(device=device, cloud=CloudSettings(cloud_url, TOKEN))
    mode = device_modes.build_mode("shout", ctx)
    try:
        text, stats = await answer(mode, "what is a tandem?", AnswerOptions(max_new_tokens=40))
    finally:
        await mode.close()
    assert text == "WHAT IS A TANDEM?" and stats.mode == "shout" and stats.bytes_up > 0


async def test_a_registered_variant_is_exact_through_split_mode(registered, device, cloud_url):
    """Greedy split with the toy variant gives the cloud's own greedy answer, token for token
    (the cloud judged the toy's drafts with the toy's judge)."""
    options = AnswerOptions(max_new_tokens=24, temperature=0.0)
    question = "Write a haiku about autumn rain."
    got = {}
    for name, variant in (("cloud", "tk-slt"), ("split", "toy-argmax")):
        ctx = ModeContext(device=device, cloud=CloudSettings(cloud_url, TOKEN), variant=variant)
        mode = device_modes.build_mode(name, ctx)
        try:
            got[name] = await answer(mode, question, options)
        finally:
            await mode.close()
    (cloud_text, cloud_stats), (split_text, split_stats) = got["cloud"], got["split"]
    assert split_stats.variant == "toy-argmax" and split_stats.rounds > 0
    assert split_stats.token_ids == cloud_stats.token_ids and split_text == cloud_text
