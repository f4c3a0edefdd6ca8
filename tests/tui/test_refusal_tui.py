"""Slow tier: in the TUI, with the real device model, one refusal does not poison the next
answer (issue 45). The bug as a user met it: after a question the notes cannot answer, the
0.5B model copied its refusal into the next answer although the right passage was retrieved
and cited. The conversation is typed into the app; its history comes from the app's own store.
The negative control runs the same conversation under the history rules before issue 45
(`benchmarks.multiturn.history_rules("before")`: every earlier turn steers) and sees the
poisoned answer, so the test can fail."""

from __future__ import annotations

import pytest

from benchmarks.multiturn import history_rules, load_set
from edge_runtime.turns import refused
from tests.tui.test_app import SIZE, ask, make_app, ready

pytestmark = pytest.mark.slow

REFUSED = "What's the PIN of my bank card?"  # no note says; the model declines
ANSWERED = "What are we giving Aunt Miravel for her birthday?"  # aunt-miravel.txt: a teapot
FACT = "teapot"


@pytest.fixture(scope="module")
def device():
    from edge_runtime.device import DeviceModel
    from tandem_packaging.prepare import model_path

    model = DeviceModel.load(model_path("device", "onnx-quant"), threads=1)
    yield model
    model._worker.close()


@pytest.fixture
def notes(isolated_dirs, embedder_dir, tmp_path):
    """The multi-turn set's private notes, ingested as a user's folder."""
    from personal_index.index import PersonalIndex

    folder = tmp_path / "notes"
    folder.mkdir()
    for note in load_set()[0]:
        (folder / note["file"]).write_text(note["text"] + "\n", encoding="utf-8")
    index = PersonalIndex(isolated_dirs.data / "index", embedder_dir)
    index.ingest([folder])
    yield index
    index.close()


async def conversation(device, notes) -> tuple[str, str, list[dict]]:
    """Both questions typed into one conversation of the app (local mode, greedy): the two
    answers and the second one's citations."""
    app = make_app(device, notes, k=3, temperature=0.0, max_tokens=40)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        first = await ask(pilot, REFUSED)
        second = await ask(pilot, ANSWERED)
        return first.text, second.text, list(app.sources)


async def test_a_refusal_does_not_poison_the_next_answer(device, notes):
    first, second, sources = await conversation(device, notes)
    assert refused(first), first  # the conversation this test is about
    assert "aunt-miravel" in sources[0]["title"], sources
    assert FACT in second.lower() and not refused(second), second


async def test_under_the_old_rules_the_refusal_poisons_it(device, notes):
    with history_rules("before"):
        first, second, sources = await conversation(device, notes)
    assert refused(first), first
    assert "aunt-miravel" in sources[0]["title"], sources  # the passage was there
    assert refused(second) and FACT not in second.lower(), second  # the same refusal
