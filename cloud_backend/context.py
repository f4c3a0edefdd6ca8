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

from cloud_backend.engine_api import CloudEngine, CloudSequence
from collab.protocol import Cancel, Limits, Message, Mode


class RequestMetrics(Protocol):
    """Where decoding reports what it did; the server turns it into Prometheus series."""

    def tokens(self, n: int) -> None:
        """`n` more tokens committed to the answer."""

    def round(self, drafted: int, accepted: int, seconds: float) -> None:
        """One speculation round: drafts received, drafts accepted, cloud time spent."""

    def ttft(self, seconds: float) -> None:
        """Time from Generate to the first committed token."""

    def reused(self, kind: str, tokens: int) -> None:
        """Prompt tokens not prefilled again: their KV was kept (`conversation`, `document`)."""


class RequestInbox(asyncio.Queue[Message]):
    """A request's frames from the device, bounded in count and bytes: a device that sends
    faster than its request reads cannot grow the server's memory."""

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        super().__init__()
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self.nbytes = 0  # wire bytes of the frames queued
        self._sizes: dict[int, int] = {}  # id(frame) → its wire bytes, while queued
        self._cancels = 0

    def offer(self, msg: Message, nbytes: int) -> bool:
        """Queue a frame of `nbytes` wire bytes; False (nothing queued) if it would overflow."""
        if self.qsize() >= self.max_frames or self.nbytes + nbytes > self.max_bytes:
            return False
        self._sizes[id(msg)] = nbytes
        self.nbytes += nbytes
        self.put_nowait(msg)
        return True

    def replace_all(self, msg: Message) -> None:
        """Drop every frame queued and queue `msg` alone (a Cancel that must come first)."""
        while not self.empty():
            self.get_nowait()
        self.put_nowait(msg)

    @property
    def cancelled(self) -> bool:
        """Whether a Cancel is queued (the queue is left as it is)."""
        return self._cancels > 0

    def _put(self, item: Message) -> None:
        super()._put(item)
        self._cancels += isinstance(item, Cancel)

    def _get(self) -> Message:
        msg: Message = super()._get()
        self._cancels -= isinstance(msg, Cancel)
        self.nbytes -= self._sizes.pop(id(msg), 0)
        return msg


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

    engine: CloudEngine
    session: CloudSequence  # this websocket's engine session (one per websocket)
    corpus: Any | None  # PublicCorpus or None
    corpus_k: int
    corpus_floor: float | None
    mode: Mode  # CLOUD, SPLIT or DRAGON
    variant: str  # for SPLIT: a name in collab.variants.variant_names()
    limits: Limits
    send: Callable[[Message], Awaitable[None]]  # encodes, counts bytes, sends one frame
    inbox: RequestInbox  # drafts, CloudDecode, TokenChunk, Cancel for this request
    traffic: Callable[[], tuple[int, int]]  # (bytes_up, bytes_down) of this request so far
    metrics: RequestMetrics
    ping: Callable[[], Awaitable[None]] | None = None  # ask the device for a Pong (RTT)
    rtt: Callable[[], float | None] = lambda: None  # the session's measured round trip, s
    pace: DraftPace = field(default_factory=DraftPace)  # the session's, kept across answers
    cache_salt: bytes = b""  # the scope whose document KV this request may reuse
    corpus_focus_words: int = 0  # a prompt's public passages cut to the sentences that answer
