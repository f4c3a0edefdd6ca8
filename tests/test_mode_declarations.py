"""Each mode declares its figures and settings (edge_runtime.declared) and its messages
(collab.protocol.modes); what the user already has on disk from before still reads: a
config.toml main wrote, a stored answer's figures, `tandem ask --json`'s keys."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from app.conversations import ConversationStore
from app.settings import Settings, load_settings, save_settings, settings_problems
from app.tui.status import figures
from cloud_backend.session import request_frames
from collab.protocol import CloudDecode, DragonSetup, TopKDraft, Verdict
from edge_runtime import declared
from edge_runtime.events import Stats
from edge_runtime.modes import get_mode

# config.toml as main wrote it (commit aae5f0f, save_settings), byte for byte
MAIN_CONFIG = """\
# Tandem settings. Edit here or in the TUI's settings screen.

cloud_url = ""
cloud_token = ""
cloud_ca = ""
cloud_allow_insecure = false
cloud_engine = "ort"
device_model = ""
cloud_model = ""
default_mode = "local"
variant = "tk-slt"
aggregator = "cloud"
k = 3
relevance_floor = 0.3
max_tokens = 512
temperature = 0.0
eta = 2.5
pipeline = false
theme = "textual-dark"
ingest_max_mb = 50

[keymap]
cycle_mode = "ctrl+o"
"""

# a dragon answer's figures as main stored them (Stats.as_dict() at commit aae5f0f)
MAIN_FIGURES = json.loads(
    '{"mode": "dragon", "variant": "", "tokens": 9, "ttft_s": 0.25, "elapsed_s": 1.0, '
    '"rounds": 0, "drafted": 0, "accepted": 0, "gamma": null, "cloud_only": false, '
    '"cloud_tokens": 0, "bytes_up": 0, "bytes_down": 0, "draft_bytes_up": 0, "finish": null, '
    '"aggregator": "cloud", "switches": 2, "rapid_eta": 0.0, "pipeline": false, '
    '"pipeline_depth": 0, "truncations": 0, "waits": 0, "fast_verified": 0, "rollbacks": 0, '
    '"device_drafted": 4, "device_accepted": 3, "cloud_drafted": 5, "cloud_accepted": 5, '
    '"device_decode_s": null, "cloud_decode_s": null, "acceptance": null, '
    '"tokens_per_s": 10.666666666666666, "device_acceptance": 0.75, "cloud_acceptance": 1.0}'
)

AUTO_FIGURES = {"auto_mode": None, "auto_reason": None}  # added with auto (issue 34)
NOT_RECORDED = {"sent": None}  # what left the device (issue 44): unknown for an older answer


def test_a_config_file_main_wrote_still_loads_and_saves_the_same_keys(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(MAIN_CONFIG, encoding="utf-8")
    s = load_settings(path)
    assert (s.variant, s.aggregator, s.eta, s.pipeline, s.k) == ("tk-slt", "cloud", 2.5, False, 3)
    assert s.keymap == {"cycle_mode": "ctrl+o"}
    save_settings(s, path)
    assert load_settings(path) == s
    # nothing lost; added only the settings declared since (auto's policy, with defaults, and
    # the clouds' consent, empty)
    old, saved = set(tomllib.loads(MAIN_CONFIG)), set(tomllib.loads(path.read_text("utf-8")))
    added = {"auto_cloud_questions", "auto_private_in_cloud", "cloud_consent"}
    assert old <= saved and saved - old == added


def test_a_stored_answers_figures_from_main_still_read(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "conversations.sqlite") as store:
        conversation = store.create("old")
        store.add_message(conversation.id, "assistant", "an answer", "dragon", stats=MAIN_FIGURES)
        row = store.messages(conversation.id)[0]
    stats = Stats.from_dict(row.stats)
    # same keys, same values; auto's unset, and no record of what it sent
    assert stats.as_dict() == MAIN_FIGURES | AUTO_FIGURES | NOT_RECORDED
    assert (stats.aggregator, stats.switches, stats.device_acceptance) == ("cloud", 2, 0.75)
    assert "aggregator cloud · accept device 0.75 / cloud 1.00 · 2 switches" in figures(stats)


def test_ask_json_keys_are_unchanged_for_the_built_in_modes() -> None:
    """The same keys as main's flat Stats printed (their order may differ: the core first,
    then each mode's), and auto's two, null in the other modes' answers; the ledger of what
    was sent (`sent`) is stored with the figures and printed beside them (`app.ask`)."""
    for mode in ("local", "cloud", "split", "dragon"):
        keys = set(MAIN_FIGURES) | set(AUTO_FIGURES)
        assert set(Stats(mode).as_dict()) == keys | set(NOT_RECORDED)


def test_built_in_modes_carry_their_own_declarations() -> None:
    table = declared.declarations()
    assert get_mode("split").declared is table["split"]
    assert get_mode("dragon").declared is table["dragon"]
    assert {s.name for s in table["split"].settings} == {"variant", "eta", "pipeline"}
    assert {s.name for s in table["dragon"].settings} == {"aggregator"}
    assert not get_mode("local").declared.figures and not get_mode("cloud").declared.settings


def test_the_session_routes_what_each_mode_declares() -> None:
    frames = request_frames()
    assert TopKDraft in frames and CloudDecode in frames and DragonSetup in frames
    assert Verdict not in frames  # the cloud sends verdicts; a device's is not routed


def test_a_mode_setting_is_checked_by_its_declaration() -> None:
    said = settings_problems(Settings(aggregator="sideways", eta=-1.0))
    assert any(p.startswith("aggregator must be one of auto, device, cloud") for p in said)
    assert any("η" in p or "eta" in p for p in said)
