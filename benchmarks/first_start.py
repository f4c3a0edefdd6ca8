"""A fresh install's first start (issue 46): the embedded cloud started on a data folder that
holds only the prepared models, as after the README's first command, then one public question
in cloud mode. How long until the cloud serves, and until the first answer has arrived citing
its source.

    python -m benchmarks.first_start                # 2 runs, each on a fresh data folder
    python -m benchmarks.first_start --runs 1 --quick   # one run, 8 tokens (a smoke run)
    python -m benchmarks.first_start --no-shipped-vectors --name ort-embed-all
                                                    # the worst case: every summary embedded

The device (this process) is pinned to core 0 and the cloud to core 1, as in every benchmark
here; the cloud's first start serves public search by keyword at once while it builds the
public corpus (`cloud_backend.corpus_serving`), with the vectors shipped with the project where
they pass their spot check (`cloud_backend.corpus_vectors`), and the run records when public
search could do what (`public_search`) and what its build did (the corpus manifest's
`shipped_vectors`, when it finished before the cloud stopped). Target: the first public
answer, citing its source, within 120 s of starting the cloud."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import command_line, default_out, record, write_result

QUESTION = "In which city was the pop group ABBA formed?"
FACT = "stockholm"
TARGET_S = 120.0


def _fresh_data_dir(root: Path) -> Path:
    """A data folder holding only the prepared models (linked, not copied: 16 GB)."""
    from collab.plumbing.paths import models_dir

    data = root / "data"
    data.mkdir(mode=0o700)
    (data / "models").symlink_to(models_dir(), target_is_directory=True)
    return data


def _manifest(data: Path) -> dict[str, Any]:
    found = sorted((data / "cloud" / "corpus").glob("corpus-*/corpus.json"))
    return json.loads(found[0].read_text()) if found else {}


async def one_start(
    device: Any, max_tokens: int, cloud_core: int | None, shipped: bool = True
) -> dict[str, Any]:
    """Start the cloud on a fresh data folder, ask the question, stop: the times."""
    from app.embedded import EmbeddedCloud
    from collab.plumbing.paths import DATA_DIR_ENV
    from edge_runtime.events import Citation, Stats, TextDelta
    from edge_runtime.modes import build_mode
    from edge_runtime.modes.base import CloudSettings, ModeContext
    from edge_runtime.options import AnswerOptions
    from personal_index.index import PersonalIndex
    from retrieval.embedder import question_cosines

    with tempfile.TemporaryDirectory(prefix="tandem-first-start-") as tmp:
        data = _fresh_data_dir(Path(tmp))
        before = os.environ.get(DATA_DIR_ENV)
        os.environ[DATA_DIR_ENV] = str(data)  # the child inherits it: its corpus goes there
        searching: list[tuple[float, str]] = []  # what public search could do, and when
        config = Path(tmp) / "cloud.toml"
        config.write_text(f"[cloud]\ncorpus_shipped_vectors = {str(shipped).lower()}\n")
        started = time.perf_counter()
        try:
            cloud = await EmbeddedCloud.start(
                ["--engine", "ort", "--threads", "1", "--config", str(config)],
                cores=None if cloud_core is None else {cloud_core},
                on_search=lambda what: searching.append(
                    (round(time.perf_counter() - started, 2), what)
                ),
                log_path=Path(tmp) / "cloud.log",
            )
        finally:
            if before is None:
                os.environ.pop(DATA_DIR_ENV, None)
            else:
                os.environ[DATA_DIR_ENV] = before
        serving_s = time.perf_counter() - started
        index = PersonalIndex(Path(tmp) / "index", data / "models" / "all-minilm-l6-v2-onnx")
        ctx = ModeContext(
            device=device,
            index=index,
            judge=partial(question_cosines, index.embedder.embed),
            cloud=CloudSettings(cloud.url, cloud.token, embedded=True),
        )
        mode = build_mode("cloud", ctx)
        text, cited, stats = "", [], None
        asked = time.perf_counter()
        try:
            async for ev in mode.answer(
                QUESTION, [], AnswerOptions(max_new_tokens=max_tokens, temperature=0.0)
            ):
                if isinstance(ev, TextDelta):
                    text += ev.text
                elif isinstance(ev, Citation):
                    cited.append({"title": ev.title, "side": ev.side, "score": ev.score})
                elif isinstance(ev, Stats):
                    stats = ev
        finally:
            answered_s = time.perf_counter() - started
            await mode.close()
            await cloud.stop()
            index.close()
        manifest = _manifest(data)
    return {
        "serving_s": round(serving_s, 2),
        "first_answer_s": round(answered_s, 2),
        "answer_s": round(answered_s - (asked - started), 2),
        "ttft_s": None if stats is None or stats.ttft_s is None else round(stats.ttft_s, 2),
        "answer": text,
        "right": FACT in text.lower(),
        "citations": cited,
        "cites_public": any(c["side"] == "cloud" for c in cited),
        "corpus": {
            k: manifest.get(k)
            for k in (
                "documents",
                "chunks",
                "build_seconds",
                "embedded_this_run",
                "shipped_vectors",
            )
        },
        "public_search": searching,
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.common import pin_device
    from edge_runtime.device import DeviceModel
    from tandem_packaging.prepare import model_path

    cloud_core = pin_device(0, 1)
    device = DeviceModel.load(model_path("device", "onnx-quant"), threads=1)
    runs = []
    for i in range(args.runs):
        row = await one_start(device, args.max_tokens, cloud_core, args.shipped_vectors)
        runs.append(row)
        print(
            f"run {i + 1}: serving after {row['serving_s']:.1f} s, first answer after "
            f"{row['first_answer_s']:.1f} s (cites public: {row['cites_public']}) "
            f"{row['answer'][:60]!r}",
            file=sys.stderr,
            flush=True,
        )
    return runs


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The median and worst of each time, and the target's verdict on the worst run."""
    first = [r["first_answer_s"] for r in runs]
    ok = all(r["cites_public"] for r in runs)
    return {
        "runs": len(runs),
        "serving_s": {
            "median": statistics.median(r["serving_s"] for r in runs),
            "max": max(r["serving_s"] for r in runs),
        },
        "first_answer_s": {"median": statistics.median(first), "max": max(first)},
        "all_cite_public": ok,
        "all_right": all(r["right"] for r in runs),
        "target_s": TARGET_S,
        "met": ok and max(first) <= TARGET_S,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="8 tokens (a smoke run)")
    parser.add_argument("--name", default="ort")
    parser.add_argument(
        "--no-shipped-vectors",
        dest="shipped_vectors",
        action="store_false",
        help="embed every summary on this machine (corpus_shipped_vectors = false)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens = 8
    prov = record(
        command_line("benchmarks.first_start", argv),
        pinning={"device": 0, "cloud": 1},
        threads={"device": 1, "cloud": 1},
        engines=["ort"],
    )
    runs = asyncio.run(run(args))
    data = {
        "config": {
            "question": QUESTION,
            "max_tokens": args.max_tokens,
            "shipped_vectors": args.shipped_vectors,
        },
        "runs": runs,
        "summary": summary(runs),
    }
    out = write_result(default_out("first-start", args.name, args.quick), prov, data)
    print(json.dumps(data["summary"]), f"\nwritten to {out}")


if __name__ == "__main__":
    main()
