"""Tandem's user settings: one TOML file, read at start-up, written by the settings screen.

Imported at start-up, so it stays light: no Textual, torch, transformers or numpy here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from collab.plumbing.files import atomic_write
from collab.plumbing.paths import config_path
from collab.sources import RELEVANCE_FLOOR
from collab.temperature import eta_problem, temperature_problem
from collab.variants import DEFAULT_VARIANT, variant_names
from edge_runtime.options import DEFAULTS
from personal_index.safe_read import DEFAULT_MAX_FILE_MB

logger = logging.getLogger(__name__)

CLOUD_URL_ENV = "TANDEM_CLOUD_URL"
CLOUD_TOKEN_ENV = "TANDEM_CLOUD_TOKEN"

CLOUD_ENGINES = ("ort", "torch")
AGGREGATORS = ("auto", "device", "cloud")
"""dragon: where each token is aggregated; auto = the scheduler picks before every token
(the names of edge_runtime.modes.dragon.POLICIES, kept here so start-up loads no numpy)."""

_HEADER = (
    "# Tandem settings. Edit here or in the TUI's settings screen.\n"
    '# cloud_url = "" starts the embedded backend on loopback; $TANDEM_CLOUD_URL and\n'
    "# $TANDEM_CLOUD_TOKEN override cloud_url and cloud_token. [keymap] maps binding ids to keys,\n"
    '# e.g. cycle_mode = "ctrl+o".\n\n'
)


class SettingsError(ValueError):
    """Settings that cannot be used: a corrupt file, a wrong type or an out-of-range value."""


@dataclass
class Settings:
    """What the user can set; the defaults are what a missing file means."""

    cloud_url: str = ""  # "" = start the embedded backend on loopback
    cloud_token: str = ""  # for a remote cloud; also $TANDEM_CLOUD_TOKEN
    cloud_ca: str = ""  # a CA bundle (PEM) to verify a wss:// cloud with; "" = the system's
    cloud_allow_insecure: bool = False  # allow ws:// (unencrypted) to a host not on loopback
    cloud_engine: str = "ort"  # embedded backend engine: "ort" | "torch"
    device_model: str = ""  # "" = the prepared default; else a folder with an ONNX model
    cloud_model: str = ""  # "" = the prepared default; else a folder (embedded backend)
    default_mode: str = "local"
    variant: str = DEFAULT_VARIANT  # split variant: a name in collab.variants
    aggregator: str = "auto"  # dragon: a name in AGGREGATORS
    k: int = DEFAULTS.k  # private passages retrieved
    relevance_floor: float = RELEVANCE_FLOOR  # a less relevant passage is neither used nor cited
    max_tokens: int = DEFAULTS.max_new_tokens
    temperature: float = DEFAULTS.temperature
    eta: float = DEFAULTS.eta  # split: RAPID's η (0 = exact; DESIGN §5.4)
    pipeline: bool = DEFAULTS.pipeline  # split: PicoSpec's pipeline (DESIGN §5.3)
    theme: str = "textual-dark"
    ingest_max_mb: int = DEFAULT_MAX_FILE_MB  # ingest: a larger file is not read ("too large")
    keymap: dict[str, str] = field(default_factory=dict)  # binding id -> keys


_FIELD_TYPES: dict[str, type] = {
    "cloud_url": str,
    "cloud_token": str,
    "cloud_ca": str,
    "cloud_allow_insecure": bool,
    "cloud_engine": str,
    "device_model": str,
    "cloud_model": str,
    "default_mode": str,
    "variant": str,
    "aggregator": str,
    "k": int,
    "relevance_floor": float,
    "max_tokens": int,
    "temperature": float,
    "eta": float,
    "pipeline": bool,
    "theme": str,
    "ingest_max_mb": int,
    "keymap": dict,
}
assert set(_FIELD_TYPES) == {f.name for f in dataclasses.fields(Settings)}

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", dict: "a table"}


def settings_problems(settings: Settings) -> list[str]:
    """Every reason `settings` cannot be used, as plain sentences naming the key."""
    problems: list[str] = []
    if not isinstance(settings.default_mode, str) or not settings.default_mode.strip():
        problems.append("default_mode must not be empty")
    if settings.k < 1:
        problems.append(f"k must be at least 1 (got {settings.k})")
    if not -1.0 <= settings.relevance_floor <= 1.0:
        problems.append(f"relevance_floor must be in -1..1 (got {settings.relevance_floor})")
    if settings.max_tokens < 1:
        problems.append(f"max_tokens must be at least 1 (got {settings.max_tokens})")
    if settings.ingest_max_mb < 1:
        problems.append(f"ingest_max_mb must be at least 1 (got {settings.ingest_max_mb})")
    problem = temperature_problem(settings.temperature)
    if problem:
        problems.append(problem)
    if problem := eta_problem(settings.eta):
        problems.append(problem)
    if settings.cloud_engine not in CLOUD_ENGINES:
        problems.append(
            f"cloud_engine must be one of {', '.join(CLOUD_ENGINES)} "
            f"(got {settings.cloud_engine!r})"
        )
    if settings.variant not in variant_names():
        problems.append(
            f"variant must be one of {', '.join(variant_names())} (got {settings.variant!r})"
        )
    if settings.aggregator not in AGGREGATORS:
        problems.append(
            f"aggregator must be one of {', '.join(AGGREGATORS)} (got {settings.aggregator!r})"
        )
    if settings.cloud_url and not settings.cloud_url.startswith(("ws://", "wss://")):
        problems.append(
            f"cloud_url must start with ws:// or wss:// (got {settings.cloud_url!r}); "
            "leave it empty to use the embedded backend"
        )
    for binding_id, keys in settings.keymap.items():
        if not isinstance(keys, str) or not keys.strip():
            problems.append(f"keymap.{binding_id} must be a non-empty string of keys")
    return problems


def validate_settings(settings: Settings) -> None:
    """Raise SettingsError listing every problem with `settings` (none: returns)."""
    problems = settings_problems(settings)
    if problems:
        raise SettingsError("; ".join(problems))


def _coerce(path: Path, key: str, value: Any) -> Any:
    """The TOML value as the field's type, or SettingsError naming the file and the key."""
    expected = _FIELD_TYPES[key]
    ok: bool
    if expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif expected is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif expected is dict:
        ok = isinstance(value, dict)
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise SettingsError(f"{path}: {key} must be {_TYPE_NAMES[expected]}, got {value!r}")
    if expected is dict:
        value = _flatten_keymap(path, value)
    return value


def _flatten_keymap(path: Path, table: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The keymap with dotted binding ids restored: in TOML, `citation.open = "o"` without quotes
    is a nested table, which we read as the id "citation.open"."""
    flat: dict[str, str] = {}
    for name, keys in table.items():
        binding_id = f"{prefix}{name}"
        if isinstance(keys, dict):
            flat.update(_flatten_keymap(path, keys, f"{binding_id}."))
        elif isinstance(keys, str):
            flat[binding_id] = keys
        else:
            raise SettingsError(
                f'{path}: keymap.{binding_id} must be a string of keys such as "ctrl+o", '
                f"got {keys!r}"
            )
    return flat


def load_settings(path: Path | None = None) -> Settings:
    """Read the settings file; a missing file means the defaults.

    A corrupt file or a bad value raises SettingsError (naming the file and the key) and the file
    is left as it is: the app shows the message and starts on defaults without overwriting it.
    """
    path = path if path is not None else config_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Settings()
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read the settings file: {exc}") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path}: not UTF-8 text: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from exc
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in _FIELD_TYPES:
            logger.warning("%s: ignoring unknown setting %r", path, key)
            continue
        values[key] = _coerce(path, key, value)
    settings = Settings(**values)
    problems = settings_problems(settings)
    if problems:
        raise SettingsError(f"{path}: " + "; ".join(problems))
    return settings


def save_settings(settings: Settings, path: Path | None = None) -> Path:
    """Write every key (so users see what they can set) atomically, readable only by the user.

    The file may hold a cloud token, hence 0600. Invalid settings raise SettingsError and
    nothing is written.
    """
    validate_settings(settings)
    path = path if path is not None else config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dataclasses.asdict(settings)
    data["keymap"] = dict(sorted(settings.keymap.items()))
    text = _HEADER + tomli_w.dumps(data)
    atomic_write(path, text, mode=0o600)
    logger.info("settings saved to %s", path)
    return path


def effective_cloud(settings: Settings) -> tuple[str, str]:
    """(cloud_url, cloud_token): the environment overrides the file, so scripts and CI need no
    config file and a token can stay out of it."""
    url = os.environ.get(CLOUD_URL_ENV) or settings.cloud_url
    token = os.environ.get(CLOUD_TOKEN_ENV) or settings.cloud_token
    return url, token
