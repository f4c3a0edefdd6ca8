"""Load the cloud model a `ServerConfig` names into an engine: the built-in batching engine on
ONNX Runtime or torch, or vLLM (`engine = "vllm"`, its own install: README "vLLM")."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from cloud_backend.config import ConfigError, ServerConfig
from cloud_backend.engine import LLMEngine
from cloud_backend.engine_api import CloudEngine
from cloud_backend.logfmt import kv
from model_runtime.tokenizer import load_tokenizer

log = logging.getLogger("tandem.cloud")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_dir(model_dir: Path) -> Path:
    """The model folder itself (prepare saves the tokenizer beside every variant), else the
    sibling `hf` folder of a prepared model."""
    for candidate in (model_dir, model_dir.parent / "hf"):
        if any((candidate / name).is_file() for name in _TOKENIZER_FILES):
            return candidate
    raise ConfigError(f"no tokenizer files (tokenizer.json) in {model_dir}")


def model_name(model_dir: Path) -> str:
    """A prepared model lives in `<models>/<key>/<variant>/`: name it by its key."""
    if (model_dir.parent / "manifest.json").is_file():
        return model_dir.parent.name
    return model_dir.name


def model_folder(config: ServerConfig) -> Path:
    """The folder the config names, else the prepared cloud model's (ONNX for `ort`, the
    Hugging Face checkpoint for torch and vLLM)."""
    model_dir = config.model_dir
    if model_dir is None:
        # Only here does the cloud look at the device's model store: a deployment that
        # passes model_dir never imports the packaging code.
        from tandem_packaging.prepare import model_path
        from tandem_packaging.sources import PrepareError

        variant = "onnx-quant" if config.engine == "ort" else "hf"
        try:
            model_dir = model_path("cloud", variant)
        except PrepareError as exc:
            raise ConfigError(str(exc)) from None
    if not model_dir.is_dir():
        raise ConfigError(f"model folder {model_dir} does not exist")
    return model_dir


def build_engine(config: ServerConfig) -> CloudEngine:
    """Load the cloud model and its tokenizer into the engine the config names."""
    model_dir = model_folder(config)
    log.info(kv("loading_model", path=str(model_dir), engine=config.engine))
    tokenizer = load_tokenizer(tokenizer_dir(model_dir))
    name = config.model_name or model_name(model_dir)
    if config.engine == "vllm":
        from cloud_backend.vllm_engine import build_vllm_engine

        return build_vllm_engine(config, model_dir, tokenizer, name)
    lm: Any
    if config.engine == "ort":
        from model_runtime.ort_runtime import OrtCausalLM

        lm = OrtCausalLM(model_dir, threads=config.threads, allow_spinning=False)
    else:
        import torch

        from model_runtime.torch_runtime import TorchCausalLM

        dtype = torch.bfloat16 if config.torch_dtype == "bfloat16" else torch.float32
        lm = TorchCausalLM(model_dir, dtype=dtype, threads=config.threads)
    return LLMEngine(
        lm,
        tokenizer,
        name,
        kv_budget_bytes=config.kv_budget_bytes,
        kv_tenant_bytes=config.kv_budget_per_token_bytes,
        prefill_chunk=config.prefill_chunk,
        max_batch_sequences=config.max_batch_sequences,
        document_cache_bytes=config.document_cache_bytes,
    )
