"""The figures of an answer that both front ends print the same way (the TUI's status bar and
`tandem ask`'s last line). Headless: `tandem ask` must not import Textual."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def rapid_parts(stats: Mapping[str, Any]) -> list[str]:
    """Marks a split answer verified against RAPID's target: it leans toward the device's
    drafts on purpose, so it follows neither model exactly (DESIGN §5.4)."""
    eta = stats.get("rapid_eta") or 0.0
    return [f"RAPID η {eta:g}: leans to the device"] if eta else []


def pipeline_parts(stats: Mapping[str, Any]) -> list[str]:
    """split with PicoSpec's pipeline: the most batches in flight at once, batches sent short
    because the cloud was idle, batches the cloud began verifying before they were whole,
    batches the cost model sent stop-and-wait, and rejections that threw drafting away."""
    if not stats.get("pipeline"):
        return []
    counts = [("truncations", "short"), ("fast_verified", "verified early"),
              ("waits", "stop-and-wait"), ("rollbacks", "rolled back")]  # fmt: skip
    said = [f"{stats.get(key, 0)} {what}" for key, what in counts
            if stats.get(key) or key in ("truncations", "rollbacks")]  # fmt: skip
    return [f"pipelined ×{stats.get('pipeline_depth', 0)}: " + ", ".join(said)]


def dragon_parts(stats: Mapping[str, Any]) -> list[str]:
    """dragon's own figures from `Stats.as_dict()`: who aggregates now, how often each side's
    draft became the target token, and how many times the aggregator moved. Empty for the
    other modes (they never set an aggregator)."""
    if not stats.get("aggregator"):
        return []
    parts = [f"aggregator {stats['aggregator']}"]
    rates = [
        f"{side} {rate:.2f}"
        for side in ("device", "cloud")
        if (rate := stats.get(f"{side}_acceptance")) is not None
    ]
    if rates:
        parts.append("accept " + " / ".join(rates))
    switches = int(stats.get("switches") or 0)
    parts.append(f"{switches} switch{'es' if switches != 1 else ''}")
    return parts
