"""The private index, measured in one run.

    python -m benchmarks.index [--chunks 256] [--threads 2] [--model-dir DIR] [--quick] [--out F]

1. Embedding: sentence-transformers (torch) vs our ONNX embedder on the same 256-token chunks
   (cut with the MiniLM tokenizer from this repository's Markdown and Python files, so prose
   and code are mixed), same threads: chunks/s each, cosine agreement, the ratio (target ≥ 3×
   at cosine ≥ 0.99). Each side runs twice, interleaved; its best run counts.
2. The whole ingest pipeline (walk, hash, parse, chunk, embed, SQLite + FAISS) on a folder of
   text files vs the embedder alone on the same chunk texts (target: overhead ≤ 15%).
3. Search latency p50/p99 (query embedding excluded) at 10k and 100k chunks (target: p50 ≤ 20
   ms at 100k), and the process's peak RSS.

Writes every figure with provenance to `--out` (default `results/index/index.json`). `--quick`
embeds 16 chunks and searches 1,000 chunks (a smoke run of seconds, `index-quick.json`).
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
SEARCH_SIZES = (10_000, 100_000)
QUICK_SEARCH_SIZES = (1_000,)


def build_chunks(tokenizer, n: int, tokens: int = 256) -> list[str]:
    """n texts of `tokens` word pieces each (special tokens included), from varied files."""
    files = sorted(ROOT.glob("*.md")) + sorted(ROOT.glob("*/*.md")) + sorted(ROOT.glob("*/*.py"))
    ids: list[int] = []
    for f in files:
        if ".venv" in f.parts:
            continue
        ids += tokenizer(f.read_text(errors="ignore"), add_special_tokens=False)["input_ids"]
        if len(ids) >= n * tokens:
            break
    width = tokens - 2
    windows = [ids[i : i + width] for i in range(0, len(ids) - width + 1, width)]
    if not windows:
        raise SystemExit("not enough text in the repository to build chunks")
    return [tokenizer.decode(windows[i % len(windows)]) for i in range(n)]


def timed(embed, chunks: list[str]) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    vectors = embed(chunks)
    return vectors, len(chunks) / (time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--chunks", type=int, help="chunks embedded (default 256, quick 16)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, help="prepared ONNX embedder (else a temp dir)")
    parser.add_argument("--quick", action="store_true", help="16 chunks, search at 1,000")
    parser.add_argument("--out", type=Path, help="the result file (default results/index/)")
    args = parser.parse_args(argv)
    if args.chunks is None:
        args.chunks = 16 if args.quick else 256
    from benchmarks.provenance import command_line, default_out, record, write_result

    prov = record(
        command_line("benchmarks.index", argv),
        threads={"torch": args.threads, "onnxruntime": args.threads},
        engines=["sentence-transformers (torch)", "onnxruntime", "faiss"],
    )

    import torch
    from transformers.utils import logging as hf_logging

    from retrieval.embedder import (
        FP32_FILE,
        OnnxEmbedder,
        TorchEmbedder,
        _OrtModel,
        prepare_onnx_embedder,
    )

    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()  # "sequence longer than 512": expected, chunks are cut
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or Path(tmp) / "minilm-onnx"
        t0 = time.perf_counter()
        prepare_onnx_embedder(model_dir)
        print(f"prepare: {time.perf_counter() - t0:.1f} s ({model_dir})")
        onnx = OnnxEmbedder(model_dir, threads=args.threads)
        ref = TorchEmbedder()
        chunks = build_chunks(onnx._model.tokenizer, args.chunks)
        lengths = [len(x) for x in onnx._model.tokenizer(chunks)["input_ids"]]
        print(
            f"{len(chunks)} chunks, {min(lengths)}-{max(lengths)} tokens before truncation at 256, "
            f"{args.threads} threads, model {onnx.model_file.name} "
            f"({onnx.info['int8']['scheme'] or 'fp32'})"
        )
        onnx.embed(chunks[:8])
        ref.embed(chunks[:8])
        torch_best = onnx_best = 0.0
        for _ in range(2):
            torch_vec, speed = timed(ref.embed, chunks)
            torch_best = max(torch_best, speed)
            onnx_vec, speed = timed(onnx.embed, chunks)
            onnx_best = max(onnx_best, speed)
        cos = np.sum(torch_vec * onnx_vec, axis=1)
        fp32 = _OrtModel(model_dir, model_dir / FP32_FILE, threads=args.threads)
        fp32.embed(chunks[:8])
        fp32_vec, fp32_speed = timed(fp32.embed, chunks)
        fp32_cos = np.sum(torch_vec * fp32_vec, axis=1)
    print(f"torch (sentence-transformers): {torch_best:7.1f} chunks/s")
    print(f"onnx ({onnx.model_file.name}): {onnx_best:7.1f} chunks/s")
    print(f"cosine onnx vs torch: mean {cos.mean():.5f}, min {cos.min():.5f}")
    print(
        f"(for reference, onnx fp32: {fp32_speed:.1f} chunks/s, "
        f"cosine vs torch mean {fp32_cos.mean():.6f}, min {fp32_cos.min():.6f})"
    )
    verdict = "met" if onnx_best >= 3 * torch_best and cos.mean() >= 0.99 else "NOT met"
    print(f"speed ratio: {onnx_best / torch_best:.2f}x (target ≥ 3x at cosine ≥ 0.99: {verdict})")

    ingest = pipeline(args, chunks)
    search = search_latency(QUICK_SEARCH_SIZES if args.quick else SEARCH_SIZES)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS of this process: {rss:.0f} MB")
    result = {
        "config": {
            "chunks": len(chunks),
            "threads": args.threads,
            "quick": args.quick,
            "model_file": onnx.model_file.name,
            "scheme": onnx.info["int8"]["scheme"] or "fp32",
        },
        "embedder": {
            "torch_chunks_per_s": torch_best,
            "onnx_chunks_per_s": onnx_best,
            "cosine_mean": float(cos.mean()),
            "cosine_min": float(cos.min()),
            "onnx_fp32_chunks_per_s": fp32_speed,
            "fp32_cosine_mean": float(fp32_cos.mean()),
            "fp32_cosine_min": float(fp32_cos.min()),
        },
        "pipeline": ingest,
        "search": search,
        "peak_rss_mb": rss,
    }
    out = write_result(args.out or default_out("index", "index", args.quick), prov, result)
    print(f"written to {out}")
    return result


def pipeline(args: argparse.Namespace, chunks: list[str]) -> dict[str, Any]:
    """Ingest a folder whose files hold these chunks, vs embedding the stored chunk texts."""
    from personal_index.index import PersonalIndex

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "docs"
        folder.mkdir()
        for i in range(0, len(chunks), 4):  # four chunks' worth of text per file
            (folder / f"doc-{i:04d}.txt").write_text("\n\n".join(chunks[i : i + 4]))
        model_dir = args.model_dir or Path(tmp) / "minilm-onnx"
        with PersonalIndex(Path(tmp) / "index", model_dir, threads=args.threads) as index:
            index.embedder.embed(chunks[:8])
            start = time.perf_counter()
            results = index.ingest([folder])
            ingest_s = time.perf_counter() - start
            n = index.stats().chunks
            texts = [h.text for h in index.search("code", k=n)]  # every stored chunk
            start = time.perf_counter()
            index.embedder.embed(texts)
            embed_s = time.perf_counter() - start
    print(
        f"\npipeline: {len(results)} files, {n} chunks in {ingest_s:.1f} s = {n / ingest_s:.1f} "
        f"chunks/s; embedder alone on the same chunks {n / embed_s:.1f} chunks/s; overhead "
        f"{100 * (ingest_s / embed_s - 1):.0f}% (target ≤ 15%)"
    )
    return {
        "files": len(results),
        "chunks": n,
        "ingest_s": ingest_s,
        "chunks_per_s": n / ingest_s,
        "embed_only_chunks_per_s": n / embed_s,
        "overhead": ingest_s / embed_s - 1,
    }


def search_latency(sizes: Sequence[int] = SEARCH_SIZES) -> list[dict[str, Any]]:
    from retrieval.store import ChunkRecord, DocumentMeta, IndexStore

    out: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)
    print()
    with tempfile.TemporaryDirectory() as tmp:
        store = IndexStore(Path(tmp), 384)
        total = 0
        for target in sizes:
            while total < target:  # documents of 100 chunks with random unit vectors
                vectors = rng.normal(size=(100, 384)).astype(np.float32)
                records = [ChunkRecord(i, f"chunk {total + i}") for i in range(100)]
                meta = DocumentMeta(f"/bench/doc-{total}.txt", 1, 0.0, f"{total:064d}")
                store.replace_document(meta, records, vectors)
                total += 100
            store.flush()
            queries = rng.normal(size=(200, 384)).astype(np.float32)
            samples = []
            for q in queries:
                t = time.perf_counter()
                store.search(q, 5)
                samples.append((time.perf_counter() - t) * 1000)
            p50, p99 = np.percentile(samples, [50, 99])
            print(f"search at {total:>7,} chunks: p50 {p50:.1f} ms, p99 {p99:.1f} ms (k = 5)")
            out.append({"chunks": total, "p50_ms": float(p50), "p99_ms": float(p99), "k": 5})
        store.close()
    return out


if __name__ == "__main__":
    main()
