"""The figures of an answer that both front ends print the same way (the TUI's status bar and
`tandem ask`'s last line): each mode's own, as it declares them (`edge_runtime.declared`).
Headless: `tandem ask` must not import Textual."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edge_runtime.declared import figure_parts


def mode_parts(stats: Mapping[str, Any]) -> list[str]:
    """The answering mode's own figures (`Stats.as_dict()`), as its declaration shows them;
    the other modes' figures keep their defaults and show nothing."""
    return figure_parts(stats)
