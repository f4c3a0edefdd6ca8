"""Tiny randomly initialised Qwen2 models on the real Qwen2.5 tokenizer, prepared exactly like
the real device model (same export and quantisation code), so every code path runs in seconds."""

from __future__ import annotations

import hashlib
import inspect
import shutil
from pathlib import Path

from tandem_packaging import steps
from tandem_packaging.sources import DEVICE_DEFAULT

TINY_CONTEXT = 256


def part1_path() -> Path:
    """The first part of the device GGUF: its metadata holds the tokenizer."""
    paths = DEVICE_DEFAULT.part_paths()
    return paths[0]


def build_tokenizer(out: Path) -> Path:
    """Convert the GGUF tokenizer (from part 1 alone) and save it, as prepare does."""
    tok = steps.gguf_tokenizer(part1_path())
    tok.save_pretrained(str(out))
    return out


def build_tiny_hf(
    tokenizer_dir: Path,
    out: Path,
    seed: int = 0,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
) -> Path:
    """A Qwen2 of 2 layers, hidden 64, GQA 4:2 heads, with the full 151,936-id vocabulary.
    (vLLM's CPU attention wants heads of 32 or more dimensions: heads=2, kv_heads=1.)"""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=151_936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=TINY_CONTEXT,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        initializer_range=0.5,  # peaked distributions, so greedy paths are not all ties
        bos_token_id=151643,
        eos_token_id=151645,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    return out


def builder_version() -> str:
    """Cache key: changes whenever this file or the export steps change."""
    from importlib.metadata import version

    from tandem_packaging import grouped_attention

    here = inspect.getmodule(build_tiny_hf)
    assert here is not None
    src = "".join(inspect.getsource(m) for m in (here, steps, grouped_attention))
    libs = "".join(version(d) for d in ("transformers", "optimum-onnx", "onnxruntime", "torch"))
    return hashlib.sha256((src + libs).encode()).hexdigest()[:16]


def build_all(root: Path) -> dict[str, Path]:
    """Tokenizer, a tiny hf model, its fp32 ONNX and quantised ONNX under `root` (idempotent)."""
    done = root / "done"
    paths = {
        "tokenizer": root / "tokenizer",
        "hf": root / "hf",
        "onnx-fp32": root / "onnx-fp32",
        "onnx-quant": root / "onnx-quant",
    }
    if done.exists():
        return paths
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    build_tokenizer(paths["tokenizer"])
    build_tiny_hf(paths["tokenizer"], paths["hf"])
    steps.export_onnx(paths["hf"], paths["onnx-fp32"])
    steps.quantize(paths["onnx-fp32"], paths["onnx-quant"], "int8-head4")
    done.write_text("ok")
    return paths
