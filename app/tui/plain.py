"""Untrusted text as widget content: shown as it is, never read as markup.

Textual and Rich read a plain `str` as console markup almost everywhere (Static, Label,
tooltips, toasts, DataTable cells, Rich tables): `[/]` raises MarkupError and brings the app
down, `[@click=app.quit]` becomes a hidden action, `:smile:` an emoji. Text that did not come from
Tandem's own code (document text, titles, paths, parse-failure reasons, cloud citations,
error messages, model output) goes through `plain()` (Textual content) or `plain_text()`
(a Rich `Text`, for DataTable cells and Rich tables): literal, with control characters
stripped (`app.plain.strip_controls`) so no escape sequence reaches the terminal."""

from __future__ import annotations

from rich.style import StyleType
from rich.text import Text
from textual.content import Content

from app.plain import strip_controls


def plain(text: object) -> Content:
    """`text` as literal Textual content (a Static, a Label, a tooltip)."""
    return Content(strip_controls(str(text)))


def plain_text(text: object, style: StyleType = "", *, no_wrap: bool | None = None) -> Text:
    """`text` as a literal Rich `Text` (DataTable cells, Rich tables, `Text.assemble`)."""
    return Text(strip_controls(str(text)), style=style, no_wrap=no_wrap)


def markup_escaped(text: object) -> str:
    """`text` escaped for the few Textual APIs that take markup and nothing else (the command
    palette's help lines): it reads back as itself. Every `[` is escaped, not only those that
    look like tags (`textual.markup.escape` leaves `\\[b]` reading back as `[b]`)."""
    return strip_controls(str(text)).replace("[", "\\[")
