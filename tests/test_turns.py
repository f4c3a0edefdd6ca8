"""What of a conversation a new answer uses (edge_runtime.turns, issue 45): a refusal steers
nothing, a question that stands alone gets no history, a follow-up is searched with its topic
on the device and on the cloud, and what the cloud is sent to search by is built only from
turns it saw (the bytes on the wire)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cloud_backend.modes.base import public_passages
from collab.protocol import Generate, decode, encode
from edge_runtime.events import Citation
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions, Turn, steering
from edge_runtime.turns import (
    leans_on_earlier,
    refused,
    search_candidates,
    search_questions,
    topic_start,
)
from retrieval.search import best_of
from tests.test_modes import WireTap, ask, client_frames, context

REFUSALS = (
    "I'm sorry, but I can't assist with that.",
    "I am sorry, I do not have that information.",
    "Unfortunately, the notes do not say.",
    "I don't have access to your personal files.",
    "The provided sources do not mention a dentist.",
    "There is no information about that in your notes.",
    "  Sorry, but I cannot help with that.",
)
ANSWERS = (
    "Casa Thornby.",
    "Sorry to hear that! The code is 4471.",  # sympathy is not a refusal
    "The notes say the rent is 940 euros; I can't say more.",  # a refusal later on still answers
    "You stayed at Casa Thornby [1].",
)


@pytest.mark.parametrize("answer", REFUSALS)
def test_a_refusal_is_recognised(answer):
    assert refused(answer)


@pytest.mark.parametrize("answer", ANSWERS)
def test_an_answer_is_not_taken_for_a_refusal(answer):
    assert not refused(answer)


@pytest.mark.parametrize(
    ("question", "leans"),
    [
        ("Where was breakfast served there?", True),
        ("And how much was it?", True),
        ("The price?", True),
        ("What about the wifi?", True),
        ("Now make it uppercase too.", True),
        ("What is the capital of Australia?", False),
        ("Write a Python one-liner that reverses a string.", False),
        ("Who wrote the play A Doll's House?", False),
    ],
)
def test_a_follow_up_is_told_from_a_question_that_stands_alone(question, leans):
    assert leans_on_earlier(question) is leans


def test_a_chain_of_follow_ups_keeps_its_topic_and_a_new_topic_starts_afresh():
    asked = [
        "Where did we stay in Velmora?",
        "Where was breakfast served there?",
        "And how much was it?",
        "What is the capital of Australia?",
    ]
    searched = search_questions(asked)
    assert searched[1] == "Where did we stay in Velmora? Where was breakfast served there?"
    assert searched[2] == (
        "Where did we stay in Velmora? Where was breakfast served there? And how much was it?"
    )
    assert searched[3] == asked[3]
    assert topic_start(asked[:3]) == 0 and topic_start(asked) == 3
    # a follow-up that names nothing a pronoun points at is searched with its topic as well
    assert search_candidates([asked[0], "What's the room number?"]) == [
        "Where did we stay in Velmora? What's the room number?",
        "What's the room number?",
    ]
    assert search_candidates(["Hello?"]) == ["Hello?"]
    # a compound question is searched whole and by each clause too
    both = "What is my locker code, and where was ABBA formed?"
    assert search_candidates([both]) == [both, "What is my locker code", "where was ABBA formed?"]


def test_the_best_of_several_searches_is_the_one_with_the_most_relevant_passage():
    hit = lambda score: SimpleNamespace(score=score)  # noqa: E731
    low, high = [hit(0.4), hit(0.39)], [hit(0.7)]
    assert best_of([low, high]) == high and best_of([[], low]) == low
    assert best_of([high, [hit(0.7)]]) is not None and best_of([[], []]) == []


def test_refused_turns_steer_nothing_and_every_other_turn_is_kept():
    history = [
        Turn("What is 2 + 2?", "4.", "local"),
        Turn("Where did we stay in Velmora?", "Casa Thornby.", "local"),
        Turn("What did the dentist say?", "I'm sorry, but I can't assist with that.", "local"),
        Turn("And the room?", "Room 312.", "local"),
    ]
    kept = steering("And how much was breakfast there?", history)
    assert [t.question for t in kept] == [
        "What is 2 + 2?",
        "Where did we stay in Velmora?",
        "And the room?",
    ]
    # a question that seems to stand alone may lean on the conversation all the same
    assert steering("Who's the client?", history) == kept


# ------------------------------------------------------------------------ through the modes


async def prompt_of(device, mode, question, history, options) -> str:
    """The text of the device prompt an answer prefilled (the real model runs on)."""
    prompts: list[list[int]] = []
    real = device.prefill

    async def recording(ids, *args, **kwargs):
        prompts.append(list(ids))
        return await real(ids, *args, **kwargs)

    device.prefill = recording
    try:
        await ask(mode, question, options, history)
    finally:
        device.prefill = real
    return device.tokenizer.decode(prompts[0])


async def test_a_refusal_is_not_in_the_next_prompt_and_a_follow_up_gets_its_topic(
    device, private_index
):
    local = build_mode("local", context(device, "ws://127.0.0.1:9/x", index=private_index))
    options = AnswerOptions(max_new_tokens=4, temperature=0.0, k=2)
    refusal = "I'm sorry, but I can't assist with that."
    history = [
        Turn("Where does the spare key hide?", "Under the blue flowerpot.", "local"),
        Turn("What did my dentist say?", refusal, "local"),
    ]
    prompt = await prompt_of(device, local, "And what is the locker code there?", history, options)
    assert refusal not in prompt and "Under the blue flowerpot." in prompt


async def test_a_follow_up_finds_the_passage_its_bare_words_miss(device, private_index):
    follow_up = "And from when on?"
    assert private_index.search(follow_up, 3, 0.30) == []  # the premise: bare words find nothing
    local = build_mode("local", context(device, "ws://127.0.0.1:9/x", index=private_index))
    history = [Turn("How much does Jordan earn?", "81,250 euros.", "local")]
    _, _, events = await ask(local, follow_up, AnswerOptions(4, temperature=0.0, k=2), history)
    cited = [e.path for e in events if isinstance(e, Citation)]
    assert cited and all(str(p).endswith("salary.txt") for p in cited)


async def test_the_cloud_searches_with_turns_it_saw_and_never_a_private_one(device, cloud_url):
    port = int(cloud_url.split(":")[2].split("/")[0])
    tap = WireTap(port)
    url = f"ws://127.0.0.1:{await tap.start()}/v1/session"
    cloud = build_mode("cloud", context(device, url))
    this_cloud = cloud.ctx.cloud.identity("tiny-cloud")
    seen = Turn(
        "Who wrote Hamlet?", "Shakespeare.", "cloud", shared="Shakespeare.", shared_with=this_cloud
    )
    private = Turn("What is my locker code?", "4417.", "local")
    options = AnswerOptions(max_new_tokens=2, temperature=0.0)
    await ask(cloud, "And when was he born?", options, [seen])
    await ask(cloud, "And where is it?", options, [private])
    await cloud.close()
    await tap.close()
    frames = client_frames(bytes(tap.up), binary_only=True)
    sent = [m for m in map(decode, frames) if isinstance(m, Generate)]
    assert [m.search for m in sent] == ["Who wrote Hamlet? And when was he born?", ""]
    wire = b"".join(tap.payloads())
    assert b"locker" not in wire and b"4417" not in wire


def test_the_cloud_keeps_the_better_of_its_search_and_the_question(public_corpus):
    title = public_corpus.search("history of the city", 1)[0].title
    question = "And when was that?"
    alone = public_corpus.search(question, 3, 0.30)
    found = public_passages(
        public_corpus, Generate(question, search=f"{title}? {question}"), 3, 0.30
    )
    assert found and found[0].title == title and (not alone or alone[0].score < found[0].score)
    assert public_passages(public_corpus, Generate(question), 3, 0.30) == alone


def test_generate_carries_the_search_across_the_wire():
    msg = Generate("And when?", search="Who wrote Hamlet? And when?", request_id=3)
    assert decode(encode(msg)).search == "Who wrote Hamlet? And when?"
    assert decode(encode(Generate("Hi", request_id=1))).search == ""


def test_history_keeps_the_newest_turns_within_its_token_budget(tiny_tokenizer):
    turns = [Turn("What are tandem bicycles?", "Bicycles for two. " * 20, "local")]
    turns += [Turn(f"And what about part {i} of them?", "More. " * 20, "local") for i in range(6)]
    question = "And who rides them?"
    assert steering(question, turns) == turns  # one topic: every turn, without a budget
    kept = steering(question, turns, tiny_tokenizer, budget=100)
    assert 0 < len(kept) < len(turns) and kept == turns[-len(kept) :]
    size = sum(len(tiny_tokenizer.encode(t.question + t.answer)) for t in kept)
    assert size <= 100 + len(kept)  # (each side counted apart: a token may split at the seam)
