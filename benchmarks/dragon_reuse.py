"""DRAGON's first token with the documents' KV kept (`python -m benchmarks.dragon --caches`;
docs/architecture.md#kv-reuse): the same pinned set-up and published prompts as the grid.

Three passes over one emulated link (the grid's first latency, default +100 ms):

    off     both document caches off (the cloud started with --document-cache-mb 0, the
            device's cache None): DRAGON (auto) and device-only RAG (local mode), as before
    cold    caches on, both empty: a new session (the cloud's cache scoped per session) and
            the device's cache cleared before each question
    warm    the same question again in that session: every document's prefix is cached on
            both sides, only the question is prefilled

then a question stream: STREAM's questions, two or three about each of the notes' topics, asked
one after another in one new session with both caches on, each side's hit rate and the memory
the caches hold.

Reported: TTFT and per-token latency of each, warm DRAGON / device-only RAG TTFT, cold / off
TTFT and warm / off per-token latency, each with a 95 % paired bootstrap over prompts, and how
many greedy answers came out token for token the same with the caches off, cold and warm."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from benchmarks.common import host_port, start_cloud

if TYPE_CHECKING:
    from app.embedded import EmbeddedCloud
    from benchmarks.prompts import Prompt
    from edge_runtime.device import DeviceModel, Retriever

STREAM = (
    "Where did we stay on Maui?",
    "What should I buy on the road to Hana?",
    "What did Keoni teach us at the luau?",
    "How do I plan my week?",
    "When do I review what slipped?",
    "What did the doctor advise about sleep?",
    "What breathing exercise helps before talks?",
    "How much did revenue grow in Q3?",
    "What does Dana want in the report?",
    "How does my word count script work?",
    "Which restaurants do locals go to?",
    "When is there fado at Tasca do Chico?",
    "What are my notes on quantum superposition?",
    "When did the printing press spread ideas?",
)


async def _metric(cloud: EmbeddedCloud, name: str) -> float:
    text = await cloud.metrics()
    found = re.search(rf"^{name}(?:_total)? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@dataclass(frozen=True)
class Harness:
    """What `benchmarks.dragon` lends this module (passed in, not imported: no import circle):
    its modes by method name, one measured answer, the runtimes' warm-up."""

    make_modes: Callable[..., dict[str, Any]]
    measure: Callable[..., Awaitable[dict]]
    warm_up: Callable[..., Awaitable[None]]


async def run_caches(
    bench: Harness,
    device: DeviceModel,
    index: Retriever,
    prompts: Sequence[Prompt],
    *,
    cloud_core: int | None,
    latency_ms: float,
    k: int,
    max_tokens: int,
) -> tuple[list[dict], list[dict]]:
    """The three passes and the stream: (rows, stream rows)."""
    measure, warm_up = bench.measure, bench.warm_up

    def dragon(url: str, token: str, method: str) -> Any:
        return bench.make_modes(device, index, url, token, [method])[method]

    from benchmarks.link_emulator import LinkEmulator, LinkProfile
    from edge_runtime.modes.base import AnswerOptions

    rows: list[dict] = []
    stream: list[dict] = []
    documents = device.documents
    one_way = LinkProfile(latency_ms / 2000, latency_ms / 10_000, None)

    async def answer(mode: Any, text: str, n: int, **row: Any) -> dict:
        options = AnswerOptions(max_tokens, temperature=0.0, seed=n, k=k)
        out = row | await measure(mode, text, options)
        docs = getattr(mode, "_docs", None)
        reuse = getattr(docs, "reuse", None)
        out["device_hits"] = None if reuse is None else reuse.hits
        out["device_docs"] = None if reuse is None else len(reuse.stable)
        print(
            f"{row.get('pass', 'stream'):6s} {row.get('method', ''):12s} "
            f"{row.get('prompt', row.get('question', ''))[:40]:40s} TTFT "
            f"{out['ttft_s']:6.2f} s  per token {1000 * (out['per_token_s'] or 0):6.0f} ms",
            flush=True,
        )
        return out

    for pass_name, extra in (
        ("off", ["--document-cache-mb", "0"]),
        ("on", ["--document-cache-scope", "session"]),
    ):
        cloud, url, token = await start_cloud(
            "ort", cloud_core, corpus=True, corpus_k=k, extra=extra
        )
        host, port = host_port(url)
        link = LinkEmulator(host, port, one_way, one_way, seed=int(latency_ms))
        await link.start()
        linked = f"ws://127.0.0.1:{link.port}/v1/session"
        device.documents = None if pass_name == "off" else documents
        try:
            await warm_up(device, index, url, token, k)
            for n, prompt in enumerate(prompts):
                if pass_name == "off":
                    for method in ("dragon-auto", "local-rag"):
                        mode = dragon(linked, token, method)
                        try:
                            rows.append(
                                await answer(
                                    mode,
                                    prompt.text,
                                    n,
                                    **{
                                        "pass": "off",
                                        "method": "dragon-off"
                                        if method == "dragon-auto"
                                        else method,
                                        "prompt": prompt.id,
                                    },
                                )
                            )
                        finally:
                            await mode.close()
                    continue
                mode = dragon(linked, token, "dragon-auto")
                try:
                    assert documents is not None
                    documents.clear()
                    for method in ("dragon-cold", "dragon-warm"):
                        hits = await _metric(cloud, "tandem_document_cache_hits")
                        row = await answer(
                            mode,
                            prompt.text,
                            n,
                            **{"pass": "on", "method": method, "prompt": prompt.id},
                        )
                        row["cloud_hits"] = (
                            await _metric(cloud, "tandem_document_cache_hits") - hits
                        )
                        rows.append(row)
                finally:
                    await mode.close()
            if pass_name == "on":
                stream = await _stream(device, dragon(linked, token, "dragon-auto"), cloud, answer)
        finally:
            await link.close()
            await cloud.stop()
            device.documents = documents
    return rows, stream


async def _stream(device: DeviceModel, mode: Any, cloud: EmbeddedCloud, answer: Any) -> list[dict]:
    """STREAM in one new session, both caches on and starting empty (the cloud's scope is
    the session here; one session sees the same entries under the default user scope)."""
    assert device.documents is not None
    device.documents.clear()
    out = []
    try:
        for n, question in enumerate(STREAM):
            hits = await _metric(cloud, "tandem_document_cache_hits")
            misses = await _metric(cloud, "tandem_document_cache_misses")
            row = await answer(mode, question, n, question=question)
            row["cloud_hits"] = await _metric(cloud, "tandem_document_cache_hits") - hits
            row["cloud_misses"] = await _metric(cloud, "tandem_document_cache_misses") - misses
            row["device_bytes"] = device.documents.nbytes
            row["cloud_bytes"] = await _metric(cloud, "tandem_document_cache_bytes")
            row.pop("commits", None)
            out.append(row)
    finally:
        await mode.close()
    return out


def summarise_caches(rows: Sequence[dict], stream: Sequence[dict]) -> dict:
    from benchmarks.intervals import bootstrap_ratio, verdict

    def by(method: str, key: str) -> dict[str, float]:
        return {r["prompt"]: r[key] for r in rows if r["method"] == method and r[key] is not None}

    def ratio(a: str, b: str, key: str, up: str, down: str) -> dict | None:
        found = bootstrap_ratio(by(a, key), by(b, key))
        if found is None:
            return None
        value, low, high = found
        return {
            "ratio": value,
            "low": low,
            "high": high,
            "verdict": verdict(low, high, 1.0, up, down),
        }

    means = {}
    for method in ("dragon-off", "local-rag", "dragon-cold", "dragon-warm"):
        ttft, per = by(method, "ttft_s"), by(method, "per_token_s")
        means[method] = {
            "ttft_s": sum(ttft.values()) / len(ttft) if ttft else None,
            "per_token_s": sum(per.values()) / len(per) if per else None,
        }
    ids = {(r["method"], r["prompt"]): r["token_ids"] for r in rows}
    prompts = sorted({r["prompt"] for r in rows})
    same = sum(
        ids.get(("dragon-off", p)) == ids.get(("dragon-cold", p)) == ids.get(("dragon-warm", p))
        for p in prompts
    )
    out = {
        "means": means,
        "warm_over_local_ttft": ratio("dragon-warm", "local-rag", "ttft_s", "slower", "faster"),
        "cold_over_off_ttft": ratio("dragon-cold", "dragon-off", "ttft_s", "slower", "faster"),
        "warm_over_off_per_token": ratio(
            "dragon-warm", "dragon-off", "per_token_s", "slower", "faster"
        ),
        "cold_over_off_per_token": ratio(
            "dragon-cold", "dragon-off", "per_token_s", "slower", "faster"
        ),
        "greedy_answers_identical": [same, len(prompts)],
    }
    if stream:
        cloud_hits = sum(r["cloud_hits"] for r in stream)
        cloud_all = cloud_hits + sum(r["cloud_misses"] for r in stream)
        device_hits = sum(r["device_hits"] or 0 for r in stream)
        device_all = sum(r["device_docs"] or 0 for r in stream) or None
        out["stream"] = {
            "questions": len(stream),
            "cloud_hit_rate": cloud_hits / cloud_all if cloud_all else None,
            "device_hits": device_hits,
            "device_hit_rate": None if device_all is None else device_hits / device_all,
            "device_bytes": stream[-1]["device_bytes"],
            "cloud_bytes": stream[-1]["cloud_bytes"],
            "ttft_s_first_half": _half(stream, 0),
            "ttft_s_second_half": _half(stream, 1),
        }
    return out


def _half(stream: Sequence[dict], which: int) -> float:
    half = len(stream) // 2
    part = stream[:half] if which == 0 else stream[half:]
    return sum(r["ttft_s"] for r in part) / max(len(part), 1)


def print_caches(summary: dict) -> None:
    for method, m in summary["means"].items():
        ttft, per = m["ttft_s"], m["per_token_s"]
        print(f"  {method:12s} TTFT {ttft or 0:6.2f} s   per token {1000 * (per or 0):6.0f} ms")
    for key in (
        "warm_over_local_ttft",
        "cold_over_off_ttft",
        "warm_over_off_per_token",
        "cold_over_off_per_token",
    ):
        r = summary.get(key)
        if r:
            print(
                f"  {key:26s} {r['ratio']:.2f}x (95 % {r['low']:.2f}-{r['high']:.2f}) "
                f"{r['verdict']}"
            )
    same, n = summary["greedy_answers_identical"]
    print(f"  greedy answers identical off/cold/warm: {same} of {n}")
    s = summary.get("stream")
    if s:
        print(
            f"  stream of {s['questions']} questions: cloud hit rate {s['cloud_hit_rate']}, "
            f"device hits {s['device_hits']}; memory device {s['device_bytes'] / 2**20:.0f} "
            f"MiB, cloud {s['cloud_bytes'] / 2**20:.0f} MiB; TTFT first half "
            f"{s['ttft_s_first_half']:.2f} s, second half {s['ttft_s_second_half']:.2f} s"
        )
