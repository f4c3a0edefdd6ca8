"""`tandem serve`'s log: stderr as before (warnings; everything with -v), and with `--log-file`
a file that rotates by size and records what an operator needs (the cloud's INFO lines:
sessions, requests, refusals). On every handler, repeated lines are rate-limited
(`cloud_backend.logfilter`): a misbehaving device cannot fill the disk one line per frame.
When the file is also the process's stderr (the embedded cloud's `cloud.log`), stderr follows
the file across rotations and no line is written twice."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from io import TextIOWrapper
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.logfile import LOG_FORMAT, PrivateRotatingFileHandler
from collab.plumbing.files import make_private_dir

if TYPE_CHECKING:  # the cloud is imported by `serve` alone, not by `tandem --help`
    from cloud_backend.logfilter import RepeatLimiter

__all__ = ["LOG_BACKUPS", "LOG_MAX_MB", "ServeLogging", "serve_logging"]

LOG_MAX_MB = 10.0  # a busy day of session and request lines
LOG_BACKUPS = 5  # cloud.log.1 .. .5: at most 60 MiB in all
OPERATOR_LOGGER = "tandem"  # its INFO lines go to the file; other libraries' from WARNING


@dataclass
class ServeLogging:
    """What `serve_logging` changed, so that `close()` can report and undo it (in-process
    callers, tests, get their logging back)."""

    limiters: list[RepeatLimiter] = field(default_factory=list)
    file: logging.Handler | None = None
    levels: list[tuple[logging.Handler | logging.Logger, int]] = field(default_factory=list)
    removed: list[logging.Handler] = field(default_factory=list)  # stderr, when it is the file

    def close(self) -> None:
        """Write what was held back, then take the file and the filters away."""
        for limiter in self.limiters:
            limiter.report()
            limiter.handler.removeFilter(limiter)
        if self.file is not None:
            logging.getLogger().removeHandler(self.file)
            self.file.close()
        for handler in self.removed:
            logging.getLogger().addHandler(handler)
        for target, level in reversed(self.levels):
            target.setLevel(level)
        self.limiters, self.file, self.levels, self.removed = [], None, [], []


class _FollowingHandler(PrivateRotatingFileHandler):
    """The rotating file when it is also this process's stderr (and stdout): those file
    descriptors are pointed at the current file whenever one is opened, so that what bypasses
    logging (a traceback, a C library's warning, a stray print) rotates with the log instead
    of growing a renamed or deleted copy."""

    def __init__(self, *args: Any, fds: tuple[int, ...], **kwargs: Any) -> None:
        self.fds = fds  # before the base class opens the file
        super().__init__(*args, **kwargs)

    def _open(self) -> TextIOWrapper:
        stream = super()._open()
        for fd, std in ((1, sys.stdout), (2, sys.stderr)):
            if fd in self.fds:
                if std is not None:
                    std.flush()
                os.dup2(stream.fileno(), fd)
        return stream


def _fds_writing_to(path: Path) -> tuple[int, ...]:
    """Which of stdout and stderr write to the file `path` (the embedded cloud's: both)."""
    try:
        theirs = os.stat(path)
    except OSError:
        return ()
    fds = []
    for fd in (1, 2):
        try:
            ours = os.fstat(fd)
        except OSError:
            continue
        if (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino):
            fds.append(fd)
    return tuple(fds)


def _stderr_handlers(root: logging.Logger) -> list[logging.Handler]:
    """The root's handlers that write to stderr (logging.basicConfig's)."""
    return [
        h
        for h in root.handlers
        if isinstance(h, logging.StreamHandler)
        and not isinstance(h, logging.FileHandler)
        and h.stream in (sys.stderr, sys.__stderr__)
    ]


def serve_logging(
    log_file: Path | None,
    *,
    max_mb: float = LOG_MAX_MB,
    backups: int = LOG_BACKUPS,
    verbose: bool = False,
) -> ServeLogging:
    """Rate-limit the root logger's handlers and, with `log_file`, add the rotating file
    (new files 0600; an existing one keeps the mode its operator gave it)."""
    from cloud_backend.config import ConfigError
    from cloud_backend.logfilter import limit_repeats

    root = logging.getLogger()
    state = ServeLogging()
    if log_file is not None:
        if max_mb <= 0 or backups < 1:
            raise ConfigError("--log-max-mb must be above 0 and --log-backups at least 1")
        follow = _fds_writing_to(Path(log_file))  # the embedded cloud's: stderr is the file
        try:
            make_private_dir(Path(log_file).parent)
            size = max(1, int(max_mb * 1024**2))
            handler: PrivateRotatingFileHandler = (
                _FollowingHandler(
                    log_file, maxBytes=size, backupCount=backups, encoding="utf-8", fds=follow
                )
                if follow
                else PrivateRotatingFileHandler(
                    log_file, maxBytes=size, backupCount=backups, encoding="utf-8"
                )
            )
        except OSError as exc:
            why = exc.strerror or exc
            raise ConfigError(f"cannot write the log file {log_file}: {why}") from None
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        if 2 in follow:  # a warning on stderr would reach the file twice
            state.removed = _stderr_handlers(root)
            for existing in state.removed:
                root.removeHandler(existing)
        for existing in root.handlers:  # stderr keeps showing what it showed
            if existing.level == logging.NOTSET:
                state.levels.append((existing, existing.level))
                existing.setLevel(root.getEffectiveLevel())
        operator = logging.getLogger(OPERATOR_LOGGER)
        state.levels.append((operator, operator.level))
        operator.setLevel(logging.DEBUG if verbose else logging.INFO)
        root.addHandler(handler)
        state.file = handler
    state.limiters = [limit_repeats(h) for h in root.handlers]
    return state
