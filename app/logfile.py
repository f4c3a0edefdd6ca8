"""The TUI's log file: private and bounded.

Log lines name documents, questions and errors, so the file is created 0600 (every rotated
file too, whatever the umask), and it rotates so that months of use cannot fill the disk.
Standard library only: set up before the TUI is imported.
"""

from __future__ import annotations

import logging
import logging.handlers
from io import TextIOWrapper
from pathlib import Path
from typing import cast

from collab.plumbing.files import make_private_dir, private_opener, tighten

__all__ = ["LOG_BACKUPS", "LOG_MAX_BYTES", "PrivateRotatingFileHandler", "log_to_file"]

log = logging.getLogger(__name__)

LOG_MAX_BYTES = 5 * 1024 * 1024  # a few weeks of ordinary use; a bug's log loop stays bounded
LOG_BACKUPS = 3  # tandem.log.1 .. .3: at most 20 MiB in all
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A RotatingFileHandler whose files are created 0600: the base file at start and after
    each rotation (rotation renames the old one, which keeps its mode)."""

    def _open(self) -> TextIOWrapper:
        stream = open(  # noqa: SIM115  # the handler owns and closes it
            self.baseFilename,
            self.mode,
            encoding=self.encoding,
            errors=self.errors,
            opener=private_opener,
        )
        return cast(TextIOWrapper, stream)  # text mode ("a"), as the base class opens it


def log_files(path: Path, backups: int = LOG_BACKUPS) -> list[Path]:
    """The log file and its rotated copies."""
    path = Path(path)
    return [path, *(path.with_name(f"{path.name}.{n}") for n in range(1, backups + 1))]


def log_to_file(
    path: Path,
    level: int = logging.INFO,
    *,
    max_bytes: int = LOG_MAX_BYTES,
    backups: int = LOG_BACKUPS,
) -> PrivateRotatingFileHandler:
    """Send the root logger's records to `path` (rotating, 0600), in a folder created 0700.
    Log files an older Tandem left readable are tightened first (and that is logged)."""
    path = Path(path)
    make_private_dir(path.parent)
    changed = tighten(log_files(path, backups))
    handler = PrivateRotatingFileHandler(
        path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
    )
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    if changed:
        log.warning(
            "made %s private to this user (readable by other local users before)",
            ", ".join(p.name for p in changed),
        )
    return handler
