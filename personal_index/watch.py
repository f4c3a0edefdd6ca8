"""Watched folders: what the user adds in the app stays in sync with the private index.

A file created, changed, deleted or renamed under a watched folder is re-ingested or purged
within seconds (`watchfiles`: inotify on Linux, FSEvents on macOS). A sync is an ordinary
incremental ingest of the folder (unchanged files cost one `stat`; files that are gone are
purged), so a burst of edits, an editor's save-by-rename or a `git checkout` all end in the
same state as `tandem ingest FOLDER` run by hand. The folders and their last sync time live in
the index (`IndexStore.folders`), so the CLI and the next start see them too; at start every
folder is synced once, for what changed while the app was closed.

A folder is watched and read where it was when the user watched it (`personal_index.watched`):
one that now resolves elsewhere is not synced (the listener is told why) and not watched."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import watchfiles

from personal_index.index import IngestBusyError, PersonalIndex
from personal_index.ingest import FileResult
from personal_index.safe_read import DEFAULT_MAX_FILE_MB
from personal_index.watched import FolderMovedError

log = logging.getLogger(__name__)

DEBOUNCE_MS = 400  # changes within this window are one sync
BUSY_RETRY_S = 2.0  # another ingest holds the index: try again after this long

Synced = Callable[[str, list[FileResult] | None, str | None], None]
"""Called after each sync: (folder, results or None, error or None)."""


def visible_under(folders: Sequence[str]) -> Callable[[watchfiles.Change, str], bool]:
    """A watch filter: hidden files and folders inside a watched folder are never ingested, so
    their changes need no sync (editor swap files, .git); the folder's own path may be hidden."""

    def visible(_change: watchfiles.Change, path: str) -> bool:
        for folder in folders:
            prefix = folder.rstrip(os.sep) + os.sep
            if path.startswith(prefix):
                return not any(p.startswith(".") for p in path[len(prefix) :].split(os.sep))
        return path in folders

    return visible


def folders_touched(changed: Sequence[str], folders: Sequence[str]) -> list[str]:
    """The watched folders that hold one of the changed paths (a path can be in two, nested)."""
    out = []
    for folder in folders:
        prefix = folder.rstrip(os.sep) + os.sep
        if any(p == folder or p.startswith(prefix) for p in changed):
            out.append(folder)
    return out


class FolderWatcher:
    """Keeps the index's watched folders in sync while `run` runs (an app's async worker).

    `rescan()` syncs every folder now (one key in the app); `reload()` picks up folders added
    or removed since `run` started. Syncs run in a thread, one at a time; another process's
    ingest (the index's lock) is waited out, not reported as a failure."""

    def __init__(
        self,
        index: PersonalIndex,
        on_synced: Synced | None = None,
        *,
        max_file_mb: float = DEFAULT_MAX_FILE_MB,
    ) -> None:
        self.index = index
        self.on_synced = on_synced
        self.max_file_mb = max_file_mb  # the ingest_max_mb setting
        self._reload = asyncio.Event()
        self._rescan = asyncio.Event()
        self._sync_lock = asyncio.Lock()

    def reload(self) -> None:
        """The folder list changed: watch the new list."""
        self._reload.set()

    def rescan(self) -> None:
        """Sync every watched folder now."""
        self._rescan.set()
        self._reload.set()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Sync every folder once, then on every change, until `stop` is set (or cancelled)."""
        stop = stop or asyncio.Event()
        first = True
        while not stop.is_set():
            folders = [f.path for f in await asyncio.to_thread(self.index.folders)]
            if first or self._rescan.is_set():
                self._rescan.clear()
                first = False
                for folder in folders:
                    await self.sync(folder)
            self._reload.clear()
            live = await asyncio.to_thread(self._where, folders)  # real path -> folder
            if not live:
                await _first_of(stop, self._reload)
                continue
            existing = list(live)
            interrupt = asyncio.Event()
            relay = asyncio.ensure_future(_relay(interrupt, stop, self._reload))
            try:
                async for changes in watchfiles.awatch(
                    *existing,
                    stop_event=interrupt,
                    watch_filter=visible_under(existing),
                    debounce=DEBOUNCE_MS,
                    step=50,
                    recursive=True,
                ):
                    changed = [path for _change, path in changes]
                    for real in folders_touched(changed, existing):
                        await self.sync(live[real])
            finally:
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await relay

    async def sync(self, folder: str) -> list[FileResult] | None:
        """Ingest `folder` incrementally (a gone folder purges its documents) and record when."""
        async with self._sync_lock:
            while True:
                try:
                    results = await asyncio.to_thread(self._sync_now, folder)
                except IngestBusyError:
                    await asyncio.sleep(BUSY_RETRY_S)
                    continue
                except FolderMovedError as exc:  # not read; no longer watched until re-added
                    log.warning("not syncing %s: %s", folder, exc)
                    self._tell(folder, None, str(exc))
                    self._reload.set()
                    return None
                except Exception as exc:
                    log.warning("could not sync %s: %s", folder, exc)
                    self._tell(folder, None, str(exc))
                    return None
                if results is None:  # no longer watched: listen to the new list
                    self._reload.set()
                    return None
                self._tell(folder, results, None)
                return results

    def _where(self, folders: Sequence[str]) -> dict[str, str]:
        """{real path: folder} of the folders that exist and are still where they were
        watched: only those are listened to (a moved one would lead the watch elsewhere)."""
        live: dict[str, str] = {}
        for folder in folders:
            try:
                check = self.index.check_folder(folder)
            except Exception:
                log.exception("could not check the watched folder %s", folder)
                continue
            if check.state == "ok" and Path(check.real_path).is_dir():
                live.setdefault(check.real_path, folder)
        return live

    def _sync_now(self, folder: str) -> list[FileResult] | None:
        """The sync's results; None if `folder` was unwatched meanwhile (nothing is read)."""
        if all(f.path != folder for f in self.index.folders()):
            return None
        results = self.index.sync_folder(folder, max_file_mb=self.max_file_mb)
        changed = [r for r in results if r.outcome not in ("unchanged", "skipped")]
        if changed:
            log.info("synced %s: %d changed", folder, len(changed))
        return results

    def _tell(self, folder: str, results: list[FileResult] | None, error: str | None) -> None:
        if self.on_synced is not None:
            try:
                self.on_synced(folder, results, error)
            except Exception:
                log.exception("sync listener failed")


async def _first_of(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def _relay(target: asyncio.Event, *sources: asyncio.Event) -> None:
    """Set `target` once any of `sources` is set (awatch takes one stop event)."""
    await _first_of(*sources)
    target.set()
