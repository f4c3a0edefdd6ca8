"""What an answer streams to its caller (CLI, TUI), whatever the mode."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from collab.sources import Source
from edge_runtime import declared


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
    `tokens`: how many of the answer's tokens were committed when this was said. `cloud`: the
    identity of the cloud that sees the text (edge_runtime.cloud_identity: its URL without
    credentials and its name, never the token), so later turns go back to that cloud only."""

    shared: bool
    tokens: int = 0
    cloud: str | None = None


@dataclass(frozen=True)
class ModeChoice:
    """The mode `auto` picked for this answer and why, in words, before the answer starts
    (the status line and `tandem ask --json` show it)."""

    mode: str
    reason: str


@dataclass(frozen=True)
class Failure:
    """A plain-language error; `recoverable` if the answer went on (e.g. finished locally)."""

    message: str
    recoverable: bool = False


@dataclass
class Stats:
    """Live and final figures of one answer. Byte counts are what crossed the network.

    The fields are what every answer measures; each mode's own figures (split's γ and
    pipeline counts, dragon's aggregator, …) are declared by the mode (`edge_runtime.declared`)
    and kept in `figures`, read and written as attributes all the same (`stats.switches += 1`):
    a name no mode declares is an AttributeError, so a typo cannot pass for a figure."""

    mode: str
    variant: str = ""
    tokens: int = 0
    ttft_s: float | None = None
    elapsed_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    finish: str | None = None
    per_round: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted)
    token_ids: list[int] = field(default_factory=list)  # the answer's ids (tests, benchmarks)
    figures: dict[str, Any] = field(default_factory=dict)  # the modes' declared figures set
    # What left the device for this answer, by kind (edge_runtime.sent, written where frames
    # are sent): [] for nothing, None when not recorded (a row stored before the ledger).
    sent: list[dict[str, Any]] | None = None

    def __getattr__(self, name: str) -> Any:
        """A mode's declared figure: its value, its default until set, or computed."""
        if name.startswith("__") or name == "figures":
            raise AttributeError(name)
        figure = declared.figures().get(name)
        if figure is None:
            raise AttributeError(f"Stats has no figure {name!r} (no registered mode declares it)")
        if figure.compute is not None:
            return figure.compute(self._stored())
        return self.figures.get(name, figure.default)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FIELDS:
            object.__setattr__(self, name, value)
            return
        figure = declared.figures().get(name)
        if figure is None or figure.compute is not None:
            raise AttributeError(f"Stats has no settable figure {name!r}")
        self.figures[name] = value

    def __copy__(self) -> Stats:
        """A snapshot: its figures no longer change with the answer's."""
        return replace(
            self,
            per_round=list(self.per_round),
            token_ids=list(self.token_ids),
            figures=dict(self.figures),
            sent=copy.deepcopy(self.sent),
        )

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first (decode speed)."""
        if self.ttft_s is None or self.tokens < 2 or self.elapsed_s <= self.ttft_s:
            return None
        return (self.tokens - 1) / (self.elapsed_s - self.ttft_s)

    def _stored(self) -> dict[str, Any]:
        """Every stored figure: the fields, then each declared figure (its default if unset),
        then any figure kept that no registered mode declares (a stored row's)."""
        out = {k: getattr(self, k) for k in _FIELDS if k not in _NOT_FIGURES}
        table = declared.figures()
        for name, figure in table.items():
            if figure.compute is None:
                out[name] = self.figures.get(name, figure.default)
        out.update((k, v) for k, v in self.figures.items() if k not in table)
        return out

    def as_dict(self) -> dict[str, Any]:
        """The figures as `tandem ask --json` prints them and the conversation history stores
        them: the stored ones, the rates, and each mode's computed figures."""
        out = self._stored()
        out["acceptance"] = self.acceptance
        out["tokens_per_s"] = self.tokens_per_s
        for name, figure in declared.figures().items():
            if figure.compute is not None:
                out[name] = figure.compute(out)
        return out

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> Stats:
        """Figures as `as_dict` wrote them (a stored row, `--json`): the fields to fields, the
        rest (declared or not) to `figures`; what is computed is computed again."""
        computed = {n for n, f in declared.figures().items() if f.compute is not None}
        computed |= {"acceptance", "tokens_per_s"}
        fields_ = {k: v for k, v in row.items() if k in _FIELDS and k not in _NOT_FIGURES}
        rest = {k: v for k, v in row.items() if k not in _FIELDS and k not in computed}
        return cls(**{"mode": "", **fields_}, figures=rest)


_FIELDS = tuple(f.name for f in fields(Stats))
_NOT_FIGURES = frozenset({"per_round", "token_ids", "figures"})


Event = TextDelta | Citation | Notice | ModeChoice | Failure | Provenance | Stats
