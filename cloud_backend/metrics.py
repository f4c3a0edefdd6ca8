"""Prometheus series for one server app, in a registry of its own.

A per-app `CollectorRegistry` (not the global default) lets several apps live in one process
(tests, benchmarks) without colliding, and makes /metrics show exactly this app's numbers.
prometheus_client is thread-safe, so the engine's worker thread may record step times directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from model_runtime.prefix_cache import PrefixCache

# Step and round times on the cloud: a tiny test model takes ~1 ms, a 1.5B prefill seconds.
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """All series the cloud exports; methods are the only way the server touches them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.sessions = Gauge("tandem_sessions", "Open websocket sessions", registry=r)
        self.tokens = Counter("tandem_tokens", "Tokens committed to answers", ["mode"], registry=r)
        self.rounds = Counter("tandem_rounds", "Split speculation rounds", registry=r)
        self.drafted = Counter(
            "tandem_drafted_tokens", "Draft tokens received for verification", registry=r
        )
        self.accepted = Counter(
            "tandem_accepted_tokens", "Draft tokens accepted by verification", registry=r
        )
        self.bytes = Counter(
            "tandem_bytes",
            "Websocket payload bytes (up: device to cloud, down: cloud to device)",
            ["direction"],
            registry=r,
        )
        self.errors = Counter(
            "tandem_errors", "Error frames sent, by protocol error code", ["code"], registry=r
        )
        self.refusals = Counter(
            "tandem_handshake_refusals",
            "Sessions and requests refused (version, tokenizer, mode, variant, busy, rate)",
            ["reason"],
            registry=r,
        )
        self.evictions = Counter(
            "tandem_evictions", "Sessions whose KV cache was evicted", registry=r
        )
        self.kv_cache_bytes = Gauge(
            "tandem_kv_cache_bytes", "KV cache memory held by all sessions", registry=r
        )
        self.step_seconds = Histogram(
            "tandem_step_seconds",
            "Engine step time by kind (prefill, decode, verify, rollback)",
            ["kind"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.round_seconds = Histogram(
            "tandem_round_seconds",
            "Cloud time per speculation round",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "tandem_ttft_seconds",
            "Time from Generate to the first committed token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.reused_tokens = Counter(
            "tandem_reused_prompt_tokens",
            "Prompt tokens not prefilled again, their KV kept (conversation, document)",
            ["kind"],
            registry=r,
        )
        for direction in ("up", "down"):
            self.bytes.labels(direction=direction)  # show zeros before any traffic
        for kind in ("conversation", "document"):
            self.reused_tokens.labels(kind=kind)

    def watch_kv_cache(self, read: Callable[[], int]) -> None:
        """Read the cache size at scrape time (always current, no bookkeeping)."""
        self.kv_cache_bytes.set_function(read)

    def watch_document_cache(self, cache: PrefixCache) -> None:
        """The public documents' prefix KV cache, read at scrape time: hits, misses, bytes."""
        self.registry.register(_DocumentCacheCollector(cache))

    def watch_rows_out(self, read: Callable[[], int]) -> None:
        """Vocabulary rows an engine that samples itself (vLLM) handed out of its model
        runner, read at scrape time: each crosses its output path (~0.6 MB at Qwen's vocabulary);
        split verified inside the engine needs none (docs/architecture.md#split-on-vllm)."""
        self.registry.register(_RowsOutCollector(read))

    def step(self, kind: str, positions: int, seconds: float) -> None:
        """The engine's `on_step` observer (called from its worker thread)."""
        self.step_seconds.labels(kind=kind).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _DocumentCacheCollector(Collector):
    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        c = self.cache
        for family, name, text, value in (
            (CounterMetricFamily, "hits", "Document prefixes whose KV was reused", c.hits),
            (CounterMetricFamily, "misses", "Document prefixes prefilled (then kept)", c.misses),
            (GaugeMetricFamily, "bytes", "Memory the document prefix KV holds", c.nbytes),
            (GaugeMetricFamily, "budget_bytes", "The document cache's budget", c.budget_bytes),
        ):
            yield family(f"tandem_document_cache_{name}", text, value=value)


class _RowsOutCollector(Collector):
    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "tandem_engine_rows_out", "Vocabulary rows handed out of the engine", value=self.read()
        )


class RequestMetrics:
    """Per-request recorder handed to decoding (cloud_backend.context.RequestMetrics); keeps
    its own totals too, for the request's log line."""

    def __init__(self, metrics: ServerMetrics, mode: str) -> None:
        self._m = metrics
        self._tokens = metrics.tokens.labels(mode=mode)
        self.n_tokens = 0
        self.n_rounds = 0
        self.n_drafted = 0
        self.n_accepted = 0
        self.ttft_s: float | None = None

    def tokens(self, n: int) -> None:
        if n > 0:
            self.n_tokens += n
            self._tokens.inc(n)

    def round(self, drafted: int, accepted: int, seconds: float) -> None:
        self.n_rounds += 1
        self.n_drafted += drafted
        self.n_accepted += accepted
        self._m.rounds.inc()
        if drafted:
            self._m.drafted.inc(drafted)
        if accepted:
            self._m.accepted.inc(accepted)
        self._m.round_seconds.observe(seconds)

    def reused(self, kind: str, tokens: int) -> None:
        if tokens > 0:
            self._m.reused_tokens.labels(kind=kind).inc(tokens)

    def ttft(self, seconds: float) -> None:
        if self.ttft_s is None:
            self.ttft_s = seconds
            self._m.ttft_seconds.observe(seconds)
