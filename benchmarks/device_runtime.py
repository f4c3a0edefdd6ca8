"""Device runtime benchmark: every backend of the device model, measured in one run.

    python -m benchmarks.device_runtime [--decode 32] [--quick] [--models DIR] [--out FILE]

For torch fp32, torch bf16, ORT fp32 and each weight-only quantisation scheme (the device's
default marked *; the others are quantised into a temporary folder) it prints: prefill of 256
tokens, decode ms/token (at 256 tokens of context), forward of 5 and 9 tokens, a batch-4
decode step, mean KL to torch fp32 and top-1 agreement (teacher-forced on prose + code), and
decode time as a multiple of the memory-bandwidth floor (weight bytes read per token ÷
measured copy bandwidth, one copying thread per core). Then, for the default: IO binding vs
plain `session.run`, and two ORT sessions decoding at once with intra-op spinning on and off.
Needs `tandem models prepare` (or `--models DIR`: a folder holding `hf/`, `onnx-fp32/` and
`onnx-quant/`, like the tiny test model's). Writes every figure with provenance to `--out`
(`--json` is the old name; default `results/device/runtime.json`). `--quick` decodes 4 tokens
after 64 of context with 2 repeats per timing (a smoke run of seconds on a tiny model,
`runtime-quick.json`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from benchmarks.provenance import command_line, default_out, record, write_result
from model_runtime.ort_runtime import OrtCausalLM
from model_runtime.runtime import CausalLM
from model_runtime.tokenizer import load_tokenizer
from model_runtime.torch_runtime import TorchCausalLM
from tandem_packaging.prepare import model_path, plans_for
from tandem_packaging.steps import SCHEMES, quantize

TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Photosynthesis is the process by which green plants transform light "
    "energy into chemical energy: water, carbon dioxide and minerals become oxygen and "
    "energy-rich organic compounds.\n"
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n"
    "    middle = len(items) // 2\n    left = merge_sort(items[:middle])\n"
    "    right = merge_sort(items[middle:])\n    return merge(left, right)\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n"
    "    def push(self, x):\n        self.items.append(x)\n"
)


def timed(fn, repeats: int) -> float:
    """Median wall time of `fn()` in milliseconds."""
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1000)
    return statistics.median(samples)


def copy_bandwidth() -> float:
    """Bytes per second moved by large memory copies, one thread per core (numpy releases
    the GIL while copying); read + write both counted."""
    threads = os.cpu_count() or 1
    src = [np.ones(128 << 20, dtype=np.uint8) for _ in range(threads)]  # 128 MiB each
    dst = [np.empty_like(a) for a in src]

    def copy_all() -> None:
        workers = [
            threading.Thread(target=np.copyto, args=(d, a)) for d, a in zip(dst, src, strict=True)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    copy_all()
    best = timed(copy_all, 5)
    return 2 * sum(a.nbytes for a in src) / (best / 1000)


def onnx_weight_bytes(path: Path) -> int:
    """Bytes of weights read per decoded token: every initializer but the embedding table
    (a Gather reads one row of it)."""
    model = onnx.load(str(path / "model.onnx"), load_external_data=False)
    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    total = 0
    for init in model.graph.initializer:
        if init.name in gathered:
            continue
        ext = {e.key: e.value for e in init.external_data}
        total += int(ext["length"]) if "length" in ext else len(init.raw_data)
    return total


def torch_weight_bytes(lm: TorchCausalLM) -> int:
    return sum(
        p.numel() * p.element_size()
        for name, p in lm.model.named_parameters()
        if "embed_tokens" not in name
    )


def measure(
    lm: CausalLM, ids: list[int], decode_tokens: int, context: int = 256, repeats: int = 5
) -> dict:
    prompt = ids[:context]
    lm.prefill([prompt[:8]])  # warm-up
    prefill = timed(lambda: lm.prefill([prompt]), min(2, repeats))
    lm.prefill([prompt])
    steps = []
    for t in ids[context : context + decode_tokens]:
        s = time.perf_counter()
        lm.decode([t])
        steps.append((time.perf_counter() - s) * 1000)
    out = {"prefill_ms": prefill, "decode_ms": statistics.median(steps)}
    for n in (5, 9):

        def fwd(n=n):
            lm.forward([ids[context : context + n]])
            lm.rollback(context)

        lm.rollback(context)
        out[f"forward_{n}_ms"] = timed(fwd, repeats)
    lengths = [context * 25 // 32, context * 29 // 32, context, context * 23 // 32]
    lm.prefill([prompt[:n] for n in lengths])  # 200, 230, 256, 180 at 256 of context
    out["batch4_step_ms"] = timed(  # a tuple: both calls in one lambda
        lambda: (lm.decode([ids[context + 44]] * 4), lm.rollback(lengths)),  # type: ignore[func-returns-value]
        repeats,
    )
    return out


def teacher_forced_logprobs(lm: CausalLM, ids: list[int]) -> np.ndarray:
    lm.prefill([ids[:1]])
    logits = lm.forward([ids[1:]])[0].astype(np.float64)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def two_sessions(path: Path, spinning: bool, ids: list[int], tokens: int = 24) -> float:
    # 64 tokens of context, then `tokens` decoded by each session
    """Median ms/token of two sessions decoding at the same time, each on all cores."""
    lms = [OrtCausalLM(path, allow_spinning=spinning) for _ in range(2)]
    for lm in lms:
        lm.prefill([ids[:64]])
    results: list[list[float]] = [[], []]

    def run(i: int) -> None:
        for t in ids[64 : 64 + tokens]:
            s = time.perf_counter()
            lms[i].decode([t])
            results[i].append((time.perf_counter() - s) * 1000)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return statistics.median(results[0] + results[1])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decode", type=int, default=32, help="tokens decoded per backend")
    parser.add_argument("--context", type=int, default=256, help="tokens before decoding")
    parser.add_argument("--quick", action="store_true", help="4 tokens after 64, 2 repeats")
    parser.add_argument("--models", type=Path, help="folder of hf/, onnx-fp32/, onnx-quant/")
    parser.add_argument("--out", "--json", dest="out", type=Path, help="the result file")
    args = parser.parse_args(argv)
    repeats, io_repeats, two_tokens = 5, 15, 24
    if args.quick:
        args.decode, args.context = 4, 64
        repeats, io_repeats, two_tokens = 2, 2, 4
    prov = record(
        command_line("benchmarks.device_runtime", argv),
        threads={"torch": os.cpu_count(), "onnxruntime": os.cpu_count()},
        engines=["torch", "onnxruntime"],
    )
    started = time.perf_counter()

    if args.models:
        hf, fp32, chosen = (args.models / v for v in ("hf", "onnx-fp32", "onnx-quant"))
    else:
        hf, fp32, chosen = (
            model_path("device", "hf"),
            model_path("device", "onnx-fp32"),
            model_path("device", "onnx-quant"),
        )
    default_scheme = plans_for()[0].quantization
    context = args.context
    tokenizer = load_tokenizer(hf)
    ids = tokenizer.encode(TEXT * 4)
    assert len(ids) >= max(context + args.decode + 9, context + 45, 64 + two_tokens), len(ids)
    kl_ids = tokenizer.encode(TEXT)
    bandwidth = copy_bandwidth()
    print(f"device model: {hf.parent.name}; {os.cpu_count()} threads (torch and ORT)")
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write, {os.cpu_count()} threads)")

    scratch = tempfile.TemporaryDirectory(prefix="tandem-bench-")
    schemes = {default_scheme: chosen}
    for scheme in SCHEMES:
        if scheme not in schemes:
            schemes[scheme] = Path(scratch.name) / scheme
            quantize(fp32, schemes[scheme], scheme)
    backends = [
        ("torch fp32", lambda: TorchCausalLM(hf, torch.float32), None),
        ("torch bf16", lambda: TorchCausalLM(hf, torch.bfloat16), None),
        ("ORT fp32", lambda: OrtCausalLM(fp32), fp32),
    ] + [
        (f"ORT {s}" + ("*" if s == default_scheme else ""), lambda p=p: OrtCausalLM(p), p)
        for s, p in schemes.items()
    ]

    rows: dict[str, dict] = {}
    reference = None
    for name, make, onnx_dir in backends:
        lm = make()
        row = measure(lm, ids, args.decode, context, repeats)
        logprobs = teacher_forced_logprobs(lm, kl_ids)
        if reference is None:
            reference = logprobs
        row["kl_to_fp32"] = float((np.exp(reference) * (reference - logprobs)).sum(-1).mean())
        row["top1_agreement"] = float((reference.argmax(-1) == logprobs.argmax(-1)).mean())
        # no ONNX folder: one of the torch backends
        weight_bytes = onnx_weight_bytes(onnx_dir) if onnx_dir else torch_weight_bytes(lm)  # type: ignore[arg-type]
        row["weight_mb_per_token"] = weight_bytes / 1e6
        row["floor_ms"] = weight_bytes / bandwidth * 1000
        row["x_floor"] = row["decode_ms"] / row["floor_ms"]
        rows[name] = row
        print(f"  {name}: measured ({time.perf_counter() - started:.0f} s so far)")
        del lm
    scratch.cleanup()

    header = (
        f"{'backend':16} {'prefill' + str(context):>10} {'decode':>8} {'fwd5':>7} {'fwd9':>7}"
        f" {'batch4':>7} {'KL':>7} {'top1':>6} {'MB/tok':>7} {'×floor':>7}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, r in rows.items():
        print(
            f"{name:16} {r['prefill_ms']:9.0f}m {r['decode_ms']:7.1f}m"
            f" {r['forward_5_ms']:6.1f}m"
            f" {r['forward_9_ms']:6.1f}m {r['batch4_step_ms']:6.1f}m {r['kl_to_fp32']:7.4f}"
            f" {r['top1_agreement']:6.3f} {r['weight_mb_per_token']:7.0f} {r['x_floor']:7.2f}"
        )
    print(
        "(m = milliseconds; KL in nats to torch fp32, teacher-forced over"
        f" {len(kl_ids) - 1} positions; * = the device's default)"
    )

    plain = OrtCausalLM(chosen, io_binding=False)
    bound = OrtCausalLM(chosen)
    io = {}
    for label, lm in (("io_binding", bound), ("plain_run", plain)):
        lm.prefill([ids[:context]])
        io[label] = timed(
            lambda lm=lm: (lm.decode([ids[context]]), lm.rollback(context)), io_repeats
        )
    spin = {s: two_sessions(chosen, s, ids, two_tokens) for s in (True, False)}
    alone = {}
    for s in (True, False):
        lm = OrtCausalLM(chosen, allow_spinning=s)
        lm.prefill([ids[:64]])
        alone[s] = timed(lambda lm=lm: (lm.decode([ids[64]]), lm.rollback(64)), io_repeats)

    best = rows[f"ORT {default_scheme}*"]
    speedup = rows["torch bf16"]["decode_ms"] / best["decode_ms"]
    kl = best["kl_to_fp32"]
    print(
        f"\nORT {default_scheme} decode at {context} context: IO binding {io['io_binding']:.1f} ms,"
        f" plain run {io['plain_run']:.1f} ms"
    )
    print(
        f"ORT {default_scheme} alone: spinning on {alone[True]:.1f} ms/token,"
        f" off {alone[False]:.1f} ms/token"
    )
    print(
        f"two ORT {default_scheme} sessions at once: spinning on {spin[True]:.1f} ms/token,"
        f" off {spin[False]:.1f} ms/token"
    )
    verdict = "MET" if speedup >= 2.5 and kl <= 0.05 else "NOT MET"
    print(
        f"\nTarget (decode ≥ 2.5× torch bf16, KL ≤ 0.05): ORT {default_scheme} is"
        f" {speedup:.2f}× torch bf16 with KL {kl:.4f} → {verdict}"
    )
    result = {
        "config": {
            "model": hf.parent.name if not args.models else str(args.models.name),
            "decode_tokens": args.decode,
            "context": context,
            "repeats": repeats,
            "kl_positions": len(kl_ids) - 1,
            "default_scheme": default_scheme,
            "quick": args.quick,
        },
        "rows": rows,
        "io": io,
        "spinning_two_sessions": {str(k): v for k, v in spin.items()},
        "spinning_alone": {str(k): v for k, v in alone.items()},
        "speedup_vs_bf16": speedup,
        "copy_bandwidth": bandwidth,
    }
    out = write_result(args.out or default_out("device", "runtime", args.quick), prov, result)
    print(f"{time.perf_counter() - started:.0f} s; written to {out}")
    return result


if __name__ == "__main__":
    main()
