"""Tandem: a private assistant in the terminal that works in tandem with a cloud.

The command line is headless: nothing here imports Textual."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _cmd_models_prepare(args: argparse.Namespace) -> int:
    from tandem_packaging.prepare import prepare

    prepare(args.device_model, args.cloud_model, only=args.only)
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    from tandem_packaging.listing import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("No models prepared. Run `tandem models prepare`.")
        return 0
    for row in rows:
        print(f"{row['role']:6} {row['key']}  ({row['root']})")
        for step in row["steps"]:
            print(f"  {step['name']:10} {step['size_h']:>9}  {step['detail']}")
            for f in step["files"]:
                print(f"      {f['sha256'][:16]}  {f['size_h']:>9}  {f['path']}")
    return 0


def _cmd_ask(args: argparse.Namespace) -> int:
    import time

    import numpy as np

    from collab.sampling import SamplingParams
    from edge_runtime.generate import Generation, TextStream, generate
    from edge_runtime.ort_runtime import OrtCausalLM
    from edge_runtime.tokenizer import chat_prompt_ids, load_tokenizer
    from tandem_packaging.prepare import model_path

    folder = model_path("device", "onnx-quant")
    started = time.perf_counter()
    lm = OrtCausalLM(folder)
    tokenizer = load_tokenizer(folder)
    messages = [{"role": "user", "content": args.question}]
    prompt = chat_prompt_ids(tokenizer, messages)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    stream, result = TextStream(tokenizer), Generation()
    first = None
    answer = []
    for token in generate(
        lm, prompt, params, np.random.default_rng(args.seed), args.max_tokens, result=result
    ):
        first = first or time.perf_counter()
        delta = stream.push(token)
        answer.append(delta)
        if not args.json:
            print(delta, end="", flush=True)
    done = time.perf_counter()
    n = len(result.tokens)
    stats = {
        "mode": "local",
        "model": folder.parent.name,
        "tokens": n,
        "finish_reason": result.finish_reason,
        "ttft_s": round((first or done) - started, 3),
        "tokens_per_s": round((n - 1) / (done - first), 2) if first and n > 1 else None,
    }
    if args.json:
        print(json.dumps({"answer": "".join(answer), **stats}, ensure_ascii=False))
    else:
        print(flush=True)
        print(
            f"[{stats['mode']} · {stats['model']} · {n} tokens · TTFT {stats['ttft_s']:.2f} s"
            + (f" · {stats['tokens_per_s']:.1f} tok/s]" if stats["tokens_per_s"] else "]"),
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="prepare and list the model pair")
    msub = models.add_subparsers(dest="models_command", required=True)
    prep = msub.add_parser("prepare", help="assemble, convert, export and quantise the pair")
    prep.add_argument(
        "--device-model",
        help="Hugging Face id or local folder (default: Qwen2.5-Coder-0.5B-Instruct)",
    )
    prep.add_argument(
        "--cloud-model",
        help="Hugging Face id or local folder (default: Qwen2.5-Coder-1.5B-Instruct)",
    )
    prep.add_argument("--only", choices=["device", "cloud"], help="prepare one side only")
    prep.set_defaults(func=_cmd_models_prepare)
    lst = msub.add_parser(
        "list", help="show prepared models: paths, sizes, checksums, quantisation"
    )
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(func=_cmd_models_list)

    ask = sub.add_parser("ask", help="ask a question and stream the answer")
    ask.add_argument("question")
    ask.add_argument("--max-tokens", type=int, default=256)
    ask.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ask.add_argument("--top-p", type=float, default=1.0)
    ask.add_argument("--seed", type=int, default=0)
    ask.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ask.set_defaults(func=_cmd_ask)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from tandem_packaging.sources import PrepareError

    try:
        return args.func(args)
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
