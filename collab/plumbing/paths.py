"""Every place Tandem reads or writes on this machine, computed in one module.

Data (models, the private index, the cloud's public corpus, conversations, the log) lives in the
platform's user data folder, `$TANDEM_DATA_DIR` overriding it; `config.toml` in the user config
folder, `$TANDEM_CONFIG_DIR` overriding it (tests and scripts point both at a temporary folder).
The device, the cloud and packaging all resolve these the same way, so the cloud's embedded
backend finds the embedder the device CLI prepared.

The data folder is private (0700; docs/security.md#at-rest: private text never leaves the device,
and other
local users are not the device's owner): `secure_data_dir` creates it so, and tightens an
install an older Tandem left readable.

Light on purpose (stdlib and platformdirs): imported at start-up and by the cloud.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import platformdirs

from collab.plumbing.files import make_private_dir, tighten

log = logging.getLogger(__name__)

APP_NAME = "tandem"
DATA_DIR_ENV = "TANDEM_DATA_DIR"
CONFIG_DIR_ENV = "TANDEM_CONFIG_DIR"
CONFIG_FILE = "config.toml"
CONVERSATIONS_FILE = "conversations.sqlite"
LOG_FILE = "tandem.log"
EMBEDDER_NAME = "all-minilm-l6-v2-onnx"
INDEX_DIR = "index"


def data_dir() -> Path:
    """Tandem's data folder (`$TANDEM_DATA_DIR` overrides the platform default)."""
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override) if override else Path(platformdirs.user_data_dir(APP_NAME))


def secure_data_dir() -> Path:
    """The data folder, created 0700 if missing. In an existing install, every folder under it,
    the files at its top (conversations, logs) and the private index's files lose their group
    and other permissions; prepared models and the public corpus's files are left as they are
    (not private; the stores tighten their own files when opened). Logged once: when something
    changed."""
    root = make_private_dir(data_dir())
    changed = tighten(_private_paths(root))
    if changed:
        log.warning(
            "made %d files and folders under %s private to this user (they were readable by "
            "other local users): %s",
            len(changed),
            root,
            ", ".join(str(p.relative_to(root)) for p in changed[:8])
            + (" ..." if len(changed) > 8 else ""),
        )
    return root


def _private_paths(root: Path) -> Iterator[Path]:
    """The data folder, every folder below it (symlinks are not followed) and the files of the
    data folder itself and of the private index."""
    yield root
    index = root / INDEX_DIR
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        yield from (here / d for d in dirs)
        if here in (root, index):
            yield from (here / f for f in files)


def config_dir() -> Path:
    """Where config.toml lives (`$TANDEM_CONFIG_DIR` overrides the platform default)."""
    override = os.environ.get(CONFIG_DIR_ENV)
    return Path(override) if override else Path(platformdirs.user_config_dir(APP_NAME))


def cache_dir() -> Path:
    """Downloads that can be fetched again (the benchmarks' prompt sets)."""
    return Path(platformdirs.user_cache_dir(APP_NAME))


def export_dir() -> Path:
    """Conversation exports go to the user's documents folder (~/Documents/Tandem), not
    wherever the app happened to start."""
    return Path(platformdirs.user_documents_dir()) / "Tandem"


def config_path() -> Path:
    return config_dir() / CONFIG_FILE


def conversations_path() -> Path:
    """The conversation history lives with the data (it is data, not configuration)."""
    return data_dir() / CONVERSATIONS_FILE


def log_path() -> Path:
    """The TUI's log file (a line on stderr would tear the screen)."""
    return data_dir() / LOG_FILE


def models_dir() -> Path:
    """Prepared models, one folder each (`tandem models prepare`)."""
    return data_dir() / "models"


def embedder_dir() -> Path:
    """The prepared ONNX MiniLM, shared by the private index and the cloud's public corpus."""
    return models_dir() / EMBEDDER_NAME


def index_dir() -> Path:
    """The private document index (SQLite + FAISS)."""
    return data_dir() / INDEX_DIR


def index_paths() -> tuple[Path, Path]:
    """(index folder, embedder folder): the two arguments of `PersonalIndex`."""
    return index_dir(), embedder_dir()


def cloud_corpus_dir() -> Path:
    """Where the cloud keeps its public index: `<data dir>/cloud/corpus`."""
    return data_dir() / "cloud" / "corpus"


def describe_paths() -> dict[str, str]:
    """Every place Tandem reads or writes, for `tandem paths` (privacy users ask)."""
    return {
        "config": str(config_path()),
        "data": str(data_dir()),
        "conversations": str(conversations_path()),
        "index": str(index_dir()),
        "models": str(models_dir()),
    }
