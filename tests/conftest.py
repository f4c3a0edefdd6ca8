from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.tiny_models import build_all, build_tiny_hf, builder_version


@pytest.fixture(scope="session")
def gguf_tokenizer():
    """The tokenizer in the device GGUF's metadata (all in its first part, of which the
    prepared model.gguf is the sha256-checked concatenation), converted by transformers: ~45 s,
    so once a session for every test that compares against it."""
    from benchmarks.tiny_models import part1_path
    from tandem_packaging.steps import gguf_tokenizer

    return gguf_tokenizer(part1_path())


@pytest.fixture(scope="session")
def tiny(request) -> dict[str, Path]:
    """Paths of the tiny test model: tokenizer, hf (torch), onnx-fp32, onnx-quant.
    Built once and cached in pytest's cache directory (keyed by the builder's source)."""
    root = Path(request.config.cache.mkdir(f"tiny-qwen2-{builder_version()}"))
    return build_all(root)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny):
    from model_runtime.tokenizer import load_tokenizer

    return load_tokenizer(tiny["tokenizer"])


@pytest.fixture(scope="session")
def embedder_dir(request) -> Path:
    """all-MiniLM-L6-v2 exported to ONNX once (cached in pytest's cache, keyed by the code)."""
    import hashlib
    import inspect

    from retrieval import embedder

    key = hashlib.sha256(inspect.getsource(embedder).encode()).hexdigest()[:12]
    folder = Path(request.config.cache.mkdir(f"minilm-onnx-{key}")) / "model"
    return embedder.prepare_onnx_embedder(folder)


@pytest.fixture(scope="session")
def public_corpus(tmp_path_factory, embedder_dir):
    """A real public corpus of the first 60 summaries, built once (the DRAGON tests' cloud)."""
    from cloud_backend.corpus import PublicCorpus

    corpus = PublicCorpus.open(
        tmp_path_factory.mktemp("corpus"), embedder_dir, limit=60, progress=False
    )
    yield corpus
    corpus.close()


@pytest.fixture(scope="module")
def ort_fp32(tiny):
    """The tiny model on ONNX Runtime, float32 (one per test module)."""
    from model_runtime.ort_runtime import OrtCausalLM

    return OrtCausalLM(tiny["onnx-fp32"])


@pytest.fixture(scope="module")
def torch_fp32(tiny):
    """The tiny model on torch, float32 (one per test module)."""
    from model_runtime.torch_runtime import TorchCausalLM

    return TorchCausalLM(tiny["hf"])


@pytest.fixture(params=["ort", "torch"])
def lm(request, ort_fp32, torch_fp32):
    """Each backend in turn, behind the one `CausalLM` interface."""
    return ort_fp32 if request.param == "ort" else torch_fp32


@pytest.fixture(scope="session")
def vllm_tiny(tiny, request) -> Path:
    """A tiny Qwen2 (2 heads of 32 dimensions, 1 KV head: vLLM's CPU attention takes them) on
    the real tokenizer, as a Hugging Face checkpoint."""
    from benchmarks.tiny_models import build_tiny_hf

    root = Path(request.config.cache.mkdir("tiny-qwen2-vllm-v1"))
    if not (root / "hf" / "config.json").is_file():
        build_tiny_hf(tiny["tokenizer"], root / "hf", seed=0, heads=2, kv_heads=1)
    return root / "hf"


@pytest.fixture(scope="module")
def private_index(tmp_path_factory, embedder_dir):
    """Two private notes (a locker code and a salary), indexed: the privacy tests' documents."""
    from personal_index.index import PersonalIndex

    docs = tmp_path_factory.mktemp("private")
    (docs / "diary.md").write_text(
        "# Private\nMy locker code is 4417 and the spare key hides under the blue flowerpot.\n"
    )
    (docs / "salary.txt").write_text("Salary review: Jordan earns 81,250 euros from March on.\n")
    index = PersonalIndex(tmp_path_factory.mktemp("index"), embedder_dir)
    index.ingest([docs])
    return index


# ---- the shared test cloud and devices (each module may override `cloud_config` and
# `cloud_corpus`: e.g. the public corpus with corpus_k = 2) ------------------------------


@pytest.fixture(scope="module")
def cloud_engine(tiny, tiny_tokenizer):
    """The cloud: the tiny model in float32 torch, one engine per module."""
    from cloud_backend.engine import LLMEngine
    from model_runtime.torch_runtime import TorchCausalLM

    return LLMEngine(TorchCausalLM(tiny["hf"]), tiny_tokenizer, "tiny-cloud")


@pytest.fixture
def cloud_config():
    from cloud_backend.config import ServerConfig
    from tests.cloud import TOKEN

    return ServerConfig(token=TOKEN, corpus_enabled=False)


@pytest.fixture
def cloud_corpus():
    """No public corpus unless a module asks for one."""
    return None


@pytest.fixture
async def cloud_url(cloud_config, cloud_engine, cloud_corpus):
    """A server for the module's engine on loopback; its session URL."""
    from tests.cloud import serving

    async with serving(cloud_config, cloud_engine, cloud_corpus) as url:
        yield url
    cloud_engine.on_step = None  # a test's hook into the engine's steps ends with it


@pytest.fixture(scope="module")
def device(tiny, tiny_tokenizer):
    """The drafter close to the cloud: its int8 ONNX export (long accepted runs)."""
    from edge_runtime.device import DeviceModel
    from model_runtime.ort_runtime import OrtCausalLM

    return DeviceModel(OrtCausalLM(tiny["onnx-quant"]), tiny_tokenizer, "tiny-device")


@pytest.fixture(scope="module")
def near_drafter(device):
    """The same device, by its role where a test also has a far one."""
    return device


@pytest.fixture(scope="module")
def far_weights(tiny, tmp_path_factory) -> Path:
    """A second tiny model with other weights, on the same tokenizer."""
    return build_tiny_hf(tiny["tokenizer"], tmp_path_factory.mktemp("far") / "hf", seed=1)


@pytest.fixture(scope="module")
def far_device(far_weights, tiny_tokenizer):
    """The drafter far from the cloud (many rejections: the residual paths run)."""
    from edge_runtime.device import DeviceModel
    from model_runtime.torch_runtime import TorchCausalLM

    return DeviceModel(TorchCausalLM(far_weights), tiny_tokenizer, "tiny-device")
