"""The one composition root both front ends drive (the TUI and `tandem ask`): it builds the
device model, the private index, the cloud link and the modes from the settings, streams an
answer's events, and persists the conversation.

No Textual here: the app runs the loaders in its workers and renders what they report; tests
and the CLI drive the same object without a screen."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from app.settings import Settings, effective_cloud
from collab.plumbing.paths import conversations_path, index_paths

if TYPE_CHECKING:
    from app.conversations import ConversationStore
    from app.embedded import EmbeddedCloud
    from edge_runtime.consent import Consent
    from edge_runtime.device import DeviceModel
    from edge_runtime.events import Event, Provenance, Stats
    from edge_runtime.modes.base import ModeContext, Orchestrator
    from edge_runtime.options import AnswerOptions
    from personal_index.index import PersonalIndex

log = logging.getLogger("tandem.assistant")

CloudState = Literal["off", "idle", "starting", "ready", "unavailable"]


class ScopeError(ValueError):
    """A scoped question names a path under which nothing is indexed."""


@dataclass(frozen=True)
class CloudStatus:
    """Where the cloud link stands, in words the status bar can show."""

    state: CloudState
    detail: str = ""
    embedded: bool = False
    search: str = ""  # what public search can do while a first start builds ("keywords; …")

    @property
    def label(self) -> str:
        where = "embedded" if self.embedded else "remote"
        return {
            "off": "cloud off",
            "idle": "cloud when needed",  # not connected until a mode needs it
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


@dataclass
class Exchange:
    """One question and its answer as they happen: the events to render, and what is kept of
    it (text, sources, figures, how it ended), written to the conversation as it ends."""

    question: str
    mode: str
    conversation_id: int | None
    title: str
    orchestrator: Orchestrator
    text: str = ""
    citations: list[dict[str, Any]] = field(default_factory=list)
    stats: Stats | None = None
    status: str = "complete"  # complete | cancelled | failed
    error: str | None = None
    # How much of `text` the cloud saw (None: not even the question): what later turns may
    # send it back. Grows while the answer is the cloud's; stops when the device goes on alone.
    shared_chars: int | None = None
    shared_tokens: int | None = None  # the same in tokens (the stored figures keep it)
    # Which cloud saw it (edge_runtime.cloud_identity, never the token): later turns send
    # it back to that cloud only. None: not shared, or by a cloud that did not say.
    shared_with: str | None = None
    _sharing: bool = False
    _device_alone: bool = False
    _events: AsyncIterator[Event] | None = None
    _on_end: Callable[[Exchange], None] | None = None

    async def events(self) -> AsyncGenerator[Event, None]:
        """The answer's events; the exchange is saved when they end, however they end (a
        cancel or a crash keeps the partial answer, marked)."""
        from edge_runtime.events import Citation, Failure, Provenance, Stats, TextDelta

        assert self._events is not None
        try:
            async for event in self._events:
                if isinstance(event, TextDelta):
                    self.text += event.text
                    if self._sharing:
                        self.shared_chars = len(self.text)
                elif isinstance(event, Provenance):
                    self._track(event)
                elif isinstance(event, Citation):
                    self.citations.append(event.to_dict())
                elif isinstance(event, Failure) and not event.recoverable:
                    self.status, self.error = "failed", event.message
                elif isinstance(event, Stats):
                    self.stats = event
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            self.status = "cancelled"
            raise
        except Exception as exc:  # a bug or a dead model: saved as failed, then raised
            self.status, self.error = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            with contextlib.suppress(BaseException):
                await self._events.aclose()  # type: ignore[attr-defined]
            if self._on_end is not None:
                self._on_end(self)

    def _track(self, event: Provenance) -> None:
        """Text from a cloud-shared stretch extends what the cloud saw; once the device has
        gone on alone, nothing after it ever counts as shared (only a prefix is sent back)."""
        if event.shared and not self._device_alone:
            self._sharing = True
            self.shared_chars = len(self.text)
            self.shared_with = event.cloud  # a retry on a new session: the cloud that answers
        elif not event.shared and not self._device_alone:
            self._sharing, self._device_alone = False, True
            self.shared_tokens = event.tokens if self.shared_chars is not None else None

    def provenance(self) -> dict[str, int | None]:
        """What the cloud saw of this answer, in characters and tokens (None: nothing, not
        even the question); tokens past `shared_tokens` the device produced alone."""
        tokens = self.shared_tokens
        if tokens is None and self.shared_chars is not None:  # shared to the end
            stats = self.stats or self.live_stats()  # a cancelled answer has no final Stats
            tokens = stats.tokens if stats is not None else None
        return {"shared_chars": self.shared_chars, "shared_tokens": tokens}

    def live_stats(self) -> Stats | None:
        """The figures so far (elapsed time, bytes), for a status bar that polls."""
        return self.orchestrator.live_stats()


class Assistant:
    """Models, index, cloud, modes and conversations for one run. Loaders are idempotent;
    pass ready parts (tests: tiny models, an index in a temp dir) to skip them."""

    def __init__(
        self,
        settings: Settings,
        *,
        device: DeviceModel | None = None,
        index: PersonalIndex | None = None,
        finish_locally: bool = True,
    ) -> None:
        self.settings = settings
        self.device = device
        self.index = index
        self.finish_locally = finish_locally
        self.cloud_status = CloudStatus("off", "no cloud configured")
        self._embedded: EmbeddedCloud | None = None
        self._ctx: ModeContext | None = None
        self._modes: dict[str, Orchestrator] = {}
        self._conversations: ConversationStore | None = None
        self._citations_kept_for: PersonalIndex | None = None
        # the front end's way to ask the user whether a cloud may take part in answers shaped
        # by private passages (the TUI's dialog); None: nobody to ask (edge_runtime.consent)
        self.consent_asker: Callable[[str], Awaitable[str | None]] | None = None
        self._embedder: Any = None  # the device's embedder where no index is open

    # ------------------------------------------------------------------ loading

    def load_device(self, threads: int | None = None) -> DeviceModel:
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
            self.device = DeviceModel.load(folder, threads=threads)
        return self.device

    def open_index(self) -> PersonalIndex:
        """The private index, created empty on first use (loads the embedder: a second). A
        document that leaves it, however, takes its text out of the stored citations."""
        if self.index is None:
            from personal_index.index import PersonalIndex

            self.index = PersonalIndex(*index_paths())
        if self._citations_kept_for is not self.index:
            self.index.on_removed(self._forget_citations)
            self._citations_kept_for = self.index
        return self.index

    def _forget_citations(self, paths: list[str]) -> None:
        """Called in the removing thread (the store is thread-safe)."""
        changed = self.conversations.forget_document_text(paths)
        if changed:
            log.info("dropped the text of %d citations of removed documents", changed)

    def existing_index(self) -> PersonalIndex | None:
        """The private index if the user has indexed anything (a one-shot question need not
        create an empty one)."""
        if self.index is None and not any(index_paths()[0].glob("*.sqlite")):
            return None
        index = self.open_index()
        return index if self.index_has_documents() else None

    def scope(self, paths: Sequence[str | Path]) -> tuple[str, ...]:
        """The documents a scoped question reads from (`tandem ask --in`, the TUI's @
        mentions): each path resolved as the index stores it. A path under which nothing is
        indexed is an error (ScopeError), never an answer from no document."""
        resolved = tuple(dict.fromkeys(str(Path(p).expanduser().resolve()) for p in paths))
        index = self.existing_index()
        empty = [p for p in resolved if index is None or not index.store.chunk_ids_under([p])]
        if empty:
            raise ScopeError(
                f"nothing is indexed at or under {', '.join(empty)} "
                "(`tandem docs list` shows what is; `tandem ingest PATH` adds it)"
            )
        return resolved

    def index_has_documents(self) -> bool:
        return self.index is not None and self.index.has_documents()

    def index_changed(self) -> None:
        """Documents were added or removed: retrieval starts or stops using the index."""
        if self._ctx is not None:
            self._ctx.index = self.index if self.index_has_documents() else None

    @property
    def conversations(self) -> ConversationStore:
        """The conversation history (opened on first use)."""
        if self._conversations is None:
            from app.conversations import ConversationStore

            self._conversations = ConversationStore(conversations_path())
        return self._conversations

    # ------------------------------------------------------------------ cloud

    def _set_cloud(self, status: CloudStatus, on_status: Callable[[CloudStatus], None] | None):
        self.cloud_status = status
        if on_status is not None:
            on_status(status)

    def cloud_expected(self) -> None:
        """The cloud will be connected once the device model is loaded: say so meanwhile."""
        url, _ = effective_cloud(self.settings)
        self.cloud_status = CloudStatus(
            "starting", "waiting for the device model", embedded=not url
        )

    def cloud_skipped(self) -> None:
        self.cloud_status = CloudStatus("off", "not connected at start")

    def cloud_idle(self) -> None:
        """The cloud is connected on first use by a mode that needs it, not at start (the
        selected mode keeps questions on this device): until then no connection is opened."""
        url, _ = effective_cloud(self.settings)
        self.cloud_status = CloudStatus("idle", "connects when a mode needs it", embedded=not url)

    async def connect_cloud(
        self, on_status: Callable[[CloudStatus], None] | None = None
    ) -> CloudStatus:
        """Reach the configured cloud, or start the embedded backend when none is configured;
        then open a session once (token, tokenizer and version are checked at handshake).
        `on_status` hears every change of `cloud_status` on the way."""
        from edge_runtime.client import shown_url
        from edge_runtime.modes.base import CloudSettings

        url, token = effective_cloud(self.settings)
        embedded = not url
        try:
            self._set_cloud(
                CloudStatus("starting", "" if embedded else shown_url(url), embedded=embedded),
                on_status,
            )
            if embedded:
                url, token = await self._start_embedded(on_status)
            ctx = self.context()
            s = self.settings
            ctx.cloud = CloudSettings(
                url,
                token,
                retries=1,
                ca_file=s.cloud_ca or None,
                allow_insecure=s.cloud_allow_insecure,
                embedded=embedded,
            )
            if self.device is not None:
                await self._probe()
            ready = CloudStatus("ready", shown_url(url), embedded, self.cloud_status.search)
            self._set_cloud(ready, on_status)
        except Exception as exc:  # any failure: say why, local mode still works
            log.info("cloud unavailable: %s", exc)
            self._set_cloud(CloudStatus("unavailable", _plain(exc), embedded=embedded), on_status)
        return self.cloud_status

    async def _start_embedded(
        self, on_status: Callable[[CloudStatus], None] | None
    ) -> tuple[str, str]:
        from app.embedded import EmbeddedCloud

        def searching(what: str) -> None:
            """Public search by keyword until the meaning index is built: say so, then stop."""
            shown = "" if what == "meaning" else what
            self._set_cloud(dataclasses.replace(self.cloud_status, search=shown), on_status)

        if self._embedded is None or self._embedded.proc.returncode is not None:
            args = ["--engine", self.settings.cloud_engine]
            if self.settings.cloud_model:
                args += ["--model-dir", str(Path(self.settings.cloud_model).expanduser())]
            self._embedded = await EmbeddedCloud.start(args, on_search=searching)
        return self._embedded.url, self._embedded.token

    async def _probe(self) -> None:
        """Open the cloud-mode session now, so a wrong token or model shows before asking."""
        mode = self.mode("cloud")
        await mode.client()  # type: ignore[attr-defined]

    def link_alive(self) -> bool:
        """Whether any open cloud session is still connected (a refusal keeps it; a dropped
        server does not)."""
        ctx = self._ctx
        return ctx is not None and any(c.connected for c in ctx.clients.values())

    def cloud_lost(self, reason: str) -> bool:
        """After a failure: if no cloud session is left connected, the cloud went away; mark
        it unavailable (True) so the cloud modes show why until it is reconnected."""
        if self.cloud_status.state == "ready" and not self.link_alive():
            self.cloud_status = CloudStatus(
                "unavailable", reason, embedded=self.cloud_status.embedded
            )
            return True
        return False

    # ------------------------------------------------------------------ modes

    def context(self) -> ModeContext:
        if self._ctx is None:
            from edge_runtime.modes.base import ModeContext

            self._ctx = ModeContext(
                variant=self.settings.variant,
                aggregator=self.settings.aggregator,
                finish_locally=self.finish_locally,
                settings=dict(self.settings.modes),
                modes=self.mode,
            )
        self._ctx.device = self.device
        self._ctx.index = self.index if self.index_has_documents() else None
        self._ctx.cloud_starting = self.cloud_status.state == "starting"
        self._ctx.judge = self.relevance
        self._ctx.consent = self.consent()
        return self._ctx

    def consent(self) -> Consent:
        """What the user said about each cloud taking part in answers shaped by private
        passages (settings `cloud_consent`), and how to ask them (the front end's dialog)."""
        from edge_runtime.consent import Consent

        async def ask(identity: str) -> Any:
            return await self.consent_asker(identity) if self.consent_asker else None

        return Consent(
            dict(self.settings.cloud_consent),
            ask if self.consent_asker is not None else None,
            self._remember_consent,
        )

    def _remember_consent(self, identity: str, said: str) -> None:
        from app.settings import save_settings

        self.settings.cloud_consent = {**self.settings.cloud_consent, identity: said}
        save_settings(self.settings)

    def relevance(self, question: str, texts: Sequence[str]) -> list[float]:
        """The device's own cosine of each text with the question (its embedder: the index's,
        or loaded alone): how it checks the relevance a cloud claims for public passages."""
        from retrieval.embedder import question_cosines

        embedder = self.index.embedder if self.index is not None else self._embedder
        if embedder is None:
            from collab.plumbing.paths import embedder_dir
            from retrieval.embedder import OnnxEmbedder, prepare_onnx_embedder

            embedder = self._embedder = OnnxEmbedder(prepare_onnx_embedder(embedder_dir()))
        return question_cosines(embedder.embed, question, texts)

    def mode(self, name: str) -> Orchestrator:
        from edge_runtime.modes import build_mode

        ctx = self.context()
        if name == "split" and ctx.variant != self.settings.variant:
            self._modes.pop(name, None)
            ctx.variant = self.settings.variant
        if name not in self._modes:
            self._modes[name] = build_mode(name, ctx)
        return self._modes[name]

    def may_use_cloud(self, mode: str) -> bool:
        """Whether answers in `mode` may reach the cloud (auto: unless its policy keeps
        questions on this device), so a one-shot question connects only when it may."""
        if mode == "auto":
            return bool(self.settings.auto_cloud_questions)
        return mode != "local"

    def modes(self) -> list[ModeInfo]:
        """Every registered mode and whether it can answer now (and why not)."""
        from edge_runtime.modes import modes

        out = []
        for name, cls in modes().items():
            available, reason = True, ""
            if self.device is None:
                available, reason = False, "the device model is loading"
            elif cls.needs_cloud and self.cloud_status.state not in ("ready", "idle"):
                available = False
                reason = f"{self.cloud_status.label}: {self.cloud_status.detail}".rstrip(": ")
            out.append(ModeInfo(name, cls.description, cls.needs_cloud, available, reason))
        return out

    def options(self, **overrides: Any) -> AnswerOptions:
        """Answer options from the settings, with per-question overrides (CLI flags)."""
        from edge_runtime.options import AnswerOptions

        s = self.settings
        base = AnswerOptions(
            max_new_tokens=s.max_tokens,
            temperature=s.temperature,
            k=s.k,
            min_score=s.relevance_floor,
            eta=s.eta,
            pipeline=s.pipeline,
        )
        return dataclasses.replace(base, **overrides)

    def exchange(
        self,
        question: str,
        mode: str,
        *,
        conversation_id: int | None = None,
        options: AnswerOptions | None = None,
        save: bool = True,
    ) -> Exchange:
        """Ask `question` in `mode` within a conversation (a new one if None). With `save`,
        the question and the answer as it ends are written to the conversation history."""
        from edge_runtime.modes.base import Turn

        # Another process (`tandem ingest` in a second terminal, a watched folder's sync) may
        # have added or removed documents: retrieval starts or stops using the index, and the
        # store catches its vectors up at the next search.
        self.index_changed()
        orchestrator = self.mode(mode)
        history: list[Turn] = []
        title, on_end = "", None
        if save:
            store = self.conversations
            if conversation_id is None:
                conversation_id = store.create().id
            cid = conversation_id
            history = [
                Turn(t.question, t.answer, t.mode, t.shared, t.shared_with)
                for t in store.turns(cid)
            ]
            store.add_message(cid, "user", question, mode)
            store.set_title_from_question(cid, question)
            title = store.get(cid).title
            message_id = store.add_message(cid, "assistant", "", mode, status="streaming")

            def on_end(ex: Exchange) -> None:
                stats = ex.stats.as_dict() if ex.stats else {}
                if ex.stats is None and (live := ex.live_stats()) is not None:
                    stats["sent"] = live.sent  # cancelled: what had left (edge_runtime.sent)
                stats["shared_tokens"] = ex.provenance()["shared_tokens"]
                store.update_message(
                    message_id,
                    text=ex.text,
                    citations=ex.citations,
                    stats=stats,
                    status=ex.status,
                    error=ex.error,
                    shared_chars=ex.shared_chars,
                    shared_with=ex.shared_with,
                )

        events = orchestrator.answer(question, history, options or self.options())
        return Exchange(
            question, mode, conversation_id, title, orchestrator, _events=events, _on_end=on_end
        )

    def cancel_device(self) -> None:
        """Interrupt a device model step in flight (the answer task is cancelled separately)."""
        if self.device is not None:
            self.device.cancel()

    async def apply_settings(self, settings: Settings) -> bool:
        """Take new settings; returns True if the cloud link must be re-established."""
        old, self.settings = self.settings, settings
        if self._ctx is not None:
            self._ctx.variant = settings.variant
            self._ctx.aggregator = settings.aggregator  # dragon reads it per answer
            self._ctx.settings = dict(settings.modes)  # every mode's own, read per answer
        self._modes.pop("split", None)
        relink = (
            effective_cloud(old) != effective_cloud(settings)
            or old.cloud_engine != settings.cloud_engine
            or old.cloud_model != settings.cloud_model
        )
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
        if self._conversations is not None:
            self._conversations.close()


def _plain(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]
