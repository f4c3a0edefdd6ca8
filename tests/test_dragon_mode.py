"""DRAGON end to end over a real aiohttp server on loopback, with tiny float32 models: the
device model reads private passages, the cloud model public ones (a real public corpus of 60
Wikipedia summaries, a real private index), and every token is aggregated across the link."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestServer

from cloud_backend.config import ServerConfig
from cloud_backend.engine import LLMEngine
from cloud_backend.server import create_app
from edge_runtime.device import DeviceModel
from edge_runtime.events import Citation, Stats, TextDelta
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext
from model_runtime.torch_runtime import TorchCausalLM
from tests.tiny_models import build_tiny_hf

TOKEN = "test-token-0123456789"
QUESTION = "Where is the spare key hidden, and what is Aachen known for?"


@pytest.fixture(scope="module")
def cloud_engine(tiny, tiny_tokenizer) -> LLMEngine:
    return LLMEngine(TorchCausalLM(tiny["hf"]), tiny_tokenizer, "tiny-cloud")


@pytest.fixture(scope="module")
def device(tiny, tiny_tokenizer, tmp_path_factory) -> DeviceModel:
    """Other weights than the cloud's, same tokenizer, float32: the two sides disagree often."""
    folder = build_tiny_hf(tiny["tokenizer"], tmp_path_factory.mktemp("dev") / "hf", seed=1)
    return DeviceModel(TorchCausalLM(folder), tiny_tokenizer, "tiny-device")


@pytest.fixture(scope="module")
def public_corpus(tmp_path_factory, embedder_dir):
    from cloud_backend.corpus import PublicCorpus

    corpus = PublicCorpus.open(
        tmp_path_factory.mktemp("corpus"), embedder_dir, limit=60, progress=False
    )
    yield corpus
    corpus.close()


@pytest.fixture(scope="module")
def private_index(tmp_path_factory, embedder_dir):
    from personal_index.index import PersonalIndex

    docs = tmp_path_factory.mktemp("private")
    (docs / "diary.md").write_text(
        "# Private\nMy locker code is 4417 and the spare key hides under the blue flowerpot.\n"
    )
    (docs / "trip.txt").write_text("We stayed at the Casa Azul guesthouse in Aachen in May.\n")
    index = PersonalIndex(tmp_path_factory.mktemp("index"), embedder_dir)
    index.ingest([docs])
    return index


@pytest.fixture
async def cloud_url(cloud_engine, public_corpus):
    config = ServerConfig(token=TOKEN, corpus_enabled=False, corpus_k=2)
    app = create_app(config, cloud_engine, public_corpus)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield f"ws://127.0.0.1:{server.port}/v1/session"
    await server.close()


async def ask(mode, question, options, history=()):
    events = [e async for e in mode.answer(question, list(history), options)]
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    stats = [e for e in events if isinstance(e, Stats)]
    assert len(stats) == 1 and events[-1] is stats[0]
    return text, stats[0], events


def dragon(device, url, index, aggregator="auto", **kw):
    ctx = ModeContext(device=device, index=index, cloud=CloudSettings(url, TOKEN),
                      aggregator=aggregator, **kw)  # fmt: skip
    return build_mode("dragon", ctx)


@pytest.mark.parametrize("aggregator", ["device", "cloud"])
async def test_greedy_answer_runs(aggregator, device, cloud_url, private_index):
    mode = dragon(device, cloud_url, private_index, aggregator)
    options = AnswerOptions(max_new_tokens=24, temperature=0.0, k=2)
    text, stats, events = await ask(mode, QUESTION, options)
    await mode.close()
    sides = {e.side for e in events if isinstance(e, Citation)}
    assert sides == {"device", "cloud"}
    assert stats.tokens > 0 and stats.aggregator == aggregator
    print(aggregator, stats.as_dict(), repr(text))
