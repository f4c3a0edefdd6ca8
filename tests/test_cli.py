"""The command line is headless and explains itself."""

from __future__ import annotations

import os
import subprocess
import sys


def test_cli_never_imports_textual(tmp_path):
    code = (
        "import sys; from app.cli import main; main(['models', 'list']); main(['docs', 'list']); "
        "main(['paths']); assert 'textual' not in sys.modules, 'textual imported'"
    )
    env = {**os.environ, "TANDEM_DATA_DIR": str(tmp_path), "TANDEM_CONFIG_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "No models prepared" in out.stdout and "0 documents" in out.stdout
    assert f"config         {tmp_path / 'config.toml'}" in out.stdout  # `tandem paths`


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
