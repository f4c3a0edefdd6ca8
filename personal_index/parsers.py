"""Turn a user's file into located text sections (docs/architecture.md#layers, issue 4 item 1).

Every format ends up as a `ParsedDocument` whose sections carry the location a citation needs
(page for PDF, line for txt/md, heading title where the format has headings) and their offset
in the document's extracted text, so chunks can point back at an exact character span.

Well-kept libraries do the parsing (pypdf, python-docx, BeautifulSoup with the stdlib parser);
this module only maps their output onto sections. A bad file never raises anything but
`ParseError`, whose reason is short enough to show the user next to the file name.

Hostile files (issue 28): a .docx is unpacked under a byte budget before python-docx sees it
(a zip bomb stops at the cap, whatever sizes its directory claims; only deflate, whose
output zipfile bounds, is inflated), a PDF has a page cap, and
no regular expression here backtracks on a long line. What no cap can bound (a library stuck
on a crafted file) is bounded by running `parse_bytes` in a worker process with a deadline
(`personal_index.parse_worker`).

Scans (issue 47): a PDF page without a text layer, and a .png or .jpg file, are read by OCR
(`personal_index.ocr`); the pages it read and those that gave no text at all are part of the
result, so the user is told which pages were read how, never a silent "0 chunks".
"""

from __future__ import annotations

import io
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import docx
from bs4 import BeautifulSoup, NavigableString, Tag
from bs4.element import PreformattedString
from docx.table import Table
from pypdf import PageObject, PasswordType, PdfReader

from personal_index import ocr
from personal_index.safe_read import MB, Refused, read_document
from retrieval.document import HeadingTrail, ParsedDocument, Section

__all__ = [
    "SUPPORTED_SUFFIXES",
    "ParseError",
    "ParseLimits",
    "ParsedDocument",
    "Section",
    "is_supported",
    "parse",
    "parse_bytes",
]

# Suffix (lower case) -> document kind.
_KINDS: dict[str, str] = {
    ".txt": "txt",
    ".md": "md",
    ".markdown": "md",
    ".pdf": "pdf",
    ".docx": "docx",
    ".html": "html",
    ".htm": "html",
    ".png": "image",
    ".jpg": "image",
    ".jpeg": "image",
}
SUPPORTED_SUFFIXES: frozenset[str] = frozenset(_KINDS)

# Separator between sections of formats whose extracted text we assemble ourselves (pdf, docx,
# html): a blank line, so `ParsedDocument.text` reads naturally and offsets stay simple.
_SECTION_SEP = "\n\n"


class ParseError(ValueError):
    """A file could not be parsed; `reason` is plain and user-facing ("password-protected PDF")."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ParseLimits:
    """Caps on the work one file may cause. A PDF of more than `max_pages` pages is refused
    (text extraction costs ~10 ms a page: 2,000 pages fit the parse deadline); a zip container
    (.docx) may unpack to at most `max_unpacked_bytes` in at most `max_members` entries."""

    max_pages: int = 2000
    max_unpacked_bytes: int = 200 * MB
    max_members: int = 10_000
    max_ocr_pages: int = 500
    """Scanned pages read by OCR per file (a second or two each); later ones stay unread."""
    max_page_images: int = 16
    """Images OCR reads on one page (a scan is one; a page cut into strips has a few)."""


DEFAULT_LIMITS = ParseLimits()


def is_supported(path: Path | str) -> bool:
    """Whether `parse` handles this file, judged by its suffix (case-insensitive)."""
    return Path(path).suffix.lower() in _KINDS


def parse(
    path: Path | str, limits: ParseLimits = DEFAULT_LIMITS, max_bytes: int = 1 << 62
) -> ParsedDocument:
    """Read (as `personal_index.safe_read` does: a regular file only, at most `max_bytes`) and
    parse one file in this process; empty extracted text gives zero sections, not an error.

    Raises `ParseError` (and nothing else) for an unsupported suffix, an unreadable, corrupt
    or password-protected file, or one that is not a regular file.
    """
    path = Path(path)
    _kind_of(path)
    try:
        data, _st = read_document(path, Path(path).resolve(), max_bytes)
    except Refused as e:
        raise ParseError(e.reason) from e
    return parse_bytes(path, data, limits)


def _kind_of(path: Path) -> str:
    suffix = path.suffix.lower()
    kind = _KINDS.get(suffix)
    if kind is None:
        raise ParseError(f"unsupported file type {suffix or '(no suffix)'}")
    return kind


def parse_bytes(path: Path, data: bytes, limits: ParseLimits = DEFAULT_LIMITS) -> ParsedDocument:
    """Parse the bytes of the file `path` (its suffix picks the format); what `parse` does after
    reading, and what the parse worker runs. Raises `ParseError` and nothing else."""
    path = Path(path)
    kind = _kind_of(path)
    parser = {
        "txt": _parse_txt,
        "md": _parse_md,
        "pdf": _parse_pdf,
        "docx": _parse_docx,
        "html": _parse_html,
        "image": _parse_image,
    }[kind]
    try:
        got = parser(data, limits)
    except ParseError:
        raise
    except RecursionError as e:
        raise ParseError(f"{_WHAT[kind]}: nested too deeply") from e
    except Exception as e:  # a library's failure on a bad file: wrap it, keep its message
        raise ParseError(_wrap_reason(kind, e)) from e
    return ParsedDocument(
        path=path,
        kind=kind,
        title=got.title,
        sections=tuple(got.sections),
        ocr_pages=got.ocr_pages,
        unread_pages=got.unread_pages,
        unread_why=got.unread_why,
    )


class _Parsed(NamedTuple):
    """What a format's parser found: `ocr_pages` were read by OCR, `unread_pages` gave no text
    at all (no text layer, and OCR found none or could not run: `unread_why`)."""

    title: str | None
    sections: list[Section]
    ocr_pages: tuple[int, ...] = ()
    unread_pages: tuple[int, ...] = ()
    unread_why: str | None = None


_WHAT = {
    "pdf": "not a valid PDF",
    "docx": "not a valid .docx file",
    "html": "could not parse HTML",
    "txt": "could not read text",
    "md": "could not read Markdown",
    "image": "not a readable image",
}


def _wrap_reason(kind: str, e: Exception) -> str:
    """A user-facing reason for a library exception, keeping the library's own message."""
    detail = str(e).strip() or type(e).__name__
    return f"{_WHAT[kind]}: {detail}"


# --- plain text and Markdown ---------------------------------------------------------------


def _decode_text(data: bytes) -> str:
    """Decode a text file as UTF-8, replacing undecodable bytes with U+FFFD.

    A file in a legacy 8-bit encoding then still indexes (its ASCII words survive) instead of
    failing; guessing latin-1 would silently garble UTF-8 files with a single bad byte.
    UTF-16 with a BOM (Windows "Unicode" files) is honoured. Newlines are normalised to "\\n"
    so line numbers match what an editor shows. NUL bytes mean a binary file: ParseError.
    """
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        text = data.decode("utf-16", errors="replace")
    else:
        if b"\x00" in data:
            raise ParseError("not a text file (contains NUL bytes)")
        text = data.decode("utf-8-sig", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _stripped_section(
    text: str, start: int, end: int, headings: tuple[str, ...], first_line: int
) -> Section | None:
    """The section for `text[start:end]` without surrounding whitespace, or None if blank.

    `first_line` is the 1-based line at `start`; the result's line is that of its first
    non-blank character.
    """
    piece = text[start:end]
    lead = len(piece) - len(piece.lstrip())
    body = piece.strip()
    if not body:
        return None
    line = first_line + piece.count("\n", 0, lead)
    title = headings[-1] if headings else None
    return Section(body, None, title, line, start + lead, headings)


def _parse_txt(data: bytes, limits: ParseLimits) -> _Parsed:
    """One section for the whole file: chunking, not the parser, decides where to cut."""
    text = _decode_text(data)
    section = _stripped_section(text, 0, len(text), (), 1)
    return _Parsed(None, [section] if section else [])


# Linear on any line (issue 28): no two unbounded repetitions of the same characters in a row.
# The ATX heading is matched by `_atx` instead of one pattern, whose lazy text followed by an
# optional closing run and trailing blanks was quadratic in a line of spaces.
_ATX_OPEN = re.compile(r" {0,3}(#{1,6})(?=[ \t]|$)")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def _md_headings(lines: list[str]) -> list[tuple[int, int, str]]:
    """(first line index, level, text) of each heading; ATX (`# x`) and setext (`x` + `===`).

    Lines inside fenced code blocks and a leading YAML front matter block are not headings.
    """
    headings: list[tuple[int, int, str]] = []
    i = 0
    if lines and lines[0].strip() == "---":  # front matter: skip to its closing line
        for j in range(1, len(lines)):
            if lines[j].strip() in ("---", "..."):
                i = j + 1
                break
    fence: str | None = None
    while i < len(lines):
        line = lines[i]
        m = _FENCE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
        elif m:
            fence = m.group(1)
        elif (h := _atx(line)) is not None:
            headings.append((i, *h))
        elif (
            i + 1 < len(lines)
            and line.strip()
            and not line.startswith(("    ", "\t"))
            and (s := _SETEXT.match(lines[i + 1])) is not None
            and not _is_md_block_start(line)
        ):
            headings.append((i, 1 if s.group(1)[0] == "=" else 2, line.strip()))
            i += 2
            continue
        i += 1
    return headings


def _atx(line: str) -> tuple[int, str] | None:
    """(level, text) of an ATX heading line (`## Title ##`), else None; CommonMark's rule: up
    to three spaces, 1–6 `#`, then a blank or the end; an optional closing run of `#` preceded
    by a blank (or making up the whole rest) is not part of the text."""
    m = _ATX_OPEN.match(line)
    if m is None:
        return None
    rest = line[m.end() :].strip(" \t")
    bare = rest.rstrip("#")
    if not bare or bare[-1] in " \t":  # a closing sequence
        rest = bare
    return len(m.group(1)), rest.strip()


def _is_md_block_start(line: str) -> bool:
    """Lines that cannot be a setext heading's text (list items, quotes, rules)."""
    s = line.lstrip()
    return s.startswith((">", "- ", "* ", "+ ", "|")) or bool(_SETEXT.match(line))


def _parse_md(data: bytes, limits: ParseLimits) -> _Parsed:
    """Sections split at headings, each holding its heading line; text before the first heading
    is an untitled section. Raw Markdown is kept so char and line spans match the file."""
    text = _decode_text(data)
    lines = text.split("\n")
    line_offsets = [0]
    for line in lines[:-1]:
        line_offsets.append(line_offsets[-1] + len(line) + 1)
    headings = _md_headings(lines)
    trail = HeadingTrail()
    bounds: list[tuple[int, tuple[str, ...]]] = [(0, ())]  # (first line index, heading chain)
    bounds += [(i, trail.enter(level, title) if title else ()) for i, level, title in headings]
    sections: list[Section] = []
    for k, (idx, chain) in enumerate(bounds):
        end_idx = bounds[k + 1][0] if k + 1 < len(bounds) else len(lines)
        start = line_offsets[idx]
        end = line_offsets[end_idx] if end_idx < len(lines) else len(text)
        if end <= start:
            continue
        section = _stripped_section(text, start, end, chain, idx + 1)
        if section:
            sections.append(section)
    h1 = next((t for _i, level, t in headings if level == 1 and t), None)
    return _Parsed(h1, sections)


# --- assembled formats (pdf, docx, html) ---------------------------------------------------


_Piece = tuple[str, int | None, tuple[str, ...]]  # (text, page, heading chain)


def _assemble(pieces: list[_Piece]) -> list[Section]:
    """Sections from (text, page, heading chain) pieces laid out with `_SECTION_SEP` between
    them; blank pieces are dropped."""
    sections: list[Section] = []
    pos = 0
    for text, page, chain in pieces:
        body = text.strip()
        if not body:
            continue
        if sections:
            pos += len(_SECTION_SEP)
        title = chain[-1] if chain else None
        sections.append(Section(body, page, title, None, pos, chain))
        pos += len(body)
    return sections


def _parse_pdf(data: bytes, limits: ParseLimits) -> _Parsed:
    """One section per page that has text (page numbers 1-based). A page whose text layer
    holds fewer than `_FEW_CHARACTERS` letters or digits is read from its images by OCR. An
    empty user password is tried, as PDF viewers do."""
    reader = PdfReader(io.BytesIO(data))
    if reader.is_encrypted:
        try:
            result = reader.decrypt("")
        except Exception as e:  # e.g. AES without the `cryptography` package
            raise ParseError(f"encrypted PDF that cannot be opened: {e}") from e
        if result == PasswordType.NOT_DECRYPTED:
            raise ParseError("password-protected PDF")
    title = None
    meta = reader.metadata
    if meta is not None and meta.title:
        title = str(meta.title).strip() or None
    pages = len(reader.pages)
    if pages > limits.max_pages:
        raise ParseError(f"too many pages ({pages:,} > {limits.max_pages:,} cap)")
    pieces: list[_Piece] = []
    read_by_ocr: list[int] = []
    unread: list[int] = []
    why: str | None = None
    for number, page in enumerate(reader.pages, start=1):
        layer = page.extract_text() or ""
        if sum(c.isalnum() for c in layer) >= _FEW_CHARACTERS:
            pieces.append((layer, number, ()))
            continue
        text, problem = "", "the page holds no image to read"
        if len(read_by_ocr) >= limits.max_ocr_pages:
            problem = f"past the {limits.max_ocr_pages:,} scanned pages OCR reads per file"
        elif why is None or not why.startswith("OCR could not start"):
            text, problem = _ocr_page(page, limits)
        if text.strip():
            read_by_ocr.append(number)
            pieces.append((text, number, ()))
        else:
            unread.append(number)
            why = why or problem
            pieces.append((layer, number, ()))  # a few characters are better than none
    return _Parsed(title, _assemble(pieces), tuple(read_by_ocr), tuple(unread), why)


#: A text layer with fewer letters and digits than this is no layer (a scanner's page stamp).
_FEW_CHARACTERS = 10
#: Images smaller than this on both sides hold no line of text worth reading (icons, rules).
_MIN_IMAGE_SIDE = 32


def _ocr_page(page: PageObject, limits: ParseLimits) -> tuple[str, str]:
    """(text read from the page's images, why there is none if so). Each image is decoded on
    its own (pypdf decodes at access), so one it cannot decode spoils only itself."""
    try:
        images = page.images
        count = min(len(images), limits.max_page_images)
    except Exception as e:  # a broken resource dictionary: the page has no readable image
        return "", f"its images cannot be listed ({_short(e)})"
    if count == 0:
        return "", "the page holds no image to read"
    texts: list[str] = []
    problem = "OCR found no text on it"
    announced = False
    for i in range(count):
        try:
            image = images[i].image
        except Exception as e:  # a filter pypdf cannot decode (JBIG2 without jbig2dec)
            problem = f"an image on it cannot be decoded ({_short(e)})"
            continue
        if image is None or min(image.size) < _MIN_IMAGE_SIDE:
            continue
        if rotation := page.rotation % 360:  # shown turned clockwise: read it as shown
            image = image.rotate(-rotation, expand=True)
        if not announced:
            ocr.announce_page()
            announced = True
        try:
            texts.append(ocr.read_image(image))
        except ocr.OcrUnavailable as e:
            return "", f"OCR could not start: {e}"
        except ValueError as e:  # over the pixel cap
            problem = str(e)
        except MemoryError:
            raise
        except Exception as e:  # pixels that fail to decode late (a truncated stream)
            problem = f"an image on it cannot be read ({_short(e)})"
    return "\n".join(t for t in texts if t), problem


def _short(e: Exception) -> str:
    """A library's message, short and without object addresses ("<_io.BytesIO object at …>")."""
    message = _OBJECT_REPR.sub("", str(e)).strip()
    return (message or type(e).__name__)[:120]


_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-f]+>")


def _parse_image(data: bytes, limits: ParseLimits) -> _Parsed:
    """A photo or scan of one page (.png, .jpg), read by OCR: one untitled section."""
    from PIL import Image, ImageOps

    opened = Image.open(io.BytesIO(data))  # reads the header only: the size is known unread
    width, height = opened.size
    if width * height > ocr.MAX_PIXELS:
        raise ParseError(
            f"image too large to read ({width * height / 1e6:.0f} megapixels "
            f"> {ocr.MAX_PIXELS / 1e6:.0f} cap)"
        )
    image = ImageOps.exif_transpose(opened)  # a phone's portrait photo, upright
    ocr.announce_page()
    try:
        text = ocr.read_image(image)
    except ocr.OcrUnavailable as e:
        return _Parsed(None, [], (), (1,), f"OCR could not start: {e}")
    if not text.strip():
        return _Parsed(None, [], (), (1,), "OCR found no text in it")
    return _Parsed(None, _assemble([(text, None, ())]), (1,))


def _parse_docx(data: bytes, limits: ParseLimits) -> _Parsed:
    """Body paragraphs and tables in order; a "Heading n" or "Title" paragraph starts a new
    section titled by it. The document title is the core property, else the first heading."""
    document = docx.Document(unpacked_zip(data, limits))
    pieces: list[_Piece] = []
    current: list[str] = []
    chain: tuple[str, ...] = ()
    trail = HeadingTrail()
    first_heading: str | None = None
    for block in document.iter_inner_content():
        if isinstance(block, Table):
            current.extend(_docx_table_lines(block))
            continue
        text = block.text.strip()
        if not text:
            continue
        style = (block.style.name if block.style is not None else "") or ""
        if style.startswith("Heading") or style == "Title":
            pieces.append(("\n".join(current), None, chain))
            current, chain = [text], trail.enter(_docx_heading_level(style), text)
            first_heading = first_heading or text
        else:
            current.append(text)
    pieces.append(("\n".join(current), None, chain))
    title = (document.core_properties.title or "").strip() or first_heading
    return _Parsed(title, _assemble(pieces))


# How a .docx may store its parts: an OPC package is stored or deflated (ECMA-376 Part 2).
_ZIP_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}


def unpacked_zip(data: bytes, limits: ParseLimits) -> io.BytesIO:
    """The zip container `data` (a .docx) re-packed uncompressed after unpacking every entry
    under the byte budget `limits.max_unpacked_bytes`, so the library that reads it inflates
    nothing. The declared sizes must fit the budget; reading in blocks then holds each entry to
    its declared size (zipfile stops there), where a single `read()` of an entry that lies
    about its size inflates all of it at once.

    Only stored and deflated entries are read: zipfile bounds its output by the block asked
    for with deflate alone. A bzip2 or LZMA entry is decompressed a whole compressed block at
    a time, however much that makes (a 150-byte bzip2 entry is 150 MB of text, a few kB are
    gigabytes), before the declared size cuts it: such a zip is refused unread."""
    source = zipfile.ZipFile(io.BytesIO(data))  # a bad zip raises: the caller names the format
    entries = source.infolist()
    if len(entries) > limits.max_members:
        raise ParseError(f"too many entries in the zip ({len(entries):,} > {limits.max_members:,})")
    for entry in entries:
        if entry.compress_type not in _ZIP_METHODS:
            raise ParseError(
                f"unsupported compression in the zip (method {entry.compress_type}: "
                "a .docx is stored or deflated)"
            )
    budget = limits.max_unpacked_bytes
    too_much = ParseError(f"compressed content too large (unpacks to more than {budget / MB:g} MB)")
    if sum(entry.file_size for entry in entries) > budget:  # an honest bomb: refused unread
        raise too_much
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as packed:
        for entry in entries:
            if entry.is_dir():
                continue
            if entry.file_size > budget:
                raise too_much
            blocks: list[bytes] = []
            with source.open(entry) as member:
                while block := member.read(1 << 20):
                    budget -= len(block)
                    if budget < 0:
                        raise too_much
                    blocks.append(block)
            packed.writestr(entry.filename, b"".join(blocks))
    out.seek(0)
    return out


def _docx_table_lines(table: Table) -> list[str]:
    """A table as one line per row, cells separated by " | " (merged cells once)."""
    lines = []
    for row in table.rows:
        cells: list[str] = []
        for cell in row.cells:
            t = " ".join(cell.text.split())
            if t and (not cells or cells[-1] != t):
                cells.append(t)
        if cells:
            lines.append(" | ".join(cells))
    return lines


_HTML_DROP = ("script", "style", "nav", "noscript", "template", "head", "iframe", "svg")
_HTML_HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
_HTML_BLOCKS = frozenset(
    {
        "address",
        "article",
        "aside",
        "blockquote",
        "br",
        "dd",
        "details",
        "div",
        "dl",
        "dt",
        "figcaption",
        "figure",
        "footer",
        "form",
        "header",
        "hr",
        "li",
        "main",
        "ol",
        "p",
        "pre",
        "section",
        "summary",
        "table",
        "td",
        "th",
        "tr",
        "ul",
    }
)


def _parse_html(data: bytes, limits: ParseLimits) -> _Parsed:
    """Visible text split at h1–h6 (each section titled by its heading); script, style, nav
    and the like are dropped. Title: <title>, else the first <h1>."""
    soup = BeautifulSoup(data, "html.parser")  # bytes: bs4 detects the encoding
    title_tag = soup.find("title")
    title = " ".join(title_tag.get_text(" ").split()) if title_tag else ""
    for tag in soup.find_all(_HTML_DROP):
        tag.decompose()
    if not title:
        h1 = soup.find("h1")
        title = " ".join(h1.get_text(" ").split()) if h1 else ""

    pieces: list[_Piece] = []
    current: list[str] = []
    chain: tuple[str, ...] = ()
    trail = HeadingTrail()

    def walk(node: Tag) -> None:
        nonlocal current, chain
        for child in node.children:
            if isinstance(child, PreformattedString):  # comments, doctype, CDATA
                continue
            if isinstance(child, NavigableString):
                current.append(str(child))
            elif isinstance(child, Tag):
                if child.name in _HTML_HEADINGS:
                    heading = " ".join(child.get_text(" ").split())
                    if heading:
                        pieces.append((_html_lines("".join(current)), None, chain))
                        level = int(child.name[1])
                        current, chain = [heading, "\n"], trail.enter(level, heading)
                    continue
                block = child.name in _HTML_BLOCKS
                if block:
                    current.append("\n")
                walk(child)
                if block:
                    current.append("\n")

    walk(soup)
    pieces.append((_html_lines("".join(current)), None, chain))
    return _Parsed(title or None, _assemble(pieces))


def _docx_heading_level(style: str) -> int:
    """ "Title" is level 0, "Heading 2" level 2; a heading style without a number counts as 1."""
    if style == "Title":
        return 0
    digits = style.removeprefix("Heading").strip()
    return int(digits) if digits.isdigit() else 1


def _html_lines(raw: str) -> str:
    """Collapse runs of whitespace inside lines and drop blank lines."""
    lines = (" ".join(line.split()) for line in raw.split("\n"))
    return "\n".join(line for line in lines if line)
