"""What an answer streams to its caller (CLI, TUI), whatever the mode."""

from __future__ import annotations

from dataclasses import dataclass, field

from collab.sources import Source


@dataclass(frozen=True)
class TextDelta:
    """New answer text, safe to append (never a partial character)."""

    text: str


Citation = Source
"""A numbered source of the answer (`side` says where it lives: private "device" text never
left). The event is the one source type itself, under the name the event handlers read."""


@dataclass(frozen=True)
class Notice:
    """Something the user should know that is not an error (e.g. AS² decoding in the cloud)."""

    text: str


@dataclass(frozen=True)
class Provenance:
    """Who holds the answer's text from here on. `shared=True`: the question has gone to the
    cloud and the tokens that follow are the cloud's (it produced, verified or aggregated
    them). `shared=False`: the device goes on alone (the cloud dropped): that text never
    reached the cloud and must never be sent to it, in this turn's history or any later one.
    `tokens`: how many of the answer's tokens were committed when this was said."""

    shared: bool
    tokens: int = 0


@dataclass(frozen=True)
class Failure:
    """A plain-language error; `recoverable` if the answer went on (e.g. finished locally)."""

    message: str
    recoverable: bool = False


@dataclass
class Stats:
    """Live and final figures of one answer. Byte counts are what crossed the network."""

    mode: str
    variant: str = ""
    tokens: int = 0
    ttft_s: float | None = None
    elapsed_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    gamma: int | None = None
    cloud_only: bool = False  # AS² chose cloud decoding for (part of) this answer
    cloud_tokens: int = 0  # tokens the cloud decoded alone (AS² fallback)
    bytes_up: int = 0
    bytes_down: int = 0
    draft_bytes_up: int = 0  # the draft frames alone (split): uplink per drafted token
    finish: str | None = None
    aggregator: str | None = None  # dragon: the side aggregating now (device or cloud)
    switches: int = 0  # dragon: times the aggregator moved
    rapid_eta: float = 0.0  # split: RAPID's η this answer was verified with (0 = exact)
    pipeline: bool = False  # split: PicoSpec's pipeline drafted on while the cloud verified
    pipeline_depth: int = 0  # split, pipelined: most batches in flight at once
    truncations: int = 0  # split, pipelined: batches sent short because the cloud was idle
    waits: int = 0  # split, pipelined: batches the cost model sent stop-and-wait
    fast_verified: int = 0  # split, pipelined: batches the cloud began before they were whole
    rollbacks: int = 0  # split, pipelined: rejections that threw away drafting past them
    device_drafted: int = 0  # dragon: each side's drafts judged by a target, and the accepted
    device_accepted: int = 0
    cloud_drafted: int = 0
    cloud_accepted: int = 0
    device_decode_s: float | None = None  # dragon: each side's decode time per token (EWMA of
    cloud_decode_s: float | None = None  # its drafts' decode times: the scheduler's profile)
    per_round: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted)
    token_ids: list[int] = field(default_factory=list)  # the answer's ids (tests, benchmarks)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def device_acceptance(self) -> float | None:
        return self.device_accepted / self.device_drafted if self.device_drafted else None

    @property
    def cloud_acceptance(self) -> float | None:
        return self.cloud_accepted / self.cloud_drafted if self.cloud_drafted else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first (decode speed)."""
        if self.ttft_s is None or self.tokens < 2 or self.elapsed_s <= self.ttft_s:
            return None
        return (self.tokens - 1) / (self.elapsed_s - self.ttft_s)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("per_round", "token_ids")}
        out["acceptance"] = self.acceptance
        out["tokens_per_s"] = self.tokens_per_s
        out["device_acceptance"] = self.device_acceptance
        out["cloud_acceptance"] = self.cloud_acceptance
        return out


Event = TextDelta | Citation | Notice | Failure | Provenance | Stats
