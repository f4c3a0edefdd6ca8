"""Chunks that know where they are (issue 29): each carries `document › section › subsection`,
embedded and keyword-indexed with its text, and heading + text never overflow the embedder."""

from __future__ import annotations

from pathlib import Path

import pytest

from personal_index.parsers import parse
from retrieval.chunking import (
    DEFAULT_CHUNK_TOKENS,
    MAX_HEADING_TOKENS,
    Chunker,
    load_embedding_tokenizer,
)
from retrieval.document import HeadingTrail


@pytest.fixture(scope="module")
def tokenizer():
    return load_embedding_tokenizer()


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def test_heading_trail_closes_deeper_and_equal_levels() -> None:
    trail = HeadingTrail()
    assert trail.enter(1, "Guide") == ("Guide",)
    assert trail.enter(2, "Install") == ("Guide", "Install")
    assert trail.enter(3, "Debian") == ("Guide", "Install", "Debian")
    assert trail.enter(2, "Use") == ("Guide", "Use")
    assert trail.enter(3, "CLI") == ("Guide", "Use", "CLI")
    assert trail.enter(1, "Appendix") == ("Appendix",)


def test_markdown_chunks_carry_their_heading_path(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "guide.md"
    path.write_text(
        "# Backup guide\n\nIntro.\n\n## Restoring\n\nSteps.\n\n### From tape\n\nIt takes a day.\n\n"
        "## Pruning\n\nKeep seven.\n",
        encoding="utf-8",
    )
    chunks = Chunker(tokenizer).chunk(parse(path))
    assert [c.heading for c in chunks] == [
        "Backup guide",  # the title is the first heading: not repeated
        "Backup guide › Restoring",
        "Backup guide › Restoring › From tape",
        "Backup guide › Pruning",
    ]
    tape = chunks[2]
    assert tape.text == "### From tape\n\nIt takes a day."  # the cited text is unchanged
    assert tape.embedded_text == "Backup guide › Restoring › From tape\n" + tape.text


def test_a_file_without_a_title_is_named_by_its_file_name(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("the boiler code is 4471", encoding="utf-8")
    (chunk,) = Chunker(tokenizer).chunk(parse(path))
    assert chunk.heading == "notes.txt"


def test_html_and_docx_headings_nest_by_level(tmp_path: Path, tokenizer) -> None:
    import docx

    html = tmp_path / "page.html"
    html.write_text(
        "<html><head><title>Handbook</title></head><body><h1>Handbook</h1><p>a</p>"
        "<h2>Travel</h2><p>b</p><h3>Visas</h3><p>c</p><h2>Expenses</h2><p>d</p></body></html>",
        encoding="utf-8",
    )
    assert [c.heading for c in Chunker(tokenizer).chunk(parse(html))] == [
        "Handbook",
        "Handbook › Travel",
        "Handbook › Travel › Visas",
        "Handbook › Expenses",
    ]
    d = docx.Document()
    d.add_heading("Plan", level=0)  # the "Title" style
    d.add_heading("Budget", level=1)
    d.add_paragraph("numbers")
    d.add_heading("Q1", level=2)
    d.add_paragraph("first quarter")
    d.add_heading("Risks", level=1)
    d.add_paragraph("few")
    d.save(str(tmp_path / "plan.docx"))
    headings = [c.heading for c in Chunker(tokenizer).chunk(parse(tmp_path / "plan.docx"))]
    assert headings == ["Plan", "Plan › Budget", "Plan › Budget › Q1", "Plan › Risks"]


@pytest.mark.parametrize("chunk_tokens", [64, DEFAULT_CHUNK_TOKENS])
def test_heading_and_text_together_fit_the_window(
    tmp_path: Path, tokenizer, chunk_tokens: int
) -> None:
    """No chunk is silently cut by the embedder: heading path + text ≤ chunk_tokens, even
    with a heading path longer than the heading budget (cut at a word)."""
    deep = " ".join(f"Section{i} about unbelievably tokenised naïveté" for i in range(40))
    body = " ".join("the cat sat on the mat and ran far away" for _ in range(300))
    path = tmp_path / "deep.md"
    path.write_text(f"# Manual\n\n## {deep}\n\n{body}\n", encoding="utf-8")
    chunks = Chunker(tokenizer, chunk_tokens, 8).chunk(parse(path))
    assert len(chunks) > 3
    for c in chunks:
        assert _tokens(tokenizer, c.embedded_text) <= chunk_tokens, c.heading
    cut = chunks[-1].heading
    assert cut.startswith("Manual › Section0") and len(cut) < len("Manual › " + deep)
    assert _tokens(tokenizer, cut) <= min(MAX_HEADING_TOKENS, chunk_tokens)
    assert deep.startswith(cut.removeprefix("Manual › "))  # cut between words, not inside


def test_headings_off_keeps_the_whole_window_for_text(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "a.md"
    title = "# Annual maintenance schedule of the east building's heating\n\n"
    path.write_text(title + "word " * 600, encoding="utf-8")
    with_h = Chunker(tokenizer, 64, 8).chunk(parse(path))
    without = Chunker(tokenizer, 64, 8, headings=False).chunk(parse(path))
    assert all(c.heading == "" and c.embedded_text == c.text for c in without)
    assert len(without) < len(with_h)  # the heading's tokens come out of each window
