"""The Tandem TUI: chat, sources, modes and live figures in one Textual app.

The window appears at once; the mode registry, the device model, the private index and the
cloud (the embedded backend when none is configured) load in workers and report to the status
bar. Answers come from the CLI's orchestrators (`edge_runtime.modes`) through `Assistant`."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from app.assistant import Assistant, CloudStatus, Exchange
from app.plain import strip_controls
from app.settings import (
    Settings,
    SettingsError,
    keep_upgraded_default,
    load_settings,
    save_settings,
)
from app.tui.chat_view import AnswerView, ConversationView, PromptInput
from app.tui.clipboard import copy_from_answer
from app.tui.mentions import ScopeSuggester, resolve, split_mentions
from app.tui.plain import markup_escaped, plain
from app.tui.sources import SourceScreen, SourcesPanel, by_number
from app.tui.status import ModeBar, StatusBar, figures
from collab.plumbing.paths import config_path, describe_paths, export_dir

if TYPE_CHECKING:
    from textual.timer import Timer

    from edge_runtime.events import Stats
    from personal_index.ingest import FileResult
    from personal_index.watch import FolderWatcher

log = logging.getLogger("tandem.tui")
LIVE_REFRESH_S = 0.25
REASKED = "asked again in another mode"
"""The status bar's reason while a question is re-asked (F6) in a mode not picked."""


class DeviceLoaded(Message):
    def __init__(self, error: str | None = None) -> None:
        super().__init__()
        self.error = error


class IndexOpened(Message):
    def __init__(self, error: str | None = None) -> None:
        super().__init__()
        self.error = error


class TandemApp(App[None]):
    """`tandem` with no arguments."""

    TITLE = "Tandem"
    CSS_PATH = Path(__file__).with_name("tandem.tcss")  # absolute: subclasses live elsewhere
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("f1", "help", "Help", id="help"),
        Binding("escape", "cancel_answer", "Cancel", id="cancel_answer", show=False),
        Binding("ctrl+o", "cycle_mode", "Mode", id="cycle_mode", priority=True),
        Binding("ctrl+n", "new_conversation", "New chat", id="new_conversation", priority=True),
        Binding("f2", "documents", "Documents", id="documents"),
        Binding("f3", "conversations", "Chats", id="conversations"),
        Binding("f4", "settings", "Settings", id="settings"),
        Binding("f5", "toggle_sources", "Sources", id="toggle_sources"),
        Binding("f6", "reask_other_mode", "Other mode", id="reask_other_mode"),
        Binding("ctrl+r", "reconnect_cloud", "Reconnect", id="reconnect_cloud", show=False),
        Binding("f7", "what_was_sent", "What was sent", id="what_was_sent", show=False),
        Binding("ctrl+y", "copy_answer", "Copy answer", id="copy_answer", show=False),
        Binding("ctrl+b", "copy_code", "Copy code", id="copy_code", show=False),
    ]

    def __init__(
        self,
        settings: Settings | None = None,
        assistant: Assistant | None = None,
        *,
        connect_cloud: bool = True,
    ) -> None:
        super().__init__()
        self.settings_error: str | None = None
        self.upgrade_notice: str | None = None
        if settings is None:
            self.upgrade_notice = keep_upgraded_default()
            try:
                settings = load_settings()
            except SettingsError as exc:  # start on defaults; the file is left as it is
                self.settings_error = str(exc)
                settings = Settings()
        self.settings = settings
        self.assistant = assistant or Assistant(settings)
        self.assistant.consent_asker = self.ask_consent
        self.store = self.assistant.conversations
        self.conversation_id: int | None = None
        self.mode_name = settings.default_mode
        # connect at start only where the selected mode may use the cloud; else on first use
        # by a mode that needs it (a policy keeping questions here opens no connection)
        self.connect_cloud_at_start = connect_cloud and self.assistant.may_use_cloud(self.mode_name)
        if self.connect_cloud_at_start:  # reported as starting until the device model loads
            self.assistant.cloud_expected()
        elif connect_cloud:
            self.assistant.cloud_idle()
        self._connect_later = connect_cloud and not self.connect_cloud_at_start
        self.sources: list[dict[str, Any]] = []
        self._live_timer: Timer | None = None
        self._exchange: Exchange | None = None  # the answer streaming now
        self._answer_started = 0.0
        self._applying_theme = False
        self.watcher: FolderWatcher | None = None
        self.crash: Exception | None = None
        """The unhandled exception that stopped the app, if one did."""

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        with Horizontal(id="topbar"):
            yield Static("Tandem", id="app-title")
            yield ModeBar(id="modes")
            yield Static("", id="conversation-title")
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield ConversationView(id="conversation")
                yield PromptInput(
                    placeholder="Ask anything  (F1 help · ctrl+p commands)",
                    id="prompt",
                    suggester=ScopeSuggester(self._document_paths),
                )
            yield SourcesPanel(id="sources")
        yield StatusBar(id="status")
        yield Footer()

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def conversation(self) -> ConversationView:
        return self.query_one(ConversationView)

    def on_mount(self) -> None:
        if self.settings.keymap:
            self.set_keymap(self.settings.keymap)
        self._applying_theme = True
        if self.settings.theme in self.available_themes:
            self.theme = self.settings.theme
        self._applying_theme = False
        self.query_one("#sources").display = self.size.width >= 110
        self.status.set_state(mode=self.mode_name, cloud=self.assistant.cloud_status)
        if self.settings_error:
            self.say(f"{self.settings_error}. Started on defaults.", severity="error", timeout=10)
        if self.upgrade_notice:
            self.say(self.upgrade_notice, timeout=15)
        self.open_latest_conversation()
        self.query_one(PromptInput).focus()
        self.load_modes()

    def say(
        self, message: str, severity: SeverityLevel = "information", timeout: float | None = None
    ) -> None:
        """A toast; never markup (messages carry paths and error text)."""
        self.notify(strip_controls(message), severity=severity, timeout=timeout, markup=False)

    def watch_theme(self, theme: str) -> None:
        """Themes picked in the palette persist to the config file."""
        if self._applying_theme or not hasattr(self, "settings") or theme == self.settings.theme:
            return
        self.settings.theme = theme
        self._save_settings(self.settings)

    def _save_settings(self, settings: Settings) -> None:
        try:
            save_settings(settings)
        except OSError as exc:
            self.say(f"could not save settings: {exc}", severity="error")

    # ------------------------------------------------------------------ start-up workers

    @work(thread=True, group="load", exit_on_error=False)
    def load_modes(self) -> None:
        """Import the mode registry, then load the device model and the private index."""
        from edge_runtime.modes import modes

        modes()  # heavy imports, off the event loop
        self.call_from_thread(self.refresh_modes)
        try:
            device = self.assistant.load_device()
            self.post_message(DeviceLoaded())
            log.info("device model %s loaded", device.name)
        except Exception as exc:
            self.post_message(DeviceLoaded(f"{exc}"))
        try:
            if self.assistant.index is None:
                self.assistant.open_index()
            self.post_message(IndexOpened())
        except Exception as exc:
            self.post_message(IndexOpened(f"{exc}"))

    def on_device_loaded(self, message: DeviceLoaded) -> None:
        if message.error:
            self.status.set_state(device=f"device model unavailable: {message.error}")
            self.say(
                f"the device model could not be loaded: {message.error}",
                severity="error",
                timeout=15,
            )
        else:
            assert self.assistant.device is not None  # loaded without an error
            self.status.set_state(device=f"device {self.assistant.device.name}")
            if self.connect_cloud_at_start:
                self.connect_cloud()
            elif not self._connect_later:
                self.assistant.cloud_skipped()
        self.refresh_modes()

    def on_index_opened(self, message: IndexOpened) -> None:
        if message.error:
            self.say(f"the private index could not be opened: {message.error}", severity="error")
        else:
            self.watch_folders()

    # ------------------------------------------------------------------ watched folders

    @work(group="watch", exclusive=True, exit_on_error=False)
    async def watch_folders(self) -> None:
        """Keep the folders added in the app in sync with the index while the app runs."""
        from personal_index.watch import FolderWatcher

        index = self.assistant.index
        if index is None:
            return
        self.watcher = FolderWatcher(
            index, on_synced=self._folder_synced, max_file_mb=self.settings.ingest_max_mb
        )
        try:
            await self.watcher.run()
        except Exception as exc:  # inotify limits, a folder we may not read: say it, go on
            log.exception("watching folders failed")
            self.say(f"watched folders are not kept in sync: {exc}", severity="warning")
        finally:
            self.watcher = None

    def _folder_synced(
        self, folder: str, results: list[FileResult] | None, error: str | None
    ) -> None:
        from app.tui.documents import DocumentsScreen, summarize, tilde

        if error is not None:
            self.say(f"could not sync {tilde(folder)}: {error}", severity="warning")
            return
        changed = [r for r in results or [] if r.outcome in ("indexed", "failed", "removed")]
        if changed:
            self.assistant.index_changed()
            self.say(f"{tilde(folder)} synced: {summarize(changed)}")
        screen = self.screen
        if isinstance(screen, DocumentsScreen):
            screen.refresh_index()

    def _folder_added(self, _folder: str) -> None:
        if self.watcher is not None:
            self.watcher.reload()

    def _rescan_folders(self) -> None:
        if self.watcher is not None:
            self.watcher.rescan()
        else:
            self.say("the private index is still loading", severity="warning")

    @work(group="cloud", exclusive=True, exit_on_error=False)
    async def connect_cloud(self) -> None:
        status = await self.assistant.connect_cloud(on_status=self._cloud_status_changed)
        if status.state == "unavailable":
            self.say(
                f"{status.label}: {status.detail}. Local mode still works.",
                severity="warning",
                timeout=10,
            )
        self.refresh_modes()

    def _cloud_status_changed(self, _status: CloudStatus) -> None:
        """The cloud's state (e.g. the corpus build's progress) on the mode and status bars,
        unless a screen without them is on top."""
        if self.query_one_optional(ModeBar) is not None:
            self.refresh_modes()

    def refresh_modes(self) -> None:
        """Mode bar, status bar and the current mode's availability, from the registry."""
        try:
            infos = self.assistant.modes()
        except Exception:  # registry not imported yet
            return
        names = [i.name for i in infos]
        if self.mode_name not in names:
            self.mode_name = "local" if "local" in names else names[0]
        self.query_one(ModeBar).show(infos, self.mode_name)
        self.status.set_state(mode=self.mode_name, cloud=self.assistant.cloud_status)

    # ------------------------------------------------------------------ modes

    def set_mode(self, name: str) -> None:
        info = {i.name: i for i in self.assistant.modes()}.get(name)
        if info is None:
            self.say(f"unknown mode {name!r}", severity="error")
            return
        if not info.available:
            self.say(f"{name} is unavailable: {info.reason}", severity="warning")
            return
        self.mode_name = name
        self.refresh_modes()
        if self._cloud_waits_for(name):  # first use of a mode that needs it: connect now
            self.connect_cloud()

    def _cloud_waits_for(self, mode: str) -> bool:
        """Whether the cloud is still to be connected and `mode` may use it."""
        idle = self.assistant.cloud_status.state == "idle"
        return idle and self.assistant.device is not None and self.assistant.may_use_cloud(mode)

    async def ask_consent(self, identity: str) -> str | None:
        """Ask whether `identity` may take part in answers shaped by private passages
        (edge_runtime.consent): "always", "once", "never", or None (not this time)."""
        from app.tui.consent import ConsentScreen

        said = await self.push_screen(ConsentScreen(identity), wait_for_dismiss=True)
        if said in ("always", "never"):
            self.settings = self.assistant.settings
            self.say(f"remembered for {identity}: {said} (change it in the settings, F4)")
        return said

    def action_cycle_mode(self) -> None:
        try:
            infos = self.assistant.modes()
        except Exception:
            return
        names = [i.name for i in infos]
        start = names.index(self.mode_name) if self.mode_name in names else -1
        for step in range(1, len(names) + 1):
            info = infos[(start + step) % len(names)]
            if info.available:
                self.set_mode(info.name)
                return
        self.say("no mode is available yet", severity="warning")

    @on(ModeBar.Selected)
    def _mode_clicked(self, event: ModeBar.Selected) -> None:
        self.set_mode(event.name)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        try:
            infos = self.assistant.modes()
        except Exception:
            infos = []
        for info in infos:
            help_text = info.description + (f" (unavailable: {info.reason})" if info.reason else "")
            yield SystemCommand(
                f"Mode: {info.name}",
                markup_escaped(help_text),
                lambda name=info.name: self.set_mode(name),
            )
        yield SystemCommand(
            "New conversation", "Start a new conversation", self.action_new_conversation
        )
        yield SystemCommand(
            "Conversations",
            "List, open, rename, delete or export conversations",
            self.action_conversations,
        )
        yield SystemCommand(
            "Export conversation",
            "Write this conversation as Markdown and JSON",
            self.action_export,
        )
        yield SystemCommand(
            "Documents", "Add, remove and inspect private documents", self.action_documents
        )
        yield SystemCommand(
            "Settings",
            markup_escaped(f"Cloud, models, default mode… ({config_path()})"),
            self.action_settings,
        )
        yield SystemCommand("Sources", "Show or hide the sources panel", self.action_toggle_sources)
        yield SystemCommand(
            "Ask again in another mode",
            "The last question, in the next mode after the one that answered "
            "it (the selected mode stays)",
            self.action_reask_other_mode,
        )
        yield SystemCommand(
            "Reconnect to the cloud", "Try the cloud link again", self.action_reconnect_cloud
        )
        yield SystemCommand(
            "What was sent",
            "What left this device for the selected answer "
            "(or the last): by kind, with the texts that left",
            self.action_what_was_sent,
        )
        yield SystemCommand(
            "Copy answer",
            "The selected answer (or the last), as Markdown, to the clipboard",
            self.action_copy_answer,
        )
        yield SystemCommand(
            "Copy code block",
            "The selected answer's last code block, to the clipboard",
            self.action_copy_code,
        )
        yield SystemCommand("Help", "Keys and where data lives", self.action_help)

    # ------------------------------------------------------------------ conversations

    def open_latest_conversation(self) -> None:
        rows = self.store.list()
        self.show_conversation(rows[0].id if rows else None)

    def show_conversation(self, conversation_id: int | None) -> None:
        self.conversation_id = conversation_id
        view = self.conversation
        prompt = self.query_one(PromptInput)
        if conversation_id is None:
            view.clear()
            self.query_one("#conversation-title", Static).update("new conversation")
            self.sources = []
            self.query_one(SourcesPanel).show([])
            prompt.set_history([])
            return
        row = self.store.get(conversation_id)
        messages = self.store.messages(conversation_id)
        view.load(messages)
        self.query_one("#conversation-title", Static).update(plain(row.title))
        answers = [m for m in messages if m.role == "assistant"]
        self.sources = by_number(answers[-1].citations) if answers else []
        self.query_one(SourcesPanel).show(self.sources)
        prompt.set_history([m.text for m in messages if m.role == "user"])

    def action_new_conversation(self) -> None:
        if self.answering:
            self.say("an answer is streaming: Esc cancels it first", severity="warning")
            return
        self.show_conversation(None)

    def action_conversations(self) -> None:
        from app.tui.conversations_screen import ConversationsScreen

        def opened(conversation_id: int | None) -> None:
            ids = {r.id for r in self.store.list()}
            if conversation_id is not None:
                self.show_conversation(conversation_id)
            elif self.conversation_id is not None and self.conversation_id not in ids:
                self.show_conversation(None)  # the open one was deleted

        if self.answering:
            self.say("an answer is streaming: Esc cancels it first", severity="warning")
            return
        self.push_screen(
            ConversationsScreen(self.store, self.conversation_id, export_dir=export_dir()), opened
        )

    def action_export(self) -> None:
        if self.conversation_id is None:
            self.say("nothing to export yet", severity="warning")
            return
        md, js = self.store.export_files(self.conversation_id, export_dir())
        self.say(f"exported to {md} and {js.name}")

    # ------------------------------------------------------------------ asking

    @property
    def answering(self) -> bool:
        return any(w.group == "answer" and w.is_running for w in self.workers)

    @on(PromptInput.Submitted, "#prompt")
    def _submitted(self, event: PromptInput.Submitted) -> None:
        question = event.value.strip()
        if not question:
            return
        from app.tui.dropped import ConfirmAdd, dropped_path

        dropped = dropped_path(question)
        if dropped is not None:  # a file dropped on the terminal: offer to add it
            self.push_screen(ConfirmAdd(dropped), partial(self._add_dropped, event.input, dropped))
            return
        question, mentioned = split_mentions(question)
        scope, unknown = resolve(mentioned, self._document_paths()) if mentioned else ([], [])
        if unknown:
            self.say(
                "nothing in your documents is named " + ", ".join(f"@{m}" for m in unknown),
                severity="warning",
            )
            return
        if not question:
            self.say("ask a question after the @ mentions", severity="warning")
            return
        if self.answering:
            self.say("an answer is streaming: Esc cancels it", severity="warning")
            return
        info = next((i for i in self._mode_infos() if i.name == self.mode_name), None)
        if info is None or not info.available:
            reason = info.reason if info else "the modes are still loading"
            self.say(f"{self.mode_name} can't answer now: {reason}", severity="warning")
            return
        event.input.value = ""
        self.ask(question, self.mode_name, scope=tuple(scope))

    def _add_dropped(self, prompt: Input, path: Path, yes: bool | None) -> None:
        """After the question whether to add a dropped path: the Documents screen ingests it
        (its progress and results shown there); the prompt keeps the text on a no."""
        if yes:
            prompt.value = ""
            self.action_documents(add=path)

    def _mode_infos(self):
        try:
            return self.assistant.modes()
        except Exception:
            return []

    def _last_question(self) -> tuple[str, str] | None:
        """The current conversation's last question and the mode that answered it (for an
        `auto` answer, the mode auto chose; "auto" if it had not chosen yet)."""
        if self.conversation_id is None:
            return None
        messages = self.store.messages(self.conversation_id)
        for i in range(len(messages) - 1, -1, -1):
            if messages[i].role == "user":
                answer = next((m for m in messages[i + 1 :] if m.role == "assistant"), None)
                mode = answer.mode if answer is not None else messages[i].mode
                if mode == "auto" and answer is not None:
                    mode = str(answer.stats.get("auto_mode") or mode)
                return messages[i].text, mode
        return None

    def action_reask_other_mode(self) -> None:
        """Ask the last question again in the next available mode after the one that answered
        it (never `auto`: it would pick again); each press goes one mode further. The selected
        mode stays selected: the next typed question goes to it."""
        if self.answering:
            self.say("an answer is streaming: Esc cancels it first", severity="warning")
            return
        last = self._last_question()
        if last is None:
            self.say("nothing to ask again yet", severity="warning")
            return
        question, answered = last
        infos = self._mode_infos()
        names = [i.name for i in infos]
        start = names.index(answered) if answered in names else -1
        for step in range(1, len(names) + 1):
            info = infos[(start + step) % len(names)]
            if info.name == answered:
                break
            if info.available and info.name != "auto":
                self.say(f"asking again in {info.name}")
                self.ask(question, info.name, reask=True)
                return
        self.say(f"no mode other than {answered} can answer now", severity="warning")

    @work(group="answer", exclusive=True, exit_on_error=False)
    async def ask(
        self, question: str, mode: str, *, reask: bool = False, scope: tuple[str, ...] = ()
    ) -> None:
        """Stream one answer into the view; the assistant keeps the conversation. Esc cancels
        (the partial answer is kept and marked). `reask`: the question is asked again in a
        mode that is not the selected one (the status bar says so). `scope`: the documents
        its private passages come from (the prompt's @ mentions)."""
        from edge_runtime.events import Citation, Failure, ModeChoice, Notice, Stats, TextDelta

        if self._cloud_waits_for(mode):  # the first question in a mode that may use it
            await self.assistant.connect_cloud(on_status=self._cloud_status_changed)
            self.refresh_modes()
        options = self.assistant.options(scope=scope) if scope else None
        exchange = self.assistant.exchange(
            question, mode, conversation_id=self.conversation_id, options=options
        )
        self._exchange = exchange
        self.conversation_id = exchange.conversation_id
        self.query_one("#conversation-title", Static).update(plain(exchange.title))
        view = self.conversation
        view.add_question(question)
        answer: AnswerView = view.add_answer(mode)
        if scope:
            from app.tui.documents import tilde

            answer.add_notice("from your documents in " + ", ".join(tilde(p) for p in scope))
        self.sources = []
        self.query_one(SourcesPanel).show([])
        note = ""
        final: Stats | None = None
        self.status.set_state(choice=(mode, REASKED) if reask else None)
        self._start_live(exchange)
        events = exchange.events()
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    await answer.append(event.text)
                elif isinstance(event, Citation):
                    src = exchange.citations[-1]
                    answer.add_citation(**src)
                    self.sources = by_number([*self.sources, src])
                    self.query_one(SourcesPanel).add(src)
                elif isinstance(event, ModeChoice):  # auto says which mode answers, and why
                    self.status.set_state(choice=(event.mode, event.reason))
                    answer.choose(event.mode, event.reason)
                elif isinstance(event, Notice):
                    answer.add_notice(event.text)
                elif isinstance(event, Failure):
                    self.say(
                        event.message,
                        severity="warning" if event.recoverable else "error",
                        timeout=8,
                    )
                    answer.add_notice(f"⚠ {event.message}")
                    self._cloud_lost(event.message)
                elif isinstance(event, Stats):
                    final = event
            note = figures(final) if final else ""
        except asyncio.CancelledError:
            note = "cancelled — partial answer kept"
            raise
        except Exception as exc:  # a bug or a dead model: say it, keep the conversation
            log.exception("answer failed")
            note = f"{type(exc).__name__}: {exc}"
            self.say(f"the answer failed: {note}", severity="error")
        finally:
            await events.aclose()
            self._exchange = None
            self._stop_live(final)
            if exchange.status == "failed" and not answer.text:
                note = exchange.error or "failed"
            await answer.finish(exchange.status, note)

    def action_cancel_answer(self) -> None:
        if not self.answering:
            return
        self.workers.cancel_group(self, "answer")
        self.assistant.cancel_device()

    def _cloud_lost(self, message: str) -> None:
        """A failure with no cloud session left connected: the cloud went away. Mark it
        unavailable (the answer goes on if it can); ctrl+r reconnects."""
        if self.assistant.cloud_lost(message):
            self.refresh_modes()

    def _start_live(self, exchange) -> None:
        self._answer_started = time.perf_counter()
        self.status.set_state(answering=True, stats=None)

        def tick() -> None:
            if (stats := exchange.live_stats()) is not None:
                self.status.set_state(stats=stats)

        self._live_timer = self.set_interval(LIVE_REFRESH_S, tick)

    def _stop_live(self, final: Stats | None) -> None:
        if self._live_timer is not None:
            self._live_timer.stop()
            self._live_timer = None
        self.status.set_state(answering=False, **({"stats": final} if final else {}))

    # ------------------------------------------------------------------ sources

    def action_toggle_sources(self) -> None:
        panel = self.query_one(SourcesPanel)
        panel.display = not panel.display

    @on(SourcesPanel.Open)
    def _open_source(self, event: SourcesPanel.Open) -> None:
        self.push_screen(SourceScreen(event.src, self._indexed_chunks))

    @on(AnswerView.SourceSelected)
    def _citation_clicked(self, event: AnswerView.SourceSelected) -> None:
        if event.answer is None:
            return
        src = next((s for s in event.answer.sources if s["number"] == event.number), None)
        if src is not None:
            self.push_screen(SourceScreen(src, self._indexed_chunks))

    def _document_paths(self) -> list[str]:
        """The indexed documents' paths (what an @ mention can name)."""
        index = self.assistant.index
        return [d.path for d in index.store.documents()] if index is not None else []

    def _indexed_chunks(self, path: str) -> list[Any]:
        """A document's chunks as indexed (the pager's view of a file that is not text)."""
        index = self.assistant.index
        return index.store.document_chunks(path) if index is not None else []

    # ------------------------------------------------------------------ what was sent

    def _selected_answer(self) -> AnswerView | None:
        """The answer holding the focus (a citation line of it), else the last one shown."""
        focused = self.focused
        if focused is not None:
            for widget in (focused, *focused.ancestors):
                if isinstance(widget, AnswerView):
                    return widget
        answers = self.conversation.query(AnswerView)
        return answers.last() if answers else None

    def action_what_was_sent(self) -> None:
        """What left this device for the selected answer (edge_runtime.sent): its ledger as
        stored with the answer, or so far while it streams."""
        from app.tui.sent_screen import SentScreen

        view = self._selected_answer()
        if view is None:
            self.say("no answer yet: nothing was sent", severity="warning")
            return
        if not view.finished and self._exchange is not None:
            live = self._exchange.live_stats()
            sent = live.sent if live is not None else []
            self.push_screen(SentScreen(sent, self._exchange.question, live=True))
            return
        answers = list(self.conversation.query(AnswerView))
        back = len(answers) - answers.index(view)  # stored answers from the end: shown ones
        messages = self.store.messages(self.conversation_id) if self.conversation_id else []
        at = [i for i, m in enumerate(messages) if m.role == "assistant"]
        if back > len(at):
            self.say("this answer is not in the conversation history", severity="warning")
            return
        i = at[-back]
        question = next((m.text for m in reversed(messages[:i]) if m.role == "user"), "")
        self.push_screen(SentScreen(messages[i].stats.get("sent"), question))

    async def action_copy_answer(self) -> None:
        view = self._selected_answer()
        await copy_from_answer(self, view.text if view else None, code=False)

    async def action_copy_code(self) -> None:
        view = self._selected_answer()
        await copy_from_answer(self, view.text if view else None, code=True)

    # ------------------------------------------------------------------ other screens

    def action_documents(self, add: Path | None = None) -> None:
        """The Documents screen; with `add`, ingesting that file or folder at once."""
        from app.tui.documents import DocumentsScreen

        screen = DocumentsScreen(
            self.assistant.open_index,
            start_path=add or Path.home(),
            add_on_open=add,
            on_folder_added=self._folder_added,
            on_rescan=self._rescan_folders,
            on_folder_removed=self._folder_added,  # either way: watch the new list
        )
        self.push_screen(screen)

    def on_documents_screen_index_changed(self, _message) -> None:
        self.assistant.index_changed()

    def action_settings(self) -> None:
        from app.tui.settings_screen import SettingsScreen

        names = [i.name for i in self._mode_infos()] or [self.settings.default_mode]
        self.push_screen(
            SettingsScreen(self.settings, config_path(), names, sorted(self.available_themes)),
            # textual types a @work method as returning its Worker
            self._settings_saved,  # type: ignore[arg-type]
        )

    @work(exclusive=True, group="settings", exit_on_error=False)
    async def _settings_saved(self, settings: Settings | None) -> None:
        if settings is None:
            return
        self.settings = settings
        if settings.keymap:
            self.set_keymap(settings.keymap)
        if settings.theme in self.available_themes and settings.theme != self.theme:
            self._applying_theme = True
            self.theme = settings.theme
            self._applying_theme = False
        if await self.assistant.apply_settings(settings):
            self.connect_cloud()
        self.say(f"settings saved to {config_path()}")

    def action_reconnect_cloud(self) -> None:
        if self.assistant.device is None:
            self.say("the device model is not loaded yet", severity="warning")
            return
        self.connect_cloud()

    def action_help(self) -> None:
        from app.tui.help import HelpScreen

        keymap = self.settings.keymap
        rows = [
            (keymap.get(b.id, b.key) if b.id else b.key, b.description or b.action, b.id or "")
            for b in self.BINDINGS
            if isinstance(b, Binding)
        ]
        rows.append(("ctrl+p", "Command palette", ""))
        rows.append(("ctrl+q", "Quit", ""))
        if self.screen is not self.screen_stack[0]:  # F1 on another screen: its keys too
            rows += [
                (keymap.get(b.id, b.key), f"{b.description or b.action} (this screen)", b.id)
                for b in getattr(type(self.screen), "BINDINGS", [])
                if isinstance(b, Binding) and b.id
            ]
        paths = {"config": str(config_path()), **describe_paths()}
        self.push_screen(HelpScreen(rows, paths))

    async def action_quit(self) -> None:
        self.workers.cancel_group(self, "answer")
        self.workers.cancel_group(self, "watch")
        await self.assistant.close()
        self.exit()

    def _handle_exception(self, error: Exception) -> None:
        """An exception nothing handled: its traceback goes to the log file, then Textual
        restores the terminal and exits with return code 1 (`run` says where the log is)."""
        log.critical("the app stopped on an unhandled exception", exc_info=error)
        self.crash = error
        super()._handle_exception(error)


def run(app: TandemApp | None = None, *, headless: bool = False) -> int:
    """Run the TUI; its exit status. After an unhandled exception the terminal is back to
    normal (Textual restores it and prints the traceback), stderr names the log file that
    holds the traceback, and the status is non-zero."""
    from collab.plumbing.paths import log_path

    app = TandemApp() if app is None else app
    app.run(headless=headless)
    code = app.return_code or 0
    if app.crash is not None or code:
        what = f"{type(app.crash).__name__}: {app.crash}" if app.crash else f"exit status {code}"
        print(
            strip_controls(
                f"tandem stopped on an error ({what}).\nThe details are in the log: {log_path()}"
            ),
            file=sys.stderr,
        )
        return code or 1
    return 0
