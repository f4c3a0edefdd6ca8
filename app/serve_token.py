"""The access token of `tandem serve` from the command line: `--token-file` reads it from a
file (as ssh reads a key: a file others can read is warned about), and `--token` works but
is warned about, since a process's arguments are visible to every user of the machine.
Whatever gave them, `tandem serve` refuses tokens that look weaker than 128 bits: the
wrong-token throttle slows guessing from one address, only a random token makes it hopeless."""

from __future__ import annotations

import logging
import math
import os
import stat
from pathlib import Path

from cloud_backend.config import ConfigError, ServerConfig

__all__ = [
    "ARGV_WARNING",
    "MIN_TOKEN_BITS",
    "read_token_file",
    "refuse_weak_tokens",
    "serve_token",
    "token_bits",
]

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


MIN_TOKEN_BITS = 128
MAKE_A_TOKEN = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'
# ASCII lower case, upper case, digits, anything else (ASCII punctuation and space: 33)
_CLASS_SIZES = (26, 26, 10, 33)


def _class_of(c: str) -> int:
    if c.isascii():
        for kind, test in enumerate((str.islower, str.isupper, str.isdigit)):
            if test(c):
                return kind
    return 3


def token_bits(token: str) -> float:
    """A conservative estimate of the entropy in `token`, in bits: each character is worth
    log2 of the alphabet its token's character classes span (lower case, upper case, digits,
    the rest), a block repeated to fill the token counts once, and a character that carries
    on a run (aaa, abc, 321: the same step as the one before it) is worth one bit."""
    n = len(token)
    period = next((p for p in range(1, n) if all(token[i] == token[i % p] for i in range(n))), n)
    block = token[:period]
    alphabet = sum(_CLASS_SIZES[kind] for kind in {_class_of(c) for c in block})
    per_char = math.log2(alphabet) if alphabet > 1 else 1.0
    bits = 0.0
    for i in range(len(block)):
        steps = [ord(block[j]) - ord(block[j - 1]) for j in (i, i - 1) if j >= 1]
        carries_on = len(steps) == 2 and steps[0] == steps[1] and abs(steps[0]) <= 1
        bits += 1.0 if carries_on else per_char
    return bits


def refuse_weak_tokens(config: ServerConfig) -> None:
    """Raise ConfigError, saying how to make a good one, for an access token (or the metrics
    token) that looks weaker than MIN_TOKEN_BITS. The message never holds the token."""
    named = [(f"the access token {name!r}", t) for name, t in config.tokens.items()]
    if config.token:
        named.insert(0, ("the access token", config.token))
    if config.metrics_token:
        named.append(("the metrics token", config.metrics_token))
    for label, secret in named:
        bits = token_bits(secret)
        if bits < MIN_TOKEN_BITS:
            raise ConfigError(
                f"{label} is too easy to guess (about {bits:.0f} bits of randomness; "
                f"{MIN_TOKEN_BITS} are needed): use a random one of 32 bytes or more, made with "
                f"`{MAKE_A_TOKEN}`"
            )
