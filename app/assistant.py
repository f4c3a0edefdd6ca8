"""What the TUI drives: the device model, the private index, the cloud link and the modes.

No Textual here: the app runs these loaders in its workers and renders what they report, and
tests can drive the same object without a screen. The modes themselves are the CLI's
orchestrators (`edge_runtime.modes`); this class only builds and holds them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from app.cli import index_paths
from app.settings import Settings, effective_cloud

if TYPE_CHECKING:
    from app.embedded import EmbeddedCloud
    from edge_runtime.device import DeviceModel
    from edge_runtime.events import Event
    from edge_runtime.modes import AnswerOptions, ModeContext, Orchestrator, Turn
    from personal_index.index import PersonalIndex

log = logging.getLogger("tandem.assistant")

CloudState = Literal["off", "starting", "ready", "unavailable"]


@dataclass(frozen=True)
class CloudStatus:
    """Where the cloud link stands, in words the status bar can show."""

    state: CloudState
    detail: str = ""
    embedded: bool = False

    @property
    def label(self) -> str:
        where = "embedded" if self.embedded else "remote"
        return {
            "off": "cloud off",
            "starting": f"cloud starting ({where})…",
            "ready": f"cloud ready ({where})",
            "unavailable": "cloud unavailable",
        }[self.state]


@dataclass(frozen=True)
class ModeInfo:
    name: str
    description: str
    needs_cloud: bool
    available: bool
    reason: str = ""


class Assistant:
    """Models, index, cloud and modes for one app run. Loaders are idempotent; pass ready
    parts (tests: tiny models, an index in a temp dir) to skip them."""

    def __init__(
        self,
        settings: Settings,
        *,
        device: DeviceModel | None = None,
        index: PersonalIndex | None = None,
    ) -> None:
        self.settings = settings
        self.device = device
        self.index = index
        self.cloud_status = CloudStatus("off", "no cloud configured")
        self._embedded: EmbeddedCloud | None = None
        self._ctx: ModeContext | None = None
        self._modes: dict[str, Orchestrator] = {}
        self._index_lock = asyncio.Lock()

    # ------------------------------------------------------------------ loading

    def load_device(self) -> DeviceModel:
        """The device model (blocking: seconds for the real one; run it in a worker)."""
        if self.device is None:
            from edge_runtime.device import DeviceModel
            from tandem_packaging.prepare import model_path

            folder = (
                Path(self.settings.device_model).expanduser()
                if self.settings.device_model
                else model_path("device", "onnx-quant")
            )
            if not (folder / "model.onnx").exists() and not any(folder.glob("*.onnx")):
                raise FileNotFoundError(f"no ONNX device model in {folder}")
            self.device = DeviceModel.load(folder)
            if self._ctx is not None:
                self._ctx.device = self.device
        return self.device

    def open_index(self) -> PersonalIndex:
        """The private index, created empty on first use (loads the embedder: a second)."""
        if self.index is None:
            from personal_index.index import PersonalIndex

            root, embedder_dir = index_paths()
            self.index = PersonalIndex(root, embedder_dir)
        return self.index

    def index_has_documents(self) -> bool:
        return self.index is not None and self.index.stats().chunks > 0

    async def connect_cloud(self) -> CloudStatus:
        """Reach the configured cloud, or start the embedded backend when none is configured;
        then open a session once (token, tokenizer and version are checked at handshake)."""
        url, token = effective_cloud(self.settings)
        embedded = not url
        try:
            if embedded:
                self.cloud_status = CloudStatus("starting", "first start indexes the corpus",
                                                embedded=True)  # fmt: skip
                url, token = await self._start_embedded()
            else:
                self.cloud_status = CloudStatus("starting", url)
            from edge_runtime.modes import CloudSettings

            ctx = self.context()
            ctx.cloud = CloudSettings(url, token, retries=1)
            if self.device is not None:
                await self._probe()
            self.cloud_status = CloudStatus("ready", url, embedded=embedded)
        except Exception as exc:  # any failure: say why, local mode still works
            log.info("cloud unavailable: %s", exc)
            self.cloud_status = CloudStatus("unavailable", _plain(exc), embedded=embedded)
        return self.cloud_status

    async def _start_embedded(self) -> tuple[str, str]:
        from app.embedded import EmbeddedCloud

        if self._embedded is None or self._embedded.proc.returncode is not None:
            args = ["--engine", self.settings.cloud_engine]
            if self.settings.cloud_model:
                args += ["--model-dir", str(Path(self.settings.cloud_model).expanduser())]
            self._embedded = await EmbeddedCloud.start(args, on_progress=self._cloud_progress)
        return self._embedded.url, self._embedded.token

    def _cloud_progress(self, done: int, total: int, what: str) -> None:
        """The embedded cloud's first start builds its corpus: say how far, not just "starting"."""
        self.cloud_status = CloudStatus("starting", f"indexing {what} {done:,}/{total:,}",
                                        embedded=True)  # fmt: skip

    async def _probe(self) -> None:
        """Open the cloud-mode session now, so a wrong token or model shows before asking."""
        mode = self.mode("cloud")
        await mode.client()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ modes

    def context(self) -> ModeContext:
        if self._ctx is None:
            from edge_runtime.modes import ModeContext

            self._ctx = ModeContext(
                device=self.device, index=self.index, variant=self.settings.variant
            )
        self._ctx.device = self.device
        self._ctx.index = self.index if self.index_has_documents() else None
        return self._ctx

    def mode(self, name: str) -> Orchestrator:
        from edge_runtime.modes import build_mode

        ctx = self.context()
        if name == "split" and ctx.variant != self.settings.variant:
            self._modes.pop(name, None)
            ctx.variant = self.settings.variant
        if name not in self._modes:
            self._modes[name] = build_mode(name, ctx)
        return self._modes[name]

    def modes(self) -> list[ModeInfo]:
        """Every registered mode and whether it can answer now (and why not)."""
        from edge_runtime.modes import modes

        out = []
        for name, cls in modes().items():
            available, reason = True, ""
            if self.device is None:
                available, reason = False, "the device model is loading"
            elif cls.needs_cloud and self.cloud_status.state != "ready":
                available = False
                reason = f"{self.cloud_status.label}: {self.cloud_status.detail}".rstrip(": ")
            out.append(ModeInfo(name, cls.description, cls.needs_cloud, available, reason))
        return out

    def answer(
        self, question: str, history: Sequence[Turn], mode: str, options: AnswerOptions
    ) -> AsyncIterator[Event]:
        return self.mode(mode).answer(question, history, options)

    def options(self) -> AnswerOptions:
        from edge_runtime.modes import AnswerOptions

        s = self.settings
        return AnswerOptions(max_new_tokens=s.max_tokens, temperature=s.temperature, k=s.k)

    def link_alive(self) -> bool:
        """Whether any open cloud session is still connected (a refusal keeps it; a dropped
        server does not)."""
        ctx = self._ctx
        return ctx is not None and any(c.connected for c in ctx.clients.values())

    def cancel_device(self) -> None:
        """Interrupt a device model step in flight (the answer task is cancelled separately)."""
        if self.device is not None:
            self.device.cancel()

    async def apply_settings(self, settings: Settings) -> bool:
        """Take new settings; returns True if the cloud link must be re-established."""
        old, self.settings = self.settings, settings
        if self._ctx is not None:
            self._ctx.variant = settings.variant
        self._modes.pop("split", None)
        relink = (effective_cloud(old) != effective_cloud(settings)
                  or old.cloud_engine != settings.cloud_engine
                  or old.cloud_model != settings.cloud_model)  # fmt: skip
        if relink:
            await self._close_modes()
            if self._embedded is not None:
                await self._embedded.stop()
                self._embedded = None
        return relink

    async def _close_modes(self) -> None:
        for mode in self._modes.values():
            with contextlib.suppress(Exception):
                await mode.close()
        self._modes.clear()

    async def close(self) -> None:
        await self._close_modes()
        if self._embedded is not None:
            await self._embedded.stop()
            self._embedded = None
        if self.index is not None:
            self.index.close()


def _plain(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]
