"""`tandem serve` stopped the way systemd, a container runtime, a balancer's drain or Ctrl-C
stops it (SIGTERM, SIGINT): the answer in flight ends with a plain message on the device, the
server exits within a bound, and no process it started is left (vLLM's engine processes
ignored SIGTERM and outlived it, holding gigabytes). The vLLM case runs in the vllm tier."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from edge_runtime.device import DeviceModel
from edge_runtime.events import Failure, Notice, TextDelta
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext
from model_runtime.ort_runtime import OrtCausalLM

REPO = Path(__file__).resolve().parents[1]
# random, as `tandem serve` asks (it refuses a token that looks weaker than 128 bits)
TOKEN = "l2sC-8CSDi6O6toyqQ072bhpYRWKvbWhnGqmtSRkgqM"
METRICS_TOKEN = "Lo60dqYrMrZoB1Ru4n2hVeqeQ8vpHGjU8uln6sAojXY"
STOP_BOUND_S = 30  # the sessions' 10 s, vLLM's engine processes' 10 s, and slack


class Served:
    """A `tandem serve` process, its URL once it serves, and every line it printed."""

    def __init__(self, command: list[str]) -> None:
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
        )
        self.log: list[str] = []
        self.url = ""
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(600) or not self.url:
            self.process.kill()
            pytest.fail("the cloud did not start:\n" + "".join(self.log[-40:]))

    def _read(self) -> None:  # keep draining: a full pipe would stall the server
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line)
            if match := re.search(r"serving \S+ at (ws://\S+)", line):
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)


def serve(python: str | Path, tmp_path: Path, *args: str, more: str = "") -> Served:
    config = tmp_path / "cloud.toml"
    config.write_text(
        f'[cloud]\ntoken = "{TOKEN}"\nmetrics_token = "{METRICS_TOKEN}"\nport = 0\n'
        f"corpus_enabled = false\n{more}"
    )
    return Served([str(python), "-m", "app.cli", "serve", "--config", str(config), *args])


async def stop_mid_answer(served: Served, device: DeviceModel, how: signal.Signals) -> None:
    """A cloud-mode answer starts; at its first token the server gets `how`. The device says
    the cloud went away (and finishes alone), the server exits 0 within the bound, and every
    process it started is gone."""
    ctx = ModeContext(device=device, cloud=CloudSettings(served.url, TOKEN))
    mode = build_mode("cloud", ctx)
    options = AnswerOptions(max_new_tokens=4000, temperature=0.0, k=0)
    events = []
    children: list[psutil.Process] = []
    stopped_at = 0.0
    try:
        async for event in mode.answer("Tell me a very long story.", [], options):
            events.append(event)
            if isinstance(event, TextDelta) and not stopped_at:
                children = served.descendants()
                stopped_at = time.monotonic()
                served.process.send_signal(how)
            if stopped_at and served.process.poll() is not None and len(events) > 4000:
                break
    finally:
        await mode.close()
    assert stopped_at, events
    try:
        code = served.process.wait(STOP_BOUND_S - (time.monotonic() - stopped_at))
    except subprocess.TimeoutExpired:
        served.process.kill()
        pytest.fail(f"still running {STOP_BOUND_S} s after {how.name}:\n" + "".join(served.log))
    assert code == 0, "".join(served.log[-30:])
    said = " ".join(
        e.message if isinstance(e, Failure) else e.text
        for e in events
        if isinstance(e, Failure | Notice)
    )
    assert "shutting down" in said, events[-5:]
    time.sleep(0.5)  # a killed process is reaped by its parent, or by init, meanwhile
    left = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"left running after {how.name}: {[p.cmdline()[:3] for p in left]}"


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
async def test_builtin_cloud_stops_cleanly(how, tiny, tiny_tokenizer, tmp_path):
    served = serve(
        sys.executable,
        tmp_path,
        "--engine",
        "ort",
        "--model-dir",
        str(tiny["onnx-fp32"]),
        "--threads",
        "1",
    )
    device = DeviceModel(OrtCausalLM(tiny["onnx-quant"]), tiny_tokenizer, "tiny")
    await stop_mid_answer(served, device, how)


VLLM_SERVE = ("--engine", "vllm", "--dtype", "float32", "--model-dir")
VLLM_CONFIG = "kv_budget_bytes = 1073741824\n\n[cloud.vllm]\nenforce_eager = true\n"
