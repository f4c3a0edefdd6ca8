"""The cloud's log lines carry text a device chose (an Error frame's message): it must stay one
field of one line, and short."""

from __future__ import annotations

import shlex

from cloud_backend.logfmt import MAX_VALUE_CHARS, kv


def test_a_value_from_a_peer_cannot_start_a_line_or_fake_a_field():
    for message in ("oops\nsession_refused why=token x=1", "oops\nsession_refused"):
        line = kv("device_error", session=3, message=message)
        assert "\n" not in line
        words = shlex.split(line)
        assert words[:2] == ["device_error", "session=3"] and len(words) == 3
    assert kv("e", a="x=1") == "e a='x=1'" and kv("e", a="") == "e a=''"
    assert kv("e", a="tab\there") == r"e a='tab\there'"


def test_plain_values_stay_plain_and_long_ones_are_cut():
    assert kv("ready", port=8765, model="qwen2.5-1.5b", share=0.25) == (
        "ready port=8765 model=qwen2.5-1.5b share=0.25"
    )
    line = kv("device_error", message="A" * 300_000)
    assert len(line) < MAX_VALUE_CHARS + 60 and "(+299800 chars)" in line
