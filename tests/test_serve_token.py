"""`tandem serve --token-file`: the access token read from a file (stripped; an empty, missing
or unreadable file refused in plain words; a file open to other users warned about, as ssh
does for keys), a warning when `--token` puts it in the command line, and a token that looks
weaker than 128 bits refused however it was given (issue 44)."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import pytest

from app.cli import build_parser, main
from app.serve import _config
from app.serve_token import ARGV_WARNING, MIN_TOKEN_BITS, token_bits
from cloud_backend.config import load_config

TOKEN = "v1-kZzeBTgZj2GsYxN6eNu5yOQNpXt-0PmkQhUSUKpw"  # secrets.token_urlsafe(32)


def _config_of(*argv: str):
    return _config(build_parser().parse_args(["serve", "--no-corpus", *argv]), load_config)


def _token_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch):
    monkeypatch.delenv("TANDEM_CLOUD_TOKEN", raising=False)


def test_the_token_file_gives_the_token_stripped_and_wins_over_the_environment(
    tmp_path, monkeypatch, caplog
):
    path = _token_file(tmp_path, f"  {TOKEN}\n")
    monkeypatch.setenv("TANDEM_CLOUD_TOKEN", "env-token-0123456789")  # as --token, it wins
    with caplog.at_level(logging.WARNING, logger="tandem.cloud"):
        assert _config_of("--token-file", str(path)).token == TOKEN
    assert not caplog.records  # 0600: nothing to say


def test_a_token_file_others_can_read_is_used_with_a_warning(tmp_path, caplog):
    path = _token_file(tmp_path, TOKEN + "\n", mode=0o644)
    with caplog.at_level(logging.WARNING, logger="tandem.cloud"):
        assert _config_of("--token-file", str(path)).token == TOKEN
    assert any(
        r.levelno == logging.WARNING and str(path) in r.getMessage() and "0644" in r.getMessage()
        for r in caplog.records
    ), caplog.records


def test_a_token_from_a_pipe_is_read(tmp_path):
    read, write = os.pipe()
    os.write(write, (TOKEN + "\n").encode())
    os.close(write)
    try:
        assert _config_of("--token-file", f"/dev/fd/{read}").token == TOKEN
    finally:
        os.close(read)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "is empty"),
        (" \n\n", "is empty"),
        ("one-token\nanother-token\n", "more than one word or line"),
        (None, "cannot read the token file"),  # missing
        ("dir", "cannot read the token file"),  # a folder
    ],
)
def test_an_unusable_token_file_stops_serve_with_a_plain_error(tmp_path, capsys, text, why):
    path = tmp_path / "token"
    if text == "dir":
        path.mkdir()
    elif text is not None:
        _token_file(tmp_path, text)
    assert main(["serve", "--no-corpus", "--token-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and why in err and str(path) in err
    assert "Traceback" not in err


def test_token_and_token_file_do_not_mix(tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--token", TOKEN, "--token-file", "x"])
    assert "not allowed with" in capsys.readouterr().err


def test_token_on_the_command_line_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.cloud"):
        assert _config_of("--token", TOKEN).token == TOKEN
    assert [r.getMessage() for r in caplog.records] == [ARGV_WARNING]
    assert "ps" in ARGV_WARNING and "--token-file" in ARGV_WARNING


# ---- weak tokens ------------------------------------------------------------------------------

WEAK = [
    "secret",
    "test-token-0123456789",  # what the tests used: words and a counted run
    "t" * 64,  # long, one character
    "abcdefghijklmnopqrstuvwxyz0123456789",  # runs
    "Tandem-Tandem-Tandem-Tandem-Tandem-Tandem-",  # a block repeated
    "0123456789" * 4,
    "3141592653589793238462643383279",  # digits only: 31 of them are 103 bits at best
]


@pytest.mark.parametrize("weak", WEAK)
def test_weak_tokens_are_estimated_below_128_bits(weak):
    assert token_bits(weak) < MIN_TOKEN_BITS


def test_random_tokens_pass_the_estimate():
    """What the embedded cloud and the error message make, and `openssl rand -hex 16`."""
    for _ in range(2000):
        assert token_bits(secrets.token_urlsafe(32)) >= MIN_TOKEN_BITS
        assert token_bits(secrets.token_hex(16)) >= MIN_TOKEN_BITS


@pytest.mark.parametrize("route", ["--token", "--token-file", "env", "config", "named", "metrics"])
def test_serve_refuses_a_weak_token_however_it_is_given(tmp_path, monkeypatch, capsys, route):
    """A plain error (how to make a good one, never the token itself), before any model loads:
    the wrong-token throttle slows guessing, only a random token makes it hopeless."""
    weak = "test-token-0123456789"
    config = tmp_path / "cloud.toml"
    table = {
        "config": f'token = "{weak}"',
        "named": f'[cloud.tokens]\nalice = "{weak}"',
        "metrics": f'token = "{TOKEN}"\nmetrics_token = "{weak}"',
    }.get(route, f'token = "{TOKEN}"')
    config.write_text(f"[cloud]\n{table}\n")
    # a missing model: a token let through ends in another error, not in a served cloud
    argv = ["serve", "--no-corpus", "--config", str(config), "--model-dir", str(tmp_path / "no")]
    if route == "--token":
        argv += ["--token", weak]
    elif route == "--token-file":
        argv += ["--token-file", str(_token_file(tmp_path, weak + "\n"))]
    elif route == "env":
        config.write_text("[cloud]\n")
        monkeypatch.setenv("TANDEM_CLOUD_TOKEN", weak)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "too easy to guess" in err, err
    assert "secrets.token_urlsafe(32)" in err and weak not in err
    assert ("alice" in err) == (route == "named") and ("metrics" in err) == (route == "metrics")


def test_serve_takes_a_random_token(tmp_path):
    token = secrets.token_urlsafe(32)
    assert _config_of("--token-file", str(_token_file(tmp_path, token))).token == token
