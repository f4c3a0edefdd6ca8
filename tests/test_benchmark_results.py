"""Each benchmark that used to only print writes its figures with provenance, and
`python -m benchmarks.report` renders that file in place of "unmeasured". Every benchmark runs
for real in its `--quick` size, on the tiny test models where it needs a language model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import report


def _rendered(
    monkeypatch: pytest.MonkeyPatch, results: Path, build: Callable[[], report.Built]
) -> str:
    monkeypatch.setattr(report, "RESULTS", results)
    return report.render("t", build())


def _check(out: Path, module: str, argv: list[str]) -> dict:
    data = json.loads(out.read_text(encoding="utf-8"))
    prov = data["provenance"]
    assert prov["command"] == " ".join([f"python -m benchmarks.{module}", *argv])
    assert prov["commit"] and prov["cpu_model"] and isinstance(prov["affinity"], list)
    return data


def test_an_absent_result_is_unmeasured_with_the_command_that_measures_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    builders = (
        report.device_runtime,
        report.device_quantisation,
        report.tui_render,
        report.index,
        report.collab_math,
        report.batched_decode,
    )
    for build in builders:
        text = _rendered(monkeypatch, tmp_path, build)
        assert report.UNMEASURED in text and "no saved result" in text
        assert "taskset -c" in text and "python -m benchmarks." in text
    monkeypatch.setattr(report, "load", _load_from(tmp_path))  # the README's other sources
    readme = report.readme_speed()  # cites only saved, reproducible runs: no row, no source
    assert "device decode" not in readme.body and report.DEVICE_RUNTIME not in readme.sources


def test_collab_math_result_renders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from benchmarks import collab_math

    out = tmp_path / report.COLLAB_MATH
    argv = ["--quick", "--out", str(out)]
    collab_math.main(argv)
    data = _check(out, "collab_math", argv)
    assert len(data["ops"]) == 12 and data["config"]["repeats"] == 3
    text = _rendered(monkeypatch, tmp_path, report.collab_math)
    assert report.UNMEASURED not in text and "results/collab-math/ops.json" in text
    assert f"| {data['ops'][0]['rule']} | {data['ops'][0]['us_per_position']:.1f} |" in text
    assert "| TK-SLT K=32: tokens + top-K (id, prob) |" in text


def test_tui_render_result_renders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from benchmarks import tui_render

    out = tmp_path / report.TUI_RENDER
    argv = ["--quick", "--out", str(out)]
    tui_render.main(argv)
    data = _check(out, "tui_render", argv)
    assert [m["tokens"] for m in data["as_fast_as_possible"]] == [100, 200]
    assert data["paced"]["tokens"] == 20 and data["paced"]["cpu_ms_per_token"] > 0
    text = _rendered(monkeypatch, tmp_path, report.tui_render)
    assert report.UNMEASURED not in text and "| 200 tokens, as fast as it can |" in text
    assert "| 20 tokens at 200 tokens/s |" in text


def test_batched_decode_result_renders(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny: dict[str, Path]
) -> None:
    from benchmarks import batched_decode

    out = tmp_path / report.BATCHED_DECODE
    argv = ["--quick", "--model", str(tiny["onnx-quant"]), "--out", str(out)]
    batched_decode.main(argv)
    data = _check(out, "batched_decode", argv)
    assert [r["batch"] for r in data["rows"]] == [1, 2, 4]
    text = _rendered(monkeypatch, tmp_path, report.batched_decode)
    assert report.UNMEASURED not in text and "| 1 |" in text and "×1.00 |" in text


def test_device_runtime_result_renders_and_fills_the_readme(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny: dict[str, Path]
) -> None:
    from benchmarks import device_runtime

    out = tmp_path / report.DEVICE_RUNTIME
    models = tiny["hf"].parent
    argv = ["--quick", "--models", str(models), "--out", str(out)]
    device_runtime.main(argv)
    data = _check(out, "device_runtime", argv)
    assert list(data["rows"]) == list(report.DEVICE_BACKENDS)
    assert data["rows"]["ORT fp32"]["kl_to_fp32"] < 1e-3  # the same weights as torch fp32
    text = _rendered(monkeypatch, tmp_path, report.device_runtime)
    assert report.UNMEASURED not in text and "| ORT int8-head4 (device default) |" in text
    quant = _rendered(monkeypatch, tmp_path, report.device_quantisation)
    kl = data["rows"]["ORT int4"]["kl_to_fp32"]
    assert f"| int4 everywhere | {kl:.4f} |" in quant
    monkeypatch.setattr(report, "load", _load_from(tmp_path))  # the README's other sources
    decode = data["rows"]["ORT int8-head4*"]["decode_ms"]
    row = f"| device decode, 0.5B int8 (ms per token) | {decode:.1f} |"
    # the README cites a run from a clean tree only; this test's tree may have changes, so
    # the run's own record is set both ways
    for dirty, changed, cited in ((False, [], True), (True, ["app/cli.py"], False)):
        data["provenance"].update(dirty=dirty, changed=changed)
        out.write_text(json.dumps(data), encoding="utf-8")
        speed = report.readme_speed()
        assert (row in speed.body) is cited and (report.DEVICE_RUNTIME in speed.sources) is cited


def _load_from(tmp: Path) -> Callable[[str], dict]:
    """`report.load` reading the fresh result from `tmp` and every other from the repository
    (its archive included)."""

    committed = report.ROOT / "benchmarks" / "results"

    def load(rel: str) -> dict:
        where = [tmp / rel, committed / rel, committed / report.ARCHIVE / rel]
        path = next((p for p in where if p.exists()), where[-1])
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {"rows": data}

    return load


def test_index_result_renders(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, embedder_dir: Path
) -> None:
    from benchmarks import index

    out = tmp_path / report.INDEX
    argv = ["--quick", "--chunks", "4", "--model-dir", str(embedder_dir), "--out", str(out)]
    index.main(argv)
    data = _check(out, "index", argv)
    assert data["config"]["chunks"] == 4 and [s["chunks"] for s in data["search"]] == [1000]
    assert data["embedder"]["cosine_mean"] > 0.99
    text = _rendered(monkeypatch, tmp_path, report.index)
    assert (
        report.UNMEASURED not in text and "| search p50/p99 at 1,000 chunks (ms, k = 5) |" in text
    )
