"""`tandem ask`: one question in any mode, streamed to the terminal (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import AsyncExitStack
from typing import Any

CLOUD_URL_ENV = "TANDEM_CLOUD_URL"
CLOUD_TOKEN_ENV = "TANDEM_CLOUD_TOKEN"


def _open_index():
    """The private index, if the user has indexed anything (loading it costs a second)."""
    from app.cli import index_paths

    root, embedder_dir = index_paths()
    if not (root / "index.sqlite").exists() and not any(root.glob("*.sqlite")):
        return None
    from personal_index.index import PersonalIndex

    index = PersonalIndex(root, embedder_dir)
    return index if index.stats().chunks else None


def _show_progress(done: int, total: int, what: str) -> None:
    """The embedded cloud's first start (its corpus build), on one stderr line."""
    end = "\n" if done >= total else ""
    print(f"\rindexing {what} {done:,}/{total:,}", end=end, file=sys.stderr, flush=True)


def _format_stats(s: dict[str, Any], device: str) -> str:
    parts = [s["mode"] + (f"/{s['variant']}" if s.get("variant") else ""), device,
             f"{s['tokens']} tokens"]  # fmt: skip
    if s.get("ttft_s") is not None:
        parts.append(f"TTFT {s['ttft_s']:.2f} s")
    if s.get("tokens_per_s"):
        parts.append(f"{s['tokens_per_s']:.1f} tok/s")
    if s.get("acceptance") is not None:
        parts.append(f"acceptance {s['acceptance']:.2f} · γ {s['gamma']} · {s['rounds']} rounds")
    if s.get("cloud_only"):
        parts.append(f"AS²: {s['cloud_tokens']} tokens decoded in the cloud")
    if s["bytes_up"] or s["bytes_down"]:
        parts.append(f"↑ {s['bytes_up']:,} B ↓ {s['bytes_down']:,} B")
    return "[" + " · ".join(parts) + "]"


async def run_ask(args: argparse.Namespace) -> int:
    from app.embedded import EmbeddedCloud
    from edge_runtime.device import DeviceModel
    from edge_runtime.events import Citation, Failure, Notice, Stats, TextDelta
    from edge_runtime.modes import AnswerOptions, CloudSettings, ModeContext, build_mode
    from tandem_packaging.prepare import model_path

    out: dict[str, Any] = {"answer": "", "citations": [], "notices": [], "errors": []}
    async with AsyncExitStack() as stack:
        device = DeviceModel.load(model_path("device", "onnx-quant"))
        cloud = None
        if args.mode != "local":
            url = args.cloud_url or os.environ.get(CLOUD_URL_ENV)
            if url:
                token = os.environ.get(CLOUD_TOKEN_ENV, "")
            else:
                if not args.json:
                    print("starting the embedded cloud backend…", file=sys.stderr)
                serve_args = ["--engine", args.cloud_engine]
                shown = None if args.json else _show_progress
                embedded = await stack.enter_async_context(
                    await EmbeddedCloud.start(serve_args, on_progress=shown)
                )
                url, token = embedded.url, embedded.token
            from edge_runtime.modes import CloudSettings

            cloud = CloudSettings(url, token)
        ctx = ModeContext(
            device=device,
            index=_open_index() if args.mode != "cloud" else None,
            cloud=cloud,
            variant=args.variant,
            finish_locally=not args.no_finish_locally,
        )
        mode = build_mode(args.mode, ctx)
        stack.push_async_callback(mode.close)
        options = AnswerOptions(
            max_new_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            k=args.k,
        )
        stats: Stats | None = None
        async for event in mode.answer(args.question, [], options):
            if isinstance(event, TextDelta):
                out["answer"] += event.text
                if not args.json:
                    print(event.text, end="", flush=True)
            elif isinstance(event, Citation):
                out["citations"].append(event.__dict__)
            elif isinstance(event, Notice):
                out["notices"].append(event.text)
                if not args.json:
                    print(f"\n({event.text})", file=sys.stderr)
            elif isinstance(event, Failure):
                out["errors"].append(event.message)
                if not args.json:
                    print(f"\nerror: {event.message}", file=sys.stderr)
            elif isinstance(event, Stats):
                stats = event
    summary = stats.as_dict() if stats else {}
    if args.json:
        print(json.dumps({**out, "stats": summary, "device_model": device.name},
                         ensure_ascii=False))  # fmt: skip
    else:
        print(flush=True)
        for c in out["citations"]:
            where = f" ({c['location']})" if c["location"] else ""
            print(f"[{c['number']}] {c['side']} · {c['title']}{where} · {c['score']:.2f}")
        if summary:
            print(_format_stats(summary, device.name), file=sys.stderr)
    return 1 if out["errors"] and not out["answer"] else 0
