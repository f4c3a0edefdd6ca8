"""The runtime's own batched decoding, without the engine around it: one decode pass of B
sequences (128-token contexts) at B = 1, 2, 4, 8, 16, on one thread, for the prepared cloud
model. It bounds what batching sessions can give on this machine (`benchmarks.capacity`
measures what the engine gets).

    python -m benchmarks.batched_decode [--engine ort|torch] [--passes 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

BATCHES = (1, 2, 4, 8, 16)
CONTEXT = 128


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batched_decode")
    parser.add_argument("--engine", choices=("ort", "torch"), default="ort")
    parser.add_argument("--passes", type=int, default=8, help="decode passes timed per batch")
    args = parser.parse_args(argv)
    from model_runtime.runtime import CausalLM
    from tandem_packaging.prepare import model_path

    lm: CausalLM
    if args.engine == "ort":
        from model_runtime.ort_runtime import OrtCausalLM

        lm = OrtCausalLM(model_path("cloud", "onnx-quant"), threads=1)
    else:
        import torch

        from model_runtime.torch_runtime import TorchCausalLM

        lm = TorchCausalLM(model_path("cloud", "hf"), dtype=torch.bfloat16, threads=1)
    ms: dict[int, float] = {}
    for batch in BATCHES:
        lm.prefill([[1000 + b + i for i in range(CONTEXT)] for b in range(batch)])
        steps = []
        for step in range(args.passes + 1):
            start = time.perf_counter()
            lm.decode([2000 + step] * batch)
            steps.append((time.perf_counter() - start) * 1000)
        ms[batch] = statistics.median(steps[1:])  # the first pass warms up
        rate = batch / ms[batch] * 1000
        print(f"batch {batch:2}: {ms[batch]:6.1f} ms a pass, {rate:5.1f} tokens/s, "
              f"x{rate / (1000 / ms[1]):.2f} of batch 1", file=sys.stderr)  # fmt: skip
    return ms


if __name__ == "__main__":
    main()
