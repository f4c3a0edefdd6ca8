"""Untrusted text made safe to show: no control characters reach the terminal, and JSON stays
JSON.

Document text, titles, paths, parse-failure reasons, cloud citations, error messages and model
output did not come from Tandem's own code. A terminal obeys the escape sequences in them (an
ESC or a C1 CSI starts one: colours, cursor moves, OSC 8 links, a new window title), so they
are stripped before printing or drawing. Headless on purpose: `tandem ask` uses it without
importing Textual; the TUI's `app.tui.plain` builds its widgets' content on top of it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""C0 controls but tab and newline, DEL, and C1 controls (U+0080 to U+009F)."""


def strip_controls(text: str) -> str:
    """`text` without C0/C1 control characters (newline and tab kept). A sequence such as
    `ESC [31m` loses its ESC and shows as the harmless `[31m`."""
    return _CONTROLS.sub("", text)


def finite(value: Any) -> Any:
    """`value` with every non-finite float (NaN, ±inf), however deeply nested in dicts, lists
    and tuples, replaced by None: JSON has no NaN, and `json.dumps` would write one anyway."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def safe_json(value: Any) -> str:
    """One line of valid JSON for a terminal: non-finite numbers as null, and every control
    character written as a `\\uXXXX` escape (`json.dumps` leaves C1 controls and DEL raw when
    `ensure_ascii` is off). Text stays readable (non-ASCII is kept) and nothing is lost."""
    text = json.dumps(finite(value), ensure_ascii=False, allow_nan=False)
    # Inside JSON a control character can only sit in a string, where \\uXXXX means the same.
    return _CONTROLS.sub(_escape, text)
