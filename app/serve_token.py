"""The access token of `tandem serve` from the command line: `--token-file` reads it from a
file (as ssh reads a key: a file others can read is warned about), and `--token` works but
is warned about, since a process's arguments are visible to every user of the machine."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from cloud_backend.config import ConfigError

__all__ = ["ARGV_WARNING", "read_token_file", "serve_token"]

log = logging.getLogger("tandem.cloud")

MAX_CHARS = 64 * 1024  # a token is short; a file this long is something else
ARGV_WARNING = (
    "--token puts the access token in the command line, where every user of this machine "
    "can read it (`ps`); use --token-file or $TANDEM_CLOUD_TOKEN"
)


def read_token_file(path: Path) -> str:
    """The token in `path`, surrounding whitespace (a final newline) stripped. An unreadable,
    empty or several-word file is refused; a file open to group or others is warned about
    (and still used: its owner may mean it, a service account's group). A pipe works too."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode  # of what was opened, not of a swapped path
            text = f.read(MAX_CHARS + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"the token file {path} is not text (UTF-8)") from None
    token = text.strip()
    if not token:
        raise ConfigError(f"the token file {path} is empty: write the access token in it")
    if len(text) > MAX_CHARS or any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(
            f"the token file {path} holds more than one word or line: write the access token "
            "alone in it"
        )
    if stat.S_ISREG(mode) and mode & (stat.S_IRWXG | stat.S_IRWXO):  # a pipe: <(pass ...)
        log.warning(
            "the token file %s is open to other users of this machine (mode %04o): chmod 600 it",
            path,
            stat.S_IMODE(mode),
        )
    return token


def serve_token(token: str | None, token_file: Path | None) -> str | None:
    """The token `serve` passes on as its override (None: the environment's or the config's)."""
    if token_file is not None:
        return read_token_file(token_file)
    if token is not None:
        log.warning(ARGV_WARNING)
    return token
