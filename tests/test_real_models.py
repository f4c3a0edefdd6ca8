"""Slow tier: the real Qwen2.5-Coder 0.5B/1.5B pair prepared by `tandem models prepare`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from collab.dragon.aggregation import logsumexp
from collab.sampling import GREEDY
from model_runtime.generate import generate
from model_runtime.ort_runtime import OrtCausalLM
from model_runtime.tokenizer import chat_prompt_ids, load_tokenizer, tokenizer_fingerprint
from model_runtime.torch_runtime import TorchCausalLM
from tandem_packaging.prepare import model_path
from tests.test_tokenizer import TEXTS

pytestmark = pytest.mark.slow

PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. def merge_sort(items):\n    if len(items) <= 1:\n        return items\n"
    "    middle = len(items) // 2\n    left = merge_sort(items[:middle])\n"
)


@pytest.fixture(scope="module")
def device_tokenizer():
    return load_tokenizer(model_path("device", "hf"))


def test_prepared_tokenizers_match_the_gguf_and_each_other(device_tokenizer, gguf_tokenizer):
    # the session's conversion of the GGUF's first part: the prepared model.gguf starts with
    # those very bytes (prepare checks the concatenation's sha256), metadata and all
    assert (model_path("device", "hf").parent / "model.gguf").is_file()
    for text in TEXTS:
        assert device_tokenizer.encode(text) == gguf_tokenizer.encode(text), text
    cloud = load_tokenizer(model_path("cloud", "hf"))
    assert tokenizer_fingerprint(cloud) == tokenizer_fingerprint(device_tokenizer)


def test_ort_fp32_matches_torch_fp32(device_tokenizer):
    ids = device_tokenizer.encode(PARAGRAPH)
    ort_lm = OrtCausalLM(model_path("device", "onnx-fp32"))
    torch_lm = TorchCausalLM(model_path("device", "hf"))
    assert np.abs(ort_lm.prefill([ids[:-5]]) - torch_lm.prefill([ids[:-5]])).max() < 1e-3
    a, b = ort_lm.forward([ids[-5:]]), torch_lm.forward([ids[-5:]])
    assert np.abs(a - b).max() < 1e-3


def test_device_quantisation_stays_close_to_fp32(device_tokenizer):
    ids = device_tokenizer.encode(PARAGRAPH)
    ref = OrtCausalLM(model_path("device", "onnx-fp32"))
    q = OrtCausalLM(model_path("device", "onnx-quant"))
    ref.prefill([ids[:1]])
    q.prefill([ids[:1]])
    a = ref.forward([ids[1:]])[0].astype(np.float64)
    b = q.forward([ids[1:]])[0].astype(np.float64)
    la = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
    lb = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
    kl = (np.exp(la) * (la - lb)).sum(axis=-1)
    top1 = (a.argmax(-1) == b.argmax(-1)).mean()
    assert kl.mean() <= 0.05, kl.mean()  # measured 0.011 (int8, lm_head int4)
    assert top1 >= 0.9, top1


@pytest.mark.parametrize("role", ["device", "cloud"])
def test_real_pair_answers_the_capital_of_france(role, device_tokenizer):
    lm = OrtCausalLM(model_path(role, "onnx-quant"))
    prompt = chat_prompt_ids(
        device_tokenizer, [{"role": "user", "content": "What is the capital of France?"}]
    )
    tokens = list(generate(lm, prompt, GREEDY, np.random.default_rng(0), max_new_tokens=30))
    assert "Paris" in device_tokenizer.decode(tokens)


def tandem(capsys, *args: str) -> tuple[int, str, str]:
    """`tandem <args>` through `app.cli.main` (what the script runs) in this process: a process
    per command paid its imports (~12 s in CI) again. An embedded cloud is still its own
    process, started and stopped by the command as from a terminal."""
    from app.cli import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_ask_streams_a_sensible_answer(capsys):
    code, out, err = tandem(capsys, "ask", "--json", "What is the capital of France?")
    assert code == 0, err
    result = json.loads(out)
    stats = result["stats"]
    assert "Paris" in result["answer"] and stats["tokens"] > 0 and stats["mode"] == "local"


def test_second_prepare_does_nothing_and_says_so(capsys):
    code, out, err = tandem(capsys, "models", "prepare")
    assert code == 0, err
    assert "nothing to do" in out


@pytest.mark.parametrize("mode", ["cloud", "split"])
@pytest.mark.timeout(1500)  # the embedded cloud's first start builds caches
def test_cli_ask_through_the_embedded_cloud(mode, capsys):
    """The real pair over the embedded backend (started on loopback by `tandem ask`); cloud
    mode answers from the public corpus and cites it as cloud."""
    code, out, err = tandem(
        capsys,
        "ask",
        "What is the capital of France?",
        "--mode",
        mode,
        "--max-tokens",
        "24",
        "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    assert "Paris" in result["answer"], result
    assert not result["errors"]
    stats = result["stats"]
    assert stats["mode"] == mode and stats["tokens"] > 0
    assert stats["bytes_up"] > 0 and stats["bytes_down"] > 0
    if mode == "cloud":
        assert result["citations"] and {c["side"] for c in result["citations"]} == {"cloud"}
    else:
        assert stats["rounds"] >= 1 and stats["drafted"] >= 1


def _batch_and_alone(lm: OrtCausalLM, enc) -> tuple[np.ndarray, np.ndarray]:
    """Log-probabilities of the same continuation of a short prompt, once as the padded row
    of a batch beside a longer prompt (masked slots between its prompt and the fed tokens,
    as in DRAGON's per-document batches) and once alone."""
    long = enc("Albedo is the fraction of sunlight that is diffusely reflected by a body. " * 6)
    short = enc("The Amazon river flows through Brazil. " * 2)
    fed = enc(
        " It is measured on a scale from zero to one, and it varies widely. Rivers carry "
        "water to the sea, and the sea returns it as rain over the land."
    )
    lm.prefill([long, short])
    both = log_softmax(lm.forward([fed, fed])[1])
    lm.prefill([short])
    return both, log_softmax(lm.forward([fed])[0])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    return logits - logsumexp(logits, axis=-1)[..., None]


def _kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return (np.exp(p) * (p - q)).sum(-1)


@pytest.mark.parametrize("role", ["device", "cloud"])
def test_a_padded_batch_row_moves_a_quantized_model_far_less_than_quantisation(
    role, device_tokenizer
):
    """Masked slots change the length of attention's reductions, so float32 sums round
    differently (~1e-5 nats); MatMulNBits at accuracy level 4 rounds its activations to int8,
    which turns those last-bit differences into a fresh draw of quantisation noise. Measured:
    KL(alone ‖ padded) ≈ 0.001 nats against 0.023 for the 0.5B's quantisation itself, and the
    padded row is no further from float32 than the row alone. This test holds both bounds."""
    enc = device_tokenizer.encode
    quant = OrtCausalLM(model_path(role, "onnx-quant"), threads=2, allow_spinning=False)
    padded, alone = _batch_and_alone(quant, enc)
    assert _kl(alone, padded).mean() < 0.005
    assert (alone.argmax(-1) == padded.argmax(-1)).mean() >= 0.9
    if role == "cloud":
        return  # the cloud's float32 export is not kept on disk
    fp32 = OrtCausalLM(model_path(role, "onnx-fp32"), threads=2, allow_spinning=False)
    exact_padded, exact_alone = _batch_and_alone(fp32, enc)
    np.testing.assert_allclose(exact_padded, exact_alone, atol=1e-4)
    noise = _kl(exact_alone, alone).mean()
    assert _kl(alone, padded).mean() < noise / 5
    assert _kl(exact_alone, padded).mean() < 1.25 * noise
