"""@ mentions in the TUI prompt (issue 47, item 2): `@folder/`, `@file.md` or a path ask the
question of those documents only, the citations coming from inside them; typing a mention,
the prompt suggests the rest of an indexed name; a mention that names nothing is a warning,
not an answer from no document; an e-mail address is not a mention."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.assistant import Assistant
from app.settings import Settings
from app.tui.app import TandemApp
from app.tui.chat_view import AnswerView, PromptInput
from app.tui.mentions import ScopeSuggester, mention_names, resolve, split_mentions
from tests.tui.test_app import until

SIZE = (120, 36)
TRIP = "The kayak for the lake trip belongs to Ines. It is red and has two seats.\n"
WORK = "The kayak in the office photo belongs to Ines's manager Teodor. It is a blue kayak.\n"
QUESTION = "Whose blue kayak is in the office photo?"


def test_mentions_are_words_that_start_with_an_at() -> None:
    assert split_mentions(f"@trip/ {QUESTION}") == (QUESTION, ["trip/"])
    assert split_mentions("In @kayak.md and @~/docs: who? Mail a@b.com") == (
        "In and : who? Mail a@b.com",
        ["kayak.md", "~/docs"],
    )
    assert split_mentions("no mention here") == ("no mention here", [])


def test_a_mention_names_files_folders_or_a_path(monkeypatch) -> None:
    monkeypatch.setenv("HOME", "/home/u")
    docs = ["/home/u/docs/trip/kayak.md", "/home/u/docs/trip-work/kayak.md", "/srv/x/notes.txt"]
    assert resolve(["trip/"], docs) == (["/home/u/docs/trip"], [])
    assert resolve(["kayak.md"], docs) == (docs[:2], [])
    assert resolve(["~/docs/trip-work"], docs) == (["/home/u/docs/trip-work"], [])
    assert resolve(["/home/u/docs/tri"], docs) == ([], ["/home/u/docs/tri"])  # not a prefix
    assert resolve(["nothing", "docs"], docs) == (["/home/u/docs"], ["nothing"])
    assert mention_names(docs) == [
        "docs/",
        "kayak.md",
        "notes.txt",
        "srv/",
        "trip-work/",
        "trip/",
        "x/",
    ]


async def test_the_suggester_completes_an_indexed_name() -> None:
    docs = ["/data/trip/kayak.md", "/data/trip/tent.md"]
    suggest = ScopeSuggester(lambda: docs).get_suggestion
    assert await suggest("Who owns @ka") == "Who owns @kayak.md"
    assert await suggest("@tr") == "@trip/"
    assert await suggest("@trip/") is None  # complete already
    assert await suggest("mail a@ka") is None and await suggest("no at") is None


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    trip, work = tmp_path / "docs" / "trip", tmp_path / "docs" / "work"
    for folder, text in ((trip, TRIP), (work, WORK)):
        folder.mkdir(parents=True)
        (folder / "kayak.md").write_text(text, encoding="utf-8")
    return trip.resolve(), work.resolve()


def make_app(tiny_device, index) -> TandemApp:
    s = Settings(k=2, max_tokens=8, default_mode="local")
    return TandemApp(s, Assistant(s, device=tiny_device, index=index), connect_cloud=False)


async def submit(pilot, text: str) -> None:
    prompt = pilot.app.query_one(PromptInput)
    prompt.focus()
    prompt.value = text
    await pilot.press("enter")


async def test_a_mentioned_folder_scopes_the_answer(
    isolated_dirs, tiny_device, private_index, folders
) -> None:
    trip, work = folders
    private_index.ingest([trip, work])
    app = make_app(tiny_device, private_index)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await submit(pilot, QUESTION)  # the negative control: unscoped, the office note
        await until(pilot, lambda: len(app.query(AnswerView)) == 1)
        await until(pilot, lambda: app.query(AnswerView).last().finished)
        assert work / "kayak.md" in {Path(s["path"]) for s in app.query(AnswerView)[0].sources}

        await submit(pilot, f"@trip/ {QUESTION}")
        await until(pilot, lambda: len(app.query(AnswerView)) == 2)
        answer = app.query(AnswerView).last()
        await until(pilot, lambda: answer.finished)
        assert answer.sources and {Path(s["path"]).parent for s in answer.sources} == {trip}
        assert any(
            "from your documents in" in str(n.render()) for n in answer.query(".answer-notice")
        )

        await submit(pilot, f"@nowhere {QUESTION}")
        await until(
            pilot, lambda: any("named @nowhere" in str(n.message) for n in app._notifications)
        )
        assert len(app.query(AnswerView)) == 2  # nothing was asked
        assert app.query_one(PromptInput).value == f"@nowhere {QUESTION}"  # kept to fix


async def test_the_prompt_suggests_and_takes_a_name(
    isolated_dirs, tiny_device, private_index, folders
) -> None:
    private_index.ingest(list(folders))
    app = make_app(tiny_device, private_index)
    async with app.run_test(size=SIZE) as pilot:
        prompt = app.query_one(PromptInput)
        prompt.focus()
        await pilot.press(*"Whose? @ka")
        await until(pilot, lambda: prompt._suggestion == "Whose? @kayak.md")
        await pilot.press("right")  # takes the suggestion
        assert prompt.value == "Whose? @kayak.md"
