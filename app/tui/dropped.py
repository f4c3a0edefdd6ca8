"""A file or folder dropped on the terminal (issue 47, item 5): terminals paste its path into
the prompt, so a prompt that is one existing path and nothing else offers to add it to the
private index, rather than asking the model about a path.

Terminals paste a dropped path in several spellings: bare, in quotes (`'/a b/c.pdf'`), with
backslash-escaped spaces and brackets (`/a\\ b/c.pdf`), or as a `file://` URL with its
characters percent-encoded. `dropped_path` reads them all; anything else is a question."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import ClassVar
from urllib.parse import unquote, urlparse

from rich.text import Text
from textual.binding import Binding, BindingType

from app.tui.documents import Confirm, tilde
from app.tui.plain import plain_text

__all__ = ["ConfirmAdd", "dropped_path"]

_ESCAPED = re.compile(r"\\(.)")


def dropped_path(text: str) -> Path | None:
    """The existing file or folder `text` names as a terminal pastes a dropped one (absolute,
    or from `~`), or None: a question, even one that mentions a path."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    elif text.startswith("file://"):
        url = urlparse(text)
        if url.netloc not in ("", "localhost"):
            return None
        text = unquote(url.path)
    else:
        text = _ESCAPED.sub(r"\1", text)
    if "\n" in text or not text.startswith(("/", "~")):
        return None
    path = Path(os.path.expanduser(text))
    try:
        return path if path.is_absolute() and path.exists() else None
    except OSError:  # a name too long for the file system is not a path here
        return None


class ConfirmAdd(Confirm):
    """Asks before a path pasted alone in the prompt is added to the private index."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "confirm", "Add", id="confirm_add_dropped"),
        Binding("n,escape", "cancel", "Don't add", id="cancel_add_dropped"),
    ]
    YES, NO = "Add", "Don't add"

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def question(self) -> Text:
        what = "folder (watched: kept in sync from now on)" if self.path.is_dir() else "file"
        return Text.assemble(
            "Add the ",
            plain_text(what),
            " ",
            plain_text(tilde(str(self.path)), "bold"),
            " to your documents?  ",
            ("y", "bold"),
            " add · ",
            ("n", "bold"),
            " don't",
        )
