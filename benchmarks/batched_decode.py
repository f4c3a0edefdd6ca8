"""The runtime's own batched decoding, without the engine around it: one decode pass of B
sequences (128-token contexts) at B = 1, 2, 4, 8, 16, on one thread, for the prepared cloud
model. It bounds what batching sessions can give on this machine (`benchmarks.capacity`
measures what the engine gets).

    python -m benchmarks.batched_decode [--engine ort|torch] [--passes 8] [--out FILE]

Writes ms per pass and tokens/s at each B with provenance to `--out` (default
`results/batched-decode/<engine>.json`). `--quick` times 2 passes at B = 1, 2, 4 (a smoke run,
`<engine>-quick.json`); `--model DIR` decodes another model folder (an ONNX folder for `ort`,
a Hugging Face one for `torch`), e.g. a tiny test model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.provenance import command_line, default_out, record, write_result

BATCHES = (1, 2, 4, 8, 16)
QUICK_BATCHES = (1, 2, 4)
CONTEXT = 128


def main(argv: Sequence[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batched_decode")
    parser.add_argument("--engine", choices=("ort", "torch"), default="ort")
    parser.add_argument("--passes", type=int, default=8, help="decode passes timed per batch")
    parser.add_argument("--quick", action="store_true", help="2 passes at B = 1, 2, 4")
    parser.add_argument("--model", type=Path, help="model folder (default: the prepared cloud)")
    parser.add_argument("--out", type=Path, help="the result file")
    args = parser.parse_args(argv)
    batches = QUICK_BATCHES if args.quick else BATCHES
    passes = 2 if args.quick else args.passes
    prov = record(
        command_line("benchmarks.batched_decode", argv),
        threads={args.engine: 1},
        engines=["onnxruntime" if args.engine == "ort" else "torch bf16"],
    )
    from model_runtime.runtime import CausalLM
    from tandem_packaging.prepare import model_path

    lm: CausalLM
    if args.engine == "ort":
        from model_runtime.ort_runtime import OrtCausalLM

        model = args.model or model_path("cloud", "onnx-quant")
        lm = OrtCausalLM(model, threads=1)
    else:
        import torch

        from model_runtime.torch_runtime import TorchCausalLM

        model = args.model or model_path("cloud", "hf")
        lm = TorchCausalLM(model, dtype=torch.bfloat16, threads=1)
    ms: dict[int, float] = {}
    for batch in batches:
        lm.prefill([[1000 + b + i for i in range(CONTEXT)] for b in range(batch)])
        steps = []
        for step in range(passes + 1):
            start = time.perf_counter()
            lm.decode([2000 + step] * batch)
            steps.append((time.perf_counter() - start) * 1000)
        ms[batch] = statistics.median(steps[1:])  # the first pass warms up
        rate = batch / ms[batch] * 1000
        print(
            f"batch {batch:2}: {ms[batch]:6.1f} ms a pass, {rate:5.1f} tokens/s, "
            f"x{rate / (1000 / ms[1]):.2f} of batch 1",
            file=sys.stderr,
        )
    rows: list[dict[str, Any]] = [
        {"batch": b, "ms_per_pass": m, "tokens_per_s": b / m * 1000} for b, m in ms.items()
    ]
    config = {
        "engine": args.engine,
        "model": model.name,
        "context": CONTEXT,
        "passes": passes,
        "quick": args.quick,
    }
    out = args.out or default_out("batched-decode", args.engine, args.quick)
    write_result(out, prov, {"config": config, "rows": rows})
    print(f"written to {out}", file=sys.stderr)
    return ms


if __name__ == "__main__":
    main()
