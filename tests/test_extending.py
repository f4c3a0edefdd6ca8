"""A new mode or split variant is one module per side plus one registry line: the toy
extensions in tests/toy_extensions/ are registered here, from outside the packages, and then
show up everywhere the user picks a mode or variant and work end to end over a real server
on loopback (tiny models). The toy mode brings its own message (its wire module), two figures
and a setting: they appear in the codec and the cloud session's routing, `Stats` and
`tandem ask --json`, the status bar, the settings file and the settings screen."""

from __future__ import annotations

import json
import struct

import pytest
from textual.widgets import Input, Label

from app.ask import run_ask
from app.cli import build_parser
from app.settings import (
    Settings,
    SettingsError,
    load_settings,
    save_settings,
    settings_problems,
)
from app.tui.status import figures as status_figures
from collab import variants
from collab.protocol import PROTOCOL_VERSION, ProtocolError, decode, encode, request_frames
from edge_runtime import modes as device_modes
from edge_runtime.events import Stats, TextDelta
from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext
from tests import toy_extensions
from tests.cloud import TOKEN
from tests.toy_extensions.shout_wire import SHOUT_SETUP, ShoutSetup


@pytest.fixture
def registered():
    with toy_extensions.registered():
        yield


def choices(option: str) -> list[str]:
    ask = build_parser()._subparsers._group_actions[0].choices["ask"]  # type: ignore[union-attr]
    return next(a for a in ask._actions if option in a.option_strings).choices


def test_registered_mode_and_variant_are_offered_everywhere(registered):
    assert "shout" in choices("--mode") and "toy-argmax" in choices("--variant")
    assert settings_problems(Settings(variant="toy-argmax", default_mode="shout")) == []


def test_unregistered_names_are_refused():
    assert "shout" not in choices("--mode") and "toy-argmax" not in choices("--variant")
    assert any("variant" in p for p in settings_problems(Settings(variant="toy-argmax")))
    with pytest.raises(ValueError, match="unknown split variant"):
        variants.get_variant("toy-argmax")


async def answer(mode, question: str, options: AnswerOptions) -> tuple[str, Stats]:
    events = [e async for e in mode.answer(question, [], options)]
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return text, next(e for e in events if isinstance(e, Stats))


async def test_a_registered_mode_answers_through_both_of_its_sides(registered, device, cloud_url):
    """Its setting reaches the cloud in its own message; its figures are the answer's."""
    ctx = ModeContext(
        device=device, cloud=CloudSettings(cloud_url, TOKEN), settings={"shout_marks": 3}
    )
    mode = device_modes.build_mode("shout", ctx)
    try:
        text, stats = await answer(mode, "what is a tandem?", AnswerOptions(max_new_tokens=40))
    finally:
        await mode.close()
    assert text == "WHAT IS A TANDEM?!!!" and stats.mode == "shout" and stats.bytes_up > 0
    figures = stats.as_dict()
    assert (figures["shout_marks"], figures["shout_raised"]) == (3, 13)
    assert "marks 3 · raised 13 letters" in status_figures(stats)


def test_the_mode_s_message_is_known_only_while_it_is_registered(registered):
    frame = encode(ShoutSetup(4, request_id=7))
    assert decode(frame) == ShoutSetup(4, request_id=7) and ShoutSetup in request_frames()


def test_an_unregistered_mode_s_message_figures_and_setting_are_refused():
    # a ShoutSetup(marks=1) frame: header (magic, version, type, flags, ids, length), body
    frame = struct.pack("<2sBBHIIII", b"TD", PROTOCOL_VERSION, SHOUT_SETUP, 0, 0, 0, 0, 1)
    frame += b"\x01"
    with pytest.raises(ProtocolError, match="unknown message type 200"):
        decode(frame)
    assert ShoutSetup not in request_frames()
    with pytest.raises(AttributeError):
        _ = Stats("cloud").shout_marks
    assert "shout_marks" not in Stats("cloud").as_dict()
    with pytest.raises(TypeError, match="shout_marks"):
        Settings(shout_marks=2)


def test_the_mode_s_setting_is_read_checked_and_saved(registered, tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('default_mode = "shout"\nshout_marks = 4\n', encoding="utf-8")
    settings = load_settings(path)
    assert settings.shout_marks == 4
    assert settings_problems(Settings(shout_marks=9)) == ["shout_marks must be in 0..5 (got 9)"]
    path.write_text('shout_marks = "loud"\n', encoding="utf-8")
    with pytest.raises(SettingsError, match="shout_marks must be an integer"):
        load_settings(path)
    save_settings(settings, path)
    assert "shout_marks = 4" in path.read_text(encoding="utf-8")


async def test_the_mode_s_setting_is_on_the_settings_screen(registered, tmp_path, monkeypatch):
    from tests.tui.test_settings_screen import error_text, host, screen_of, type_into

    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path / "config"))
    app = host(Settings(), modes=[*device_modes.mode_names()])
    async with app.run_test(size=(80, 40)) as pilot:
        await pilot.pause()
        screen = screen_of(app)
        assert screen.query_one("#shout_marks", Input).value == "1"
        labels = [str(label.render()) for label in screen.query(Label)]
        assert "Shout marks" in labels
        await type_into(pilot, screen, "shout_marks", "9")
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "shout_marks must be in 0..5 (got 9)" in error_text(screen)
        await type_into(pilot, screen, "shout_marks", "2")
        await pilot.press("ctrl+s")
        await pilot.pause()
    saved = app.results[-1]
    assert saved is not None and saved.shout_marks == 2
    assert load_settings(tmp_path / "config" / "config.toml").shout_marks == 2


async def test_ask_json_carries_the_mode_s_figures(
    registered, cloud_url, tiny, tmp_path, monkeypatch, capsys
):
    """`tandem ask --mode shout --json` end to end: the setting from the file, the figures in
    the JSON object and on the last line."""
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("TANDEM_CLOUD_URL", raising=False)
    monkeypatch.delenv("TANDEM_CLOUD_TOKEN", raising=False)
    save_settings(
        Settings(
            device_model=str(tiny["onnx-quant"]),
            max_tokens=40,
            cloud_url=cloud_url,
            cloud_token=TOKEN,
            shout_marks=2,
        )
    )
    parser = build_parser()
    assert (
        await run_ask(parser.parse_args(["ask", "what is a tandem?", "--mode", "shout", "--json"]))
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["answer"] == "WHAT IS A TANDEM?!!" and not out["errors"]
    assert (out["stats"]["shout_marks"], out["stats"]["shout_raised"]) == (2, 13)
    assert await run_ask(parser.parse_args(["ask", "what is a tandem?", "--mode", "shout"])) == 0
    assert "marks 2 · raised 13 letters" in capsys.readouterr().err.strip().splitlines()[-1]


async def test_a_registered_variant_is_exact_through_split_mode(registered, device, cloud_url):
    """Greedy split with the toy variant gives the cloud's own greedy answer, token for token
    (the cloud judged the toy's drafts with the toy's judge)."""
    options = AnswerOptions(max_new_tokens=24, temperature=0.0)
    question = "Write a haiku about autumn rain."
    got = {}
    for name, variant in (("cloud", "tk-slt"), ("split", "toy-argmax")):
        ctx = ModeContext(device=device, cloud=CloudSettings(cloud_url, TOKEN), variant=variant)
        mode = device_modes.build_mode(name, ctx)
        try:
            got[name] = await answer(mode, question, options)
        finally:
            await mode.close()
    (cloud_text, cloud_stats), (split_text, split_stats) = got["cloud"], got["split"]
    assert split_stats.variant == "toy-argmax" and split_stats.rounds > 0
    assert split_stats.token_ids == cloud_stats.token_ids and split_text == cloud_text
