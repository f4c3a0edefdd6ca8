"""A mode registered from outside the packages is on the TUI's mode bar (the toy of
tests/toy_extensions), with no other file touched."""

from __future__ import annotations

from app.assistant import Assistant
from app.settings import Settings
from app.tui.app import TandemApp
from app.tui.status import ModeBar
from tests import toy_extensions


async def test_a_registered_mode_is_on_the_mode_bar(isolated_dirs, tiny_device):
    settings = Settings(default_mode="local")
    with toy_extensions.registered():
        app = TandemApp(settings, Assistant(settings, device=tiny_device), connect_cloud=False)
        async with app.run_test() as pilot:
            await app.workers.wait_for_complete()  # the loaders have reported
            await pilot.pause()
            names = [i.name for i in app.query_one(ModeBar).infos]
    assert names == ["local", "cloud", "split", "dragon", "auto", "shout"]
