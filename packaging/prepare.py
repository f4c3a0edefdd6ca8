"""`tandem models prepare`: the model pair assembled, converted, exported and quantised, once.

Every step writes to a `.partial` path, is published by a rename, and is recorded in the
model's manifest with the size and sha256 of its outputs. A re-run verifies the checksums and
skips what is done, so a run killed at any point completes when started again."""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, TimeoutError
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from collab.plumbing.files import fresh_partial, publish
from collab.plumbing.paths import models_dir
from tandem_packaging import steps
from tandem_packaging.sources import (
    CLOUD_DEFAULT,
    DEVICE_DEFAULT,
    HubSource,
    ModelSource,
    PartsSource,
    PrepareError,
    source_for,
)
from tandem_packaging.store import ModelStore

log = logging.getLogger(__name__)

PAIR_FILE = "pair.json"
GB = 1 << 30
# Output size of each step relative to the GGUF (measured on the default pair:
# float32 checkpoints are ~5–6.5× the Q4_K_M GGUF, quantised ONNX ~1.9×).
SIZE_FACTOR = {"gguf": 1.0, "hf": 6.5, "onnx-fp32": 6.5, "onnx-quant": 2.0}
# How each step makes its output; change one to have `prepare` redo that step everywhere.
RECIPES = {
    "gguf": "concat-parts-v1",
    "hf": "transformers-float32-v1",
    "onnx-fp32": "optimum-text-generation-with-past+grouped-attention+logits-positions-v3",
    "onnx-quant": "matmulnbits-asym-block32-acc4-v2",
}


@dataclass
class ModelPlan:
    role: str
    source: ModelSource
    keep_fp32_onnx: bool
    quantization: str
    store: ModelStore = field(init=False)

    def __post_init__(self) -> None:
        self.store = ModelStore(models_dir() / self.source.key)

    def step_names(self) -> list[str]:
        names = ["hf", "onnx-fp32", "onnx-quant"]
        return ["gguf", *names] if isinstance(self.source, PartsSource) else names

    def recipe(self, name: str) -> str:
        """A step's recipe chained with those before it: changing how one step works
        redoes it and everything made from its output."""
        names = self.step_names()
        chain = " > ".join(RECIPES[n] for n in names[: names.index(name) + 1])
        return f"{chain} ({self.quantization})" if name == "onnx-quant" else chain

    def pending(self) -> list[str]:
        """Steps to run, in order: walk back from the targets, needing a step's input only
        when the step itself must run (verifying checksums on the way)."""
        names = self.step_names()
        needed = {"onnx-quant"} | ({"onnx-fp32"} if self.keep_fp32_onnx else set())
        todo: list[str] = []
        for i in reversed(range(len(names))):
            if names[i] in needed and not self.store.step_done(names[i], self.recipe(names[i])):
                todo.append(names[i])
                if i > 0:
                    needed.add(names[i - 1])
        return todo[::-1]

    def prune_stale(self) -> None:
        """Delete outputs of steps this version no longer makes (renamed or dropped)."""
        manifest = self.store.manifest()
        for name in [n for n in manifest["steps"] if n not in self.step_names()]:
            path = self.store.path(manifest["steps"][name]["output"])
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            self.store.forget_step(name)

    def estimated_bytes(self, todo: list[str]) -> int | None:
        base: float | None = self.source.size if isinstance(self.source, PartsSource) else None
        if base is None and self.store.step_done("hf", self.recipe("hf")):
            base = _folder_size(self.store.path("hf")) / SIZE_FACTOR["hf"]
        if base is None and isinstance(self.source, HubSource) and self.source.local:
            base = _folder_size(self.source.local) / SIZE_FACTOR["hf"]
        if base is None:
            return None
        return int(sum(SIZE_FACTOR[n] * base for n in todo))


def _folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@contextmanager
def _safe_path() -> Iterator[None]:
    """PYTHONSAFEPATH for the children started meanwhile: a spawned child's `-c` bootstrap
    would put the working folder first on its sys.path while it imports multiprocessing (a
    `multiprocessing.py` there would run), as `-P` prevents for Tandem's other children. Only
    meanwhile: this process's later children (and a test run's) keep their own."""
    before = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONSAFEPATH"]
        else:
            os.environ["PYTHONSAFEPATH"] = before


def _run_isolated(label: str, fn: Callable, *args):
    """Run a heavy step in a fresh process: its memory (15 GB peak for the 1.5B export) is
    returned to the system when it ends, and nothing of it lingers in the parent. A ticking
    bar shows the step is alive while it has no progress of its own to report."""
    with (
        ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool,
        tqdm(desc=label, bar_format="{desc}: {elapsed}", leave=True) as ticker,
    ):
        with _safe_path():  # the child starts here
            future = pool.submit(fn, *args)
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                ticker.update(0)
                ticker.refresh()
            except BrokenProcessPool as exc:
                raise PrepareError(
                    f"{label} was killed (out of memory? the 1.5B export needs about 15 GB of "
                    "RAM). Run `tandem models prepare` again to resume."
                ) from exc


def _check_disk(plans: list[tuple[ModelPlan, list[str]]]) -> None:
    need = sum(plan.estimated_bytes(todo) or 0 for plan, todo in plans)
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if need > free:
        raise PrepareError(
            f"not enough disk space in {root}: about {need / GB:.1f} GB needed, "
            f"{free / GB:.1f} GB free. Free some space or set TANDEM_DATA_DIR to another disk."
        )


def _check_pair(device: ModelPlan, cloud: ModelPlan) -> None:
    """Both sides must share a vocabulary; refuse a mismatched pair before any heavy work."""
    fingerprints = []
    for plan in (device, cloud):
        rec = plan.store.manifest()["steps"].get("hf", {})
        fp = rec.get("tokenizer_fingerprint")
        if fp is None and isinstance(plan.source, HubSource):
            from transformers import AutoTokenizer

            from model_runtime.tokenizer import tokenizer_fingerprint

            try:
                fp = tokenizer_fingerprint(AutoTokenizer.from_pretrained(plan.source.ref))
            except Exception as exc:  # tokenizers raises plain Exception on a broken file
                raise PrepareError(
                    f"cannot load the tokenizer of {plan.source.ref!r}: {exc}"
                ) from exc
        fingerprints.append(fp)
    if None not in fingerprints and fingerprints[0] != fingerprints[1]:
        raise PrepareError(
            f"the device model ({device.source.key}) and the cloud model ({cloud.source.key}) "
            "use different tokenizers; split decoding and DRAGON need one shared vocabulary. "
            "Choose a pair from one model family."
        )


def _run_step(plan: ModelPlan, name: str) -> None:
    store = plan.store
    final = store.path("model.gguf" if name == "gguf" else name)
    partial = fresh_partial(final)
    store.forget_step(name)
    started = time.monotonic()
    if name == "gguf":
        src = plan.source
        assert isinstance(src, PartsSource)
        partial.parent.mkdir(parents=True, exist_ok=True)
        info = steps.assemble_gguf(src.part_paths(), partial, src.size, src.sha256)
    elif name == "hf":
        if isinstance(plan.source, PartsSource):
            info = _run_isolated("convert", steps.convert_gguf, store.path("model.gguf"), partial)
        else:
            info = _run_isolated("convert", steps.convert_hub, plan.source.ref, partial)
    elif name == "onnx-fp32":
        info = _run_isolated("export ONNX", steps.export_onnx, store.path("hf"), partial)
    else:
        info = _run_isolated(
            f"quantise {plan.quantization}",
            steps.quantize,
            store.path("onnx-fp32"),
            partial,
            plan.quantization,
        )
    publish(partial, final)
    store.record_step(
        name, final.name, plan.recipe(name), seconds=round(time.monotonic() - started, 1), **info
    )


def _discard_fp32(plan: ModelPlan) -> None:
    shutil.rmtree(plan.store.path("onnx-fp32"), ignore_errors=True)
    plan.store.forget_step("onnx-fp32")


def plans_for(
    device_ref: str | None = None, cloud_ref: str | None = None
) -> tuple[ModelPlan, ModelPlan]:
    # The device keeps its float32 ONNX (the reference the benchmarks compare against).
    device = ModelPlan("device", source_for(device_ref, DEVICE_DEFAULT), True, "int8-head4")
    # The cloud serves int4 (or torch from the safetensors); its float32 ONNX is only a step.
    cloud = ModelPlan("cloud", source_for(cloud_ref, CLOUD_DEFAULT), False, "int4")
    return device, cloud


def prepare(
    device_ref: str | None = None,
    cloud_ref: str | None = None,
    only: str | None = None,
    say: Callable[[str], None] = log.info,
) -> bool:
    """Prepare the pair (or `only` one role). Returns True if any work was done."""
    with _exclusive_lock():
        return _prepare(device_ref, cloud_ref, only, say)


@contextmanager
def _exclusive_lock() -> Iterator[None]:
    """One `prepare` at a time: two would overwrite each other's partial outputs."""
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".prepare.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise PrepareError("another `tandem models prepare` is running; wait for it") from exc
        yield


def _prepare(
    device_ref: str | None, cloud_ref: str | None, only: str | None, say: Callable[[str], None]
) -> bool:
    device, cloud = plans_for(device_ref, cloud_ref)
    _check_pair(device, cloud)
    chosen = [p for p in (device, cloud) if only in (None, p.role)]
    for plan in chosen:
        plan.prune_stale()
    say("Checking prepared models (verifying checksums)…")
    work = [(plan, plan.pending()) for plan in chosen]
    if not any(todo for _, todo in work):
        _write_pair(device, cloud)
        say("All models are prepared and verified; nothing to do.")
        return False
    for plan, todo in work:
        if todo and isinstance(plan.source, PartsSource):
            plan.source.part_paths()  # a missing package fails here, naming the pip command
    _check_disk(work)
    for plan, todo in work:
        for i, name in enumerate(todo, 1):
            say(f"[{plan.role} {plan.source.key}] step {i}/{len(todo)}: {name}")
            _run_step(plan, name)
        if not plan.keep_fp32_onnx and plan.store.step_done(
            "onnx-quant", plan.recipe("onnx-quant")
        ):
            _discard_fp32(plan)
    _write_pair(device, cloud)
    _check_pair(device, cloud)
    say("Models are ready.")
    return True


def _write_pair(device: ModelPlan, cloud: ModelPlan) -> None:
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    (root / PAIR_FILE).write_text(
        json.dumps({"device": device.source.key, "cloud": cloud.source.key})
    )


@dataclass
class PreparedModel:
    role: str
    key: str
    root: Path
    steps: dict


def prepared_pair() -> dict[str, PreparedModel]:
    """The prepared device and cloud models, by role (empty if never prepared)."""
    try:
        pair = json.loads((models_dir() / PAIR_FILE).read_text())
    except FileNotFoundError:
        return {}
    out = {}
    for role, key in pair.items():
        store = ModelStore(models_dir() / key)
        out[role] = PreparedModel(role, key, store.root, store.manifest()["steps"])
    return out


def model_path(role: str, variant: str = "onnx-quant") -> Path:
    """Folder of a prepared model variant (`hf`, `onnx-fp32`, `onnx-quant`), or a clear error."""
    pair = prepared_pair()
    if role not in pair or variant not in pair[role].steps:
        raise PrepareError(
            f"the {role} model ({variant}) is not prepared: run `tandem models prepare`"
        )
    return pair[role].root / variant
