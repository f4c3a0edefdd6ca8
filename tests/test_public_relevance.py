"""The public side's relevance (issue 45): a Wikipedia summary that only brushes a question
about the user's life, or a chat request, does not count as answering it; a compound
question's public half keeps its article. Real summaries, the real embedder, the product's
own rules; each test carries the rule before issue 45 as its negative control."""

from __future__ import annotations

from functools import partial

import pytest

from cloud_backend.corpus_build import load_summaries
from cloud_backend.modes.base import public_passages
from collab.protocol import Generate
from collab.sources import PUBLIC_FLOOR, RELEVANCE_FLOOR, Source
from edge_runtime.mode_choice import CONSULTED, Choice, Policy, Signals, choose
from edge_runtime.modes.auto import counted, public_scores
from retrieval.embedder import question_cosines
from retrieval.search import clauses

# A question about the user, and the chat request, each with the summary it cited at 0.30.
BRUSHED = [
    ("When is my dentist appointment?", "Dentistry"),
    ("Write a Python one-liner that reverses a string.", "Inverse function"),
]
# Its private half dilutes its public half: the whole question's best passage is under the floor.
COMPOUND = "What is my locker code at the gym on Quarry Road, and in which city was ABBA formed?"


@pytest.fixture(scope="module")
def summaries() -> dict[str, str]:
    return dict(load_summaries())


@pytest.mark.parametrize(("question", "title"), BRUSHED)
def test_a_summary_that_only_brushes_the_question_does_not_send_it_to_the_cloud(
    question, title, summaries, public_corpus
):
    judge = partial(question_cosines, public_corpus.embedder.embed)
    passage = Source(title, text=summaries[title])
    scores = public_scores(judge, [question], [passage])
    assert RELEVANCE_FLOOR <= scores[0] < PUBLIC_FLOOR  # cited before issue 45
    assert counted(scores, RELEVANCE_FLOOR) == []
    now = choose(Signals(public=counted(scores, RELEVANCE_FLOOR), consulted=True), Policy())
    assert now.mode == "split" and now.reason.startswith("no sources needed")
    # control: the rule before (the user's floor alone) calls it a public question
    old = [s for s in scores if s >= RELEVANCE_FLOOR]
    before = choose(Signals(public=old, consulted=True), Policy())
    assert before == Choice("cloud", "public sources answer this" + CONSULTED)


def test_the_users_higher_floor_still_applies():
    assert counted([0.6, 0.7], 0.65) == [0.7]
    assert counted([0.6], None) == [0.6]


def test_clauses_split_a_compound_question_and_leave_a_simple_one_alone():
    assert clauses(COMPOUND) == [
        "What is my locker code at the gym on Quarry Road",
        "in which city was ABBA formed?",
    ]
    assert clauses("Where is my passport? Who painted the Mona Lisa?") == [
        "Where is my passport",
        "Who painted the Mona Lisa?",
    ]
    assert clauses("Who painted the Mona Lisa, and when?") == ["Who painted the Mona Lisa", "when?"]
    assert clauses("What is my locker code?") == []
    assert clauses("Salt, pepper and oil: which goes first?") == []


def test_a_compound_questions_public_half_keeps_its_article(public_corpus):
    kept = public_passages(public_corpus, Generate(COMPOUND), 3, PUBLIC_FLOOR)
    assert kept and kept[0].title == "ABBA" and kept[0].score >= PUBLIC_FLOOR
    # control: judged whole, the private half dilutes it under the floor
    assert public_corpus.search(COMPOUND, 3, PUBLIC_FLOOR) == []
    # and the device, judging what the cloud returned, counts it by the same clause
    judge = partial(question_cosines, public_corpus.embedder.embed)
    whole = public_scores(judge, [COMPOUND], kept[:1])
    by_clause = public_scores(judge, [COMPOUND, *clauses(COMPOUND)], kept[:1])
    assert counted(whole, None) == [] and counted(by_clause, None) == by_clause
