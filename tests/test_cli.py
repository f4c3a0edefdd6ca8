"""The command line is headless and explains itself."""

from __future__ import annotations

import os
import subprocess
import sys


def test_listing_commands_on_an_empty_install(tmp_path, monkeypatch, capsys):
    """What the listing commands say before anything is set up (that they never import Textual
    is checked by tests/test_imports.py)."""
    from app.cli import main

    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path))
    for argv in (["models", "list"], ["docs", "list"], ["paths"]):
        main(argv)
    out = capsys.readouterr().out
    assert "No models prepared" in out and "0 documents" in out
    assert f"config         {tmp_path / 'config.toml'}" in out  # `tandem paths`


def test_ask_without_prepared_models_says_what_to_run(tmp_path):
    env = {**os.environ, "TANDEM_DATA_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "ask", "hi"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2
    assert "tandem models prepare" in out.stderr


def test_ask_offers_dragon_and_its_aggregator(capsys):
    """dragon is a --mode choice (from the registry); --aggregator takes only the three
    policies; -k says what it means in dragon."""
    import pytest

    from app.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["ask", "q", "--mode", "dragon", "--aggregator", "cloud", "-k", "2"])
    assert (args.mode, args.aggregator, args.k) == ("dragon", "cloud", 2)
    assert parser.parse_args(["ask", "q"]).aggregator is None  # the settings file's
    with pytest.raises(SystemExit):
        parser.parse_args(["ask", "q", "--aggregator", "both"])
    with pytest.raises(SystemExit):
        parser.parse_args(["ask", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "dragon" in usage and "--aggregator {auto,device,cloud}" in usage
    assert "in dragon, documents per side" in usage
