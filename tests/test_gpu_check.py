"""benchmarks/gpu_check.py (docs/benchmarks/vllm.md#gpu-check) runs where only the standard
library, numpy, torch and transformers are installed, and with no git history, as on the lent GPU
machine; its result holds the measured timings, the inputs with their files, and predictions that
are finite and labelled, with no machine's directories in it."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from benchmarks import gpu_check

REPO = Path(__file__).resolve().parents[1]
#: Installed here, absent on the GPU machine or never to be imported by the check.
FORBIDDEN = {
    "textual",
    "platformdirs",
    "faiss",
    "aiohttp",
    "onnxruntime",
    "scipy",
    "sklearn",
    "msgpack",
    "sentence_transformers",
    "optimum",
    "vllm",
    "app",
    "cloud_backend",
}


def _closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions `names` need, transitively (extras left out)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def only_numpy_torch_transformers(folder: Path) -> Path:
    """A site folder of links to numpy, torch, transformers and what they require, nothing else."""
    folder.mkdir()
    for dist in _closure(["numpy", "torch", "transformers"]):
        site = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not (folder / top).exists() and (site / top).exists() and not top.endswith(".pth"):
                (folder / top).symlink_to(site / top)
    return folder


RUN = """
import runpy, sys
import benchmarks.provenance as provenance
provenance._git = lambda *args: None  # no git history, as on the GPU machine
sys.argv = ["gpu_check", *sys.argv[1:]]
runpy.run_module("benchmarks.gpu_check", run_name="__main__")
print("MODULES", " ".join(sorted({m.split(".")[0] for m in sys.modules})))
"""


def _numbers(x: object) -> Iterator[float]:
    if isinstance(x, bool) or x is None:
        return
    if isinstance(x, (int, float)):
        yield float(x)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _numbers(v)


def test_quick_run_with_only_numpy_torch_and_transformers(tmp_path: Path) -> None:
    site = only_numpy_torch_transformers(tmp_path / "site")
    assert (site / "torch").exists() and not (site / "scipy").exists()
    out = tmp_path / "gpu-check.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(
        PYTHONPATH=f"{site}{os.pathsep}{REPO}",
        OMP_NUM_THREADS="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
    )
    done = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            RUN,
            "--device",
            "cpu",
            "--quick",
            "--threads",
            "1",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    modules = set(done.stdout.split("MODULES ", 1)[1].split())
    assert {"torch", "transformers", "numpy", "collab"} <= modules
    assert not modules & FORBIDDEN, modules & FORBIDDEN
    assert "PREDICTION" in done.stdout

    text = out.read_text()
    assert not re.search(r"/(home|root|work)/", text) and str(tmp_path) not in text
    data: dict[str, Any] = json.loads(text)
    assert set(data) == {"provenance", "measured", "inputs", "predictions"}
    prov = data["provenance"]
    assert prov["commit"] == "unknown" and prov["gpu"]["device"] == "cpu"
    assert prov["transformers"] and prov["packages"]["torch"]

    measured = data["measured"]
    for name in ("target", "draft"):
        model = measured["models"][name]
        assert model["config"] == f"benchmarks/data/gpu_check/{name}/config.json"
        assert model["layers"] == 2 and model["vocab_size"] == 151_936
        assert {d["batch"] for d in model["decode"]} >= {1, 2, 4}
        assert {(v["batch"], v["rows_per_session"]) for v in model["verify"]} >= {(1, 5), (2, 9)}
        assert [d["batch"] for d in model["dragon_rows"]] == [2, 4]
        timings = [*model["decode"], *model["verify"], model["prefill"]]
        assert all(t["ms"] > 0 and t["n"] == 2 for t in timings)
    assert all(r["host_pull_ms"] > 0 and r["gpu_sample_ms"] > 0 for r in measured["rows"])

    inputs = data["inputs"]
    files = [s["file"] for s in inputs["split"]["alpha_per_token"]["sources"]]
    files += [s["file"] for s in inputs["split"]["alpha_accepted_fraction"]["sources"]]
    files += [s["file"] for s in inputs["dragon"]["sources"]] + [inputs["device"]["file"]]
    assert files and all(
        f.startswith("benchmarks/results/") and (REPO / f).is_file() for f in files
    )
    assert 0 < inputs["split"]["alpha_accepted_fraction"]["value"] < 1
    assert 0 < inputs["split"]["alpha_per_token"]["value"] < 1
    assert 0 < inputs["dragon"]["alpha_device"] <= 1 and inputs["device"]["draft_ms"] > 0

    pred = data["predictions"]
    assert "PREDICTION" in pred["label"]
    assert {
        "cloud_only_tok_s",
        "split_gamma4_tok_s",
        "split_best",
        "dragon_tok_s",
        "capacity",
        "tk_slt_eq11",
    } <= set(pred["formulas"])
    records = pred["per_session"]
    # CPU: no GPU-busy basis; host and device sampling × 2 RTTs × 2 α × N = 1, 2
    assert len(records) == 2 * 2 * 2 * 2
    assert {r["basis"] for r in records} == {"events"}
    for r in [*records, *pred["capacity"]]:
        assert r["kind"] == "PREDICTION"
        assert all(math.isfinite(x) for x in _numbers(r)), r
    for r in records:
        assert r["cloud_only_tok_s"] > 0 and r["split_gamma4_ratio"] > 0 and r["dragon_ratio"] > 0
        assert r["split_best_tok_s"] >= r["split_gamma4_tok_s"] * (1 - 1e-9)
    assert {c["rtt_ms"] for c in pred["capacity"]} == {20.0, 50.0}


def test_predictions_follow_the_modes_cost_models() -> None:
    """With verification as cheap as a decode step, no link and drafting for free, split at γ = 4
    yields E[#tokens] = (1 − α⁵)/(1 − α) tokens per cloud step; DRAGON with the device slower
    than the cloud runs at the device's pace when the cloud's drafts always become the target."""
    step = 0.01
    times = gpu_check.Times(
        decode={1: step, 2: step, 4: step},
        verify={1: {5: step, 9: step}, 4: {5: step, 9: step}},
        rows={1: 0.0, 100: 0.0},
    )
    dragon = {"alpha_device": 0.5, "alpha_cloud": 1.0, "device_step_ms": 40.0}
    rec = gpu_check.per_session(times, 1, 0.8, gpu_check.Link(0.0, 0.0), 1e-9, dragon, 2)
    assert math.isclose(rec["split_gamma4_ratio"], (1 - 0.8**5) / (1 - 0.8), rel_tol=1e-6)
    assert rec["split_best_gamma"] == gpu_check.GAMMA_MAX  # free drafts: the longest γ wins
    assert not rec["split_device_as2_cloud_only"] and rec["split_device_ratio"] > 1
    assert math.isclose(rec["dragon_tok_s"], 1 / 0.040) and rec["dragon_aggregator"] == "device"
    assert math.isclose(rec["cloud_only_tok_s"], 1 / step)
    cap = gpu_check.capacity(lambda n: 100.0 / n, 64, 10.0)
    assert cap["sessions"] == 10 and not cap["at_most_measured"]
