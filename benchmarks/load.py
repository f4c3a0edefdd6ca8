"""Many device sessions against one cloud (issue 16): `python -m benchmarks.load [--sessions
100] [--capacity 90] [--quick] [--balancer] [--greedy 50]`.

One `tandem serve` (the tiny test model, torch float32, on its own thread and event loop) and
N scripted devices on loopback, all at once, each asking one question in its mode (cloud,
split TK-SLT, DRAGON with the cloud aggregating, in turn). A device speaks the protocol as the
real one does, but drafts with a fixed id instead of a model, so the load is the cloud's:
its engine serves every session's steps on one worker. Past `capacity` sessions the cloud
refuses with 503 and Retry-After; a refused device counts as falling back to local.

Printed (and written to results/load/<name>.json): admitted, refused and evicted sessions,
errors other than refusals and evictions (must be none), time to first token and time per
token at p50/p99, fairness (each session's tokens/s against the median), the engine's peak KV
cache against its budget, and the whole run's wall time. Bounded: every session must end
within `--timeout` s. With `--kv-budget-mib` below what the sessions hold, the engine evicts
(the least recently used sessions end with EVICTED, the rest finish) and the peak stays under
the budget.

`--balancer` (issue 33): the devices reach `--replicas` `tandem serve` processes (the same
tiny model, torch float32, one thread each, `--capacity` split among them) through HAProxy with
the shipped deploy/haproxy.cfg (benchmarks.balancer); each replica's peak sessions and
HAProxy's view of each (sessions given, retries) are recorded instead of the KV cache. `--greedy
N`: N sessions share one access token and every other session has a token of its own (with
several tokens a replica lets one hold half its sessions): each side's figures are recorded
apart ("tenants")."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from collab import protocol as p

MODES = ("cloud", "split", "dragon")
RESULTS = Path(__file__).parent / "results" / "load"


@dataclass
class Outcome:
    """One device session's figures."""

    mode: str
    tenant: str = ""  # "greedy" (the token many sessions share), "single", or "" (one token)
    refused: bool = False
    refused_status: int | None = None  # 503 (cloud full) or 429 (the token holds its share)
    evicted: bool = False  # its KV cache was dropped for the budget: it ends with an error
    error: str = ""
    tokens: int = 0
    ttft_s: float | None = None
    per_token_s: float | None = None
    seconds: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # time per token, each arrival's share
    drafted: int = 0  # split: draft tokens the cloud judged, and accepted
    accepted: int = 0


@dataclass
class Device:
    """A scripted device: one session, one question, in its mode."""

    url: str
    token: str
    tokenizer_hash: bytes
    mode: str
    max_tokens: int
    question: str = "Tell me about tandem bicycles."
    retrieve: bool = False
    dragon_k: int = 1  # public passages the cloud decodes over in DRAGON
    tenant: str = ""
    outcome: Outcome = field(init=False)

    def __post_init__(self) -> None:
        self.outcome = Outcome(self.mode, self.tenant)
        self.committed: list[int] = []  # the answer's tokens so far

    def split_draft(self, step: int, epoch: int) -> p.TopKDraft:
        """The next split draft (here: three of one fixed id, one-hot)."""
        return p.TopKDraft(
            np.full(3, 13),
            np.full((3, 1), 13),
            np.ones((3, 1)),
            request_id=1,
            epoch=epoch,
            step=step,
        )

    async def drafting(self, n: int) -> None:
        """The time a device takes to draft `n` tokens (none: the load is the cloud's)."""

    async def run(self, http: aiohttp.ClientSession) -> Outcome:
        out, t0 = self.outcome, time.perf_counter()
        try:
            ws = await http.ws_connect(self.url, headers={"Authorization": f"Bearer {self.token}"})
        except aiohttp.WSServerHandshakeError as exc:
            out.refused = exc.status in (503, 429) and "Retry-After" in (exc.headers or {})
            out.refused_status = exc.status if out.refused else None
            out.error = "" if out.refused else f"HTTP {exc.status}"
            return out
        try:
            variant = "tk-slt" if self.mode == "split" else ""
            await ws.send_bytes(
                p.encode(p.Hello(self.tokenizer_hash, p.Mode[self.mode.upper()], variant))
            )
            ack = await self._recv(ws)
            if not isinstance(ack, p.HelloAck) or not ack.accepted:
                out.error = f"handshake: {ack}"
                return out
            await ws.send_bytes(
                p.encode(
                    p.Generate(
                        self.question,
                        max_new_tokens=self.max_tokens,
                        retrieve=self.retrieve,
                        request_id=1,
                    )
                )
            )
            if self.mode == "dragon":
                setup = p.DragonSetup(
                    self.dragon_k, p.AggregatorPolicy.CLOUD, p.Side.CLOUD, request_id=1
                )
                await ws.send_bytes(p.encode(setup))
                await ws.send_bytes(p.encode(self._dragon_draft(0, 0)))
            await self._answer(ws, t0)
        except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        finally:
            out.seconds = time.perf_counter() - t0
            await ws.close()
        return out

    async def _answer(self, ws: aiohttp.ClientWebSocketResponse, t0: float) -> None:
        out = self.outcome
        first = last = None
        step = epoch = 0
        draft: p.TopKDraft | None = None
        while True:
            msg = await self._recv(ws)
            now = time.perf_counter()
            if isinstance(msg, p.Error):
                out.evicted = msg.code == p.ErrorCode.EVICTED
                out.error = (
                    "" if out.evicted else f"Error {p.ErrorCode(msg.code).name}: {msg.message}"
                )
                continue
            if isinstance(msg, p.Done):
                out.tokens, out.drafted, out.accepted = msg.tokens, msg.drafted, msg.accepted
                break
            got = 0
            if isinstance(msg, p.TokenChunk):
                got = msg.token_ids.size
                step = msg.step + got
                self.committed += msg.token_ids.tolist()
            elif isinstance(msg, p.Verdict):
                got = msg.accepted + (msg.token is not None)
                sent = draft.token_ids.tolist() if draft is not None else []
                epoch += msg.accepted < len(sent)
                step = msg.step + got
                self.committed += sent[: msg.accepted]
                self.committed += [msg.token] if msg.token is not None else []
            elif isinstance(msg, p.DragonTarget):
                got = 1
                epoch += not msg.device_accepted
                step = msg.step + 1
                self.committed.append(msg.token)
                await ws.send_bytes(p.encode(self._dragon_draft(step, epoch)))
            if got:
                if last is not None:  # the first arrival's wait is the TTFT
                    out.gaps_s += [(now - last) / got] * got
                first = first or now
                last = now
            if self.mode == "split" and isinstance(msg, p.TokenChunk | p.Verdict):
                draft = self.split_draft(step, epoch)
                await self.drafting(draft.token_ids.size)
                await ws.send_bytes(p.encode(draft))
        if first is not None:
            out.ttft_s = first - t0
            if out.tokens > 1 and last is not None and last > first:
                out.per_token_s = (last - first) / (out.tokens - 1)

    def _dragon_draft(self, step: int, epoch: int) -> p.DragonDraft:
        return p.DragonDraft(
            13,
            np.asarray([13]),
            np.asarray([1.0]),
            0.0,
            0.001,
            request_id=1,
            epoch=epoch,
            step=step,
        )

    async def _recv(self, ws: aiohttp.ClientWebSocketResponse) -> p.Message:
        while True:
            wsmsg = await ws.receive(timeout=120)
            if wsmsg.type != aiohttp.WSMsgType.BINARY:
                raise ConnectionError(f"the cloud closed the session ({ws.close_code})")
            msg = p.decode(wsmsg.data)
            if isinstance(msg, p.Ping):  # DRAGON's cloud measures the round trip
                pong = p.Pong(
                    msg.sent_ns, time.monotonic_ns(), time.monotonic_ns(), request_id=msg.request_id
                )
                await ws.send_bytes(p.encode(pong))
                continue
            return msg


def quantile(values: list[float], q: float) -> float | None:
    return float(np.quantile(values, q)) if values else None


def _figures(outcomes: list[Outcome]) -> dict[str, Any]:
    """Latency and rate quantiles of the sessions that finished."""
    ok = [o for o in outcomes if not (o.refused or o.error or o.evicted)]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    per_token = [o.per_token_s for o in ok if o.per_token_s is not None]
    rates = [o.tokens / o.seconds for o in ok if o.seconds > 0]
    return {
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p99_s": quantile(ttft, 0.99),
        "per_token_p50_s": quantile(per_token, 0.5),
        "per_token_p99_s": quantile(per_token, 0.99),
        "rate_p50_tokens_per_s": quantile(rates, 0.5),
    }


def tenant_figures(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Each tenant's sessions apart: one token holding many sessions against many holding one
    each (who was refused, and how fast the admitted were served)."""
    out = {}
    for tenant in sorted({o.tenant for o in outcomes} - {""}):
        mine = [o for o in outcomes if o.tenant == tenant]
        refused = Counter(str(o.refused_status) for o in mine if o.refused)
        out[tenant] = {
            "sessions": len(mine),
            "admitted": sum(not o.refused for o in mine),
            "refused_by_status": dict(sorted(refused.items())),
            "errors": sum(bool(o.error) for o in mine if not o.refused),
            **_figures(mine),
        }
    return out


def summarise(outcomes: list[Outcome], peak_kv: int, budget: int, wall: float) -> dict:
    admitted = [o for o in outcomes if not o.refused]
    ok = [o for o in admitted if not (o.error or o.evicted)]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    per_token = [o.per_token_s for o in ok if o.per_token_s is not None]
    rates = [o.tokens / o.seconds for o in ok if o.seconds > 0]
    median_rate = statistics.median(rates) if rates else None
    refused = Counter(str(o.refused_status) for o in outcomes if o.refused)
    return {
        "sessions": len(outcomes),
        "admitted": len(admitted),
        "refused": len(outcomes) - len(admitted),
        "refused_by_status": dict(sorted(refused.items())),
        "evicted": sum(o.evicted for o in admitted),
        "errors": [f"{o.mode}: {o.error}" for o in admitted if o.error],
        "by_mode": {m: sum(o.mode == m for o in ok) for m in MODES},
        "tokens": sum(o.tokens for o in ok),
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p99_s": quantile(ttft, 0.99),
        "per_token_p50_s": quantile(per_token, 0.5),
        "per_token_p99_s": quantile(per_token, 0.99),
        "slowest_vs_median_rate": min(rates) / median_rate if median_rate else None,
        "longest_session_s": max((o.seconds for o in ok), default=None),
        "peak_kv_bytes": peak_kv,
        "kv_budget_bytes": budget,
        "wall_s": wall,
        "tenants": tenant_figures(outcomes),
    }


GREEDY = "greedy"


def tenancy(sessions: int, greedy: int | None) -> list[tuple[str, str]]:
    """(tenant, token name) of each session: with `greedy`, that many share the token
    "greedy" (spread evenly through the arrivals) and every other has a token of its own;
    without it, all share the default token."""
    if greedy is None:
        return [("", "default")] * sessions
    if not 0 <= greedy <= sessions:
        raise ValueError(f"--greedy must be within 0..{sessions}")
    return [
        (GREEDY, GREEDY)
        if (i * greedy) // sessions != ((i + 1) * greedy) // sessions
        else ("single", f"user{i}")
        for i in range(sessions)
    ]


def secret(name: str) -> str:
    """The loopback benchmark's access token named `name` (other than the default one)."""
    return f"load-{name}-0123456789"


async def run_load(
    url: str,
    token: str,
    tokenizer_hash: bytes,
    sessions: int,
    max_tokens: int,
    cache_bytes: Callable[[], int],
    timeout: float,
    tenants: Sequence[tuple[str, str]] | None = None,
    sample: Callable[[], Awaitable[None]] | None = None,
) -> tuple[list[Outcome], int, float]:
    """All devices at once; the engine's KV cache sampled every 10 ms while they run (and
    `sample` awaited between). `tenants`: each device's (tenant, token name), else all
    `token`."""
    tenants = tenants or [("", "default")] * sessions
    devices = [
        Device(
            url,
            token if name == "default" else secret(name),
            tokenizer_hash,
            MODES[i % len(MODES)],
            max_tokens,
            tenant=tenant,
        )
        for i, (tenant, name) in enumerate(tenants)
    ]
    peak = 0
    stop = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, cache_bytes())
            if sample is not None:
                await sample()
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    t0 = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        outcomes = await asyncio.wait_for(asyncio.gather(*(d.run(http) for d in devices)), timeout)
    wall = time.perf_counter() - t0
    stop.set()
    await watcher
    return list(outcomes), peak, wall


async def run_balanced(
    args: argparse.Namespace,
    hf: Path,
    budget: int,
    tenants: Sequence[tuple[str, str]],
    token: str,
) -> tuple[list[Outcome], float, dict[str, Any]]:
    """`args.replicas` `tandem serve` processes behind HAProxy (the shipped config), the
    devices through it. Returns the outcomes, the wall time and what the balancer and the
    replicas saw: peak sessions a replica, HAProxy's counters, ERROR lines of their logs."""
    from app.embedded import EmbeddedCloud
    from benchmarks.balancer import Balancer
    from model_runtime.tokenizer import load_tokenizer, tokenizer_fingerprint

    tokenizer_hash = bytes.fromhex(tokenizer_fingerprint(load_tokenizer(hf)))
    per_replica = -(-args.capacity // args.replicas)
    named = sorted({name for _, name in tenants} - {"default"})
    with tempfile.TemporaryDirectory(prefix="tandem-load-") as tmp:
        folder = Path(tmp)
        (folder / "token").write_text(token)
        (folder / "replica.toml").write_text(
            f"[cloud]\nmax_sessions = {per_replica}\nkv_budget_bytes = {budget}\n"
            "corpus_enabled = false\n\n[cloud.tokens]\n"
            + "".join(f'{name} = "{secret(name)}"\n' for name in named)
        )
        serve = [
            "--config",
            str(folder / "replica.toml"),
            "--token-file",
            str(folder / "token"),
            "--engine",
            "torch",
            "--dtype",
            "float32",
            "--model-dir",
            str(hf),
            "--threads",
            "1",
        ]
        clouds = await asyncio.gather(
            *(
                EmbeddedCloud.start(serve, timeout_s=120, log_path=folder / f"cloud{i + 1}.log")
                for i in range(args.replicas)
            )
        )
        ports = {f"cloud{i + 1}": urlsplit(c.url).port or 0 for i, c in enumerate(clouds)}
        peaks = dict.fromkeys(ports, 0)
        try:
            balancer = Balancer(folder, list(ports.items()))
            async with aiohttp.ClientSession() as http:

                async def sample() -> None:  # /healthz names the sessions to the metrics token
                    for (name, port), cloud in zip(ports.items(), clouds, strict=True):
                        auth = {"Authorization": f"Bearer {cloud.metrics_token}"}
                        url = f"http://127.0.0.1:{port}/healthz"
                        async with http.get(url, headers=auth) as resp:
                            sessions = (await resp.json())["sessions"]
                        peaks[name] = max(peaks[name], sessions)

                try:
                    outcomes, _, wall = await run_load(
                        balancer.url,
                        token,
                        tokenizer_hash,
                        args.sessions,
                        args.tokens,
                        lambda: 0,
                        args.timeout,
                        tenants,
                        sample,
                    )
                    stats = balancer.stats()
                finally:
                    balancer.close()
        finally:
            await asyncio.gather(*(cloud.stop() for cloud in clouds))
        errors = [
            line
            for name in ports
            for line in (folder / f"{name}.log").read_text(errors="replace").splitlines()
            if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line
        ]
    seen = {
        "replicas": args.replicas,
        "max_sessions_per_replica": per_replica,
        "peak_sessions_by_replica": peaks,
        "balancer_by_replica": {n: asdict(s) for n, s in stats.items()},
    }
    return outcomes, wall, {"balancer": seen, "server_errors": errors}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--capacity", type=int, default=90, help="the cloud's max_sessions")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument(
        "--kv-budget-mib",
        type=float,
        default=256,
        help="the engine's KV budget; below what the sessions hold, the least "
        "recently used lose their cache (EVICTED) and the rest go on",
    )
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--quick", action="store_true", help="12 sessions, capacity 10")
    parser.add_argument("--name", default=None, help="results/load/<name>.json")
    parser.add_argument("--out", type=Path, help="write the JSON here instead")
    parser.add_argument("--tiny-root", type=Path, help="where the tiny model is (built if not)")
    parser.add_argument(
        "--balancer",
        action="store_true",
        help="HAProxy (deploy/haproxy.cfg) in front of --replicas tandem serve "
        "processes, --capacity split among them",
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--greedy",
        type=int,
        default=None,
        help="this many sessions share one access token, every other session "
        "has its own (default: all share one)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.capacity, args.tokens = 12, 10, 8
    from platformdirs import user_cache_dir

    from benchmarks.tiny_models import build_all, builder_version
    from benchmarks.wire import TOKEN, ServerThread
    from cloud_backend.engine import LLMEngine
    from model_runtime.tokenizer import load_tokenizer
    from model_runtime.torch_runtime import TorchCausalLM

    quiet = logging.getLogger("tandem")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # a line per session is noise here
    cache = Path(user_cache_dir("tandem")) / "load" / f"tiny-qwen2-{builder_version()}"
    tiny = build_all(args.tiny_root or cache)
    budget = int(args.kv_budget_mib * 2**20)
    tenants = tenancy(args.sessions, args.greedy)
    if args.balancer:
        try:
            outcomes, wall, seen = asyncio.run(
                run_balanced(args, tiny["hf"], budget, tenants, TOKEN)
            )
        finally:
            quiet.setLevel(level)
        summary = summarise(outcomes, 0, budget, wall)
        summary["peak_kv_bytes"] = None  # each replica's own: not sampled across processes
        summary.update(seen)
    else:
        named = {name: secret(name) for _, name in tenants if name != "default"}
        engine = LLMEngine(
            TorchCausalLM(tiny["hf"]),
            load_tokenizer(tiny["hf"]),
            "tiny-cloud",
            kv_budget_bytes=budget,
        )
        server = ServerThread(engine, p.DEFAULT_LIMITS, max_sessions=args.capacity, tokens=named)
        try:
            outcomes, peak, wall = asyncio.run(
                run_load(
                    server.url,
                    TOKEN,
                    engine.tokenizer_hash,
                    args.sessions,
                    args.tokens,
                    lambda: engine.cache_bytes,
                    args.timeout,
                    tenants,
                )
            )
        finally:
            server.stop()
            engine.close()
            quiet.setLevel(level)
        summary = summarise(outcomes, peak, budget, wall)
        summary["server_errors"] = [r.getMessage() for r in server.errors]
    finished = [o for o in outcomes if not (o.refused or o.error or o.evicted)]
    summary["short_answers"] = sum(o.tokens != args.tokens for o in finished)  # nothing lost: 0
    from benchmarks.provenance import command_line, record

    behind = f", {args.replicas} replicas behind HAProxy" if args.balancer else ""
    engines = [f"cloud torch (tiny model){behind}"]
    summary["provenance"] = record(command_line("benchmarks.load", argv), engines=engines)
    summary["config"] = vars(args)
    summary["outcomes"] = [asdict(o) for o in outcomes]
    name = args.name or ("quick" if args.quick else time.strftime("%Y%m%d-%H%M%S"))
    out = args.out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1, default=str))
    show = {k: v for k, v in summary.items() if k not in ("outcomes", "config")}
    print(json.dumps(show, indent=1), file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
