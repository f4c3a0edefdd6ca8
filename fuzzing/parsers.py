"""The five document parsers on arbitrary bytes. Whatever a file holds, `parse_bytes` returns
located sections or raises ParseError (the one documented exception), never hangs (libFuzzer's
-timeout; the suite's Hypothesis run keeps a deadline per example) and never crashes the
process; the sections it returns point back at the extracted text exactly.

An input is one byte (the format: txt, md, pdf, docx, html) then the file's bytes. No atheris
import here: the suite runs `test_one` under Hypothesis (tests/test_ingest_hostile.py) and
`python -m fuzzing parsers` under libFuzzer, instrumenting the parsers and their libraries."""

from __future__ import annotations

import io
from pathlib import Path

from personal_index.parsers import ParseError, ParseLimits, parse_bytes
from retrieval.document import ParsedDocument

KINDS = ("txt", "md", "pdf", "docx", "html")
# Small caps keep each input fast; the caps' own checks are exercised all the same.
LIMITS = ParseLimits(max_pages=50, max_unpacked_bytes=8_000_000, max_members=200)
MAX_REASON = 4000


def split(data: bytes) -> tuple[str, bytes]:
    """(format, file bytes) of a fuzz input."""
    return (KINDS[data[0] % len(KINDS)], data[1:]) if data else ("txt", b"")


def check(doc: ParsedDocument, kind: str) -> None:
    """What every parse result promises: offsets that locate each section in `doc.text`, in
    order; non-blank stripped text; lines for txt/md, pages (1-based) for pdf."""
    assert doc.kind == kind, (doc.kind, kind)
    text, end = doc.text, 0
    for s in doc.sections:
        assert s.text and s.text == s.text.strip(), s
        assert s.char_start >= end, (s.char_start, end)
        assert text[s.char_start : s.char_start + len(s.text)] == s.text
        end = s.char_start + len(s.text)
        if kind in ("txt", "md"):
            assert s.line_start is not None and s.line_start >= 1, s
        else:
            assert s.line_start is None, s
        assert (s.page is not None and s.page >= 1) if kind == "pdf" else s.page is None, s
    assert doc.title is None or isinstance(doc.title, str)


def test_one(data: bytes) -> None:
    kind, body = split(data)
    try:
        doc = parse_bytes(Path(f"fuzz.{kind}"), body, LIMITS)
    except ParseError as exc:
        assert isinstance(exc.reason, str) and exc.reason, exc
        return
    check(doc, kind)


def seeds() -> list[bytes]:
    """A small valid file of every format (libFuzzer and Hypothesis mutate from these)."""
    import docx
    from pypdf import PdfWriter
    from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject

    out = [
        bytes([0]) + b"Plain text.\nSecond line\r\nthird\n",
        bytes([1]) + b"---\na: 1\n---\n# Title #\n\nBody\n\nSub\n---\n```\n# not\n```\n",
        bytes([4]) + b"<html><head><title>T</title></head><body><h1>H</h1><p>x<br>y</p>"
        b"<table><tr><td>a</td></tr></table><script>z</script></body></html>",
    ]
    writer = PdfWriter()
    page = writer.add_blank_page(200, 200)
    font = DictionaryObject(
        {
            NameObject("/Type"): NameObject("/Font"),
            NameObject("/Subtype"): NameObject("/Type1"),
            NameObject("/BaseFont"): NameObject("/Helvetica"),
        }
    )
    page[NameObject("/Resources")] = DictionaryObject(
        {NameObject("/Font"): DictionaryObject({NameObject("/F1"): writer._add_object(font)})}
    )
    content = DecodedStreamObject()
    content.set_data(b"BT /F1 12 Tf 20 100 Td (Hello PDF) Tj ET")
    page[NameObject("/Contents")] = writer._add_object(content)
    writer.add_metadata({"/Title": "A title"})
    pdf = io.BytesIO()
    writer.write(pdf)
    out.append(bytes([2]) + pdf.getvalue())
    document = docx.Document()
    document.add_heading("Heading", level=1)
    document.add_paragraph("A paragraph.")
    document.add_table(rows=1, cols=2).rows[0].cells[0].text = "cell"
    packed = io.BytesIO()
    document.save(packed)
    out.append(bytes([3]) + packed.getvalue())
    return out
