"""The embedded cloud's life with its parent: it ends when the parent ends (a closed terminal's
SIGHUP, SIGTERM, SIGKILL), and it never writes on the parent's terminal, reporting its corpus
build through the progress callback instead. Real processes throughout: a parent script that
starts `EmbeddedCloud` (the tiny model), and the `tandem serve` child it starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.embedded import PARENT_ENV

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# The parent: starts the embedded cloud, prints each progress report and the child's pid, then
# either waits to be killed or (with `--stop`) stops the cloud and exits.
PARENT = """
import asyncio, signal, sys
from app.embedded import EmbeddedCloud

signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal, even if the tests run under nohup

async def main(stop, args):
    def progress(done, total, what):
        print(f"progress {done} {total} {what}", flush=True)

    cloud = await EmbeddedCloud.start(args, timeout_s=120, on_progress=progress)
    print(f"child {cloud.proc.pid}", flush=True)
    if stop:
        await cloud.stop()
    else:
        await asyncio.Event().wait()

stop = sys.argv[1] == "--stop"
asyncio.run(main(stop, sys.argv[2:]))
"""


def alive(pid: int) -> bool:
    """Running (a zombie left for an init that does not reap is as good as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def serve_args(tiny: dict[str, Path], *more: str) -> list[str]:
    return ["--engine", "torch", "--dtype", "float32", "--model-dir", str(tiny["hf"]), *more]


def start_parent(args: list[str], data: Path, *, stop: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, "TANDEM_DATA_DIR": str(data)}
    return subprocess.Popen(
        [sys.executable, "-c", PARENT, "--stop" if stop else "--wait", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def child_pid(parent: subprocess.Popen[str]) -> int:
    assert parent.stdout is not None
    for line in parent.stdout:
        if line.startswith("child "):
            return int(line.split()[1])
    raise AssertionError(f"the parent ended without a child: {parent.wait()} {parent.stderr}")


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGKILL])
def test_the_child_ends_with_its_parent(tiny, tmp_path, sig):
    parent = start_parent(serve_args(tiny, "--no-corpus"), tmp_path)
    child = 0
    try:
        child = child_pid(parent)
        assert alive(child)
        parent.send_signal(sig)
        assert parent.wait(60) == -sig  # a loaded machine can delay delivery: no timing asserted
        assert wait_gone(child), f"the embedded cloud outlived its parent ({sig.name})"
    finally:
        parent.kill()
        parent.communicate()
        if child and alive(child):
            os.kill(child, signal.SIGKILL)


def test_the_child_watches_its_stdin_without_the_death_signal(tmp_path):
    """The parent is still alive (no parent-death signal): the closed pipe alone ends it."""
    code = "from app.embedded import tie_to_parent; tie_to_parent(); import time; time.sleep(60)"
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env,
                            stdin=subprocess.PIPE)  # fmt: skip
    try:
        time.sleep(1.0)
        assert proc.poll() is None  # waiting while the pipe is open
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(10) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def test_a_child_whose_parent_is_already_gone_does_not_start():
    code = "from app.embedded import tie_to_parent; tie_to_parent(); import time; time.sleep(60)"
    env = {**os.environ, PARENT_ENV: "1" if os.getpid() != 1 else "2"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, timeout=30,
                          stdin=subprocess.PIPE, capture_output=True)  # fmt: skip
    assert proc.returncode == 1


def test_the_corpus_build_reports_progress_and_never_writes_on_the_terminal(
    tiny, embedder_dir, tmp_path
):
    """The child's tqdm bar and logs go to `<data dir>/cloud.log`; the parent gets the bar's
    counts through its callback, and its own stdout and stderr carry nothing of the child."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "all-minilm-l6-v2-onnx").symlink_to(embedder_dir)
    parent = start_parent(serve_args(tiny, "--corpus-limit", "12"), tmp_path, stop=True)
    try:
        out, err = parent.communicate(timeout=300)
    finally:
        parent.kill()
    assert parent.returncode == 0, err
    assert err == ""
    lines = out.splitlines()
    assert lines[-1].startswith("child ")
    progress = [line.split(" ", 3) for line in lines[:-1]]
    assert progress and all(p[0] == "progress" and p[3] == "public corpus" for p in progress)
    counts = [(int(p[1]), int(p[2])) for p in progress]
    assert counts[-1] == (12, 12) and counts == sorted(counts)
    log = (tmp_path / "cloud.log").read_text()
    assert "%|" not in log and "ready" not in log


async def test_whoever_connects_hears_how_far_the_corpus_build_is(monkeypatch):
    """`tandem ask`'s stderr line and the TUI's status bar hear the build's progress through
    `connect_cloud`'s `on_status` (a merge once left it on a callback nobody called)."""
    from app.assistant import Assistant
    from app.embedded import EmbeddedCloud
    from app.settings import Settings
    from app.tui.status import StatusBar

    async def start(args, on_progress=None, **_):  # the child's first report, then no cloud
        on_progress(1234, 10033, "public corpus")
        raise OSError("no backend in this test")

    monkeypatch.setattr(EmbeddedCloud, "start", start)
    monkeypatch.delenv("TANDEM_CLOUD_URL", raising=False)
    heard = []
    status = await Assistant(Settings()).connect_cloud(on_status=heard.append)
    assert status.state == "unavailable"
    building = [s for s in heard if s.detail.startswith("indexing")]
    assert [s.detail for s in building] == ["indexing public corpus 1,234/10,033"]
    bar = StatusBar()
    bar.cloud = building[0]
    assert "cloud starting (embedded)… indexing public corpus 1,234/10,033" in str(bar.line_text())
