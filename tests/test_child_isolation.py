"""Child processes never import from the working folder (issue 44, item 5). Started from a
folder holding an `app.py`, or `app/`, `personal_index/`, `collab/` and `cloud_backend/`
packages that leave a marker and crash when imported, the parse worker, the embedded cloud's
child and `tandem ingest` (the console script, as a user runs it) run Tandem's own code:
`-m` and `-c` put the working folder first on `sys.path`, and `-P` keeps it off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from app.embedded import EmbeddedCloud, serve_command
from personal_index.parse_worker import ParseWorker

HOSTILE = """
with open({marker!r}, "a") as f:
    f.write(__name__ + "\\n")
raise RuntimeError("hostile code from the working folder ran: " + __name__)
"""
PACKAGES = ("app", "personal_index", "collab", "cloud_backend")


def hostile_folder(root: Path, layout: str) -> tuple[Path, Path]:
    """A folder whose `app` (a module, or packages of every name Tandem imports first) would
    write to the marker and crash; (the folder, the marker)."""
    folder, marker = root / f"hostile-{layout}", root / f"marker-{layout}"
    folder.mkdir()
    code = HOSTILE.format(marker=str(marker))
    if layout == "module":
        (folder / "app.py").write_text(code)
        (folder / "personal_index.py").write_text(code)
    else:
        for name in PACKAGES:
            (folder / name).mkdir()
            (folder / name / "__init__.py").write_text(code)
        (folder / "app" / "cli.py").write_text(code)
    return folder, marker


@pytest.fixture(params=["module", "packages"])
def hostile(request, tmp_path) -> tuple[Path, Path]:
    return hostile_folder(tmp_path, request.param)


def test_the_parse_worker_runs_from_a_hostile_folder(hostile, monkeypatch):
    """The real worker, in a child started from that folder, parses a real file."""
    folder, marker = hostile
    monkeypatch.chdir(folder)
    with ParseWorker(timeout_s=60) as worker:
        doc = worker.parse(Path("note.md"), b"# Locker\nThe code is 4417.\n")
    assert "4417" in doc.text and doc.kind == "md"
    assert not marker.exists(), marker.read_text()


def test_the_embedded_clouds_command_runs_tandem_from_a_hostile_folder(hostile, tmp_path):
    """The exact command line `EmbeddedCloud.start` runs (`--help` ends it once `app.cli` has
    been imported and its parser built)."""
    folder, marker = hostile
    cmd = serve_command(["--help"], tmp_path / "cloud.log")
    done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: tandem serve" in done.stdout
    assert not marker.exists(), marker.read_text()


async def test_the_embedded_cloud_starts_from_a_hostile_folder(tiny, tmp_path, monkeypatch):
    """What `tandem ask --mode cloud` starts with no cloud configured: it serves."""
    folder, marker = hostile_folder(tmp_path, "packages")
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(folder)
    serve = [
        "--engine",
        "torch",
        "--dtype",
        "float32",
        "--model-dir",
        str(tiny["hf"]),
        "--no-corpus",
    ]
    async with await EmbeddedCloud.start(serve, timeout_s=120) as cloud:
        health = cloud.url.replace("ws://", "http://").rsplit("/v1/", 1)[0] + "/healthz"
        async with aiohttp.ClientSession() as http, http.get(health) as resp:
            assert resp.status == 200
    assert not marker.exists(), marker.read_text()


def test_tandem_ingest_runs_from_a_hostile_folder(tmp_path, embedder_dir):
    """The `tandem` console script (which puts its own folder, not the working one, on
    sys.path) and the parse worker it starts, as a user runs them from a project folder."""
    folder, marker = hostile_folder(tmp_path, "packages")
    (folder / "app.py").write_text(HOSTILE.format(marker=str(marker)))  # shadowed, but there
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "note.md").write_text("# Locker\nThe code is 4417.\n")
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    os.symlink(embedder_dir, data / "models" / "all-minilm-l6-v2-onnx")
    env = {**os.environ, "TANDEM_DATA_DIR": str(data), "TANDEM_CONFIG_DIR": str(tmp_path)}
    env.pop("PYTHONPATH", None)  # as a user's shell has it: only the install finds Tandem
    tandem = Path(sys.executable).with_name("tandem")
    done = subprocess.run(
        [str(tandem), "ingest", str(docs), "--json"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert [r["outcome"] for r in json.loads(done.stdout)] == ["indexed"], done.stdout
    assert not marker.exists(), marker.read_text()


def test_prepares_spawned_steps_never_import_from_the_working_folder_and_leave_none_behind(
    monkeypatch,
):
    """`tandem models prepare` runs its heavy steps in a spawned child: it starts with
    PYTHONSAFEPATH (its bootstrap would put the working folder first on sys.path), and this
    process's environment is as it was after (a later child keeps its own sys.path)."""
    import os

    from tandem_packaging.prepare import _run_isolated

    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    assert _run_isolated("probe", os.getenv, "PYTHONSAFEPATH") == "1"
    assert "PYTHONSAFEPATH" not in os.environ
