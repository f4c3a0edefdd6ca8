"""app.settings: the TOML round trip, defaults, clear errors that never lose the file."""

from __future__ import annotations

import logging
import os
import stat
import sys
import tomllib
from pathlib import Path

import pytest

from app.settings import (
    Settings,
    SettingsError,
    effective_cloud,
    field_types,
    load_settings,
    save_settings,
)
from collab.plumbing import paths
from collab.plumbing.paths import config_path, conversations_path, describe_paths


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("TANDEM_CLOUD_URL", raising=False)
    monkeypatch.delenv("TANDEM_CLOUD_TOKEN", raising=False)
    return tmp_path


def test_paths_follow_the_environment(isolated: Path) -> None:
    assert config_path() == isolated / "config" / "config.toml"
    assert conversations_path() == isolated / "data" / "conversations.sqlite"
    paths = describe_paths()
    assert paths == {
        "config": str(isolated / "config" / "config.toml"),
        "data": str(isolated / "data"),
        "conversations": str(isolated / "data" / "conversations.sqlite"),
        "index": str(isolated / "data" / "index"),
        "models": str(isolated / "data" / "models"),
    }


def test_missing_file_means_defaults() -> None:
    assert not config_path().exists()
    assert load_settings() == Settings()
    assert not config_path().exists(), "loading must not create the file"


def test_round_trip_writes_every_key() -> None:
    custom = Settings(
        cloud_url="wss://cloud.example:8443",
        cloud_token="s3cret",
        cloud_engine="torch",
        device_model="/models/device",
        cloud_model="/models/cloud",
        default_mode="split",
        variant="dssd-topk",
        aggregator="cloud",
        k=5,
        max_tokens=64,
        temperature=0.7,
        theme="nord",
        keymap={"cycle_mode": "ctrl+o", "conversations_new": "ctrl+n"},
    )
    path = save_settings(custom)
    assert path == config_path()
    assert load_settings() == custom
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    assert set(data) == set(field_types())  # Tandem's own keys and every mode's
    assert data["keymap"] == {"conversations_new": "ctrl+n", "cycle_mode": "ctrl+o"}


def test_defaults_written_in_full_with_an_empty_keymap(tmp_path: Path) -> None:
    path = save_settings(Settings(), tmp_path / "nested" / "dir" / "config.toml")
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    assert data["k"] == 3 and data["keymap"] == {} and data["cloud_url"] == ""
    assert load_settings(path) == Settings()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_saved_file_is_private() -> None:
    path = save_settings(Settings(cloud_token="t"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    leftovers = [p.name for p in path.parent.iterdir() if p.name != "config.toml"]
    assert leftovers == [], "the temporary file must be renamed, not left behind"


def test_corrupt_file_raises_and_is_left_untouched() -> None:
    path = config_path()
    path.parent.mkdir(parents=True)
    garbage = b"k = 3\nthis is [not toml\n"
    path.write_bytes(garbage)
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert str(path) in str(info.value)
    assert path.read_bytes() == garbage


def test_non_utf8_file_is_a_settings_error() -> None:
    path = config_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"theme = '\xff\xfe'\n")
    with pytest.raises(SettingsError, match="UTF-8"):
        load_settings()


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ('k = "three"', "k"),
        ("max_tokens = 1.5", "max_tokens"),
        ('temperature = "hot"', "temperature"),
        ("cloud_url = 5", "cloud_url"),
        ("k = true", "k"),
        ("aggregator = 1", "aggregator"),
        ('keymap = "ctrl+o"', "keymap"),
    ],
)
def test_wrong_type_names_the_file_and_key(line: str, key: str) -> None:
    path = config_path()
    path.parent.mkdir(parents=True)
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert str(path) in message and key in message
    assert path.read_text(encoding="utf-8") == line + "\n"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("k = 0", "k"),
        ("max_tokens = 0", "max_tokens"),
        ("temperature = -0.1", "temperature"),
        ("temperature = 1e-9", "temperature"),
        ("eta = -1.0", "eta"),
        ("eta = nan", "eta"),
        ("eta = 1e9", "eta"),
        ('cloud_engine = "tensorflow"', "cloud_engine"),
        ('variant = "magic"', "variant"),
        ('aggregator = "both"', "aggregator"),
        ('cloud_url = "http://example.com"', "cloud_url"),
        ('default_mode = "  "', "default_mode"),
        ('[keymap]\ncycle_mode = ""', "keymap.cycle_mode"),
    ],
)
def test_out_of_range_values_are_refused(text: str, key: str) -> None:
    path = config_path()
    path.parent.mkdir(parents=True)
    path.write_text(text + "\n", encoding="utf-8")
    with pytest.raises(SettingsError, match=key):
        load_settings()


def test_dotted_keymap_ids_work_quoted_or_not() -> None:
    path = config_path()
    path.parent.mkdir(parents=True)
    path.write_text(
        '[keymap]\ncitation.open = "o"\n"prompt.history_prev" = "ctrl+up"\ncycle_mode = "f6"\n',
        encoding="utf-8",
    )
    keymap = {"citation.open": "o", "prompt.history_prev": "ctrl+up", "cycle_mode": "f6"}
    assert load_settings().keymap == keymap
    save_settings(load_settings())
    assert load_settings().keymap == keymap


def test_keymap_values_must_be_strings() -> None:
    path = config_path()
    path.parent.mkdir(parents=True)
    path.write_text("[keymap]\ncitation.open = 5\n", encoding="utf-8")
    with pytest.raises(SettingsError, match=r"keymap\.citation\.open must be a string"):
        load_settings()


def test_integer_temperature_is_accepted_as_float() -> None:
    path = config_path()
    path.parent.mkdir(parents=True)
    path.write_text("temperature = 1\n", encoding="utf-8")
    loaded = load_settings()
    assert loaded.temperature == 1.0 and isinstance(loaded.temperature, float)


def test_unknown_keys_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    path = config_path()
    path.parent.mkdir(parents=True)
    path.write_text('k = 7\nfuture_option = "x"\n', encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="app.settings"):
        loaded = load_settings()
    assert loaded.k == 7
    assert "future_option" in caplog.text


def test_save_refuses_invalid_settings(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    with pytest.raises(SettingsError, match="k must be at least 1"):
        save_settings(Settings(k=0), path)
    assert not path.exists()


def test_save_replaces_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    save_settings(Settings(k=4), path)
    save_settings(Settings(k=9), path)
    assert load_settings(path).k == 9


def test_environment_overrides_the_cloud(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(cloud_url="ws://file:1", cloud_token="file-token")
    assert effective_cloud(settings) == ("ws://file:1", "file-token")
    monkeypatch.setenv("TANDEM_CLOUD_URL", "wss://env:2")
    assert effective_cloud(settings) == ("wss://env:2", "file-token")
    monkeypatch.setenv("TANDEM_CLOUD_TOKEN", "env-token")
    assert effective_cloud(settings) == ("wss://env:2", "env-token")
    assert effective_cloud(Settings()) == ("wss://env:2", "env-token")


def test_config_dir_defaults_to_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_CONFIG_DIR")
    assert paths.config_dir().name == "tandem"


def test_the_ingest_size_cap_is_a_validated_setting(isolated: Path) -> None:
    path = config_path()
    path.parent.mkdir(parents=True)
    path.write_text("ingest_max_mb = 7\n")
    assert load_settings().ingest_max_mb == 7
    assert Settings().ingest_max_mb == 50
    path.write_text("ingest_max_mb = 0\n")
    with pytest.raises(SettingsError, match=r"ingest_max_mb must be at least 1 \(got 0\)"):
        load_settings()
    path.write_text('ingest_max_mb = "big"\n')
    with pytest.raises(SettingsError, match="ingest_max_mb must be an integer"):
        load_settings()
    save_settings(Settings(ingest_max_mb=3))
    assert tomllib.loads(path.read_text())["ingest_max_mb"] == 3


# ---- a hand-written config.toml holding a token (issue 44) -----------------------------------


def _hand_written(text: str, mode: int) -> Path:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_readable_config_holding_a_token_is_made_private(caplog) -> None:
    path = _hand_written('cloud_url = "wss://c.example"\ncloud_token = "s3cret"\n', 0o644)
    with caplog.at_level(logging.WARNING, logger="app.settings"):
        assert load_settings().cloud_token == "s3cret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    [record] = [r for r in caplog.records if "cloud token" in r.getMessage()]
    assert str(path) in record.getMessage() and "0644" in record.getMessage()
    assert "s3cret" not in record.getMessage()
    caplog.clear()
    load_settings()  # private now: nothing more to say
    assert not [r for r in caplog.records if "cloud token" in r.getMessage()]


def test_a_readable_config_without_a_token_is_left_as_it_is(caplog) -> None:
    path = _hand_written('cloud_url = "wss://c.example"\ncloud_token = ""\n', 0o644)
    with caplog.at_level(logging.WARNING, logger="app.settings"):
        load_settings()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not caplog.records


def test_a_config_that_cannot_be_made_private_is_warned_about(
    caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's file (here: the system call refused, as it is for a file this user does
    not own) is still read, with a warning that says what to do."""
    path = _hand_written('cloud_token = "s3cret"\n', 0o640)

    def refuse(fd: int, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", refuse)
    with caplog.at_level(logging.WARNING, logger="app.settings"):
        assert load_settings().cloud_token == "s3cret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    [record] = [r for r in caplog.records if "cloud token" in r.getMessage()]
    assert "chmod 600" in record.getMessage() and "0640" in record.getMessage()
