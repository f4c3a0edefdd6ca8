"""The docs' figure tables are what `python -m benchmarks.report` makes of the result files,
every result file says where it came from, and no difference inside its interval is a win."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.intervals import verdict
from benchmarks.provenance import CHANGED, FLAGS_OF_INTEREST, caption, record

RESULTS = Path(report.RESULTS)


@pytest.fixture(scope="module")
def tables() -> dict[str, str]:
    return report.generate()


def test_committed_tables_are_what_the_generator_makes(tables: dict[str, str]) -> None:
    assert report.differences(tables) == [], "run `python -m benchmarks.report`"
    names = {p.stem for p in report.TABLES.glob("*.md")}
    assert names == {t.name for t in report.TABLE_LIST}


def test_a_changed_table_or_readme_block_is_named(tables: dict[str, str], tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    start, end = report.README_BLOCK
    readme.write_text(f"# x\n{start}\nold figures\n{end}\nrest\n", encoding="utf-8")
    report.write(tables, tmp_path / "tables", readme)
    assert report.differences(tables, tmp_path / "tables", readme) == []
    assert tables["readme-speed"] in readme.read_text(encoding="utf-8")
    (tmp_path / "tables" / "capacity-ort.md").write_text("| typed by hand |\n", encoding="utf-8")
    readme.write_text(f"# x\n{start}\nold figures\n{end}\nrest\n", encoding="utf-8")
    stale = report.differences(tables, tmp_path / "tables", readme)
    assert stale == ["capacity-ort", "readme-speed"]


def test_every_table_names_its_sources_and_machine(tables: dict[str, str]) -> None:
    for name, text in tables.items():
        assert "*Source: " in text, name
        assert "machine not recorded" in text or "cores" in text or "no saved result" in text


def test_a_difference_inside_its_interval_is_not_a_win() -> None:
    assert verdict(-0.02, 0.05) == "within noise"
    assert verdict(0.01, 0.05, up="faster") == "faster"
    assert verdict(-0.05, -0.01, down="slower") == "slower"
    assert verdict(0.97, 1.04, null=1.0, up="faster") == "within noise"
    assert verdict(1.02, 1.20, null=1.0, up="faster") == "faster"
    same = {str(i): 1.0 + 0.1 * (i % 3) for i in range(20)}
    noisy = {k: v + (0.05 if int(k) % 2 else -0.05) for k, v in same.items()}
    assert "within noise" in report.ratio_cell(report.bootstrap_ratio(noisy, same))
    faster = {k: 2 * v for k, v in same.items()}
    assert "faster" in report.ratio_cell(report.bootstrap_ratio(faster, same))


def test_provenance_has_every_field() -> None:
    prov = record("python -m benchmarks.x --y", {"cloud_core": 1}, {"cloud": 1}, ["cloud ort"])
    for key in (
        "commit",
        "dirty",
        "date",
        "command",
        "cpu_model",
        "cpu_flags",
        "cpu_count",
        "affinity",
        "pinning",
        "engines",
        "threads",
        "python",
        "packages",
    ):
        assert key in prov, key
    assert len(prov["commit"]) == 40 and prov["date"].endswith("+00:00")
    assert set(prov["cpu_flags"]) == set(FLAGS_OF_INTEREST)
    assert prov["pinning"] == {"cloud_core": 1} and prov["engines"] == ["cloud ort"]
    assert {"numpy", "onnxruntime", "torch", "transformers", "faiss-cpu", "vllm"} <= set(
        prov["packages"]
    )


def test_a_run_from_a_tree_with_changed_results_only_says_so_and_code_changes_do_not() -> None:
    """`changed` names the tracked files that differed; a correction added after a run (which
    names who checked what) may supply it for a run recorded before the field existed."""
    base = {"commit": "a" * 40, "date": "2026-12-02", "cpu_model": "x", "dirty": True}
    results = {**base, "changed": ["benchmarks/results/multiturn/ort-search.json"]}
    code = {**base, "changed": ["benchmarks/results/a.json", "edge_runtime/turns.py"]}
    fixed = {
        **base,
        "corrections": [
            {"field": CHANGED, "value": results["changed"], "by": "a session", "why": "file times"}
        ],
    }
    assert "changes to result files only" in caption([("r", results)])
    assert "changes to result files only" in caption([("r", fixed)])
    assert "uncommitted changes, 2026" in caption([("c", code)])
    assert "result files only" not in caption([("c", code)]) + caption([("d", base)])


def test_every_saved_result_carries_provenance() -> None:
    files = sorted(RESULTS.rglob("*.json"))
    assert len(files) > 40
    for path in files:
        prov = json.loads(path.read_text(encoding="utf-8"))["provenance"]
        assert prov["commit"] and prov["date"] and prov["command"], path
        assert "cpu_model" in prov or prov["machine"] == "not recorded", path
    assert not any("issue" in p.name for p in RESULTS.rglob("*"))


def test_a_fresh_result_records_its_provenance(tmp_path: Path) -> None:
    from benchmarks import dragon_schedule

    out = tmp_path / "schedule.json"
    dragon_schedule.main(["--quick", "--out", str(out)])
    prov = json.loads(out.read_text())["provenance"]
    assert prov["command"] == f"python -m benchmarks.dragon_schedule --quick --out {out}"
    assert prov["cpu_count"] and isinstance(prov["affinity"], list) and prov["commit"]


def test_the_gpu_check_tables_label_predictions_and_compare_runs(tables: dict[str, str]) -> None:
    predicted = tables["gpu-check-predicted"]
    lines = predicted.splitlines()
    headers = [h for h, sep in itertools.pairwise(lines) if sep.startswith("|---")]
    assert len(headers) == 3 and all(h.startswith("| PREDICTION") for h in headers)
    assert predicted.count("**PREDICTION**") >= 2 and "nothing here ran a mode" in predicted
    one = {"batch": 1, "rows_per_session": 1}
    a = {"models": {"m": {"decode": [{**one, "ms": 10.0, "busy_ms": 2.0}], "verify": []}}}
    b = {"models": {"m": {"decode": [{**one, "ms": 15.0, "busy_ms": 2.0}], "verify": []}}}
    noise = report.gpu_check_noise(a, b)
    assert noise["max"] == 0.5 and noise["other_slower"] == 1 and noise["busy_max"] == 0.0
    assert "10-repeat run" in tables["gpu-check-measured"]
