"""Opening a cited file where its citation points (issue 47, item 4): in the user's editor at
the line ($VISUAL, else $EDITOR: the app steps aside while it runs), else in the desktop's
viewer (a PDF viewer that takes a page where one is installed, else xdg-open or open), else
in a built-in pager at that place: a text file as it is on disk, any other document as its
text was indexed, each page marked.

Only the device's own files open here: a public source lives in the cloud's corpus, and its
whole passage is already on the source screen."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import ModalScreen
from textual.widgets import Static, TextArea

from app.plain import strip_controls
from app.tui.plain import plain
from collab.sources import Source

__all__ = [
    "Pager",
    "Place",
    "editor_command",
    "pager_text",
    "place_of",
    "start_viewer",
    "viewer_command",
]

#: Documents an editor cannot show as text: they go to a viewer, or to the indexed text.
NOT_TEXT = frozenset(
    {
        ".pdf",
        ".docx",
        ".doc",
        ".odt",
        ".epub",
        ".pptx",
        ".xlsx",
        ".rtf",
        ".png",
        ".jpg",
        ".jpeg",
        ".gif",
        ".webp",
        ".tif",
        ".tiff",
    }
)
PAGER_MAX_BYTES = 8 * 1024**2  # a text file larger than this is shown as indexed

# editors that open at a line with `+N file`, and those that take `file:N` after a flag
_PLUS_LINE = frozenset(
    {
        "vi",
        "vim",
        "nvim",
        "gvim",
        "nano",
        "emacs",
        "emacsclient",
        "micro",
        "hx",
        "helix",
        "kak",
        "joe",
        "ne",
        "mg",
        "jed",
        "mcedit",
    }
)
_COLON_LINE = {"code": ["-g"], "codium": ["-g"], "subl": [], "zed": []}
# PDF viewers that open at a page: (command, how the page is passed)
_PAGE_VIEWERS: tuple[tuple[str, Callable[[str, int], list[str]]], ...] = (
    ("zathura", lambda path, page: ["-P", str(page), path]),
    ("evince", lambda path, page: ["-p", str(page), path]),
    ("okular", lambda path, page: ["-p", str(page), path]),
    ("mupdf", lambda path, page: [path, str(page)]),
)

_PAGE = re.compile(r"\bp\. (\d+)")
_LINE = re.compile(r"\blines? (\d+)")


@dataclass(frozen=True)
class Place:
    """A cited file and where in it (1-based; None: not known)."""

    path: Path
    page: int | None = None
    line: int | None = None

    @property
    def is_text(self) -> bool:
        return self.path.suffix.lower() not in NOT_TEXT

    def __str__(self) -> str:
        where = ", ".join(
            p
            for p in (
                f"page {self.page}" if self.page else "",
                f"line {self.line}" if self.line else "",
            )
            if p
        )
        return f"{self.path}" + (f" at {where}" if where else "")


def place_of(src: Source) -> Place | None:
    """Where a device source's passage is in its file (from the citation's "p. 3, lines 4–9"),
    or None for a public source or one without a file."""
    if src.side != "device" or not src.path:
        return None
    page, line = _PAGE.search(src.location), _LINE.search(src.location)
    return Place(
        Path(src.path), int(page.group(1)) if page else None, int(line.group(1)) if line else None
    )


def editor_command(place: Place, env: Mapping[str, str] | None = None) -> list[str] | None:
    """$VISUAL (else $EDITOR) opening the text file at its line where the editor takes one;
    None for no editor, or a file that is not text."""
    env = os.environ if env is None else env
    editor = (env.get("VISUAL") or env.get("EDITOR") or "").strip()
    if not editor or not place.is_text:
        return None
    try:
        argv = shlex.split(editor)
    except ValueError:
        return None
    name = Path(argv[0]).name if argv else ""
    path = str(place.path)
    if place.line and name in _PLUS_LINE:
        return [*argv, f"+{place.line}", path]
    if place.line and name in _COLON_LINE:
        return [*argv, *_COLON_LINE[name], f"{path}:{place.line}"]
    return [*argv, path]


def viewer_command(
    place: Place, which: Callable[[str], str | None] = shutil.which
) -> list[str] | None:
    """The desktop's viewer for the file: a PDF viewer at the page where one is installed,
    else xdg-open (Linux) or open (macOS); None where there is none (a server)."""
    if place.page and place.path.suffix.lower() == ".pdf":
        for name, args in _PAGE_VIEWERS:
            if which(name):
                return [name, *args(str(place.path), place.page)]
    for name in ("xdg-open", "open"):
        if which(name):
            return [name, str(place.path)]
    return None


def start_viewer(command: Sequence[str]) -> None:
    """Start the viewer detached: it outlives nothing of ours and writes nowhere we show."""
    subprocess.Popen(
        list(command),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def pager_text(place: Place, indexed: Callable[[str], Sequence[Any]]) -> tuple[str, int]:
    """(the text to page, the 0-based row to open at): a text file from disk, at its line;
    anything else (or a file gone or too large) as indexed (`indexed(path)`: its stored
    chunks), each page marked, at the cited page. Control characters are dropped."""
    path = place.path
    if place.is_text:
        try:
            if path.stat().st_size <= PAGER_MAX_BYTES:
                text = strip_controls(path.read_text(encoding="utf-8", errors="replace"))
                return text, max(0, (place.line or 1) - 1)
        except OSError:
            pass
    lines: list[str] = ["(the text of this document as Tandem indexed it)"]
    row, page, end, shown = 0, None, None, False
    for chunk in indexed(str(path)):
        text = chunk.text
        if chunk.page != page:
            page, end = chunk.page, None
            lines += ["", f"── page {page} ──" if page else "──", ""]
        elif end is not None and chunk.char_start is not None and chunk.char_start < end:
            text = text[end - chunk.char_start :]  # the overlap the chunker repeats
        end = chunk.char_end
        if not shown and (
            (place.page and chunk.page == place.page)
            or (
                place.line
                and chunk.line_start
                and chunk.line_start <= place.line <= (chunk.line_end or chunk.line_start)
            )
        ):
            row, shown = len(lines), True
        lines += strip_controls(text).splitlines()
    if len(lines) == 1:
        lines.append("(nothing of it is in the index any more)")
    return "\n".join(lines), row


class Pager(ModalScreen[None]):
    """A read-only view of a cited file, opened at the cited place (no markup is read)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "dismiss", "Close", id="close_pager"),
    ]
    DEFAULT_CSS = """
    Pager { align: center middle; }
    Pager > #pager-title { dock: top; width: 100%; background: $accent 30%; padding: 0 1; }
    Pager > TextArea { width: 100%; height: 1fr; }
    """

    def __init__(self, title: str, text: str, row: int) -> None:
        super().__init__()
        self.title_text, self.text, self.row = title, text, row

    def compose(self) -> ComposeResult:
        yield Static(plain(self.title_text), id="pager-title")
        yield TextArea(self.text, read_only=True, show_line_numbers=True, id="pager-text")

    def on_mount(self) -> None:
        area = self.query_one(TextArea)
        area.focus()
        area.move_cursor((min(self.row, area.document.line_count - 1), 0), center=True)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
