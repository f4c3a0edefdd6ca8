"""`tandem serve`'s log: stderr as before (warnings; everything with -v), and with `--log-file`
a file that rotates by size and records what an operator needs (the cloud's INFO lines:
sessions, requests, refusals). On every handler, repeated lines are rate-limited
(`cloud_backend.logfilter`): a misbehaving device cannot fill the disk one line per frame."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

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

    def close(self) -> None:
        """Write what was held back, then take the file and the filters away."""
        for limiter in self.limiters:
            limiter.report()
            limiter.handler.removeFilter(limiter)
        if self.file is not None:
            logging.getLogger().removeHandler(self.file)
            self.file.close()
        for target, level in reversed(self.levels):
            target.setLevel(level)
        self.limiters, self.file, self.levels = [], None, []


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
        try:
            make_private_dir(Path(log_file).parent)
            handler = PrivateRotatingFileHandler(
                log_file, maxBytes=max(1, int(max_mb * 1024**2)), backupCount=backups,
                encoding="utf-8",
            )  # fmt: skip
        except OSError as exc:
            why = exc.strerror or exc
            raise ConfigError(f"cannot write the log file {log_file}: {why}") from None
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
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
