"""The one source type: its location, its line, and the rows the conversation store keeps."""

from __future__ import annotations

import pytest

from collab.sources import EXCERPT_CHARS, Source, format_location
from retrieval.store import Hit


@pytest.mark.parametrize(
    ("page", "start", "end", "shown"),
    [
        (3, 4, 9, "p. 3, lines 4–9"),
        (3, None, None, "p. 3"),
        (None, 4, 9, "lines 4–9"),
        (None, 4, 4, "line 4"),
        (None, 4, None, "line 4"),
        (None, None, None, ""),
    ],
)
def test_location_is_written_one_way(page, start, end, shown):
    assert format_location(page, start, end) == shown


def test_line_and_heading():
    src = Source("notes.md", "lines 3–9", 0.8234, "private", 1, "device", "/d/notes.md")
    assert src.line() == "[1] device · notes.md (lines 3–9) · 0.82"
    assert Source("Ada", score=0.5, number=2).line() == "[2] cloud · Ada · 0.50"
    assert Source("", "p. 2").heading == "(p. 2)"


def test_excerpt_is_the_text_start_and_clipping_keeps_it_consistent():
    src = Source("t", text="x" * 5000)
    assert src.excerpt == "x" * EXCERPT_CHARS
    short = src.clipped(100)
    assert short.text == short.excerpt == "x" * 100


def test_rows_round_trip_and_old_rows_load():
    src = Source("notes.md", "p. 2", 0.75, "full passage", 1, "device", "/d/notes.md")
    row = src.to_dict()
    assert list(row) == [
        "number",
        "side",
        "title",
        "location",
        "score",
        "excerpt",
        "path",
        "text",
        "found_by",
    ]
    assert Source.from_dict(row) == src
    old = {
        "number": 1,
        "side": "device",
        "title": "a.md",
        "location": "",
        "score": 0.9,
        "excerpt": "alpha",
    }
    loaded = Source.from_dict(old)
    assert (loaded.text, loaded.excerpt, loaded.path) == ("alpha", "alpha", None)
    kept = {**old, "text": "the whole chunk", "excerpt": "a preview"}
    assert Source.from_dict(kept).excerpt == "a preview"  # a stored excerpt is shown as stored
    assert Source.from_dict({"title": "x"}, number=4).number == 4


def test_a_store_hit_is_a_numbered_source():
    hit = Hit(7, 0.5, "text", "/docs/a.pdf", None, 3, 4, 9, 0, 4, 0)
    assert hit.location == "p. 3, lines 4–9"
    src = hit.source(2, "device")
    assert (src.number, src.side, src.title, src.path) == (2, "device", "a.pdf", "/docs/a.pdf")
    assert src.location == hit.location and src.text == "text"
