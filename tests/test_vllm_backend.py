"""The cloud on vLLM (`tandem serve --engine vllm`), end to end: a real vLLM engine in its own
environment (docs/benchmarks/vllm.md#install), a real server process on loopback, real devices.

vLLM and the device's toolchain need different transformers, so the server runs from the
vLLM environment (`.venv-vllm/`, or the python `TANDEM_VLLM_PYTHON` names) and the devices
from this one. The cloud model is a tiny Qwen2 on the real tokenizer whose heads fit vLLM's
CPU attention (32 dimensions), in float32; the same checkpoint in torch float32 gives the
exact distribution the samples are checked against (vLLM's raw logits agree with it to 1e-5)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from aiohttp.test_utils import TestServer

from app.embedded import read_metrics
from benchmarks.common import VLLM_INSTALL, vllm_python
from cloud_backend.config import ServerConfig
from cloud_backend.engine import LLMEngine
from cloud_backend.server import create_app
from collab.sampling import SamplingParams, distribution
from collab.variants import variant_names
from edge_runtime.device import DeviceModel
from edge_runtime.events import Failure, Stats, TextDelta
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext
from edge_runtime.split_costs import SplitCosts
from model_runtime.ort_runtime import OrtCausalLM
from model_runtime.prompting import prompt_ids
from model_runtime.torch_runtime import TorchCausalLM
from tests.concurrent_answers import WORKERS, by_seed
from tests.sampled_law import stratified_chi_square_p
from tests.test_serve_stop import (
    METRICS_TOKEN,
    TOKEN,
    VLLM_CONFIG,
    VLLM_SERVE,
    Served,
    serve,
    stop_mid_answer,
)

pytestmark = pytest.mark.vllm

QUESTIONS = ["What is a tandem bicycle?", "Write a haiku about autumn rain."]


@pytest.fixture(scope="module")
def vllm_served(vllm_tiny, tmp_path_factory) -> Iterator[Served]:
    """`tandem serve --engine vllm` from the vLLM environment, on a free loopback port (the
    module's last test stops it with SIGTERM)."""
    python = vllm_python()
    if python is None:
        pytest.skip(VLLM_INSTALL)
    served = serve(
        python, tmp_path_factory.mktemp("vllm"), *VLLM_SERVE, str(vllm_tiny), more=VLLM_CONFIG
    )
    yield served
    if served.process.poll() is None:
        served.process.terminate()
        try:
            served.process.wait(60)
        except subprocess.TimeoutExpired:
            served.process.kill()
    sys.stderr.write("".join(line for line in served.log if "ERROR" in line)[-4000:])


@pytest.fixture(scope="module")
def vllm_url(vllm_served) -> str:
    return vllm_served.url


@pytest.fixture(scope="module")
def cloud_lm(vllm_tiny) -> TorchCausalLM:
    """The cloud's checkpoint in torch float32: the exact distribution to check against."""
    return TorchCausalLM(vllm_tiny)


@pytest.fixture(scope="module")
def near_drafter(cloud_lm, tiny_tokenizer) -> DeviceModel:
    """The cloud's own weights: drafts that vLLM accepts (nearly) always."""
    return DeviceModel(cloud_lm, tiny_tokenizer, "tiny-near")


@pytest.fixture(scope="module")
def private_index(tmp_path_factory, embedder_dir):
    from personal_index.index import PersonalIndex

    docs = tmp_path_factory.mktemp("private")
    (docs / "diary.md").write_text(
        "# Private\nMy locker code is 4417 and the spare key hides under the blue flowerpot.\n"
    )
    index = PersonalIndex(tmp_path_factory.mktemp("index"), embedder_dir)
    index.ingest([docs])
    return index


@pytest.fixture(scope="module")
def far_drafter(tiny, tiny_tokenizer) -> DeviceModel:
    """Other weights, same tokenizer (the usual tiny model's int8 ONNX): many rejections."""
    return DeviceModel(OrtCausalLM(tiny["onnx-quant"]), tiny_tokenizer, "tiny-far")


@pytest.fixture(scope="module")
def far_drafters(tiny, tiny_tokenizer) -> list[DeviceModel]:
    """The far drafter once per concurrent session (`tests.concurrent_answers`)."""
    return [
        DeviceModel(OrtCausalLM(tiny["onnx-quant"]), tiny_tokenizer, f"tiny-far-{n}")
        for n in range(WORKERS)
    ]


@pytest.fixture
async def builtin_url(vllm_tiny, tiny_tokenizer):
    """The same checkpoint on the built-in engine (torch float32), in process."""
    engine = LLMEngine(TorchCausalLM(vllm_tiny), tiny_tokenizer, "tiny-builtin")
    server = TestServer(create_app(ServerConfig(token=TOKEN, corpus_enabled=False), engine))
    await server.start_server()
    yield f"ws://127.0.0.1:{server.port}/v1/session"
    await server.close()
    engine.close()


def context(device: DeviceModel, url: str, variant: str = "tk-slt", **kw) -> ModeContext:
    """The test's own cloud on this machine, standing in for the embedded one: on-device, so
    dragon and split take part with the private passages without asking (edge_runtime.consent)."""
    cloud = CloudSettings(url, TOKEN, embedded=True)
    return ModeContext(device=device, cloud=cloud, variant=variant, **kw)


async def ask(mode, question: str, options: AnswerOptions) -> tuple[str, Stats]:
    events = [e async for e in mode.answer(question, [], options)]
    stats = [e for e in events if isinstance(e, Stats)]
    assert len(stats) == 1 and events[-1] is stats[0], events
    assert not [e for e in events if isinstance(e, Failure)], events  # the cloud answered
    return "".join(e.text for e in events if isinstance(e, TextDelta)), stats[0]


@pytest.mark.parametrize("drafter", ["near", "far"])
async def test_greedy_split_equals_greedy_cloud_on_vllm(drafter, request, vllm_url):
    device = request.getfixturevalue(f"{drafter}_drafter")
    cloud = build_mode("cloud", context(device, vllm_url))
    options = AnswerOptions(max_new_tokens=24, temperature=0.0)
    for question in QUESTIONS:
        want_text, want = await ask(cloud, question, options)
        for variant in variant_names():
            split = build_mode("split", context(device, vllm_url, variant))
            split.costs = SplitCosts()  # unmeasured: speculate
            rows = await rows_out(vllm_url)
            got_text, got = await ask(split, question, options)
            assert got.token_ids == want.token_ids and got_text == want_text, variant
            assert await rows_out(vllm_url) == rows, variant  # greedy: ids only, every variant
            assert got.rounds > 0 and got.drafted > 0 and got.accepted <= got.drafted
            if drafter == "far":
                assert got.accepted < got.drafted  # rejections: the residual path ran
            await split.close()
    await cloud.close()


async def test_cloud_answers_follow_vllm_greedy_decoding_of_the_checkpoint(
    cloud_lm, near_drafter, tiny_tokenizer, vllm_url
):
    """The vLLM engine decodes what the checkpoint says: its greedy answer is torch's."""
    cloud = build_mode("cloud", context(near_drafter, vllm_url))
    _, got = await ask(cloud, QUESTIONS[0], AnswerOptions(max_new_tokens=16, temperature=0.0))
    await cloud.close()
    ids = prompt_ids(tiny_tokenizer, QUESTIONS[0])
    want = []
    logits = cloud_lm.prefill([ids])[0]
    for _ in range(16):
        want.append(int(np.argmax(logits)))
        logits = cloud_lm.decode([want[-1]])[0]
    assert got.token_ids == want


@pytest.mark.parametrize("aggregator", ["device", "cloud"])
async def test_greedy_dragon_on_vllm_equals_dragon_on_the_builtin_engine(
    aggregator, far_drafter, private_index, vllm_url, builtin_url
):
    """DRAGON's per-document rows and aggregation on vLLM: token for token what the built-in
    engine gives with the same checkpoint (the device reads its private passages; the cloud
    has none here: its corpus is off)."""
    options = AnswerOptions(max_new_tokens=16, temperature=0.0, k=2)
    answers = []
    for url in (builtin_url, vllm_url):
        mode = build_mode(
            "dragon", context(far_drafter, url, index=private_index, aggregator=aggregator)
        )
        _, stats = await ask(mode, "Where is the spare key hidden?", options)
        await mode.close()
        assert stats.device_drafted > 0 and stats.cloud_drafted > 0
        answers.append(stats.token_ids)
    assert answers[0] == answers[1] and len(answers[0]) > 0


async def metric(ws_url: str, sample: str) -> float:
    """One sample of the cloud's /metrics (0 where it is not there yet)."""
    text = await read_metrics(ws_url, METRICS_TOKEN)
    found = re.search("^" + re.escape(sample) + r" (\S+)", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def reused_documents(ws_url: str) -> float:
    return await metric(ws_url, 'tandem_reused_prompt_tokens_total{kind="document"}')


async def rows_out(ws_url: str) -> float:
    """Vocabulary rows vLLM handed out so far (split verified inside it needs none)."""
    return await metric(ws_url, "tandem_engine_rows_out_total")


async def test_dragon_rows_reuse_vllm_prefix_cache_across_one_users_sessions(
    far_drafter, private_index, vllm_url, tiny_tokenizer
):
    """Two sessions (websockets) of one access token ask the same new question: the second's
    document rows start from what vLLM cached for the first, salted by the document cache's
    scope ("user", the default) rather than each session's own salt, which would give the
    second session nothing (only a first block of the instructions, shared by any earlier
    DRAGON request of this user, is reused by the first)."""
    from model_runtime.prompting import document_prompt

    question = "Which locker number did the diary mention, and what hides under the flowerpot?"
    options = AnswerOptions(max_new_tokens=4, temperature=0.0, k=2)
    got = []
    for _ in range(2):
        before = await reused_documents(vllm_url)
        mode = build_mode("dragon", context(far_drafter, vllm_url, index=private_index))
        await ask(mode, question, options)
        await mode.close()
        got.append(await reused_documents(vllm_url) - before)
    bare = document_prompt(tiny_tokenizer, question, [], None, 10_000)[0]  # the cloud's only row
    assert got[0] <= 16 < len(bare) - 17 <= got[1]  # whole blocks, never the last token


@pytest.mark.parametrize("variant", ["tk-slt", "dsd"])
async def test_sampled_split_tokens_follow_the_vllm_cloud_model(
    variant, far_drafter, far_drafters, cloud_lm, tiny_tokenizer, vllm_url
):
    """Temperature 0.7, top-k 6, verified inside vLLM (its sampler draws each verdict from the
    distribution `cloud_backend.vllm_draws` makes of the raw row, so T != 1 is exact): the
    token each speculative round decides, given the first, follows the cloud's P, not the
    drafter's Q (the negative control shows the test tells them apart); no row leaves vLLM."""
    params = SamplingParams(temperature=0.7, top_k=6)
    question = QUESTIONS[0]
    ids = prompt_ids(tiny_tokenizer, question)

    def target(lm):
        return lambda first: distribution(lm.prefill([[*ids, first]])[0], params)

    splits = [build_mode("split", context(d, vllm_url, variant)) for d in far_drafters]

    async def answer(split, seed: int) -> tuple[int, int]:
        options = AnswerOptions(max_new_tokens=2, temperature=0.7, top_k=6, seed=seed)
        split.costs = SplitCosts()  # always one speculative round, never AS²'s cloud decoding
        _, stats = await ask(split, question, options)
        assert stats.rounds == 1 and not stats.cloud_only and len(stats.token_ids) == 2
        return stats.token_ids[0], stats.token_ids[1]

    rows = await rows_out(vllm_url)
    pairs = await by_seed(splits, range(300), answer)
    assert await rows_out(vllm_url) == rows  # verified inside vLLM: token ids out
    for split in splits:
        await split.close()
    p_first = distribution(cloud_lm.prefill([ids])[0], params)
    firsts = [f for f, _ in pairs]
    fits, control = (
        stratified_chi_square_p(pairs, target(lm)) for lm in (cloud_lm, far_drafter.lm)
    )
    print(f"{variant} on vLLM: {len(pairs)} answers, chi2 p under P {fits:.3g}, Q {control:.3g}")
    assert stratified_chi_square_p([(0, f) for f in firsts], lambda _: p_first) > 1e-3
    assert fits > 1e-3 and control < 1e-6


async def test_sigterm_stops_the_vllm_cloud_and_its_engine_processes(
    vllm_served, tiny, tiny_tokenizer
):
    """Last in this module (it stops the module's server): mid-answer, SIGTERM, as systemd or
    a balancer's drain sends it (both signals take one path in `app.serve`; SIGINT is
    tests/test_serve_stop.py's, on the built-in engine)."""
    assert vllm_served.descendants(), "vLLM runs its engine in processes of its own"
    device = DeviceModel(OrtCausalLM(tiny["onnx-quant"]), tiny_tokenizer, "tiny")
    await stop_mid_answer(vllm_served, device, signal.SIGTERM)
