"""Rendering cost of a streamed answer in the TUI, per token.

    python -m benchmarks.tui_render [--tokens 1000] [--runs 3] [--quick] [--out FILE]

A minimal headless App (100x40) holds a `ConversationView`; an answer is fed a fake, fast token
source: realistic Markdown (paragraphs, bold/italic/inline code, a bullet list, a fenced code
block, a table), generated deterministically, a few characters per `append`, awaited one by one
as the app's streaming worker would, with nothing else in between. The clock runs from the first
`append` to the end of `finish()` *and* until the app has settled: every queued message handled,
the layout reflowed, and every frame turned into the escape sequences a terminal driver would
write (the headless driver skips that step, so the benchmark does it itself and counts frames).
So the figure includes Textual's parse, layout and paint work caused by the tokens, not only the
cost of queueing them. Target: < 2 ms per token at 1,000-token answers, flat in the length.
Writes every figure with provenance to `--out` (default `results/tui-render/stream.json`);
`--quick` streams 200 tokens once and 20 paced at 200 tokens/s (a smoke run, `stream-quick.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from textual.app import App, ComposeResult

from app.tui.chat_view import AnswerView, ConversationView
from benchmarks.provenance import command_line, default_out, record, write_result

TARGET_MS_PER_TOKEN = 2.0

_VOCABULARY = (
    "the device drafts tokens and the cloud verifies them in one batched forward pass while "
    "private notes never leave the laptop retrieval finds the chunks that answer the question "
    "speculative decoding keeps the output distribution exact acceptance rate depends on how "
    "well the small model agrees with the large one latency hides behind the link round trip "
    "each chunk is embedded once and searched with cosine similarity over normalised vectors"
)
_WORDS = _VOCABULARY.split()
_IDENTS = ("tokens", "draft", "accepted", "logits", "probs", "index", "chunk", "score", "link")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 16))]
    i = rng.randrange(len(words))
    style = rng.random()
    if style < 0.3:
        words[i] = f"**{words[i]}**"
    elif style < 0.55:
        words[i] = f"*{words[i]}*"
    elif style < 0.75:
        words[i] = f"`{rng.choice(_IDENTS)}()`"
    return " ".join(words).capitalize() + "."


def _sections(rng: random.Random) -> Iterator[str]:
    """Markdown blocks of an endless, plausible answer."""
    yield "Here is how it works.\n\n"
    while True:
        yield " ".join(_sentence(rng) for _ in range(rng.randint(2, 4))) + "\n\n"
        yield "".join(f"- {_sentence(rng)}\n" for _ in range(rng.randint(3, 5))) + "\n"
        yield " ".join(_sentence(rng) for _ in range(rng.randint(1, 3))) + "\n\n"
        lines = ["```python", "def verify(draft, target):"]
        for _ in range(rng.randint(6, 12)):
            a, b = rng.sample(_IDENTS, 2)
            lines.append(f"    {a} = {b}[{rng.randint(0, 9)}] * {rng.random():.3f}")
        lines += ["    return accepted", "```"]
        yield "\n".join(lines) + "\n\n"
        yield (
            "| mode | tokens/s | accepted |\n|---|---:|---:|\n"
            + "".join(
                f"| {m} | {rng.uniform(5, 60):.1f} | {rng.uniform(0.4, 0.95):.2f} |\n"
                for m in ("device", "cloud", "split", "speculative")[: rng.randint(2, 4)]
            )
            + "\n"
        )


def _split_token(piece: str, rng: random.Random) -> Iterator[str]:
    """Cut a word into BPE-sized pieces (1 to 6 characters)."""
    while piece:
        n = rng.randint(3, 6) if len(piece) > 6 else len(piece)
        yield piece[:n]
        piece = piece[n:]


def fake_tokens(count: int, seed: int = 0) -> list[str]:
    """`count` deterministic tokens (a few characters each, leading spaces and newlines kept
    as a tokenizer would) of a realistic Markdown answer."""
    rng = random.Random(seed)
    out: list[str] = []
    for section in _sections(rng):
        for line in section.splitlines(keepends=True):
            body, newline = (line[:-1], "\n") if line.endswith("\n") else (line, "")
            for i, word in enumerate(body.split(" ")):
                word = word if i == 0 else " " + word
                out.extend(_split_token(word, rng))
            if newline:
                out.append(newline)
            if len(out) >= count:
                return out[:count]
    raise AssertionError("unreachable")


class _BenchApp(App[None]):
    """Holds one ConversationView; turns each frame into terminal output like a real driver."""

    def __init__(self) -> None:
        super().__init__()
        self.frames = 0
        self.output_chars = 0

    def compose(self) -> ComposeResult:
        yield ConversationView()

    def _display(self, screen: Any, renderable: Any) -> None:
        super()._display(screen, renderable)
        if renderable is not None and not self._batch_count:
            # The headless driver drops the frame; a terminal driver would encode it.
            self.frames += 1
            self.output_chars += len(renderable.render_segments(self.console))


async def _run_once(tokens: list[str], rate: float = 0.0) -> dict[str, Any]:
    app = _BenchApp()
    async with app.run_test(size=(100, 40)) as pilot:
        view = app.query_one(ConversationView)
        view.add_question("How does split verification keep my notes private?")
        answer = view.add_answer("split")
        await pilot.pause()
        frames0, chars0 = app.frames, app.output_chars
        latencies: list[float] = []
        clock, cpu_clock = time.perf_counter, time.process_time
        start, cpu_start = clock(), cpu_clock()
        for i, token in enumerate(tokens):
            t = clock()
            await answer.append(token)
            latencies.append(clock() - t)
            if rate:  # a paced source: the next token is due at start + (i + 1) / rate
                await asyncio.sleep(max(0.0, start + (i + 1) / rate - clock()))
        streamed = clock()
        await answer.finish("complete", f"{len(tokens)} tokens")
        await pilot.pause()  # all messages handled, then a forced layout + frame
        end, cpu_end = clock(), cpu_clock()
        assert answer.body.source == "".join(tokens)
        result = {
            "total_s": end - start,
            "cpu_s": cpu_end - cpu_start,
            "stream_s": streamed - start,
            "settle_s": end - streamed,
            "latencies": latencies,
            "frames": app.frames - frames0,
            "output_chars": app.output_chars - chars0,
            "blocks": len(answer.body.children),
        }
    return result


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


async def measure_async(
    tokens: int, runs: int = 1, seed: int = 0, rate: float = 0.0
) -> dict[str, Any]:
    """Stream `tokens` fake tokens `runs` times, as fast as possible (`rate` 0) or at `rate`
    tokens per second; per-token costs in milliseconds (wall and process CPU)."""
    source = fake_tokens(tokens, seed)
    results = [await _run_once(source, rate) for _ in range(runs)]
    per_token = [r["total_s"] * 1000 / tokens for r in results]
    latencies = [x for r in results for x in r["latencies"]]
    return {
        "tokens": tokens,
        "runs": runs,
        "chars": len("".join(source)),
        "ms_per_token": statistics.fmean(per_token),
        "ms_per_token_runs": per_token,
        "cpu_ms_per_token": statistics.fmean(r["cpu_s"] for r in results) * 1000 / tokens,
        "rate": rate,
        "p95_append_ms": _p95(latencies) * 1000,
        "max_append_ms": max(latencies) * 1000,
        "stream_ms": statistics.fmean(r["stream_s"] for r in results) * 1000,
        "settle_ms": statistics.fmean(r["settle_s"] for r in results) * 1000,
        "frames": statistics.fmean(r["frames"] for r in results),
        "output_kb": statistics.fmean(r["output_chars"] for r in results) / 1000,
        "blocks": results[-1]["blocks"],
    }


def measure(tokens: int, runs: int = 1, seed: int = 0, rate: float = 0.0) -> dict[str, Any]:
    """Synchronous wrapper of `measure_async` (runs its own event loop)."""
    return asyncio.run(measure_async(tokens, runs, seed, rate))


def _report(m: dict[str, Any]) -> str:
    runs = ", ".join(f"{x:.3f}" for x in m["ms_per_token_runs"])
    return (
        f"{m['tokens']:>5} tokens ({m['chars']:,} chars, {m['blocks']} blocks): "
        f"{m['ms_per_token']:.3f} ms/token wall (runs: {runs}), "
        f"{m['cpu_ms_per_token']:.3f} ms/token CPU; "
        f"p95 append {m['p95_append_ms']:.3f} ms (max {m['max_append_ms']:.1f}); "
        f"stream {m['stream_ms']:.0f} ms + finish/settle {m['settle_ms']:.0f} ms; "
        f"{m['frames']:.0f} frames, {m['output_kb']:.0f} kB of terminal output"
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--paced",
        type=float,
        default=50.0,
        metavar="TOK_PER_S",
        help="also stream --paced-tokens at this model-like rate and report CPU (0: skip)",
    )
    parser.add_argument("--paced-tokens", type=int, default=300)
    parser.add_argument(
        "--interval",
        type=float,
        help="override AnswerView.STREAM_INTERVAL, seconds between writes to the body "
        "(0: every event-loop tick, MarkdownStream's own batching only)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of seconds")
    parser.add_argument("--out", type=Path, help="the result file (default results/tui-render/)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.runs, args.paced_tokens = 200, 1, 20
        args.paced = args.paced and 200.0
    prov = record(
        command_line("benchmarks.tui_render", argv),
        engines=["textual"],
        packages=("textual", "rich", "tandem-assistant"),
    )
    if args.interval is not None:
        AnswerView.STREAM_INTERVAL = args.interval
    print(f"AnswerView.STREAM_INTERVAL = {AnswerView.STREAM_INTERVAL} s")
    measure(50, 1, args.seed)  # warm-up: imports, CSS parsing, first-use caches
    short = measure(100, args.runs, args.seed)
    long = measure(args.tokens, args.runs, args.seed)
    print("as fast as possible (the target):")
    print(_report(short))
    print(_report(long))
    ratio = long["ms_per_token"] / short["ms_per_token"]
    print(f"growth per token, {args.tokens} vs 100 tokens: x{ratio:.2f} (1.0 = flat, O(n) total)")
    verdict = "PASS" if long["ms_per_token"] < TARGET_MS_PER_TOKEN else "FAIL"
    print(
        f"{verdict}: {long['ms_per_token']:.3f} ms/token at {args.tokens} tokens "
        f"(target < {TARGET_MS_PER_TOKEN} ms)"
    )
    paced = None
    if args.paced:
        paced = measure(args.paced_tokens, 1, args.seed, rate=args.paced)
        core = paced["cpu_ms_per_token"] * args.paced / 10
        paced["core_percent"] = core
        print(f"paced at {args.paced:g} tokens/s (what a model does; wall time is the pacing):")
        print(_report(paced))
        print(f"  the TUI keeps {core:.0f}% of one core busy while an answer streams at that rate")
    result = {
        "config": {
            "stream_interval_s": AnswerView.STREAM_INTERVAL,
            "size": [100, 40],
            **{k: v for k, v in vars(args).items() if k != "out"},
        },
        "as_fast_as_possible": [short, long],
        "paced": paced,
        "growth": ratio,
        "target_ms_per_token": TARGET_MS_PER_TOKEN,
    }
    out = write_result(args.out or default_out("tui-render", "stream", args.quick), prov, result)
    print(f"written to {out}")
    return result


if __name__ == "__main__":
    main()
