"""The second turn's first token with the conversation's KV kept (docs/architecture.md#kv-reuse):
cloud and split mode over a ~1,000-token conversation, the built-in engine, the real pair.

    python -m benchmarks.conversation                # 6 conversations, every mode below
    python -m benchmarks.conversation --quick        # 1 conversation, a smoke run

Each conversation has ~1,000 tokens of earlier exchanges (published prompts as the person's
turns, the benchmark's notes as the answers), given as history text. Turn 1 asks a question
after them in a fresh session (the cloud prefills all of it); turn 2, in the same session,
asks the next question with turn 1 appended to the history. The cloud kept turn 1's KV (its
prompt and answer), so turn 2 feeds only what follows the tokens both prompts share. Modes:

    cloud          cloud decoding, no public passages in the prompt
    cloud+corpus   cloud decoding with its k public passages (the default cloud mode): the
                   passages follow the conversation, so each turn feeds its own again
    split          TK-SLT, greedy (the device's own prompt is kept on the device too)

It prints each turn's TTFT, turn 1 / turn 2 with a 95 % bootstrap over conversations, and the
prompt tokens the cloud did not feed again (its /metrics). The cloud runs in its own process
pinned to core 1, the device on core 0, loopback without an emulated link."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import pin_device, start_cloud
from benchmarks.provenance import command_line, default_out, record, write_result

if TYPE_CHECKING:
    from app.embedded import EmbeddedCloud

MODES = ("cloud", "cloud+corpus", "split")
HISTORY_TOKENS = 1_000


def history_for(n: int, tokenizer: Any, prompts: Sequence[Any]) -> list[Any]:
    """About HISTORY_TOKENS tokens of earlier exchanges (conversation n's own mix)."""
    from benchmarks.dragon import NOTES
    from edge_runtime.cloud_identity import EMBEDDED
    from edge_runtime.modes.base import Turn

    notes = list(NOTES.values())
    turns: list[Turn] = []
    size, i = 0, 0
    while size < HISTORY_TOKENS:
        question = prompts[(n * 7 + i) % len(prompts)].text
        answer = notes[(n + i) % len(notes)]
        # the benchmark's cloud is one this device started (`start_cloud`): the embedded one
        turns.append(Turn(question, answer, "cloud", shared=answer, shared_with=EMBEDDED))
        size += len(tokenizer.encode(question + answer))
        i += 1
    return turns


async def reused_tokens(cloud: EmbeddedCloud) -> float:
    """tandem_reused_prompt_tokens{kind="conversation"} from the cloud's /metrics."""
    text = await cloud.metrics()
    found = re.search(r'tandem_reused_prompt_tokens_total\{kind="conversation"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


async def answer(mode: Any, question: str, history: list[Any], options: Any) -> tuple[str, Any]:
    from edge_runtime.events import Stats, TextDelta

    text, stats = [], None
    async for ev in mode.answer(question, history, options):
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, Stats):
            stats = ev
    return "".join(text), stats


async def run(args: argparse.Namespace) -> list[dict]:
    from benchmarks.prompts import load_prompts
    from edge_runtime.cloud_identity import EMBEDDED
    from edge_runtime.device import DeviceModel
    from edge_runtime.modes import get_mode
    from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext, Turn
    from tandem_packaging.prepare import model_path

    prompts = load_prompts(n=40)
    device = DeviceModel.load(model_path("device", "onnx-quant"), threads=1)
    cloud, url, token = await start_cloud("ort", args.cloud_core, corpus=True)
    rows: list[dict] = []
    options = AnswerOptions(args.max_tokens, temperature=0.0, k=0)
    try:
        for n in range(args.conversations):
            history = history_for(n, device.tokenizer, prompts)
            q1, q2 = prompts[30 + n % 10].text, prompts[(31 + n) % 40].text
            for name in args.modes:
                ctx = ModeContext(
                    device=device,
                    index=None,
                    cloud=CloudSettings(url, token, embedded=True),
                    retrieve_public=name == "cloud+corpus",
                )
                mode = get_mode("split" if name == "split" else "cloud")(ctx)
                try:
                    before = await reused_tokens(cloud)
                    text1, s1 = await answer(mode, q1, history, options)
                    mid = await reused_tokens(cloud)
                    turn1 = Turn(q1, text1, name, shared=text1, shared_with=EMBEDDED)
                    _, s2 = await answer(mode, q2, [*history, turn1], options)
                    after = await reused_tokens(cloud)
                finally:
                    await mode.close()
                row = {
                    "conversation": n,
                    "mode": name,
                    "history_tokens": sum(
                        len(device.tokenizer.encode(t.question + t.answer)) for t in history
                    ),
                    "ttft1_s": s1.ttft_s,
                    "ttft2_s": s2.ttft_s,
                    "reused1": mid - before,
                    "reused2": after - mid,
                    "tokens1": s1.tokens,
                    "tokens2": s2.tokens,
                }
                rows.append(row)
                print(
                    f"conversation {n} {name:13s} TTFT turn 1 {s1.ttft_s:6.2f} s, turn 2 "
                    f"{s2.ttft_s:6.2f} s ({s1.ttft_s / s2.ttft_s:4.1f}x); cloud reused "
                    f"{row['reused2']:.0f} tokens",
                    flush=True,
                )
    finally:
        await cloud.stop()
        device._worker.close()
    return rows


def summarise(rows: Sequence[dict]) -> dict:
    from benchmarks.intervals import bootstrap_ratio

    out = {}
    for name in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == name]
        first = {str(r["conversation"]): r["ttft1_s"] for r in mine}
        second = {str(r["conversation"]): r["ttft2_s"] for r in mine}
        ratio = bootstrap_ratio(first, second)
        out[name] = {
            "ttft1_s": sum(first.values()) / len(mine),
            "ttft2_s": sum(second.values()) / len(mine),
            "turn1_over_turn2": ratio,
            "reused2": sum(r["reused2"] for r in mine) / len(mine),
            "conversations": len(mine),
        }
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device-core", type=int, default=0)
    parser.add_argument("--cloud-core", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="1 conversation, 8 tokens")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.max_tokens = 1, 8
    logging.basicConfig(level=logging.WARNING)
    args.cloud_core = pin_device(args.device_core, args.cloud_core)
    started = time.time()
    prov = record(
        command_line("benchmarks.conversation", argv),
        {"device_core": args.device_core, "cloud_core": args.cloud_core},
        {"device": 1, "cloud": 1},
        ["cloud ort"],
    )
    rows = asyncio.run(run(args))
    summary = summarise(rows)
    for name, s in summary.items():
        ratio = s["turn1_over_turn2"]
        span = f"{ratio[0]:.2f}x (95 % {ratio[1]:.2f}-{ratio[2]:.2f})" if ratio else "—"
        print(
            f"{name:13s} TTFT turn 1 {s['ttft1_s']:.2f} s, turn 2 {s['ttft2_s']:.2f} s: "
            f"{span}; {s['reused2']:.0f} prompt tokens reused"
        )
    out = args.out or default_out("conversation", "second-turn-ort", args.quick)
    write_result(out, prov, {"seconds": time.time() - started, "rows": rows, "summary": summary})
    print(f"written to {out}")


if __name__ == "__main__":
    main()
