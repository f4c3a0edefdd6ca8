"""split's figures and settings (`edge_runtime.declared`): light, read at start-up."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from collab.temperature import eta_problem
from collab.variants import DEFAULT_VARIANT, variant_names
from edge_runtime.declared import Declaration, Figure, Setting
from edge_runtime.options import DEFAULTS


def rapid_parts(stats: Mapping[str, Any]) -> list[str]:
    """Marks a split answer verified against RAPID's target: it leans toward the device's
    drafts on purpose, so it follows neither model exactly (docs/math.md#rapid)."""
    eta = stats.get("rapid_eta") or 0.0
    return [f"RAPID η {eta:g}: leans to the device"] if eta else []


def pipeline_parts(stats: Mapping[str, Any]) -> list[str]:
    """split with PicoSpec's pipeline: the most batches in flight at once, batches sent short
    because the cloud was idle, batches the cloud began verifying before they were whole,
    batches the cost model sent stop-and-wait, and rejections that threw drafting away."""
    if not stats.get("pipeline"):
        return []
    counts = [
        ("truncations", "short"),
        ("fast_verified", "verified early"),
        ("waits", "stop-and-wait"),
        ("rollbacks", "rolled back"),
    ]
    said = [
        f"{stats.get(key, 0)} {what}"
        for key, what in counts
        if stats.get(key) or key in ("truncations", "rollbacks")
    ]
    return [f"pipelined ×{stats.get('pipeline_depth', 0)}: " + ", ".join(said)]


def split_parts(stats: Mapping[str, Any]) -> list[str]:
    """γ, AS²'s hand-over to the cloud, the pipeline and RAPID, in that order."""
    parts = [f"γ {stats['gamma']}"] if stats.get("gamma") is not None else []
    if stats.get("cloud_only"):
        parts.append(f"AS² cloud {stats.get('cloud_tokens', 0)} tok")
    return parts + pipeline_parts(stats) + rapid_parts(stats)


DECLARED = Declaration(
    figures=(
        Figure("gamma", None, "γ"),  # the draft length of the last round
        Figure("cloud_only", False),  # AS² chose cloud decoding for (part of) this answer
        Figure("cloud_tokens", 0),  # tokens the cloud decoded alone (AS² fallback)
        Figure("draft_bytes_up", 0),  # the draft frames alone: uplink per drafted token
        Figure("rapid_eta", 0.0),  # RAPID's η this answer was verified with (0 = exact)
        Figure("pipeline", False),  # PicoSpec's pipeline drafted on while the cloud verified
        Figure("pipeline_depth", 0),  # pipelined: most batches in flight at once
        Figure("truncations", 0),  # pipelined: batches sent short because the cloud was idle
        Figure("waits", 0),  # pipelined: batches the cost model sent stop-and-wait
        Figure("fast_verified", 0),  # pipelined: batches the cloud began before they were whole
        Figure("rollbacks", 0),  # pipelined: rejections that threw away drafting past them
    ),
    settings=(
        Setting(
            "variant",
            str,
            DEFAULT_VARIANT,
            "Split variant",
            choices=variant_names,
            after="default_mode",
        ),
        Setting(
            "pipeline",
            bool,
            DEFAULTS.pipeline,
            "Split pipeline",
            after="variant",
            caption="draft on while the cloud verifies",
            help="split: the device drafts on while the cloud verifies (PicoSpec); "
            "off = wait for each verdict. The answers are the same either way",
        ),
        Setting(
            "eta",
            float,
            DEFAULTS.eta,
            "RAPID η",
            check=eta_problem,
            after="temperature",
            help="split, when sampling: how far the device's drafts pull the cloud's answer "
            "toward your documents (0 = exactly the cloud model; about 20 lets facts "
            "from your documents through, 2 or less does not)",
        ),
    ),
    parts=split_parts,
)
