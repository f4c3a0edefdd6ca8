"""dragon in the TUI without a cloud: the mode bar and the palette offer it (unavailable, with
the reason, while no cloud is ready, as split is), the status bar shows its figures, and the
sources of both sides are listed in number order with their side. A real dragon answer through
the TUI is in test_app.py."""

from __future__ import annotations

from app.assistant import Assistant
from app.settings import Settings
from app.tui.app import TandemApp
from app.tui.chat_view import CitationLine, ConversationView
from app.tui.sources import SourceItem, SourcesPanel
from app.tui.status import ModeBar, StatusBar
from edge_runtime.events import Stats

UNREACHABLE = "ws://127.0.0.1:9/v1/session"  # the discard port: nothing listens

# dragon's citations as they arrive: the device's own first (numbered after the cloud's k = 2),
# then the cloud's
ARRIVAL = [
    {"number": 3, "side": "device", "title": "diary.md", "location": "lines 1–2", "score": 0.7},
    {"number": 1, "side": "cloud", "title": "Aachen", "location": "", "score": 0.6},
    {"number": 4, "side": "device", "title": "trip.txt", "location": "", "score": 0.4},
    {"number": 2, "side": "cloud", "title": "Charlemagne", "location": "", "score": 0.3},
]


def dragon_stats() -> Stats:
    return Stats(
        "dragon",
        tokens=21,
        ttft_s=0.25,
        elapsed_s=2.25,
        rounds=21,
        bytes_up=2048,
        bytes_down=3584,
        figures={
            "aggregator": "cloud",
            "switches": 2,
            "device_drafted": 20,
            "device_accepted": 12,
            "cloud_drafted": 20,
            "cloud_accepted": 18,
        },
    )


async def settled(pilot, app: TandemApp) -> None:
    while not app.query_one(ModeBar).infos or app.assistant.cloud_status.state == "starting":
        await pilot.pause(0.05)
    await app.workers.wait_for_complete()
    await pilot.pause()


async def test_dragon_is_offered_and_unavailable_with_the_reason_while_the_cloud_is_not(
    isolated_dirs, tiny_device
):
    # auto may use the cloud: it is connected at start, and found unreachable
    settings = Settings(default_mode="auto", cloud_url=UNREACHABLE, cloud_token="t")
    app = TandemApp(settings, Assistant(settings, device=tiny_device))
    async with app.run_test(size=(120, 36), notifications=True) as pilot:
        await settled(pilot, app)
        assert app.assistant.cloud_status.state == "unavailable"
        infos = {i.name: i for i in app.assistant.modes()}
        assert infos["dragon"].needs_cloud and not infos["dragon"].available
        assert infos["dragon"].reason == infos["split"].reason
        assert infos["dragon"].reason.startswith("cloud unavailable")
        button = app.query_one("#mode-dragon")
        assert button.has_class("-unavailable")
        assert "unavailable: cloud unavailable" in str(button.tooltip)
        # the palette lists it from the registry, with the reason; picking it is refused
        commands = {c.title: c for c in app.get_system_commands(app.screen)}
        assert "cloud unavailable" in commands["Mode: dragon"].help
        commands["Mode: dragon"].callback()
        await pilot.pause()
        assert app.mode_name == "auto"
        assert any("dragon is unavailable" in str(n.message) for n in app._notifications)


async def test_the_status_bar_shows_dragons_figures_and_sources_by_number(
    isolated_dirs, tiny_device
):
    settings = Settings(default_mode="local")
    app = TandemApp(settings, Assistant(settings, device=tiny_device), connect_cloud=False)
    async with app.run_test(size=(200, 36)) as pilot:
        await settled(pilot, app)
        bar = app.query_one(StatusBar)
        bar.set_state(mode="dragon", stats=dragon_stats(), answering=True)
        await pilot.pause()
        line = str(bar.line_text())
        parts = (
            "● dragon",
            "21 tok",
            "TTFT 0.25 s",
            "10.0 tok/s",
            "aggregator cloud",
            "accept device 0.60 / cloud 0.90",
            "2 switches",
            "↑ 2.0 KB ↓ 3.5 KB",
        )
        for part in parts:
            assert part in line, (part, line)
        assert "γ" not in line  # split's figures stay split's
        assert "aggregator cloud" in str(bar.render())  # what is on the screen
        # before any draft: no acceptance yet, one aggregator, no switch
        bar.set_state(stats=Stats("dragon", figures={"aggregator": "device"}))
        line = str(bar.line_text())
        assert "aggregator device · 0 switches" in line and "accept" not in line
        # the other modes show none of it
        bar.set_state(stats=Stats("split", drafted=8, accepted=6, figures={"gamma": 4}))
        assert "aggregator" not in str(bar.line_text())

        # the sources of both sides, listed by number with their side (one app: starting
        # one takes seconds)
        answer = app.query_one(ConversationView).add_answer("dragon")
        panel = app.query_one(SourcesPanel)
        panel.show([])
        for row in ARRIVAL:
            answer.add_citation(**row)
            panel.add(row)
        await answer.finish()
        await pilot.pause()
        lines = [line.plain for line in answer.query(CitationLine)]
        assert [line[:10] for line in lines] == [
            "[1] cloud ",
            "[2] cloud ",
            "[3] device",
            "[4] device",
        ]
        assert [r["number"] for r in answer.sources] == [1, 2, 3, 4]
        items = list(panel.query(SourceItem))
        assert [(i.src.number, i.src.side) for i in items] == [
            (1, "cloud"),
            (2, "cloud"),
            (3, "device"),
            (4, "device"),
        ]
        # a stored answer comes back in the same order
        stored = app.query_one(ConversationView)
        await stored.load(
            [{"role": "assistant", "text": "x", "mode": "dragon", "citations": ARRIVAL}]
        )
        await pilot.pause()
        restored = [c.number for c in stored.query(CitationLine)]
        assert restored == [1, 2, 3, 4]
