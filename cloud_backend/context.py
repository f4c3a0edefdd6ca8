"""What the transport hands to a request's decoding loop (cloud_backend.modes).

A separate module so that the server (which starts requests) and the modes (which serve them)
both import it without importing each other.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from cloud_backend.engine import EngineSession, LLMEngine
from collab.protocol import Limits, Message, Mode


class RequestMetrics(Protocol):
    """Where decoding reports what it did; the server turns it into Prometheus series."""

    def tokens(self, n: int) -> None:
        """`n` more tokens committed to the answer."""

    def round(self, drafted: int, accepted: int, seconds: float) -> None:
        """One speculation round: drafts received, drafts accepted, cloud time spent."""

    def ttft(self, seconds: float) -> None:
        """Time from Generate to the first committed token."""


@dataclass
class DraftPace:
    """What the cloud learns of a split session across its answers, for fast verification:
    its own verification passes (tokens fed, seconds) and the gap between a batch's drafts as
    they arrive (the device's drafting, per draft)."""

    passes: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=32))
    gap: float | None = None


@dataclass
class RequestContext:
    """One request's view of its session: the engine, where to send, what arrives for it."""

    engine: LLMEngine
    session: EngineSession  # this websocket's engine session (one per websocket)
    corpus: Any | None  # PublicCorpus or None
    corpus_k: int
    mode: Mode  # CLOUD, SPLIT or DRAGON
    variant: str  # for SPLIT: a name in collab.variants.VARIANTS
    limits: Limits
    send: Callable[[Message], Awaitable[None]]  # encodes, counts bytes, sends one frame
    inbox: asyncio.Queue[Message]  # drafts, CloudDecode, TokenChunk, Cancel for this request
    traffic: Callable[[], tuple[int, int]]  # (bytes_up, bytes_down) of this request so far
    metrics: RequestMetrics
    ping: Callable[[], Awaitable[None]] | None = None  # ask the device for a Pong (RTT)
    rtt: Callable[[], float | None] = lambda: None  # the session's measured round trip, s
    pace: DraftPace = field(default_factory=DraftPace)  # the session's, kept across answers
