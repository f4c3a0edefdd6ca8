"""The cloud server's settings: defaults, a TOML file's `[cloud]` table, the environment, flags.

Precedence, lowest first: the defaults here, the file, `TANDEM_CLOUD_TOKEN` and
`TANDEM_METRICS_TOKEN` (so the secrets need not sit in a file), then explicit overrides
(command-line flags). A typo in the file is an
error that names the key, not a silently ignored setting.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from collab.protocol import DEFAULT_LIMITS, Limits
from collab.sources import PUBLIC_FLOOR

TOKEN_ENV = "TANDEM_CLOUD_TOKEN"
METRICS_TOKEN_ENV = "TANDEM_METRICS_TOKEN"
DEFAULT_TOKEN_NAME = "default"
ENGINES = ("ort", "torch", "vllm")
TORCH_DTYPES = ("bfloat16", "float32")
CACHE_SCOPES = ("user", "session", "all")


class ConfigError(ValueError):
    """A setting is missing or wrong; the message says which and how to fix it."""


@dataclass(frozen=True)
class ServerConfig:
    """Everything `run_server` and `build_engine` need; validated on construction."""

    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None  # the access token (named "default" in logs and limits)
    tokens: dict[str, str] = field(default_factory=dict)  # more: name -> token, one per user
    engine: Literal["ort", "torch", "vllm"] = "ort"  # vllm: docs/benchmarks/vllm.md#install
    torch_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # torch's and vLLM's
    model_dir: Path | None = None  # None: the prepared cloud model (`tandem models prepare`)
    model_name: str | None = None  # None: derived from model_dir
    threads: int | None = None
    max_sessions: int = 8  # websockets at once, handshaken or not; past it: 503 Retry-After
    idle_timeout_s: float = 300.0
    hello_timeout_s: float = 10.0  # a websocket must say Hello within this, whatever it sends
    heartbeat_s: float | None = 5.0  # websocket ping every this; no pong in half: dead (None: off)
    send_timeout_s: float = 30.0  # a device that takes no frame for this long is cut off
    kv_budget_bytes: int = 2 * 1024**3
    # public documents' prefix KV kept for reuse (0: off), and who shares an entry: "user"
    # (sessions of one access token), "session", or "all" (the best hit rate, but a session
    # can time whether another recently used a document: docs/security.md#document-cache)
    document_cache_bytes: int = 512 * 1024**2
    document_cache_scope: Literal["user", "session", "all"] = "user"
    max_batch_sequences: int = 64  # sequences of all sessions in one pass (1: one step a pass)
    prefill_chunk: int = 256  # positions of a long prefill per pass (others decode between)
    limits: Limits = field(default=DEFAULT_LIMITS)
    corpus_enabled: bool = True
    corpus_limit: int | None = None
    corpus_k: int = 3
    corpus_floor: float = PUBLIC_FLOOR  # a public passage less relevant is not used
    # a cloud-mode prompt holds about this many words of each public passage: the sentences
    # that answer (retrieval.focus; the citation stays whole); 0 keeps passages whole
    corpus_focus_words: int = 60
    # a first build takes the public vectors shipped with the project where they pass their
    # spot check (cloud_backend.corpus_vectors); false embeds every summary on this machine
    corpus_shipped_vectors: bool = True
    data_dir: Path | None = None
    tls_cert: Path | None = None  # PEM certificate chain: serve wss:// (with tls_key)
    tls_key: Path | None = None
    auth_failures: int = 10  # wrong tokens from one client within auth_window_s, then 429
    auth_window_s: float = 60.0
    # proxies (addresses or networks) whose X-Forwarded-For names the client: the balancer
    trusted_proxies: list[str] = field(default_factory=list)
    # fairness between access tokens: sessions one token may hold (None: all of max_sessions
    # with one token, half of them with several) and KV cache bytes (None: the whole budget;
    # over the budget, the token holding the most gives up its least recently used first)
    max_sessions_per_token: int | None = None
    kv_budget_per_token_bytes: int | None = None
    # /metrics: on its own bind (metrics_host:metrics_port), or on the service's bind behind
    # `Authorization: Bearer <metrics_token>`; with neither it is not served
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_token: str | None = None
    requests_per_minute: int = 3000  # per access token, in bursts of a minute's worth; 0: off
    vllm: dict[str, Any] = field(default_factory=dict)  # [cloud.vllm]: vLLM engine arguments
    # how vLLM verifies split drafts (docs/architecture.md#split-on-vllm): "decode", one
    # request generating a token per draft; "fanout", a one-token request per draft at once
    vllm_verify: Literal["decode", "fanout"] = "decode"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if self.torch_dtype not in TORCH_DTYPES:
            raise ConfigError(
                f"torch_dtype must be one of {', '.join(TORCH_DTYPES)}, not {self.torch_dtype!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, not {self.port}")
        if self.max_sessions < 1:
            raise ConfigError("max_sessions must be at least 1")
        for name in ("idle_timeout_s", "hello_timeout_s", "send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds")
        if self.heartbeat_s is not None and not self.heartbeat_s > 0:
            raise ConfigError("heartbeat_s must be > 0 seconds (or unset to turn it off)")
        if self.kv_budget_bytes < 0:
            raise ConfigError("kv_budget_bytes must be ≥ 0")
        if self.document_cache_bytes < 0:
            raise ConfigError("document_cache_bytes must be ≥ 0 (0 turns the cache off)")
        if self.document_cache_scope not in CACHE_SCOPES:
            raise ConfigError(
                f"document_cache_scope must be one of {', '.join(CACHE_SCOPES)}, "
                f"not {self.document_cache_scope!r}"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads must be at least 1 (or unset for all cores)")
        if self.corpus_k < 1:
            raise ConfigError("corpus_k must be at least 1")
        if self.corpus_focus_words < 0:
            raise ConfigError("corpus_focus_words must be 0 (whole passages) or more")
        if not -1.0 <= self.corpus_floor <= 1.0:
            raise ConfigError(f"corpus_floor must be in -1..1, not {self.corpus_floor}")
        if self.corpus_limit is not None and self.corpus_limit < 1:
            raise ConfigError("corpus_limit must be at least 1 (or unset for the whole corpus)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together: give both, or neither")
        if self.auth_failures < 1 or not self.auth_window_s > 0:
            raise ConfigError("auth_failures must be ≥ 1 and auth_window_s > 0 seconds")
        if self.max_batch_sequences < 1 or self.prefill_chunk < 1:
            raise ConfigError("max_batch_sequences and prefill_chunk must be at least 1")
        if self.max_sessions_per_token is not None and self.max_sessions_per_token < 1:
            raise ConfigError("max_sessions_per_token must be at least 1 (or unset)")
        if self.kv_budget_per_token_bytes is not None and self.kv_budget_per_token_bytes < 0:
            raise ConfigError("kv_budget_per_token_bytes must be ≥ 0 (or unset)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in 0..65535, not {self.metrics_port}")
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ConfigError(
                    f"trusted_proxies: {proxy!r} is not an address or a network (10.0.0.0/8)"
                ) from None
        if self.requests_per_minute < 0:
            raise ConfigError("requests_per_minute must be ≥ 0 (0 turns the limit off)")
        for name, secret in self.tokens.items():
            if not name or not secret:
                raise ConfigError("every entry of [cloud.tokens] needs a name and a token")
        for name in ("model_dir", "data_dir", "tls_cert", "tls_key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value).expanduser())

    def proxy_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return [ipaddress.ip_network(p, strict=False) for p in self.trusted_proxies]

    def sessions_per_token(self) -> int:
        """The most sessions one access token may hold: `max_sessions_per_token`, else all
        slots when one token is set and half of them (rounded up) when several are."""
        if self.max_sessions_per_token is not None:
            return min(self.max_sessions_per_token, self.max_sessions)
        several = len(self.tokens) + (self.token is not None) > 1
        return -(-self.max_sessions // 2) if several else self.max_sessions

    def access_tokens(self) -> dict[str, str]:
        """Every access token by name, or a clear error: the cloud never serves without one."""
        named = {DEFAULT_TOKEN_NAME: self.token} if self.token else {}
        named.update(self.tokens)
        if not named:
            raise ConfigError(
                "no access token is set for the cloud server: set the environment variable "
                f'{TOKEN_ENV}, or `token = "..."` in the [cloud] table of the config file'
            )
        if len(set(named.values())) < len(named):
            raise ConfigError("two access tokens are the same: give each user their own")
        if self.metrics_token is not None and self.metrics_token in named.values():
            raise ConfigError(
                "metrics_token is also an access token: give /metrics a token of its own"
            )
        return named


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check (and convert where TOML cannot express it: paths) one value from the file."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}, not {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} must be a list of strings, not {value!r}")
        return list(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ConfigError(f"{key} must be a table of names to strings ([cloud.{key}])")
        return dict(value)
    if tp is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(f"{key} must be a path (a string), not {value!r}")
        return Path(value).expanduser()
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, not {value!r}")
        return float(value)
    if tp is int or tp is bool or tp is str:
        if type(value) is not tp:
            raise ConfigError(f"{key} must be of type {_type_name(tp)}, not {value!r}")
        return value
    return value


def _limits(table: Any) -> Limits:
    if isinstance(table, Limits):
        return table
    if not isinstance(table, dict):
        raise ConfigError("limits must be a table ([cloud.limits])")
    known = {f.name for f in fields(Limits)}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(
                f"unknown setting limits.{key} in [cloud.limits]; known: {', '.join(sorted(known))}"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"limits.{key} must be a positive integer, not {value!r}")
    return replace(DEFAULT_LIMITS, **table)


def _from_mapping(values: dict[str, Any], where: str) -> dict[str, Any]:
    hints = typing.get_type_hints(ServerConfig)
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in hints:
            known = ", ".join(sorted(hints))
            raise ConfigError(f"unknown setting {key!r} in {where}; known settings: {known}")
        if key == "limits":
            out[key] = _limits(value)
        elif key == "vllm":
            if not isinstance(value, dict):
                raise ConfigError("vllm must be a table of vLLM engine arguments ([cloud.vllm])")
            out[key] = dict(value)
        else:
            out[key] = _coerce(key, value, hints[key])
    return out


def load_config(path: Path | None = None, **overrides: Any) -> ServerConfig:
    """Defaults < the file's `[cloud]` table < TANDEM_CLOUD_TOKEN < `overrides` (None values in
    `overrides` mean "not given" and are skipped, so CLI flags can be passed straight through)."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path).expanduser()
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        table = data.get("cloud", {})
        if not isinstance(table, dict):
            raise ConfigError(f"[cloud] in {path} must be a table")
        values.update(_from_mapping(table, f"the [cloud] table of {path}"))
    for env, key in ((TOKEN_ENV, "token"), (METRICS_TOKEN_ENV, "metrics_token")):
        if secret := os.environ.get(env):
            values[key] = secret
    given = {k: v for k, v in overrides.items() if v is not None}
    values.update(_from_mapping(given, "the overrides"))
    return ServerConfig(**values)
