"""Fixtures shared by the TUI tests: isolated data and config dirs, the tiny device model."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest


@pytest.fixture
def isolated_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Data and config under tmp_path; no cloud configured from the environment."""
    data, config = tmp_path / "data", tmp_path / "config"
    monkeypatch.setenv("TANDEM_DATA_DIR", str(data))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(config))
    monkeypatch.delenv("TANDEM_CLOUD_URL", raising=False)
    monkeypatch.delenv("TANDEM_CLOUD_TOKEN", raising=False)
    return SimpleNamespace(data=data, config=config)


@pytest.fixture(scope="session")
def tiny_device(tiny, tiny_tokenizer):
    """The tiny model's int8 ONNX export as the device model."""
    from edge_runtime.device import DeviceModel
    from model_runtime.ort_runtime import OrtCausalLM

    return DeviceModel(OrtCausalLM(tiny["onnx-quant"]), tiny_tokenizer, "tiny-device")


@pytest.fixture
def private_index(tmp_path: Path, embedder_dir: Path):
    """An empty private index in tmp_path (the real all-MiniLM-L6-v2 ONNX embedder)."""
    from personal_index.index import PersonalIndex

    index = PersonalIndex(tmp_path / "index", embedder_dir)
    yield index
    index.close()
