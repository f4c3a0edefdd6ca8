"""`tandem ask` is built from the same settings file as the app; its flags override it."""

from __future__ import annotations

from app.ask import settings_for
from app.cli import build_parser


def test_ask_reads_the_settings_file_and_flags_override_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path))
    (tmp_path / "config.toml").write_text(
        'max_tokens = 3\nvariant = "dssd"\nk = 5\ntemperature = 0.5\ncloud_engine = "torch"\n'
    )
    plain = settings_for(build_parser().parse_args(["ask", "q"]))
    assert (plain.max_tokens, plain.variant, plain.k, plain.temperature, plain.cloud_engine) == (
        3, "dssd", 5, 0.5, "torch",
    )  # fmt: skip
    flags = ["ask", "q", "--max-tokens", "9", "--variant", "dsd", "-k", "1", "--temperature",
             "0", "--cloud-engine", "ort"]  # fmt: skip
    given = settings_for(build_parser().parse_args(flags))
    assert (given.max_tokens, given.variant, given.k, given.temperature, given.cloud_engine) == (
        9, "dsd", 1, 0.0, "ort",
    )  # fmt: skip


def test_without_a_file_ask_uses_the_shared_defaults(tmp_path, monkeypatch):
    from app.settings import Settings
    from edge_runtime.options import DEFAULTS

    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path))
    s = settings_for(build_parser().parse_args(["ask", "q"]))
    assert s == Settings()
    assert (s.max_tokens, s.temperature, s.k) == (
        DEFAULTS.max_new_tokens, DEFAULTS.temperature, DEFAULTS.k,
    )  # fmt: skip
