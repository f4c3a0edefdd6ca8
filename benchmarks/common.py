"""What the latency benchmarks with the real pair share
(docs/benchmarks/index.md#measuring-honestly): the cloud in its own
process pinned to one core with `taskset`, this process (the device and the link emulator)
pinned to another, the link's address, and the figures' formatting."""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.embedded import EmbeddedCloud


async def start_cloud(
    engine: str,
    core: int | None,
    corpus: bool = False,
    corpus_k: int | None = None,
    extra: Sequence[str] = (),
    dtype: str = "bfloat16",
) -> tuple[EmbeddedCloud, str, str]:
    """`tandem serve` with `engine` on one thread (pinned to `core`), with or without the
    public corpus (`corpus_k` passages per cloud-mode answer), and `extra` flags: the cloud,
    its session URL and its token."""
    from app.embedded import EmbeddedCloud

    python = None
    if engine == "vllm":
        python = str(vllm_python() or sys.exit(f"--engine vllm: {VLLM_INSTALL}"))
    serve = ["--engine", engine, "--threads", "1", *extra]
    if not corpus:
        serve.append("--no-corpus")
    elif corpus_k is not None:
        serve += ["--corpus-k", str(corpus_k)]
    if engine in ("torch", "vllm"):
        serve += ["--dtype", dtype]
    cloud = await EmbeddedCloud.start(serve, cores=None if core is None else {core}, python=python)
    return cloud, cloud.url, cloud.token


def repo_relative(path: Path | str) -> str:
    """`path` as a result file records it: relative to the repository when inside it, so a
    committed result names no machine's directories."""
    resolved = Path(path).resolve()
    root = Path(__file__).resolve().parents[1]
    return str(resolved.relative_to(root)) if resolved.is_relative_to(root) else str(path)


VLLM_INSTALL = "the vLLM environment is not installed: sh packaging/install_vllm_cloud.sh"


def vllm_python() -> Path | None:
    """The python of the vLLM cloud's environment (`TANDEM_VLLM_PYTHON`, else the repo's
    `.venv-vllm/`), or None where it is not installed."""
    named = os.environ.get("TANDEM_VLLM_PYTHON")
    path = Path(named) if named else Path(__file__).resolve().parents[1] / ".venv-vllm/bin/python"
    return path if path.is_file() else None


def host_port(url: str) -> tuple[str, int]:
    """The host and port of a ws://host:port/... URL (where the link emulator forwards to)."""
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    return host, int(port)


def pin_device(device_core: int, cloud_core: int | None) -> int | None:
    """Pin this process (the device) to `device_core` so the cloud's core stays its own; the
    core the cloud gets (None on a one-core machine: nothing to separate)."""
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {device_core})
    else:
        cloud_core = None
    print(
        f"device on core {device_core} (sched_setaffinity), cloud on core "
        f"{cloud_core} (taskset); link: TCP delay proxy",
        file=sys.stderr,
    )
    return cloud_core


def fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def mean_of(rows: list[dict], key: str) -> float | None:
    """The mean of `key` over the rows that have it (None where none has)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.mean(values) if values else None
