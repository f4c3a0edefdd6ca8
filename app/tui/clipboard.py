"""Copying text out of the app (issue 47): through the terminal with OSC 52 (Textual's
`App.copy_to_clipboard`, which works over SSH and in most terminals) and, where one is
installed, with the desktop's own tool as well (wl-copy, xclip, xsel, pbcopy), since some
terminals ignore OSC 52 or ask before they allow it.

Control characters are dropped first: a passage from a hostile document, pasted later into a
shell, must not carry an escape sequence with it."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

from textual.app import App

from app.plain import strip_controls

__all__ = ["code_blocks", "copy_and_tell", "copy_from_answer", "copy_text", "desktop_tool"]

log = logging.getLogger(__name__)

# (the environment variable that says the desktop is there, the command reading stdin)
_TOOLS: tuple[tuple[str | None, tuple[str, ...]], ...] = (
    ("WAYLAND_DISPLAY", ("wl-copy",)),
    ("DISPLAY", ("xclip", "-selection", "clipboard")),
    ("DISPLAY", ("xsel", "--clipboard", "--input")),
    (None, ("pbcopy",)),  # macOS
)
_TOOL_TIMEOUT_S = 3.0


def desktop_tool(
    env: Mapping[str, str] | None = None, which: Callable[[str], str | None] = shutil.which
) -> tuple[str, ...] | None:
    """The desktop clipboard command to use here, or None (no desktop, or no tool installed)."""
    env = os.environ if env is None else env
    for needs, command in _TOOLS:
        if (needs is None or env.get(needs)) and which(command[0]):
            return command
    return None


def _run_tool(command: tuple[str, ...], text: str) -> bool:
    # wl-copy and xclip fork a process that keeps serving the selection: it must not hold
    # pipes of ours open, or this would wait for it
    try:
        subprocess.run(
            command,
            input=text.encode("utf-8"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=_TOOL_TIMEOUT_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("copying with %s failed: %s", command[0], exc)
        return False
    return True


def copy_text(app: App[Any], text: str) -> str:
    """Put `text` (control characters dropped) on the clipboard; returns how, for the toast:
    "the terminal (OSC 52)", with "and wl-copy" (or the tool used) where one took it too.
    Blocks for at most a few seconds on the desktop tool: call it from a thread."""
    text = strip_controls(text)
    app.call_from_thread(app.copy_to_clipboard, text)
    how = "the terminal (OSC 52)"
    tool = desktop_tool()
    if tool is not None and _run_tool(tool, text):
        how += f" and {tool[0]}"
    return how


# A fenced block: ``` or ~~~ (with an info string or not) to the same fence alone on a line,
# or to the end of an answer that stopped inside one.
_FENCE = re.compile(
    r"^(?P<fence>```|~~~)[^\n]*\n(?P<code>.*?)(?:^(?P=fence)[ \t]*$|\Z)", re.M | re.S
)


def code_blocks(markdown: str) -> list[str]:
    """The contents of the fenced code blocks in `markdown`, in order, without the fences."""
    return [m.group("code").rstrip("\n") for m in _FENCE.finditer(markdown)]


async def copy_and_tell(app: App[Any], text: str, what: str) -> None:
    """Copy `text` (on a thread: the desktop tool may take a moment) and say in a toast what
    was copied and how."""
    how = await asyncio.to_thread(copy_text, app, text)
    app.notify(f"Copied {what} ({len(text):,} characters) with {how}.", markup=False)


async def copy_from_answer(app: App[Any], answer: str | None, *, code: bool) -> None:
    """Copy an answer's Markdown, or (`code`) its last fenced code block; a warning toast
    when there is none."""
    if answer is None or not answer.strip():
        app.notify("No answer to copy yet.", severity="warning", markup=False)
        return
    if not code:
        await copy_and_tell(app, answer, "the answer")
        return
    blocks = code_blocks(answer)
    if not blocks:
        app.notify("This answer has no code block to copy.", severity="warning", markup=False)
        return
    what = "the code block" if len(blocks) == 1 else f"the last of its {len(blocks)} code blocks"
    await copy_and_tell(app, blocks[-1], what)
