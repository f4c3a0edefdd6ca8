"""Tandem's user settings: one TOML file, read at start-up, written by the settings screen.

Imported at start-up, so it stays light: no Textual, torch, transformers or numpy here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from collab.plumbing.files import atomic_write
from collab.plumbing.paths import config_path
from collab.sources import RELEVANCE_FLOOR
from collab.temperature import temperature_problem
from edge_runtime.declared import settings as declared_settings
from edge_runtime.modes import dragon_declared as _dragon_declared
from edge_runtime.options import DEFAULTS
from personal_index.safe_read import DEFAULT_MAX_FILE_MB

logger = logging.getLogger(__name__)

CLOUD_URL_ENV = "TANDEM_CLOUD_URL"
CLOUD_TOKEN_ENV = "TANDEM_CLOUD_TOKEN"

CLOUD_ENGINES = ("ort", "torch")
AGGREGATORS = _dragon_declared.AGGREGATORS  # dragon's own setting; named here for the CLI

_HEADER = (
    "# Tandem settings. Edit here or in the TUI's settings screen.\n"
    '# cloud_url = "" starts the embedded backend on loopback; $TANDEM_CLOUD_URL and\n'
    "# $TANDEM_CLOUD_TOKEN override cloud_url and cloud_token. [keymap] maps binding ids to keys,\n"
    '# e.g. cycle_mode = "ctrl+o".\n\n'
)


class SettingsError(ValueError):
    """Settings that cannot be used: a corrupt file, a wrong type or an out-of-range value."""


@dataclass(init=False)
class Settings:
    """What the user can set; the defaults are what a missing file means.

    The fields are Tandem's own; each mode's settings (split's variant, eta and pipeline,
    dragon's aggregator, a mode added later) are declared by the mode (`edge_runtime.declared`)
    and kept in `modes`, read, written and passed to the constructor as if they were fields.
    In the file they are top-level keys like the rest."""

    cloud_url: str = ""  # "" = start the embedded backend on loopback
    cloud_token: str = ""  # for a remote cloud; also $TANDEM_CLOUD_TOKEN
    cloud_ca: str = ""  # a CA bundle (PEM) to verify a wss:// cloud with; "" = the system's
    cloud_allow_insecure: bool = False  # allow ws:// (unencrypted) to a host not on loopback
    cloud_engine: str = "ort"  # embedded backend engine: "ort" | "torch"
    device_model: str = ""  # "" = the prepared default; else a folder with an ONNX model
    cloud_model: str = ""  # "" = the prepared default; else a folder (embedded backend)
    default_mode: str = "auto"  # picks a mode per question (docs/benchmarks/auto.md)
    k: int = DEFAULTS.k  # private passages retrieved
    relevance_floor: float = RELEVANCE_FLOOR  # a less relevant passage is neither used nor cited
    max_tokens: int = DEFAULTS.max_new_tokens
    temperature: float = DEFAULTS.temperature
    theme: str = "textual-dark"
    ingest_max_mb: int = DEFAULT_MAX_FILE_MB  # ingest: a larger file is not read ("too large")
    keymap: dict[str, str] = field(default_factory=dict)  # binding id -> keys
    # cloud identity -> "always" | "never": may that cloud take part in answers shaped by
    # private passages (edge_runtime.consent; the embedded cloud needs no entry)
    cloud_consent: dict[str, str] = field(default_factory=dict)
    modes: dict[str, Any] = field(default_factory=dict)  # the modes' declared settings by name

    def __init__(self, modes: dict[str, Any] | None = None, **values: Any) -> None:
        declared = declared_settings()
        given = dict(modes or {})
        for name, f in _CORE.items():
            if name in values:
                value = values.pop(name)
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = f.default
            object.__setattr__(self, name, value)
        for name, value in values.items():
            if name not in declared:
                raise TypeError(
                    f"Settings has no setting {name!r} (no registered mode declares it)"
                )
            given[name] = value
        mode_values = {name: s.default for name, s in declared.items()}
        object.__setattr__(self, "modes", mode_values | given)

    def __getattr__(self, name: str) -> Any:
        """A mode's declared setting: its value, or its default."""
        if name.startswith("__") or name == "modes":
            raise AttributeError(name)
        if name in self.modes:
            return self.modes[name]
        setting = declared_settings().get(name)
        if setting is None:
            raise AttributeError(f"Settings has no setting {name!r}")
        return setting.default

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CORE or name == "modes":
            object.__setattr__(self, name, value)
        elif name in self.modes or name in declared_settings():
            self.modes[name] = value
        else:
            raise AttributeError(f"Settings has no setting {name!r}")


_CORE = {f.name: f for f in dataclasses.fields(Settings) if f.name != "modes"}
_CORE_TYPES: dict[str, type] = {
    "cloud_url": str,
    "cloud_token": str,
    "cloud_ca": str,
    "cloud_allow_insecure": bool,
    "cloud_engine": str,
    "device_model": str,
    "cloud_model": str,
    "default_mode": str,
    "k": int,
    "relevance_floor": float,
    "max_tokens": int,
    "temperature": float,
    "theme": str,
    "ingest_max_mb": int,
    "keymap": dict,
    "cloud_consent": dict,
}
assert set(_CORE_TYPES) == set(_CORE)

_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    dict: "a table",
    bool: "true or false",
}


def field_types() -> dict[str, type]:
    """Every key the file may hold and its type: Tandem's own, then each mode's."""
    return _CORE_TYPES | {name: s.kind for name, s in declared_settings().items()}


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
    if settings.cloud_engine not in CLOUD_ENGINES:
        problems.append(
            f"cloud_engine must be one of {', '.join(CLOUD_ENGINES)} "
            f"(got {settings.cloud_engine!r})"
        )
    for name, setting in declared_settings().items():  # each mode checks its own
        if problem := setting.problem(getattr(settings, name)):
            problems.append(problem)
    if settings.cloud_url and not settings.cloud_url.startswith(("ws://", "wss://")):
        problems.append(
            f"cloud_url must start with ws:// or wss:// (got {settings.cloud_url!r}); "
            "leave it empty to use the embedded backend"
        )
    for identity, said in settings.cloud_consent.items():
        if said not in ("always", "never"):
            problems.append(
                f'cloud_consent."{identity}" must be "always" or "never" (got {said!r})'
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
    expected = field_types()[key]
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
    if key == "keymap":
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


def _keep_token_private(path: Path, fd: int, data: dict[str, Any]) -> None:
    """A hand-written config.toml that holds a cloud token and is open to other users of this
    machine is made 0600, as the settings screen writes it, and the log says so; where that
    fails, a warning says to do it."""
    token = data.get("cloud_token")
    if not (isinstance(token, str) and token.strip()):
        return
    mode = None
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if not mode & (stat.S_IRWXG | stat.S_IRWXO):
            return
        private = mode & ~(stat.S_IRWXG | stat.S_IRWXO)
        os.fchmod(fd, private)
    except OSError as exc:
        shown = "" if mode is None else f" (mode {mode:04o})"
        logger.warning(
            "%s holds the cloud token and other users of this machine may read it%s: it "
            "could not be made private (%s); chmod 600 it",
            path,
            shown,
            exc.strerror or exc,
        )
        return
    logger.warning(
        "%s holds the cloud token and was open to other users of this machine (mode %04o): "
        "made it private to you (mode %04o)",
        path,
        mode,
        private,
    )


def load_settings(path: Path | None = None) -> Settings:
    """Read the settings file; a missing file means the defaults.

    A corrupt file or a bad value raises SettingsError (naming the file and the key) and the file
    is left as it is: the app shows the message and starts on defaults without overwriting it.
    """
    path = path if path is not None else config_path()
    try:
        with open(path, "rb") as f:
            raw = f.read()
            try:
                data = tomllib.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise SettingsError(f"{path}: not UTF-8 text: {exc}") from exc
            except tomllib.TOMLDecodeError as exc:
                raise SettingsError(f"{path}: not valid TOML: {exc}") from exc
            _keep_token_private(path, f.fileno(), data)  # the file opened, not a swapped path
    except FileNotFoundError:
        return Settings()
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read the settings file: {exc}") from exc
    values: dict[str, Any] = {}
    types = field_types()
    for key, value in data.items():
        if key not in types:
            logger.warning("%s: ignoring unknown setting %r", path, key)
            continue
        values[key] = _coerce(path, key, value)
    settings = Settings(**values)
    problems = settings_problems(settings)
    if problems:
        raise SettingsError(f"{path}: " + "; ".join(problems))
    return settings


KEPT_LOCAL = (
    "this install answers in local mode, as it did before auto became the default: your "
    "settings name a remote cloud and no default mode; choose auto in the settings (F4) to "
    "let Tandem pick a mode per question"
)


def keep_upgraded_default(path: Path | None = None) -> str | None:
    """An install from before auto was the default keeps its effective default: a settings
    file with no `default_mode` and a remote cloud (in the file or $TANDEM_CLOUD_URL) answered
    in local mode then, and still does. The key is written into the file (on its first line,
    the rest kept as the user wrote it), so the notice returned is shown once."""
    path = path if path is not None else config_path()
    try:
        raw = path.read_text(encoding="utf-8")
        data = tomllib.loads(raw)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None  # no file (a new install: auto), or one load_settings reports
    remote = os.environ.get(CLOUD_URL_ENV) or data.get("cloud_url")
    if "default_mode" in data or not remote:
        return None
    line = "# kept at upgrade: this install answered in local mode before auto was the default\n"
    atomic_write(path, line + 'default_mode = "local"\n' + raw, mode=0o600)
    logger.warning("%s: %s", path, KEPT_LOCAL)
    return KEPT_LOCAL


def save_settings(settings: Settings, path: Path | None = None) -> Path:
    """Write every key (so users see what they can set) atomically, readable only by the user.

    The file may hold a cloud token, hence 0600. Invalid settings raise SettingsError and
    nothing is written.
    """
    validate_settings(settings)
    path = path if path is not None else config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {name: getattr(settings, name) for name in _CORE} | settings.modes
    data["keymap"] = dict(sorted(settings.keymap.items()))
    data["cloud_consent"] = dict(sorted(settings.cloud_consent.items()))
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
