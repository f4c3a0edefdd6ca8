"""SVG snapshots of the main screens (pytest-textual-snapshot). Paths and times are pinned so
the pictures only change when the UI does; `pytest --snapshot-update` re-records them after a
deliberate change (look at the report first)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from app.assistant import Assistant
from app.conversations import ConversationStore
from app.settings import Settings
from app.tui.app import TandemApp
from app.tui.chat_view import PromptInput
from app.tui.status import ModeBar
from collab.plumbing.paths import conversations_path

ROOT = Path("/tmp/tandem-snapshots")  # fixed: the help and settings screens show paths
SIZE = (110, 32)
NOON_2025 = 1_735_732_800.0  # 2025-01-01 12:00 UTC: a date, not "today hh:mm"
ANSWER = """A tandem is a bicycle for two riders [1].

- the **captain** steers in front
- the *stoker* pedals behind

```python
riders = ("captain", "stoker")
```
"""


@pytest.fixture
def pinned(monkeypatch) -> Path:
    shutil.rmtree(ROOT, ignore_errors=True)
    for sub in ("data", "config", "home/notes"):
        (ROOT / sub).mkdir(parents=True)
    monkeypatch.setenv("TANDEM_DATA_DIR", str(ROOT / "data"))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(ROOT / "config"))
    monkeypatch.setenv("HOME", str(ROOT / "home"))
    monkeypatch.delenv("TANDEM_CLOUD_URL", raising=False)
    monkeypatch.delenv("TANDEM_CLOUD_TOKEN", raising=False)
    return ROOT


def seed_conversation() -> None:
    with ConversationStore(conversations_path()) as store:
        cid = store.create("Tandem bicycles").id
        store.add_message(cid, "user", "What is a tandem?", "local")
        source = {
            "number": 1,
            "side": "device",
            "title": "bikes.md",
            "location": "lines 1–4",
            "score": 0.82,
            "excerpt": "A tandem bicycle…",
            "path": "/notes/bikes.md",
            "text": "A tandem bicycle is ridden by two people.",
        }
        store.add_message(
            cid, "assistant", ANSWER, "local", citations=[source], stats={"tokens": 40}
        )
        store._conn.execute(
            "UPDATE conversations SET created_at = ?, updated_at = ?", (NOON_2025, NOON_2025)
        )
        store._conn.commit()


def make_app(tiny_device) -> TandemApp:
    settings = Settings()
    return TandemApp(settings, Assistant(settings, device=tiny_device), connect_cloud=False)


async def settled(pilot) -> None:
    app: TandemApp = pilot.app
    while not app.query_one(ModeBar).infos:
        await pilot.pause(0.05)
    app.query_one(PromptInput).cursor_blink = False
    await pilot.pause(0.3)


def test_chat_screen(snap_compare, pinned, tiny_device):
    seed_conversation()
    assert snap_compare(make_app(tiny_device), terminal_size=SIZE, run_before=settled)


def test_help_screen(snap_compare, pinned, tiny_device):
    assert snap_compare(make_app(tiny_device), terminal_size=SIZE, press=["f1"], run_before=settled)


def test_conversations_screen(snap_compare, pinned, tiny_device):
    seed_conversation()
    assert snap_compare(make_app(tiny_device), terminal_size=SIZE, press=["f3"], run_before=settled)


def test_settings_screen(snap_compare, pinned, tiny_device):
    async def before(pilot) -> None:
        await settled(pilot)
        await pilot.press("f4")
        await pilot.pause(0.3)
        for field in pilot.app.screen.query("Input"):
            field.cursor_blink = False

    assert snap_compare(make_app(tiny_device), terminal_size=SIZE, run_before=before)


def test_documents_screen(snap_compare, pinned, tiny_device, embedder_dir):
    (pinned / "home" / "notes" / "bikes.md").write_text("# Bikes\n\nA tandem has two seats.\n")
    (pinned / "data" / "models").mkdir()
    (pinned / "data" / "models" / "all-minilm-l6-v2-onnx").symlink_to(embedder_dir)

    async def before(pilot) -> None:
        await settled(pilot)
        await pilot.press("f2")
        screen = pilot.app.screen
        while "Loading" in str(screen.query_one("#documents-stats").render()):
            await pilot.pause(0.05)
        for field in screen.query("Input"):
            field.cursor_blink = False
        await pilot.pause(0.3)

    assert snap_compare(make_app(tiny_device), terminal_size=SIZE, run_before=before)
