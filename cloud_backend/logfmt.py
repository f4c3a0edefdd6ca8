"""The cloud's structured log lines, shared by the server, its sessions and model loading.

Field values can come from a device (an Error frame's message, a model name): a value is quoted
unless it is plainly one token, so it can never start a line of its own or fake a field, and it
is cut to `MAX_VALUE_CHARS` so a peer cannot fill the log."""

from __future__ import annotations

from typing import Any

MAX_VALUE_CHARS = 200


def _plain(text: str) -> bool:
    return bool(text) and text.isprintable() and not any(c in text for c in " =\"'\\")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    if len(text) > MAX_VALUE_CHARS:
        text = f"{text[:MAX_VALUE_CHARS]}…(+{len(text) - MAX_VALUE_CHARS} chars)"
    return text if _plain(text) else repr(text)


def kv(event: str, /, **fields: Any) -> str:
    """One structured log line: an event name and key=value fields, easy to grep and parse
    (`event` is positional only, so a line may have a field called event too)."""
    return event + "".join(f" {k}={_fmt(v)}" for k, v in fields.items())
