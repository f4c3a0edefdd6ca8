"""OCR of scanned pages and images (issue 47): generated scans with known text, read through
the parse worker (its child, deadline and 4 GiB memory cap) and through `tandem ingest`."""

from __future__ import annotations

import io
import os
import sqlite3
from pathlib import Path

import pytest
from fpdf import FPDF
from PIL import Image

from benchmarks.ocr_scans import LETTERS, cer, normalise, scan_page, scanned_pdf
from personal_index import ocr
from personal_index.parse_worker import ParseWorker
from personal_index.parsers import ParseError, parse_bytes

pytestmark = pytest.mark.timeout(300)

TYPED = "Quarterly garden plan: tomatoes in the south bed, beans along the fence."


def test_cer_is_the_edit_distance_over_the_truth() -> None:
    assert cer("sitting", "kitten") == pytest.approx(3 / 6)
    assert cer("kitten", "sitting") == pytest.approx(3 / 7)
    assert cer("Your  invoice\n4471", "Your invoice 4471") == 0.0  # line breaks are not errors
    assert cer("Yourinvoice 4471", "Your invoice 4471") == pytest.approx(1 / 17)
    assert cer("", "abc") == 1.0


@pytest.mark.parametrize("dpi", [150, 300])
def test_a_generated_scan_reads_back_almost_exactly(dpi: int) -> None:
    text = LETTERS[0]
    read = ocr.read_image(scan_page(text, dpi, seed=1))
    assert cer(read, text) < 0.03, read
    words = normalise(read)
    assert "invoice 4471 for the roof" in words and "1,830 EUR" in words  # spaces kept
    # Negative control: another letter's scan is far from this text, a blank page reads nothing.
    assert cer(ocr.read_image(scan_page(LETTERS[1], dpi, seed=1)), text) > 0.5
    assert ocr.read_image(Image.new("L", (1240, 1754), 255)) == ""


def mixed_pdf() -> bytes:
    """Page 1 typed (a text layer), page 2 a scan (an image only), page 3 blank."""
    pdf = FPDF(format="A4")
    pdf.set_font("Helvetica", size=12)
    pdf.add_page()
    pdf.multi_cell(0, 8, TYPED)
    pdf.add_page()
    pdf.image(scan_page(LETTERS[0], 150, seed=2), x=0, y=0, w=210, h=297)
    pdf.add_page()
    return bytes(pdf.output())


@pytest.fixture(scope="module")
def worker():
    with ParseWorker() as w:
        yield w


def test_each_page_is_read_from_its_layer_or_by_ocr(worker: ParseWorker) -> None:
    doc = worker.parse(Path("mixed.pdf"), mixed_pdf())
    assert doc.ocr_pages == (2,) and doc.unread_pages == (3,)
    assert doc.unread_why == "the page holds no image to read"
    pages = {s.page: s.text for s in doc.sections}
    assert set(pages) == {1, 2}  # citations name the page
    assert "tomatoes in the south bed" in pages[1]
    assert cer(pages[2], LETTERS[0]) < 0.03, pages[2]


def test_an_image_file_is_one_page_read_by_ocr(worker: ParseWorker) -> None:
    png = io.BytesIO()
    scan_page(LETTERS[2], 200, seed=3).save(png, "PNG")
    doc = worker.parse(Path("lease.png"), png.getvalue())
    assert doc.kind == "image" and doc.ocr_pages == (1,) and doc.unread_pages == ()
    assert "1,275 euros" in normalise(doc.text)
    blank = io.BytesIO()
    Image.new("RGB", (900, 1200), "white").save(blank, "JPEG")
    empty = worker.parse(Path("wall.jpg"), blank.getvalue())
    assert empty.sections == () and empty.unread_pages == (1,)
    assert empty.unread_why == "OCR found no text in it"


def test_an_image_over_the_pixel_cap_is_refused_unread() -> None:
    png = io.BytesIO()
    Image.new("L", (8000, 8000), 255).save(png, "PNG")  # 64 megapixels, 80 kB
    with pytest.raises(ParseError, match=r"image too large to read \(64 megapixels > 50 cap\)"):
        parse_bytes(Path("huge.png"), png.getvalue())


def test_each_scanned_page_gets_its_own_allowance_past_the_file_deadline() -> None:
    scans = scanned_pdf([scan_page(t, 150, seed=4) for t in LETTERS[:3]], 150)
    with ParseWorker() as w:
        w.parse(Path("warm.txt"), b"start the child")  # its imports are not the test
        w.timeout_s = 0.3  # far less than three pages of OCR take
        doc = w.parse(Path("three.pdf"), scans)
        assert doc.ocr_pages == (1, 2, 3)
        # Negative control: a page allowance too short for any page fails the file.
        w.parse(Path("warm.txt"), b"a fresh child")
        w.ocr_page_s = 0.05
        with pytest.raises(ParseError, match=r"OCR took longer than 0\.05 s on scanned page 1"):
            w.parse(Path("three.pdf"), scans)


def test_tandem_ingest_reads_scans_and_says_which_pages(
    tmp_path, embedder_dir, monkeypatch, capsys
) -> None:
    """`tandem ingest` and `tandem docs list` (in this process, through `app.cli.main`)."""
    from app.cli import main

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "invoice scan.pdf").write_bytes(scanned_pdf([scan_page(LETTERS[0], 150)], 150))
    (docs / "mixed.pdf").write_bytes(mixed_pdf())
    scan_page(LETTERS[1], 150, seed=5).save(docs / "clinic.jpg", "JPEG", quality=85)
    Image.new("RGB", (600, 800), (200, 180, 160)).save(docs / "holiday.png")
    data, config = tmp_path / "data", tmp_path / "config"
    (data / "models").mkdir(parents=True)
    config.mkdir()
    os.symlink(embedder_dir, data / "models" / "all-minilm-l6-v2-onnx")
    monkeypatch.setenv("TANDEM_DATA_DIR", str(data))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(config))
    capsys.readouterr()

    assert main(["ingest", str(docs)]) == 1  # the photo without text fails, with its reason
    lines = capsys.readouterr().out.splitlines()
    assert f"indexed    {docs / 'invoice scan.pdf'}  1 chunks" in lines, lines
    assert f"indexed    {docs / 'clinic.jpg'}  1 chunks" in lines, lines
    assert (
        f"indexed    {docs / 'mixed.pdf'}  2 chunks; no text on page 3: "
        "the page holds no image to read"
    ) in lines, lines
    assert f"failed     {docs / 'holiday.png'}  no text found: OCR found no text in it" in lines
    assert lines[-1] == "3 indexed, 1 failed"

    assert main(["docs", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert f"{docs / 'invoice scan.pdf'}  (pdf, 1 chunks, OCR p. 1)" in listed, listed
    assert f"{docs / 'mixed.pdf'}  (pdf, 2 chunks, OCR p. 2; no text p. 3)" in listed
    assert f"{docs / 'clinic.jpg'}  (image, 1 chunks, read by OCR)" in listed
    assert any(line.startswith(f"{docs / 'holiday.png'}  (?, failed: no text") for line in listed)

    db = sqlite3.connect(next(data.rglob("index.sqlite")))
    pages = db.execute(
        "SELECT c.page, c.text FROM chunks c JOIN documents d ON d.id = c.document_id "
        "WHERE d.path = ? ORDER BY c.page",
        [str(docs / "mixed.pdf")],
    ).fetchall()
    assert [p for p, _ in pages] == [1, 2] and "roof repair" in pages[1][1]
    # A scan indexed before OCR existed ("0 chunks", its pages never looked at) is read again.
    with db:
        db.execute(
            "DELETE FROM chunks WHERE document_id IN (SELECT id FROM documents d WHERE d.path = ?)",
            [str(docs / "invoice scan.pdf")],
        )
        db.execute(
            "UPDATE documents SET ocr_pages = NULL, chunk_count = 0 WHERE path = ?",
            [str(docs / "invoice scan.pdf")],
        )
    db.close()
    main(["ingest", str(docs)])
    again = capsys.readouterr().out.splitlines()
    assert f"indexed    {docs / 'invoice scan.pdf'}  1 chunks" in again, again
    assert f"unchanged  {docs / 'mixed.pdf'}" in again
    # The photo with no text is not read (nor OCR run) again while it has not changed.
    assert f"unchanged  {docs / 'holiday.png'}  no text found: OCR found no text in it" in again
    assert again[-1] == "1 indexed, 3 unchanged"


def test_a_page_shown_turned_is_read_as_shown(worker: ParseWorker) -> None:
    """A scanner that stores the page sideways and sets /Rotate: OCR reads what a viewer shows."""
    from pypdf import PdfReader, PdfWriter

    sideways = scan_page(LETTERS[1], 150, seed=6).rotate(90, expand=True)  # stored turned left
    reader = PdfReader(io.BytesIO(scanned_pdf([sideways], 150)))
    writer = PdfWriter()
    writer.add_page(reader.pages[0]).rotate(90)  # shown turned right: upright
    out = io.BytesIO()
    writer.write(out)
    doc = worker.parse(Path("turned.pdf"), out.getvalue())
    assert doc.ocr_pages == (1,) and cer(doc.text, LETTERS[1]) < 0.03, doc.text


def test_an_image_that_cannot_be_decoded_spoils_only_its_page() -> None:
    """A scanned page whose JPEG is damaged: that page is named with the reason, the typed page
    is still indexed, and the message carries no object address."""
    jpeg = io.BytesIO()
    scan_page(LETTERS[0], 150, seed=2).convert("RGB").save(jpeg, "JPEG", quality=80)
    pdf = FPDF(format="A4")
    pdf.set_font("Helvetica", size=12)
    pdf.add_page()
    pdf.multi_cell(0, 8, TYPED)
    pdf.add_page()
    pdf.image(io.BytesIO(jpeg.getvalue()), x=0, y=0, w=210, h=297)
    raw = bytes(pdf.output())
    at = raw.index(jpeg.getvalue()[:64])
    damaged = raw[: at + 2] + bytes(200) + raw[at + 202 :]  # its header, zeroed
    doc = parse_bytes(Path("damaged.pdf"), damaged)
    assert [s.page for s in doc.sections] == [1] and doc.unread_pages == (2,)
    assert doc.unread_why == "an image on it cannot be decoded (cannot identify image file)"
