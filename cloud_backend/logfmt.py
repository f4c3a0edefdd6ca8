"""The cloud's structured log lines, shared by the server, its sessions and model loading."""

from __future__ import annotations

from typing import Any


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return repr(text) if (" " in text or not text) else text


def kv(event: str, **fields: Any) -> str:
    """One structured log line: an event name and key=value fields, easy to grep and parse."""
    return event + "".join(f" {k}={_fmt(v)}" for k, v in fields.items())
