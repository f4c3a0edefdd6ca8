"""DRCG/KV, priced rather than run (DRAGON §7.2, issue 14): the cloud would ship the KV cache of
its retrieved documents for the device to reuse. Tandem cannot run it: the device's model
(Qwen2.5-0.5B: 24 layers × 2 KV heads × 64) cannot read the cloud model's cache (1.5B:
28 layers × 2 KV heads × 128). What it would cost is computed from the cloud model's real
cache size per token (its ONNX or torch runtime's layout) and the tokens of each prompt's
top-k public passages in their per-document prompts, over the link at each extra latency.

    python -m benchmarks.dragon_kv [--prompts 20] [-k 2] [--mbit 100 20]"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root is the import root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results" / "dragon"
LATENCIES_MS = (0, 50, 100, 200, 300)


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """Keys and values of one token over every layer: 2 · layers · KV heads · head dim."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * dtype_bytes


def transfer_s(nbytes: float, extra_ms: float, mbit: float) -> float:
    """One fetch: a round trip (the request, then the first byte back) plus serialisation."""
    return extra_ms / 1000 + nbytes * 8 / (mbit * 1e6)


def price(
    tokens: Sequence[int],
    per_token: int,
    mbits: Sequence[float],
    latencies_ms: Sequence[float] = LATENCIES_MS,
) -> dict[str, Any]:
    """Mean bytes per answer and the mean fetch time at each link."""
    nbytes = statistics.mean(tokens) * per_token
    fetch = {
        f"{mbit:g} Mbit/s": {str(lat): transfer_s(nbytes, lat, mbit) for lat in latencies_ms}
        for mbit in mbits
    }
    return {
        "mean_tokens": statistics.mean(tokens),
        "bytes_per_token": per_token,
        "mean_bytes": nbytes,
        "fetch_s": fetch,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("-k", type=int, default=2)
    parser.add_argument("--mbit", nargs="+", type=float, default=[100.0, 20.0])
    parser.add_argument("--out", type=Path, default=RESULTS / "drcg-kv.json")
    args = parser.parse_args(argv)

    from benchmarks.prompts import load_prompts
    from cloud_backend.corpus import PublicCorpus, default_corpus_dir, default_embedder_dir
    from model_runtime.prompting import document_prompt, prompt_budget
    from model_runtime.tokenizer import load_tokenizer
    from tandem_packaging.prepare import model_path

    hf = model_path("cloud", "hf")
    config = json.loads((hf / "config.json").read_text())
    tokenizer = load_tokenizer(hf)
    corpus = PublicCorpus.open(default_corpus_dir(), default_embedder_dir())
    budget = prompt_budget(config["max_position_embeddings"], 32)
    tokens = []
    for prompt in load_prompts(n=args.prompts):
        passages = corpus.search(prompt.text, args.k)
        tokens.append(
            sum(len(document_prompt(tokenizer, prompt.text, [], p, budget)[0]) for p in passages)
        )
    out = {
        engine: price(tokens, kv_bytes_per_token(config, size), args.mbit)
        for engine, size in (("ort (float32 cache)", 4), ("torch bfloat16", 2))
    }
    for engine, p in out.items():
        print(
            f"{engine}: {p['mean_tokens']:.0f} tokens of k = {args.k} per-document prompts, "
            f"{p['bytes_per_token'] / 1024:.0f} KiB a token, {p['mean_bytes'] / 2**20:.1f} MiB"
        )
        for link, times in p["fetch_s"].items():
            print(f"  {link}: " + ", ".join(f"+{lat} ms {s:.2f} s" for lat, s in times.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from benchmarks.provenance import command_line, record

    prov = record(command_line("benchmarks.dragon_kv", argv))  # arithmetic: no timing
    args.out.write_text(
        json.dumps({"provenance": prov, "k": args.k, "prompts": args.prompts, **out}, indent=1)
    )


if __name__ == "__main__":
    main()
