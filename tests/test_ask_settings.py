"""`tandem ask` is built from the same settings file as the app; its flags override it."""

from __future__ import annotations

from app.ask import settings_for
from app.cli import build_parser


def test_ask_reads_the_settings_file_and_flags_override_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path))
    (tmp_path / "config.toml").write_text(
        'max_tokens = 3\nvariant = "dssd"\nk = 5\ntemperature = 0.5\ncloud_engine = "torch"\n'
        'aggregator = "cloud"\neta = 2.5\npipeline = false\n'
    )
    plain = settings_for(build_parser().parse_args(["ask", "q"]))
    assert (plain.max_tokens, plain.variant, plain.k, plain.temperature, plain.cloud_engine) == (
        3,
        "dssd",
        5,
        0.5,
        "torch",
    )
    assert plain.aggregator == "cloud" and plain.eta == 2.5 and not plain.pipeline
    flags = [
        "ask",
        "q",
        "--max-tokens",
        "9",
        "--variant",
        "dsd",
        "-k",
        "1",
        "--temperature",
        "0",
        "--cloud-engine",
        "ort",
        "--aggregator",
        "device",
        "--eta",
        "0",
        "--pipeline",
    ]
    given = settings_for(build_parser().parse_args(flags))
    assert (given.max_tokens, given.variant, given.k, given.temperature, given.cloud_engine) == (
        9,
        "dsd",
        1,
        0.0,
        "ort",
    )
    assert given.aggregator == "device" and given.eta == 0.0 and given.pipeline


def test_without_a_file_ask_uses_the_shared_defaults(tmp_path, monkeypatch):
    from app.settings import Settings
    from edge_runtime.options import DEFAULTS

    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path))
    s = settings_for(build_parser().parse_args(["ask", "q"]))
    assert s == Settings()
    assert (s.max_tokens, s.temperature, s.k) == (
        DEFAULTS.max_new_tokens,
        DEFAULTS.temperature,
        DEFAULTS.k,
    )


async def test_the_aggregator_reaches_dragon_mode_from_the_file_the_flag_and_the_screen(
    tmp_path, monkeypatch
):
    """Settings -> Assistant.context() -> ModeContext.aggregator -> DragonMode.policy, the way
    split's variant flows; a change of settings reaches a dragon mode already built."""
    import dataclasses

    from app.assistant import Assistant
    from collab.protocol import AggregatorPolicy

    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path))
    (tmp_path / "config.toml").write_text('aggregator = "device"\n')
    plain = Assistant(settings_for(build_parser().parse_args(["ask", "q", "--mode", "dragon"])))
    assert plain.context().aggregator == "device"
    mode = plain.mode("dragon")
    assert mode.policy == AggregatorPolicy.DEVICE  # type: ignore[attr-defined]
    await plain.apply_settings(dataclasses.replace(plain.settings, aggregator="auto"))
    assert plain.mode("dragon").policy == AggregatorPolicy.AUTO  # type: ignore[attr-defined]
    args = build_parser().parse_args(["ask", "q", "--mode", "dragon", "--aggregator", "cloud"])
    flagged = Assistant(settings_for(args))
    assert flagged.mode("dragon").policy == AggregatorPolicy.CLOUD  # type: ignore[attr-defined]
    await plain.close()
    await flagged.close()


def test_the_setting_names_every_dragon_policy():
    from app.settings import AGGREGATORS
    from edge_runtime.modes.dragon import POLICIES

    assert sorted(AGGREGATORS) == sorted(POLICIES)
