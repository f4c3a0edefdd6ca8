"""The always-visible parts of the chat screen: the mode bar and the status bar."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Label, Static

from app.figures import mode_parts
from app.tui.plain import plain, plain_text

if TYPE_CHECKING:
    from app.assistant import CloudStatus, ModeInfo
    from edge_runtime.events import Stats


class ModeButton(Label):
    """One mode in the mode bar; click to switch."""

    def __init__(self, info: ModeInfo) -> None:
        super().__init__(plain(info.name), id=f"mode-{info.name}", classes="mode")
        self.info = info

    def on_click(self) -> None:
        self.post_message(ModeBar.Selected(self.info.name))


class ModeBar(Horizontal):
    """Every registered mode; the active one highlighted, unavailable ones dimmed (the reason
    is the tooltip)."""

    DEFAULT_CSS = """
    ModeBar { height: 1; width: auto; }
    ModeBar .mode { padding: 0 1; margin-right: 1; color: $text-muted; }
    ModeBar .mode.-active { background: $accent; color: $text; text-style: bold; }
    ModeBar .mode.-unavailable { color: $text-disabled; text-style: strike; }
    ModeBar .mode.-unavailable.-active { background: $warning-darken-2; text-style: bold strike; }
    """

    class Selected(Message):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.infos: list[ModeInfo] = []
        self.active = ""

    def show(self, infos: list[ModeInfo], active: str) -> None:
        """Re-draw the modes (cheap: a handful of labels)."""
        names = [i.name for i in infos]
        if names != [i.name for i in self.infos]:
            self.remove_children()
            self.mount_all(ModeButton(i) for i in infos)
        self.infos, self.active = infos, active
        for info in infos:
            for button in self.query(f"#mode-{info.name}").results(ModeButton):
                button.info = info
                button.set_class(info.name == active, "-active")
                button.set_class(not info.available, "-unavailable")
                button.tooltip = plain(  # the reason may carry an error's text
                    info.description + (f"\nunavailable: {info.reason}" if info.reason else "")
                )


def human_bytes(size: int) -> str:
    """Sizes and traffic as people read them: 512 B, 1.5 KB, 3.2 MB."""
    value = float(size)
    for unit in ("B", "KB", "MB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"


def figures(stats: Stats) -> str:
    """The live figures of an answer, as the status bar and the answer footer show them."""
    parts = [f"{stats.tokens} tok"]
    if stats.ttft_s is not None:
        parts.append(f"TTFT {stats.ttft_s:.2f} s")
    if (tps := stats.tokens_per_s) is not None:
        parts.append(f"{tps:.1f} tok/s")
    if stats.acceptance is not None:
        parts.append(f"accept {stats.acceptance:.2f}")
    parts += mode_parts(stats.as_dict())  # γ, AS², dragon's, the pipeline's, RAPID, …
    if stats.bytes_up or stats.bytes_down:
        parts.append(f"↑ {human_bytes(stats.bytes_up)} ↓ {human_bytes(stats.bytes_down)}")
    return " · ".join(parts)


class StatusBar(Static):
    """Active mode, cloud link, device model, and the figures of the current answer.

    `choice` is the mode the current answer is in when it is not the active one, and why:
    what `auto` picked (`● auto → local (your notes answer this)`), or a re-ask in another
    mode. It stays until the next answer starts or the active mode changes."""

    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; color: $text-muted; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.mode = ""
        self.cloud: CloudStatus | None = None
        self.device = "device model loading…"
        self.stats: Stats | None = None
        self.answering = False
        self.choice: tuple[str, str] | None = None

    def set_state(self, **changes) -> None:
        if changes.get("mode", self.mode) != self.mode and "choice" not in changes:
            changes["choice"] = None  # another mode picked: the last answer's choice is not its
        for key, value in changes.items():
            setattr(self, key, value)
        self.update(self.line_text())

    def line_text(self) -> Text:
        """Literal: the cloud's state and the device line can carry error text."""
        text = Text()
        text.append_text(plain_text(f"● {self.mode or '…'}", style="bold"))
        if self.choice is not None:  # the reason is model-side text: literal
            mode, reason = self.choice
            text.append_text(plain_text(f" → {mode}", style="bold"))
            if reason:
                text.append_text(plain_text(f" ({reason})"))
        if self.cloud is not None:
            style = {"ready": "green", "starting": "yellow", "unavailable": "red"}.get(
                self.cloud.state, "dim"
            )
            text.append("  │  ")
            text.append_text(plain_text(self.cloud.label, style=style))
            if self.cloud.state == "starting" and self.cloud.detail:
                text.append_text(plain_text(f" {self.cloud.detail}", style=style))
            if self.cloud.state == "ready" and self.cloud.search:
                text.append_text(plain_text(f" · public search: {self.cloud.search}"))
        text.append_text(plain_text("  │  " + self.device))
        if self.stats is not None:
            text.append("  │  ")
            text.append(figures(self.stats), style="bold" if self.answering else "")
        return text
