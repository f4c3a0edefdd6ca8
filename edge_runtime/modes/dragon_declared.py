"""dragon's figures and settings (`edge_runtime.declared`): light, read at start-up."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edge_runtime.declared import Declaration, Figure, Setting

AGGREGATORS = ("auto", "device", "cloud")
"""Where each token is aggregated; auto = the scheduler picks before every token (the names of
edge_runtime.modes.dragon.POLICIES, kept here so start-up loads no numpy)."""


def _rate(side: str) -> Any:
    def rate(stats: Mapping[str, Any]) -> float | None:
        drafted = stats.get(f"{side}_drafted") or 0
        return (stats.get(f"{side}_accepted") or 0) / drafted if drafted else None

    return rate


def dragon_parts(stats: Mapping[str, Any]) -> list[str]:
    """Who aggregates now, how often each side's draft became the target token, and how many
    times the aggregator moved. Empty for the other modes (they never set an aggregator)."""
    if not stats.get("aggregator"):
        return []
    parts = [f"aggregator {stats['aggregator']}"]
    rates = [
        f"{side} {rate:.2f}"
        for side in ("device", "cloud")
        if (rate := stats.get(f"{side}_acceptance", _rate(side)(stats))) is not None
    ]
    if rates:
        parts.append("accept " + " / ".join(rates))
    switches = int(stats.get("switches") or 0)
    parts.append(f"{switches} switch{'es' if switches != 1 else ''}")
    return parts


DECLARED = Declaration(
    figures=(
        Figure("aggregator", None),  # the side aggregating now (device or cloud)
        Figure("switches", 0),  # times the aggregator moved
        Figure("device_drafted", 0),  # each side's drafts judged by a target, and the accepted
        Figure("device_accepted", 0),
        Figure("cloud_drafted", 0),
        Figure("cloud_accepted", 0),
        Figure("device_decode_s", None),  # each side's decode time per token (EWMA of its
        Figure("cloud_decode_s", None),  # drafts' decode times: the scheduler's profile)
        Figure("device_acceptance", None, compute=_rate("device")),
        Figure("cloud_acceptance", None, compute=_rate("cloud")),
    ),
    settings=(
        Setting(
            "aggregator",
            str,
            "auto",
            "Aggregator",
            choices=lambda: AGGREGATORS,
            after="pipeline",
            help="dragon: the side that aggregates each token "
            "(auto: the scheduler picks before every token)",
        ),
    ),
    parts=dragon_parts,
)
