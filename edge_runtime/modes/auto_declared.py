"""auto's figures and settings (`edge_runtime.declared`): light, read at start-up.

The settings are the user's policy for auto (edge_runtime.mode_choice.Policy); the figures say
which mode answered and why, in `tandem ask --json`, the status bar and the history."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edge_runtime.declared import Declaration, Figure, Setting


def auto_parts(stats: Mapping[str, Any]) -> list[str]:
    """`chose local`: empty for the other modes (they never set it)."""
    chosen = stats.get("auto_mode")
    return [f"chose {chosen}"] if chosen else []


DECLARED = Declaration(
    figures=(
        Figure("auto_mode", None),  # the mode auto picked for this answer
        Figure("auto_reason", None),  # why, in words
    ),
    settings=(
        Setting(
            "auto_cloud_questions",
            bool,
            True,
            "Auto: questions may go to the cloud",
            after="default_mode",
            caption="let auto send a question to the cloud",
            help="auto: off keeps every question on this device (auto answers in local mode "
            "and opens no connection); on lets auto ask the cloud how well its public "
            "sources match the question, and answer there when they do",
        ),
        Setting(
            "auto_private_in_cloud",
            bool,
            True,
            "Auto: private passages may shape cloud answers",
            after="auto_cloud_questions",
            caption="let auto mix your documents into cloud-backed answers",
            help="auto: on lets auto answer in dragon (your passages stay here, only token "
            "ids and probabilities cross) or split; off answers questions your documents "
            "match in local mode",
        ),
    ),
    parts=auto_parts,
)
