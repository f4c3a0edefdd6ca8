"""The Documents screen: see what the private index holds, add files and folders, remove them.

A folder added here is watched (kept in sync). Watching `/`, the home folder or a very large
tree asks first; `w` stops watching a folder. A document removed from inside a watched folder
stays out of it (listed as excluded, after the documents) until `i` includes it again.

Everything that touches the index runs in thread workers: opening it loads the ONNX embedder,
and its store serialises readers behind a running ingest. Ingest progress crosses from the
ingesting thread to the UI through a `ProgressCoalescer` (toolong's pattern): however fast
files finish, at most one wake-up message is pending, and the UI shows the newest progress plus
every file result gathered since its last look."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.coordinate import Coordinate
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.widgets import (
    Button,
    DataTable,
    DirectoryTree,
    Footer,
    Input,
    Label,
    OptionList,
    ProgressBar,
    Static,
    Tree,
)
from textual.widgets.option_list import Option
from textual.worker import Worker, WorkerState, get_current_worker

from app.plain import strip_controls
from app.tui.plain import plain, plain_text
from app.tui.status import human_bytes
from personal_index.pages import read_pages

if TYPE_CHECKING:
    from textual.app import App

    from personal_index.index import PersonalIndex
    from personal_index.ingest import FileResult, Progress
    from personal_index.watched import Exclusion
    from retrieval.store import DocumentRow, FolderRow, StoreStats

log = logging.getLogger(__name__)

INGEST_GROUP = "documents-ingest"
"""Worker group of ingests. They run on the app, not the screen, so leaving the screen does
not orphan them; any screen instance can see that one is running."""
REFRESH_GROUP = "documents-refresh"
REMOVE_GROUP = "documents-remove"
EXCLUDED_KEY = "excluded:"
"""Row keys of excluded files in the documents list (a document's key is its absolute path,
so the two never meet)."""

OUTCOMES: tuple[str, ...] = ("indexed", "unchanged", "failed", "skipped", "removed")
_OUTCOME_STYLE = {
    "indexed": "green",
    "unchanged": "dim",
    "failed": "bold red",
    "skipped": "yellow",
    "removed": "magenta",
}
# Outcomes that changed what the store holds (failed files are recorded as failed documents).
_CHANGING = frozenset({"indexed", "failed", "removed"})

# One thread opens the index at a time: the first call loads the embedder, and two screens (or
# a refresh racing an ingest) must not construct it twice.
_GET_INDEX_LOCK = threading.Lock()


class ProgressCoalescer:
    """Hands ingest progress from the ingesting thread to the UI without a message per file.

    `push` (any thread) keeps only the newest `Progress` but every file result, and calls
    `wake` only when no wake-up is already pending; `drain` (UI thread) takes both and re-arms
    the wake-up. A thousand files finishing between two frames cost one message, and no row is
    lost."""

    def __init__(self, wake: Callable[[ProgressCoalescer], Any]) -> None:
        self._wake = wake
        self._lock = threading.Lock()
        self._latest: Progress | None = None
        self._results: list[FileResult] = []
        self._pending = False
        self.wakes = 0
        """How many wake-ups were requested (for tests and logs)."""

    def push(self, progress: Progress) -> None:
        with self._lock:
            self._latest = progress
            self._results.append(progress.result)
            wake = not self._pending
            self._pending = True
        if wake:
            self.wakes += 1
            try:
                self._wake(self)
            except Exception:  # the UI may be gone; the ingest must go on
                log.debug("progress wake-up failed", exc_info=True)

    def drain(self) -> tuple[Progress | None, list[FileResult]]:
        """The newest progress since the last drain (None if none) and the results since then."""
        with self._lock:
            latest, results = self._latest, self._results
            self._latest, self._results, self._pending = None, [], False
        return latest, results


def summarize(results: Sequence[FileResult]) -> str:
    """'3 indexed, 1 unchanged, 1 failed', in the CLI's order and words."""
    counts: Counter[str] = Counter(r.outcome for r in results)
    return ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o]) or "nothing to ingest"


def tilde(path: str | Path) -> str:
    """A path with the home folder shortened to ~ (tables are narrow at 80 columns)."""
    text, home = os.fspath(path), os.path.expanduser("~")
    if home not in ("", "/") and (text == home or text.startswith(home + os.sep)):
        return "~" + text[len(home) :]
    return text


def _shown_path(path: str, base: Path) -> str:
    """A result's path relative to the ingested folder when it lies under it."""
    prefix = str(base) + os.sep
    return path[len(prefix) :] if path.startswith(prefix) else tilde(path)


@dataclass
class IngestOutcome:
    """What an ingest worker hands back to the UI thread."""

    target: Path
    coalescer: ProgressCoalescer
    results: list[FileResult] = field(default_factory=list)
    error: str | None = None
    busy: bool = False
    seconds: float = 0.0
    folder: str | None = None  # the folder now watched, if one was added
    confirm: str | None = None  # why watching the folder needs a yes first (nothing was done)
    included: str | None = None  # the excluded path brought back, if that was the job


@dataclass
class _Snapshot:
    stats: StoreStats
    documents: list[DocumentRow]
    root: Path
    folders: list[FolderRow] = field(default_factory=list)
    excluded: list[Exclusion] = field(default_factory=list)


def folders_line(folders: Sequence[FolderRow], now: float | None = None) -> Text:
    """'Watching ~/notes (synced 14:03:07) · ~/papers (not synced yet) · s rescans · w stops'
    as plain text (folder names are the user's: never markup)."""
    if not folders:
        return plain_text("No watched folders: a folder you add here is kept in sync.")
    now = time.time() if now is None else now
    parts = []
    for f in folders:
        if f.synced_at is None:
            when = "not synced yet"
        else:
            fmt = "%H:%M:%S" if now - f.synced_at < 86400 else "%Y-%m-%d %H:%M"
            when = "synced " + time.strftime(fmt, time.localtime(f.synced_at))
        parts.append(f"{tilde(f.path)} ({when})")
    return plain_text("Watching " + " · ".join(parts) + " · s rescans · w stops")


class PickerTree(DirectoryTree):
    """The file picker: hidden entries are left out, as the ingester skips them anyway (a
    hidden path can still be typed)."""

    def filter_paths(self, paths: Iterable[Path]) -> Iterable[Path]:
        return [p for p in paths if not p.name.startswith(".")]

    def process_label(self, label: str | Text) -> Text:
        """A file name as it is, but without control characters (they would reach the
        terminal)."""
        return super().process_label(plain_text(label) if isinstance(label, str) else label)


class Confirm(ModalScreen[bool]):
    """A yes/no question whose default (Enter, Escape, n) is no."""

    DEFAULT_CSS = """
    Confirm {
        align: center middle;
    }
    Confirm > #confirm-dialog {
        width: 64;
        max-width: 90%;
        height: auto;
        border: thick $error 60%;
        background: $surface;
        padding: 1 2;
    }
    Confirm #confirm-question {
        width: 100%;
        margin-bottom: 1;
    }
    Confirm #confirm-buttons {
        width: 100%;
        height: auto;
        align-horizontal: right;
    }
    Confirm Button {
        margin-left: 2;
    }
    """

    YES, NO = "Yes", "No"

    def question(self) -> Text:
        raise NotImplementedError

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-dialog"):
            yield Label(self.question(), id="confirm-question")
            with Horizontal(id="confirm-buttons"):
                yield Button(self.NO, id="confirm-no")
                yield Button(self.YES, variant="error", id="confirm-yes")

    def on_mount(self) -> None:
        self.query_one("#confirm-no", Button).focus()  # Enter on the default says no

    @on(Button.Pressed, "#confirm-yes")
    def action_confirm(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#confirm-no")
    def action_cancel(self) -> None:
        self.dismiss(False)


class ConfirmRemove(Confirm):
    """Asks before a document leaves the index (the file itself is never touched)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "confirm", "Remove", id="documents_confirm_remove"),
        Binding("n,escape", "cancel", "Keep", id="documents_cancel_remove"),
    ]
    YES, NO = "Remove", "Keep"

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def question(self) -> Text:
        return Text.assemble(
            "Remove ",
            plain_text(tilde(self.path), "bold"),
            " from the index?\nThe file on disk is not touched.  ",
            ("y", "bold"),
            " remove · ",
            ("n", "bold"),
            " keep",
        )


class ConfirmWatch(Confirm):
    """Asks before watching `/`, the home folder or a very large tree: everything in it would
    be indexed and kept in sync."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "confirm", "Watch", id="documents_confirm_watch"),
        Binding("n,escape", "cancel", "Cancel", id="documents_cancel_watch"),
    ]
    YES, NO = "Watch", "Cancel"

    def __init__(self, path: str, reason: str) -> None:
        super().__init__()
        self.path, self.reason = path, reason

    def question(self) -> Text:
        return Text.assemble(
            "Watch ",
            plain_text(tilde(self.path), "bold"),
            "?\nIt would index ",
            plain_text(self.reason),
            " and keep it in sync.  ",
            ("y", "bold"),
            " watch · ",
            ("n", "bold"),
            " cancel",
        )


class StopWatching(ModalScreen[str | None]):
    """Picks the watched folder to stop keeping in sync (its documents stay)."""

    DEFAULT_CSS = """
    StopWatching {
        align: center middle;
    }
    StopWatching > #unwatch-dialog {
        width: 72;
        max-width: 90%;
        height: auto;
        max-height: 80%;
        border: thick $primary 60%;
        background: $surface;
        padding: 1 2;
    }
    StopWatching #unwatch-folders {
        height: auto;
        max-height: 12;
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Keep watching", id="documents_cancel_unwatch"),
    ]

    def __init__(self, folders: Sequence[str]) -> None:
        super().__init__()
        self.folders = list(folders)

    def compose(self) -> ComposeResult:
        with Vertical(id="unwatch-dialog"):
            yield Label(
                Text.assemble(
                    "Stop watching which folder? Its documents stay in the index.  ",
                    ("Enter", "bold"),
                    " stops · ",
                    ("Escape", "bold"),
                    " keeps watching",
                )
            )
            yield OptionList(
                *(Option(plain_text(tilde(f)), id=str(i)) for i, f in enumerate(self.folders)),
                id="unwatch-folders",
            )

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    @on(OptionList.OptionSelected)
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.folders[event.option_index])

    def action_cancel(self) -> None:
        self.dismiss(None)


class DocumentsScreen(Screen[None]):
    """Index statistics, a file picker with an ingest that shows per-file progress, and the
    list of indexed documents with removal."""

    class IndexChanged(Message):
        """The documents in the private index changed (an ingest or a removal): refresh
        whatever retrieval state is derived from it."""

    class IngestProgress(Message, bubble=False):
        """Wake-up from the ingesting thread: drain `coalescer` (never queued more than once)."""

        def __init__(self, coalescer: ProgressCoalescer) -> None:
            super().__init__()
            self.coalescer = coalescer

    CSS_PATH = "documents.tcss"

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("a", "add", "Add", id="documents_add"),
        Binding("d,delete", "remove", "Remove", id="documents_remove"),
        Binding("r", "refresh", "Refresh", id="documents_refresh"),
        Binding("s", "rescan", "Rescan folders", id="documents_rescan"),
        Binding("w", "unwatch", "Stop watching", id="documents_unwatch"),
        Binding("i", "include", "Include", id="documents_include"),
        Binding("escape", "back", "Back", id="documents_back"),
    ]

    def __init__(
        self,
        get_index: Callable[[], PersonalIndex],
        start_path: Path | None = None,
        *,
        on_folder_added: Callable[[str], Any] | None = None,
        on_rescan: Callable[[], Any] | None = None,
        on_folder_removed: Callable[[str], Any] | None = None,
        add_on_open: Path | None = None,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self._get_index = get_index
        self._on_folder_added = on_folder_added
        self._on_rescan = on_rescan
        self._on_folder_removed = on_folder_removed
        self._add_on_open = add_on_open
        """A path to ingest as soon as the screen opens (one dropped on the prompt)."""
        self._folders: list[str] = []
        """The watched folders as last read from the index."""
        self._excluded: dict[str, str] = {}
        """Excluded path -> its watched folder, as last read."""
        start = Path(start_path).expanduser() if start_path is not None else Path.home()
        if not start.exists():
            start = Path.home()
        self._tree_root = start if start.is_dir() else start.parent
        self._start_value = str(start)
        self._ingest_target = Path(os.sep)
        self.ingest_worker: Worker[None] | None = None
        """The last ingest this screen started (on the app, so it outlives the screen)."""
        self.last_results: list[FileResult] = []
        """The results of the last ingest that finished."""
        self.message_text = ""
        """The text of the status line (errors, refusals, summaries)."""

    # ---- layout -------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Vertical(id="documents-head"):
            yield Static("Loading the private index…", id="documents-stats")
            yield Static("", id="documents-where")
            yield Static("", id="documents-folders")
        with Horizontal(id="documents-top"):
            with Vertical(id="documents-picker"):
                tree = PickerTree(self._tree_root, id="documents-tree")
                tree.border_title = "Pick a file or folder"
                yield tree
                with Horizontal(id="documents-path-row"):
                    yield Input(
                        self._start_value,
                        placeholder="path to a file or folder (Enter adds)",
                        id="documents-path",
                        compact=True,
                    )
                    yield Button("Add", id="documents-add", variant="primary", compact=True)
            with Vertical(id="documents-ingest"):
                yield ProgressBar(total=1, show_eta=False, id="documents-progress")  # idle: still
                yield Static("Pick a file or folder and press a to add it.", id="documents-status")
                files: DataTable[str | Text] = DataTable(
                    id="documents-files", cursor_type="row", zebra_stripes=True
                )
                files.border_title = "This ingest"
                yield files
        docs: DataTable[str | Text] = DataTable(
            id="documents-list", cursor_type="row", zebra_stripes=True
        )
        docs.border_title = "Indexed documents"
        yield docs
        yield Footer()

    def on_mount(self) -> None:
        files = self.query_one("#documents-files", DataTable)
        files.add_column("File", key="path")
        files.add_column("Outcome", key="outcome")
        files.add_column("Chunks", key="chunks")
        files.add_column("Reason", key="reason")
        docs = self.query_one("#documents-list", DataTable)
        docs.add_column("Path", key="path")
        docs.add_column("Kind", key="kind")
        docs.add_column("Chunks", key="chunks")
        docs.add_column("Status", key="status")
        if self.ingest_running():  # Add stays enabled: a second add is refused with a message
            self._say("An ingest started earlier is still running; it will notify you when done.")
        if self._add_on_open is not None:
            self.query_one("#documents-path", Input).value = str(self._add_on_open)
            self.add_path(str(self._add_on_open))

    def on_screen_resume(self) -> None:
        """Re-read the index whenever the screen is shown (it may have changed meanwhile)."""
        self.refresh_index()

    # ---- helpers ------------------------------------------------------------------------------
    def ingest_running(self) -> bool:
        """Whether any ingest worker (from this or another Documents screen) is still running."""
        return any(
            w.group == INGEST_GROUP and w.state in (WorkerState.PENDING, WorkerState.RUNNING)
            for w in self.app.workers
        )

    def _alive(self) -> bool:
        """Whether this screen can still be drawn on (it may have been popped and removed)."""
        return self.is_running and self.is_attached

    def _open_index(self) -> PersonalIndex:
        with _GET_INDEX_LOCK:
            return self._get_index()

    def _say(self, text: str, *, error: bool = False) -> None:
        self.message_text = text
        status = self.query_one("#documents-status", Static)
        status.update(plain(text))  # carries paths and error text
        status.set_class(error, "-error")

    def _fail(self, text: str) -> None:
        """A plain message in the screen and a notification; the screen stays usable."""
        self._say(text, error=True)
        self.notify(strip_controls(text), severity="error", markup=False)

    def _set_busy(self, busy: bool) -> None:
        self.query_one("#documents-add", Button).disabled = busy

    @staticmethod
    def _to_ui(app: App[Any], callback: Callable[..., Any], *args: Any) -> None:
        """Run `callback` on the event loop from a worker thread (and live with an app that
        has exited meanwhile)."""
        try:
            app.call_from_thread(callback, *args)
        except Exception:
            log.warning("could not hand a result back to the UI", exc_info=True)

    def _post_index_changed(self) -> None:
        message = DocumentsScreen.IndexChanged()
        if not (self._alive() and self.post_message(message)):
            self.app.post_message(message)  # the screen is gone: tell the app directly

    # ---- statistics and the document list ------------------------------------------------------
    def refresh_index(self) -> None:
        """Re-read statistics and documents (in a thread: the store may be busy ingesting)."""
        self._refresh_worker(self.app)

    @work(thread=True, exclusive=True, group=REFRESH_GROUP, exit_on_error=False)
    def _refresh_worker(self, app: App[Any]) -> None:
        worker = get_current_worker()
        try:
            index = self._open_index()
            snapshot = _Snapshot(
                index.stats(),
                index.documents(),
                Path(index.store.root),
                index.folders(),
                index.watches.exclusions(),
            )
        except Exception as exc:
            log.exception("could not read the private index")
            if not worker.is_cancelled:
                self._to_ui(app, self._fail, f"Could not read the index: {exc}")
            return
        if not worker.is_cancelled:
            self._to_ui(app, self._show_index, snapshot)

    def _show_index(self, snap: _Snapshot) -> None:
        if not self._alive():
            return
        s = snap.stats
        line = Text.assemble(
            (f"{s.documents} documents", "bold"),
            f" · {s.chunks} chunks · ",
            (f"{s.failed} failed", "bold red" if s.failed else ""),
            f" · {human_bytes(s.bytes_on_disk)} on disk · {s.index_kind} index",
        )
        self.query_one("#documents-stats", Static).update(line)
        where = Text.assemble(("Private index", "bold"), plain_text(f" at {tilde(snap.root)}"))
        self.query_one("#documents-where", Static).update(where)
        self.query_one("#documents-folders", Static).update(folders_line(snap.folders))
        self._folders = [f.path for f in snap.folders]
        self._excluded = {e.path: e.folder for e in snap.excluded}
        table = self.query_one("#documents-list", DataTable)
        keep = self._highlighted_document()
        table.clear()
        for d in snap.documents:
            status = (
                Text("indexed", "green")
                if d.status == "indexed"
                else plain_text(f"failed: {d.error or '?'}", "red")
            )
            if pages := read_pages(d):
                status.append(f" · {pages}", "dim")
            # Text cells: a DataTable reads a str cell as markup, and paths are free text.
            table.add_row(
                plain_text(tilde(d.path)),
                plain_text(d.kind or "?"),
                Text(str(d.chunk_count)),
                status,
                key=d.path,
            )
        for e in snap.excluded:  # what the user removed from a watched folder: i undoes it
            table.add_row(
                plain_text(tilde(e.path), "dim"),
                Text(""),
                Text(""),
                Text("excluded · i includes", "yellow"),
                key=EXCLUDED_KEY + e.path,
            )
        if keep is not None and keep in table.rows:
            table.move_cursor(row=table.get_row_index(keep), animate=False)

    def _highlighted_document(self) -> str | None:
        table = self.query_one("#documents-list", DataTable)
        if table.row_count == 0:
            return None
        row = min(max(table.cursor_row, 0), table.row_count - 1)
        return table.coordinate_to_cell_key(Coordinate(row, 0)).row_key.value

    # ---- adding -------------------------------------------------------------------------------
    @on(Tree.NodeHighlighted, "#documents-tree")
    def _tree_highlighted(self, event: Tree.NodeHighlighted) -> None:
        """The path box follows the tree while the user moves in it, so Enter/Add is clear."""
        tree = self.query_one("#documents-tree", DirectoryTree)
        if tree.has_focus and event.node.data is not None:
            self.query_one("#documents-path", Input).value = str(event.node.data.path)

    @on(Input.Submitted, "#documents-path")
    def _path_submitted(self, event: Input.Submitted) -> None:
        self.add_path(event.value)

    @on(Button.Pressed, "#documents-add")
    def _add_pressed(self) -> None:
        self.add_path(self.query_one("#documents-path", Input).value)

    def action_add(self) -> None:
        """Add the tree's highlighted entry when the tree has focus, else the typed path."""
        tree = self.query_one("#documents-tree", DirectoryTree)
        node = tree.cursor_node
        if tree.has_focus and node is not None and node.data is not None:
            path = str(node.data.path)
            self.query_one("#documents-path", Input).value = path
            self.add_path(path)
        else:
            self.add_path(self.query_one("#documents-path", Input).value)

    def add_path(self, raw: str, *, confirmed: bool = False) -> None:
        """Start ingesting `raw` (a file or folder: watched) in a thread worker on the app;
        a folder that needs a yes first (`/`, home, a very large tree) asks, unless
        `confirmed`."""
        text = raw.strip()
        if not text:
            self._say("Type a path or pick one in the tree, then press a.", error=True)
            return
        if self.ingest_running():
            self._fail("An ingest is already running; wait for it to finish.")
            return
        target = Path(os.path.expanduser(text)).absolute()
        if not target.exists():
            self._fail(f"No such file or folder: {tilde(target)}")
            return
        self._start_ingest(target, confirmed=confirmed)

    def _start_ingest(
        self, target: Path, *, confirmed: bool = False, include: str | None = None
    ) -> None:
        self.query_one("#documents-files", DataTable).clear()
        self.query_one("#documents-progress", ProgressBar).update(total=None, progress=0)
        self._say(f"Scanning {tilde(target)}…")
        self._set_busy(True)
        self._ingest_target = target
        coalescer = ProgressCoalescer(self._wake)
        job = partial(
            self._ingest_thread, self.app, target, coalescer, confirmed=confirmed, include=include
        )
        self.ingest_worker = self.app.run_worker(
            job,
            name=f"ingest {target}",
            group=INGEST_GROUP,
            thread=True,
            exit_on_error=False,
        )

    def _wake(self, coalescer: ProgressCoalescer) -> None:
        """Called from the ingesting thread: one message asks the UI to drain."""
        self.post_message(DocumentsScreen.IngestProgress(coalescer))

    def _ingest_thread(
        self,
        app: App[Any],
        target: Path,
        coalescer: ProgressCoalescer,
        *,
        confirmed: bool = False,
        include: str | None = None,
    ) -> None:
        from personal_index.index import IngestBusyError
        from personal_index.watched import FolderMovedError, WatchNeedsConfirmation

        outcome = IngestOutcome(target, coalescer)
        started = time.monotonic()
        try:
            index = self._open_index()
            cap = getattr(getattr(app, "settings", None), "ingest_max_mb", None)
            extra = {} if cap is None else {"max_file_mb": cap}
            if include is not None:  # back into its watched folder: sync that folder now
                for folder in index.include(include):
                    outcome.results += index.sync_folder(folder, coalescer.push, **extra)
                outcome.included = include
            elif target.is_dir():  # a folder added here is kept in sync from now on
                outcome.folder = index.watch(target, confirmed=confirmed)
                outcome.results = index.sync_folder(target, coalescer.push, **extra)
            else:
                outcome.results = index.ingest([target], coalescer.push, **extra)
        except WatchNeedsConfirmation as exc:  # nothing was read or recorded
            outcome.confirm = exc.reason
        except IngestBusyError as exc:
            outcome.error, outcome.busy = f"Index busy: {exc}", True
        except FolderMovedError as exc:
            outcome.error = str(exc)
        except Exception as exc:
            log.exception("ingest of %s failed", target)
            outcome.error = f"Ingest failed: {exc}"
        outcome.seconds = time.monotonic() - started
        self._to_ui(app, self._ingest_finished, outcome)

    @on(IngestProgress)
    def _ingest_progress(self, event: IngestProgress) -> None:
        self._drain(event.coalescer)

    def _drain(self, coalescer: ProgressCoalescer, *, target: Path | None = None) -> None:
        latest, results = coalescer.drain()
        if latest is not None:
            self.query_one("#documents-progress", ProgressBar).update(
                total=latest.total, progress=latest.done
            )
            name = Path(latest.result.path).name
            self._say(f"Ingesting: {latest.done}/{latest.total} files · {name}")
        if not results:
            return
        table = self.query_one("#documents-files", DataTable)
        base = target or self._ingest_target
        for r in results:
            table.add_row(  # Text cells: a DataTable reads a str cell as markup
                plain_text(_shown_path(r.path, base)),
                Text(r.outcome, _OUTCOME_STYLE.get(r.outcome, "")),
                Text(str(r.chunks) if r.outcome == "indexed" else ""),
                plain_text(r.reason or ""),
            )
        if not table.has_focus:  # follow the newest row unless the user is reading the table
            table.move_cursor(row=table.row_count - 1, animate=False)

    def _ingest_finished(self, outcome: IngestOutcome) -> None:
        results = outcome.results
        self.last_results = results
        changed = any(r.outcome in _CHANGING for r in results)
        alive = self._alive()
        where = tilde(outcome.target)
        if alive:
            self._drain(outcome.coalescer, target=outcome.target)
            self._set_busy(False)
        if outcome.confirm is not None:
            self._ask_to_watch(outcome.target, outcome.confirm)
            return
        if outcome.error is not None:
            if alive:
                self.query_one("#documents-progress", ProgressBar).update(total=1, progress=0)
                self._fail(outcome.error)
            else:
                self.app.notify(strip_controls(outcome.error), severity="error", markup=False)
        else:
            summary = f"{summarize(results)} ({outcome.seconds:.1f} s)"
            if alive:
                bar = self.query_one("#documents-progress", ProgressBar)
                bar.update(total=max(len(results), 1), progress=max(len(results), 1))
                back = f"Included {tilde(outcome.included)} again. " if outcome.included else ""
                self._say(f"{back}Done: {summary}", error=False)
            if not (alive and self.is_current):
                self.app.notify(
                    strip_controls(f"Ingest of {where} finished: {summary}"), markup=False
                )
        log.info("ingest of %s: %s", outcome.target, outcome.error or summarize(results))
        if outcome.folder is not None and self._on_folder_added is not None:
            self._on_folder_added(outcome.folder)
        if changed:
            self._post_index_changed()
        if alive:
            self.refresh_index()

    def _ask_to_watch(self, target: Path, reason: str) -> None:
        """Watching `target` needs a yes first: ask, and add it again when the answer is yes."""
        if not self._alive():
            text = f"{tilde(target)} was not watched: it would index {reason}"
            self.app.notify(strip_controls(text), severity="warning", markup=False)
            return
        self.query_one("#documents-progress", ProgressBar).update(total=1, progress=0)
        self._say(f"Watching {tilde(target)} would index {reason}: confirm or cancel.")

        def answered(yes: bool | None) -> None:
            if yes:
                self.add_path(str(target), confirmed=True)
            else:
                self._say(f"Not watched: {tilde(target)}.")

        self.app.push_screen(ConfirmWatch(str(target), reason), answered)

    # ---- removing -----------------------------------------------------------------------------
    def action_remove(self) -> None:
        """Ask, then remove the highlighted document from the index."""
        path = self._highlighted_document()
        if path is None:
            self._say("No document to remove.", error=True)
            return
        if path.startswith(EXCLUDED_KEY):
            self._say("That file is already out of the index: i includes it again.", error=True)
            return
        if self.ingest_running():
            self._fail("An ingest is running; remove documents when it has finished.")
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._say(f"Removing {tilde(path)}…")
                self._remove_worker(self.app, path)
            else:
                self._say("Kept.")

        self.app.push_screen(ConfirmRemove(path), confirmed)

    @work(thread=True, group=REMOVE_GROUP, exit_on_error=False)
    def _remove_worker(self, app: App[Any], path: str) -> None:
        try:
            removal = self._open_index().forget(path)
        except Exception as exc:
            log.exception("could not remove %s", path)
            self._to_ui(app, self._removed, path, 0, str(exc))
        else:
            self._to_ui(app, self._removed, path, removal.documents, None, removal.excluded_from)

    def _removed(
        self, path: str, removed: int, error: str | None, excluded_from: str | None = None
    ) -> None:
        if removed:
            self._post_index_changed()
        if not self._alive():
            return
        if error is not None:
            self._fail(f"Could not remove {tilde(path)}: {error}")
        elif removed and excluded_from is not None:
            self._say(
                f"Removed {tilde(path)}: it stays out of {tilde(excluded_from)} "
                "(i includes it again)."
            )
        elif removed:
            self._say(f"Removed {tilde(path)} from the index.")
        else:
            self._say(f"{tilde(path)} was not in the index.", error=True)
        self.refresh_index()

    # ---- watched folders and exclusions ---------------------------------------------------------
    def action_unwatch(self) -> None:
        """Pick a watched folder and stop keeping it in sync (its documents stay)."""
        if not self._folders:
            self._say("No folder is watched.", error=True)
            return

        def chosen(folder: str | None) -> None:
            if folder:
                self._say(f"Stopping watching {tilde(folder)}…")
                self._unwatch_worker(self.app, folder)

        self.app.push_screen(StopWatching(self._folders), chosen)

    @work(thread=True, group=REMOVE_GROUP, exit_on_error=False)
    def _unwatch_worker(self, app: App[Any], folder: str) -> None:
        try:
            done = self._open_index().unwatch(folder)
        except Exception as exc:
            log.exception("could not stop watching %s", folder)
            self._to_ui(app, self._unwatched, folder, False, str(exc))
        else:
            self._to_ui(app, self._unwatched, folder, done, None)

    def _unwatched(self, folder: str, done: bool, error: str | None) -> None:
        if done and self._on_folder_removed is not None:
            self._on_folder_removed(folder)
        if not self._alive():
            return
        if error is not None:
            self._fail(f"Could not stop watching {tilde(folder)}: {error}")
        elif done:
            self._say(f"Stopped watching {tilde(folder)}; its documents stay in the index.")
        else:
            self._say(f"{tilde(folder)} was not watched.", error=True)
        self.refresh_index()

    def action_include(self) -> None:
        """Bring the highlighted excluded file back: no longer excluded, its folder synced."""
        key = self._highlighted_document()
        if key is None or not key.startswith(EXCLUDED_KEY):
            self._say(
                "Highlight an excluded file (listed after the documents) to include it.", error=True
            )
            return
        if self.ingest_running():
            self._fail("An ingest is running; include the file when it has finished.")
            return
        path = key[len(EXCLUDED_KEY) :]
        self._start_ingest(Path(self._excluded.get(path, path)), include=path)

    # ---- other actions ------------------------------------------------------------------------
    def action_refresh(self) -> None:
        self.refresh_index()

    def action_rescan(self) -> None:
        """Sync every watched folder now (changes are also picked up as they happen)."""
        if self._on_rescan is None:
            self._say("Folders are not watched in this session.", error=True)
            return
        self._on_rescan()
        self._say("Rescanning the watched folders…")

    def action_back(self) -> None:
        if self.ingest_running():
            self.app.notify(
                "The ingest goes on in the background; you will be notified when it ends."
            )
        if len(self.app.screen_stack) > 1:
            self.app.pop_screen()
