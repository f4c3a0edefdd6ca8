"""Parsing and chunking on real files of every format, generated here with the same libraries a
user's tools would use (fpdf2, pypdf, python-docx), so locations are checked end to end."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from personal_index.parsers import (
    SUPPORTED_SUFFIXES,
    ParsedDocument,
    ParseError,
    is_supported,
    parse,
)
from retrieval.chunking import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_OVERLAP_TOKENS,
    Chunk,
    Chunker,
    load_embedding_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_embedding_tokenizer()


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def _check_chunks(doc: ParsedDocument, chunks: list[Chunk], tokenizer, chunk_tokens: int) -> None:
    """Invariants every chunking must keep: exact slices, in-budget, ordinals, in-section."""
    text = doc.text
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    for c in chunks:
        assert text[c.char_start : c.char_end] == c.text
        assert len(_ids(tokenizer, c.text)) <= chunk_tokens
        inside = [
            s
            for s in doc.sections
            if s.char_start <= c.char_start and c.char_end <= s.char_start + len(s.text)
        ]
        assert len(inside) == 1, "a chunk must lie within exactly one section"
        assert (c.page, c.title) == (inside[0].page, inside[0].title)


def _write_pdf(path: Path, pages: list[str]) -> None:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("Helvetica", size=12)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 8, text)
    pdf.output(str(path))


# --- formats ------------------------------------------------------------------------------


def test_pdf_two_pages(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "report.pdf"
    _write_pdf(path, ["Alpha page one talks about apples.", "Beta page two talks about bananas."])
    doc = parse(path)
    assert doc.kind == "pdf"
    assert [s.page for s in doc.sections] == [1, 2]
    assert "Alpha page one talks about apples." in doc.sections[0].text
    assert "Beta" not in doc.sections[0].text
    assert "Beta page two talks about bananas." in doc.sections[1].text
    assert all(s.line_start is None for s in doc.sections)
    chunks = Chunker(tokenizer).chunk(doc)
    assert [c.page for c in chunks] == [1, 2]
    _check_chunks(doc, chunks, tokenizer, DEFAULT_CHUNK_TOKENS)


def test_docx_heading_and_paragraphs(tmp_path: Path) -> None:
    import docx

    d = docx.Document()
    d.add_paragraph("Preamble before any heading.")
    d.add_heading("Garden Notes", level=1)
    d.add_paragraph("Tomatoes need sun.")
    d.add_paragraph("Basil likes warmth.")
    d.add_heading("Tools", level=2)
    d.add_paragraph("A spade and a rake.")
    table = d.add_table(rows=1, cols=2)
    table.rows[0].cells[0].text = "hose"
    table.rows[0].cells[1].text = "20 m"
    path = tmp_path / "notes.docx"
    d.save(str(path))

    doc = parse(path)
    assert doc.kind == "docx"
    assert doc.title == "Garden Notes"
    assert [s.title for s in doc.sections] == [None, "Garden Notes", "Tools"]
    assert doc.sections[0].text == "Preamble before any heading."
    assert doc.sections[1].text == "Garden Notes\nTomatoes need sun.\nBasil likes warmth."
    assert doc.sections[2].text == "Tools\nA spade and a rake.\nhose | 20 m"
    for s in doc.sections:
        assert doc.text[s.char_start : s.char_start + len(s.text)] == s.text


def test_html_title_headings_and_dropped_script(tmp_path: Path) -> None:
    path = tmp_path / "page.html"
    path.write_text(
        "<!DOCTYPE html><html><head><title>My  Recipes</title>"
        "<style>body { color: red }</style></head><body>"
        "<nav><a href='/'>Home</a> <a href='/x'>Menu link</a></nav>"
        "<!-- a comment -->"
        "<h1>Pancakes</h1><p>Mix flour and   milk.</p><p>Fry <b>gently</b>.</p>"
        "<script>var secret = 'do not index';</script>"
        "<div><h2>Toppings</h2><ul><li>Maple syrup</li><li>Lemon</li></ul></div>"
        "</body></html>",
        encoding="utf-8",
    )
    doc = parse(path)
    assert doc.kind == "html"
    assert doc.title == "My Recipes"
    assert [s.title for s in doc.sections] == ["Pancakes", "Toppings"]
    assert doc.sections[0].text == "Pancakes\nMix flour and milk.\nFry gently."
    assert doc.sections[1].text == "Toppings\nMaple syrup\nLemon"
    for bad in ("secret", "color", "Menu link", "comment"):
        assert bad not in doc.text


def test_html_title_falls_back_to_h1(tmp_path: Path) -> None:
    path = tmp_path / "page.htm"
    path.write_text("<html><body><h1>Only  Heading</h1><p>Body.</p></body></html>")
    doc = parse(path)
    assert doc.title == "Only Heading"
    assert doc.sections[0].text == "Only Heading\nBody."


def test_markdown_sections_and_lines(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "guide.md"
    path.write_text(
        "# Install\n"  # 1
        "\n"  # 2
        "Run the installer.\n"  # 3
        "```sh\n"  # 4
        "# not a heading\n"  # 5
        "```\n"  # 6
        "\n"  # 7
        "## Usage\n"  # 8
        "Type a question.\n"  # 9
        "Press enter.\n",  # 10
        encoding="utf-8",
    )
    doc = parse(path)
    assert doc.kind == "md"
    assert doc.title == "Install"
    assert [s.title for s in doc.sections] == ["Install", "Usage"]
    assert [s.line_start for s in doc.sections] == [1, 8]
    assert doc.sections[0].text == "# Install\n\nRun the installer.\n```sh\n# not a heading\n```"
    assert doc.sections[1].text == "## Usage\nType a question.\nPress enter."
    source = path.read_text(encoding="utf-8")
    assert doc.text == source.rstrip("\n")  # offsets are the file's own
    chunks = Chunker(tokenizer).chunk(doc)
    assert [(c.title, c.line_start, c.line_end) for c in chunks] == [
        ("Install", 1, 6),
        ("Usage", 8, 10),
    ]
    _check_chunks(doc, chunks, tokenizer, DEFAULT_CHUNK_TOKENS)


def test_markdown_setext_and_preamble(tmp_path: Path) -> None:
    path = tmp_path / "notes.markdown"
    path.write_text("Intro line.\n\nTitle\n=====\nBody here.\n", encoding="utf-8")
    doc = parse(path)
    assert [(s.title, s.line_start, s.text) for s in doc.sections] == [
        (None, 1, "Intro line."),
        ("Title", 3, "Title\n=====\nBody here."),
    ]


def test_txt_chunk_line_ranges(tmp_path: Path, tokenizer) -> None:
    # Line k holds five single-token words, and a chunk of 10 tokens with overlap 5 then covers
    # exactly two lines: lines (1, 2), (2, 3), ... — the line ranges are known in advance.
    words = ["apple", "river", "stone", "cloud", "green"]
    for w in words:
        assert len(_ids(tokenizer, w)) == 1
    lines = [" ".join(words) for _ in range(6)]
    path = tmp_path / "plain.txt"
    path.write_text("\n\n" + "\n".join(lines) + "\n", encoding="utf-8")  # two leading blank lines
    doc = parse(path)
    assert doc.kind == "txt" and doc.title is None
    assert len(doc.sections) == 1 and doc.sections[0].line_start == 3
    chunks = Chunker(tokenizer, chunk_tokens=10, overlap_tokens=5).chunk(doc)
    assert [(c.line_start, c.line_end) for c in chunks] == [(k, k + 1) for k in range(3, 8)]
    assert chunks[0].text == lines[0] + "\n" + lines[1]
    _check_chunks(doc, chunks, tokenizer, 10)


def test_txt_encodings(tmp_path: Path) -> None:
    path = tmp_path / "legacy.txt"
    path.write_bytes("café\r\nnaïve\r\n".encode("latin-1"))  # not UTF-8: replaced, not failed
    doc = parse(path)
    assert doc.sections[0].text == "caf\ufffd\nna\ufffdve"
    path.write_bytes("hello wörld".encode("utf-16"))  # with a BOM
    assert parse(path).sections[0].text == "hello wörld"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(ParseError, match="not a text file"):
        parse(path)


# --- chunking ------------------------------------------------------------------------------


def _long_text(n_words: int, seed: int = 0, single_token: bool = True) -> str:
    rng = random.Random(seed)
    vocab = ["the", "cat", "sat", "on", "mat", "and", "ran", "far", "away", "from", "dog"]
    if not single_token:
        vocab += ["unbelievably", "tokenisation", "photosynthesis", "Zyzzyva", "naïveté"]
    out = []
    for i in range(n_words):
        out.append(rng.choice(vocab))
        out.append("\n" if i % 13 == 12 else (". " if i % 7 == 6 else " "))
    return "".join(out)


def _token_spans(tokenizer, text: str) -> list[tuple[int, int]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return [tuple(o) for o in enc["offset_mapping"]]


@pytest.mark.parametrize(("chunk_tokens", "overlap"), [(64, 8), (DEFAULT_CHUNK_TOKENS, 32)])
def test_long_text_windows(tmp_path: Path, tokenizer, chunk_tokens: int, overlap: int) -> None:
    path = tmp_path / "long.txt"
    path.write_text(_long_text(3000), encoding="utf-8")
    doc = parse(path)
    text = doc.text
    chunks = Chunker(tokenizer, chunk_tokens, overlap, headings=False).chunk(doc)
    assert len(chunks) > 3
    _check_chunks(doc, chunks, tokenizer, chunk_tokens)
    spans = _token_spans(tokenizer, text)
    windows = []
    for c in chunks:
        # Every chunk starts and ends on token edges: it is a window of whole tokens.
        first = next(i for i, s in enumerate(spans) if s[0] == c.char_start)
        last = next(i for i, s in enumerate(spans) if s[1] == c.char_end)
        windows.append((first, last + 1))
        assert last + 1 - first <= chunk_tokens
    assert windows[0][0] == 0 and windows[-1][1] == len(spans)  # union covers all tokens
    for (a0, a1), (b0, _b1) in itertools.pairwise(windows):
        assert a1 - b0 == overlap, "consecutive windows share exactly overlap_tokens tokens"
        assert a1 - a0 == chunk_tokens, "only the last window is short"
    assert windows[-1][1] - windows[-1][0] <= chunk_tokens
    # Covering tokens covers the text: only whitespace lies outside every chunk.
    covered = [False] * len(text)
    for c in chunks:
        covered[c.char_start : c.char_end] = [True] * (c.char_end - c.char_start)
    assert all(ch.isspace() for ch, cov in zip(text, covered, strict=True) if not cov)


def test_windows_snap_to_words(tmp_path: Path, tokenizer) -> None:
    # Multi-piece words: a window never starts or ends inside a word, so re-tokenising a chunk
    # (what the embedder does) gives the same tokens and never more than chunk_tokens.
    path = tmp_path / "words.txt"
    path.write_text(_long_text(2000, seed=1, single_token=False), encoding="utf-8")
    doc = parse(path)
    chunk_tokens, overlap = 50, 6
    chunks = Chunker(tokenizer, chunk_tokens, overlap, headings=False).chunk(doc)
    _check_chunks(doc, chunks, tokenizer, chunk_tokens)
    spans = _token_spans(tokenizer, doc.text)
    starts = {s[0]: i for i, s in enumerate(spans)}
    ends = {s[1]: i for i, s in enumerate(spans)}
    max_word = max(len(_ids(tokenizer, w)) for w in doc.text.split())
    for a, b in itertools.pairwise(chunks):
        shared = ends[a.char_end] + 1 - starts[b.char_start]
        assert overlap <= shared < overlap + max_word
    for c in chunks:
        ids = _ids(tokenizer, c.text)
        assert ids == _ids(tokenizer, doc.text)[starts[c.char_start] : ends[c.char_end] + 1]
    assert chunks[-1].char_end == len(doc.text)


def test_one_huge_word_is_cut(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "blob.txt"
    word = "qzxv" * 24  # one "word" of 96 word pieces, longer than a window
    assert len(_ids(tokenizer, word)) == 96
    path.write_text(f"short start {word} end", encoding="utf-8")
    doc = parse(path)
    chunks = Chunker(tokenizer, 32, 4).chunk(doc)
    assert len(chunks) >= 4
    assert chunks[0].char_start == 0 and chunks[-1].char_end == len(doc.text)
    for c in chunks:
        assert doc.text[c.char_start : c.char_end] == c.text
        assert c.char_end > c.char_start


def test_chunker_validates(tokenizer) -> None:
    for chunk_tokens, overlap in [(0, 1), (10, 0), (10, 10), (10, 11), (-5, 1)]:
        with pytest.raises(ValueError):
            Chunker(tokenizer, chunk_tokens, overlap)
    c = Chunker(tokenizer)
    assert (c.chunk_tokens, c.overlap_tokens) == (254, DEFAULT_OVERLAP_TOKENS)


# --- failures ------------------------------------------------------------------------------


def test_corrupt_pdf(tmp_path: Path) -> None:
    path = tmp_path / "broken.pdf"
    path.write_bytes(random.Random(7).randbytes(4096))
    with pytest.raises(ParseError) as info:
        parse(path)
    assert info.value.reason.startswith("not a valid PDF")
    assert str(info.value) == info.value.reason
    assert isinstance(info.value, ValueError)


def test_truncated_pdf(tmp_path: Path) -> None:
    good = tmp_path / "good.pdf"
    _write_pdf(good, ["Some text."])
    path = tmp_path / "cut.pdf"
    path.write_bytes(good.read_bytes()[:300])
    with pytest.raises(ParseError, match="not a valid PDF"):
        parse(path)


def test_password_protected_pdf(tmp_path: Path) -> None:
    from pypdf import PdfReader, PdfWriter

    plain = tmp_path / "plain.pdf"
    _write_pdf(plain, ["Secret plans."])
    writer = PdfWriter(clone_from=PdfReader(plain))
    # RC4: pypdf can write and read it without the optional `cryptography` package.
    writer.encrypt(user_password="hunter2", owner_password="owner", algorithm="RC4-128")
    locked = tmp_path / "locked.pdf"
    with locked.open("wb") as f:
        writer.write(f)
    with pytest.raises(ParseError, match="password"):
        parse(locked)

    # Only an owner password (empty user password): viewers open it, and so do we.
    writer = PdfWriter(clone_from=PdfReader(plain))
    writer.encrypt(user_password="", owner_password="owner", algorithm="RC4-128")
    open_pdf = tmp_path / "owner_only.pdf"
    with open_pdf.open("wb") as f:
        writer.write(f)
    assert "Secret plans." in parse(open_pdf).sections[0].text


def test_corrupt_docx(tmp_path: Path) -> None:
    path = tmp_path / "bad.docx"
    path.write_bytes(b"this is not a zip file")
    with pytest.raises(ParseError, match=r"not a valid \.docx"):
        parse(path)


def test_unsupported_suffix(tmp_path: Path) -> None:
    path = tmp_path / "data.xyz"
    path.write_text("hello")
    assert not is_supported(path)
    with pytest.raises(ParseError, match=r"unsupported file type \.xyz"):
        parse(path)
    assert is_supported(tmp_path / "A.PDF") and ".docx" in SUPPORTED_SUFFIXES


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ParseError, match="cannot read file"):
        parse(tmp_path / "gone.txt")


@pytest.mark.parametrize("name", ["empty.txt", "empty.md", "empty.html", "blank.txt"])
def test_empty_file_has_no_sections(tmp_path: Path, tokenizer, name: str) -> None:
    path = tmp_path / name
    path.write_text("  \n\n" if name.startswith("blank") else "")
    doc = parse(path)
    assert doc.sections == ()
    assert doc.text == ""
    assert Chunker(tokenizer).chunk(doc) == []


def test_empty_pdf_page_and_docx(tmp_path: Path) -> None:
    import docx
    from fpdf import FPDF

    pdf = FPDF()
    pdf.add_page()
    pdf.output(str(tmp_path / "blank.pdf"))
    assert parse(tmp_path / "blank.pdf").sections == ()
    docx.Document().save(str(tmp_path / "blank.docx"))
    assert parse(tmp_path / "blank.docx").sections == ()
