"""Device runtime benchmark: every backend of the device model, measured in one run.

    python benchmarks/device_runtime.py [--decode 32] [--json out.json]

For torch fp32, torch bf16, ORT fp32 and each weight-only quantisation scheme (the device's
default marked *; the others are quantised into a temporary folder) it prints: prefill of 256
tokens, decode ms/token (at 256 tokens of context), forward of 5 and 9 tokens, a batch-4
decode step, mean KL to torch fp32 and top-1 agreement (teacher-forced on prose + code), and
decode time as a multiple of the memory-bandwidth floor (weight bytes read per token ÷
measured copy bandwidth, one copying thread per core). Then, for the default: IO binding vs
plain `session.run`, and two ORT sessions decoding at once with intra-op spinning on and off.
Needs `tandem models prepare`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import torch

from benchmarks.provenance import command_line, record
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


def measure(lm: CausalLM, ids: list[int], decode_tokens: int) -> dict:
    prompt = ids[:256]
    lm.prefill([prompt[:8]])  # warm-up
    prefill = timed(lambda: lm.prefill([prompt]), 2)
    lm.prefill([prompt])
    steps = []
    for t in ids[256 : 256 + decode_tokens]:
        s = time.perf_counter()
        lm.decode([t])
        steps.append((time.perf_counter() - s) * 1000)
    out = {"prefill_256_ms": prefill, "decode_ms": statistics.median(steps)}
    for n in (5, 9):

        def fwd(n=n):
            lm.forward([ids[256 : 256 + n]])
            lm.rollback(256)

        lm.rollback(256)
        out[f"forward_{n}_ms"] = timed(fwd, 5)
    lm.prefill([prompt[:200], prompt[:230], prompt[:256], prompt[:180]])
    out["batch4_step_ms"] = timed(  # a tuple: both calls in one lambda
        lambda: (lm.decode([ids[300]] * 4), lm.rollback([200, 230, 256, 180])),  # type: ignore[func-returns-value]
        5,
    )
    return out


def teacher_forced_logprobs(lm: CausalLM, ids: list[int]) -> np.ndarray:
    lm.prefill([ids[:1]])
    logits = lm.forward([ids[1:]])[0].astype(np.float64)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def two_sessions(path: Path, spinning: bool, ids: list[int], tokens: int = 24) -> float:
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decode", type=int, default=32, help="tokens decoded per backend")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    hf, fp32, chosen = (
        model_path("device", "hf"),
        model_path("device", "onnx-fp32"),
        model_path("device", "onnx-quant"),
    )
    default_scheme = plans_for()[0].quantization
    tokenizer = load_tokenizer(hf)
    ids = tokenizer.encode(TEXT * 4)
    assert len(ids) >= 256 + args.decode + 9, len(ids)
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
        row = measure(lm, ids, args.decode)
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
        del lm
    scratch.cleanup()

    header = (
        f"{'backend':16} {'prefill256':>10} {'decode':>8} {'fwd5':>7} {'fwd9':>7} {'batch4':>7}"
        f" {'KL':>7} {'top1':>6} {'MB/tok':>7} {'×floor':>7}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, r in rows.items():
        print(
            f"{name:16} {r['prefill_256_ms']:9.0f}m {r['decode_ms']:7.1f}m"
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
        lm.prefill([ids[:256]])
        io[label] = timed(lambda lm=lm: (lm.decode([ids[256]]), lm.rollback(256)), 15)
    spin = {s: two_sessions(chosen, s, ids) for s in (True, False)}
    alone = {}
    for s in (True, False):
        lm = OrtCausalLM(chosen, allow_spinning=s)
        lm.prefill([ids[:64]])
        alone[s] = timed(lambda lm=lm: (lm.decode([ids[64]]), lm.rollback(64)), 15)

    best = rows[f"ORT {default_scheme}*"]
    speedup = rows["torch bf16"]["decode_ms"] / best["decode_ms"]
    kl = best["kl_to_fp32"]
    print(
        f"\nORT {default_scheme} decode at 256 context: IO binding {io['io_binding']:.1f} ms,"
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
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "provenance": record(
                        command_line("benchmarks.device_runtime"),
                        threads={"torch": os.cpu_count(), "onnxruntime": os.cpu_count()},
                        engines=["torch", "onnxruntime"],
                    ),
                    "rows": rows,
                    "io": io,
                    "spinning_two_sessions": {str(k): v for k, v in spin.items()},
                    "spinning_alone": {str(k): v for k, v in alone.items()},
                    "speedup_vs_bf16": speedup,
                    "copy_bandwidth": bandwidth,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
