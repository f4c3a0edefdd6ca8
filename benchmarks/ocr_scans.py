"""Generated scans with known text, and the character error rate of what OCR read from them.

A page is typeset in Pillow's own font, then made to look scanned: a slight skew, blur and
sensor noise, in grey. The same text at 150 and 300 dpi is what `benchmarks.ocr` measures and
what the OCR tests read (`tests/test_ocr.py`)."""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

__all__ = ["LETTERS", "cer", "normalise", "scan_page", "scanned_pdf"]

#: Each a page of everyday paperwork, as people scan it: names, figures, dates, addresses.
LETTERS: tuple[str, ...] = (
    "Dear Ms. Alvarez, your invoice 4471 for the roof repair at 12 Harbour Lane is due on "
    "3 March 2026. The total is 1,830 EUR, including VAT at 21 percent. Please transfer the "
    "amount to account NL91 ABNA 0417 1643 00 and quote the invoice number. Kind regards, "
    "Tomas Berg, Berg & Sons Roofing.",
    "Appointment confirmation. Patient: Jordan Okafor, born 14 July 1988. Your check-up with "
    "Dr. Helen Marsh is on Tuesday 9 June at 10:45 in room 3B, Riverside Clinic, 200 Mill "
    "Road. Please bring your insurance card and a list of the medicines you take. To cancel, "
    "call 020 7946 0958 at least 24 hours before.",
    "Lease agreement, page 2. The monthly rent of 1,275 euros is paid on the first working "
    "day of each month. The deposit of 2,550 euros is held until the keys are returned. The "
    "tenant may keep one cat. Heating is included; electricity and water are not. Notice "
    "period: three months, in writing.",
    "School trip permission slip. I allow my child Maya Lindqvist, class 4C, to take part in "
    "the museum visit on Friday 16 October. The bus leaves at 8:15 and returns by 15:30. The "
    "cost is 12 euros, paid in cash to Mr. Dubois. Allergies or medical notes: peanuts.",
)


def scan_page(text: str, dpi: int, seed: int = 0, point_size: float = 11.0) -> Image.Image:
    """An A4 page of `text` at `point_size` as a grey scan at `dpi`: wrapped at 70 columns,
    skewed by up to 0.8°, blurred and noisy (seeded)."""
    rng = np.random.default_rng(seed)
    scale = dpi / 72
    width, height = round(8.27 * dpi), round(11.69 * dpi)
    page = Image.new("L", (width, height), 255)
    draw = ImageDraw.Draw(page)
    font = ImageFont.load_default(size=round(point_size * scale))
    y = round(72 * scale)
    for line in textwrap.wrap(text, 70):
        draw.text((round(72 * scale), y), line, fill=20, font=font)
        y += round(point_size * 1.5 * scale)
    skew = float(rng.uniform(-0.8, 0.8))
    page = page.rotate(skew, resample=Image.Resampling.BICUBIC, fillcolor=255)
    page = page.filter(ImageFilter.GaussianBlur(0.4 * scale / 2))
    noisy = np.asarray(page, dtype=np.float32) + rng.normal(0, 10, (height, width))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def scanned_pdf(pages: Sequence[Image.Image], dpi: int) -> bytes:
    """An image-only PDF of `pages` (no text layer), as a scanner writes one."""
    out = io.BytesIO()
    first, *rest = [p.convert("L") for p in pages]
    first.save(out, "PDF", save_all=True, append_images=rest, resolution=dpi)
    return out.getvalue()


def normalise(text: str) -> str:
    """Runs of whitespace (line breaks included) as one space: OCR's line breaks are not
    errors, a lost or extra space between words is."""
    return " ".join(text.split())


def cer(read: str, truth: str) -> float:
    """Character error rate: Levenshtein distance from `read` to `truth` over the length of
    `truth`, both `normalise`d. One numpy pass per character of `read`."""
    a, b = normalise(read), normalise(truth)
    if not b:
        return float(len(a) > 0)
    target = np.frombuffer(b.encode("utf-32-le"), dtype=np.uint32)
    steps = np.arange(len(b) + 1)
    row = steps.copy()
    codes = np.frombuffer(a.encode("utf-32-le"), dtype=np.uint32)
    for i, code in enumerate(codes, start=1):
        cost = (target != code).astype(np.int64)
        best = np.empty_like(row)
        best[0] = i
        best[1:] = np.minimum(row[1:] + 1, row[:-1] + cost)
        row = np.minimum.accumulate(best - steps) + steps  # insertions along the row
    return float(row[-1]) / len(b)
