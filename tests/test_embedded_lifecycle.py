"""The embedded cloud's life with its parent: it ends when the parent ends (a closed terminal's
SIGHUP, SIGTERM, SIGKILL), and it never writes on the parent's terminal, reporting what its
public search can do (by keyword while the corpus builds) through a callback instead. Real
processes throughout: a parent script that starts `EmbeddedCloud` (the tiny model), and the
`tandem serve` child it starts."""

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

# The parent: starts the embedded cloud, prints each search report and the child's pid, then
# either waits to be killed or (with `--stop`) stops the cloud and exits.
PARENT = """
import asyncio, signal, sys
from app.embedded import EmbeddedCloud

signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal, even if the tests run under nohup

async def main(stop, args):
    def searching(what):
        print(f"search {what}", flush=True)

    cloud = await EmbeddedCloud.start(args, timeout_s=120, on_search=searching)
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
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdin=subprocess.PIPE)
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
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        timeout=30,
        stdin=subprocess.PIPE,
        capture_output=True,
    )
    assert proc.returncode == 1


def test_a_first_start_serves_by_keyword_and_never_writes_on_the_terminal(
    tiny, embedder_dir, tmp_path
):
    """A first start serves before its corpus is embedded: the parent hears "keywords" before
    the child is ready. The child's logs go to `<data dir>/cloud.log`, which says what public
    search can do, and the parent's own stdout and stderr carry nothing of the child."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "all-minilm-l6-v2-onnx").symlink_to(embedder_dir)
    config = tmp_path / "cloud.toml"  # the shipped vectors would make the build take seconds
    config.write_text("[cloud]\ncorpus_shipped_vectors = false\n")
    args = serve_args(tiny, "--corpus-limit", "12", "--config", str(config))
    parent = start_parent(args, tmp_path, stop=True)
    try:
        out, err = parent.communicate(timeout=300)
    finally:
        parent.kill()
    assert parent.returncode == 0, err
    assert err == ""
    lines = out.splitlines()
    assert lines[-1].startswith("child ")
    assert lines[0] == "search keywords; meaning 0 %", lines
    assert all(line.startswith("search ") for line in lines[:-1]), lines
    log = (tmp_path / "cloud.log").read_text()
    assert "public search: keywords; meaning 0 %" in log
    assert "%|" not in log and "ready" not in log


async def test_whoever_connects_hears_what_public_search_can_do(monkeypatch):
    """`tandem ask`'s stderr line and the TUI's status bar hear, through `connect_cloud`'s
    `on_status`, that a first start searches by keyword until its meaning index is built."""
    from types import SimpleNamespace

    from app.assistant import Assistant
    from app.embedded import EmbeddedCloud
    from app.settings import Settings
    from app.tui.status import StatusBar

    told = []

    async def start(args, on_search=None, **_):  # the child's reports, without a child
        told.append(on_search)
        on_search("keywords; meaning 0 %")
        proc = SimpleNamespace(returncode=None)
        return SimpleNamespace(url="ws://127.0.0.1:9/ws", token="t", proc=proc)

    monkeypatch.setattr(EmbeddedCloud, "start", start)
    monkeypatch.delenv("TANDEM_CLOUD_URL", raising=False)
    heard = []
    assistant = Assistant(Settings())
    status = await assistant.connect_cloud(on_status=heard.append)
    assert status.state == "ready" and status.search == "keywords; meaning 0 %"
    bar = StatusBar()
    bar.cloud = status
    assert "cloud ready (embedded) · public search: keywords; meaning 0 %" in str(bar.line_text())

    told[0]("keywords; meaning 40 %")
    assert heard[-1].state == "ready" and heard[-1].search == "keywords; meaning 40 %"
    told[0]("meaning")  # built: nothing more to say
    assert heard[-1].state == "ready" and heard[-1].search == ""
    bar.cloud = heard[-1]
    assert "public search" not in str(bar.line_text())
