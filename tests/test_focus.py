"""Passages cut to the sentences that answer (issue 46 item 1, `retrieval.focus`): what a
cloud-mode prompt holds of each public passage; the citation stays whole."""

from __future__ import annotations

import tomllib

import pytest

from benchmarks.auto import right
from benchmarks.passage_focus import QUESTIONS
from cloud_backend.config import ConfigError, ServerConfig
from retrieval.focus import focused, sentences

ABBA = (
    "ABBA were a Swedish pop group. They are among the best-selling music acts in history. "
    "The group was formed in Stockholm in 1972 by Agnetha Fältskog and Björn Ulvaeus. "
    "Their hits include Dancing Queen and Waterloo, which won Eurovision in 1974. "
    "The members later pursued solo careers, and the group reunited in 2021 for an album."
)


def test_sentences_are_cut_where_a_sentence_ends() -> None:
    assert sentences("Dr. Marsh is in. She left at 10.30 today! Why? 3 cats.\nNext line") == [
        "Dr.",
        "Marsh is in.",
        "She left at 10.30 today!",
        "Why?",
        "3 cats.",
        "Next line",
    ]


def test_the_lead_and_the_answering_sentence_are_kept_in_order() -> None:
    [cut] = focused("In which city was the pop group ABBA formed?", [ABBA], 30)
    assert cut.startswith("ABBA were a Swedish pop group.")
    assert "formed in Stockholm in 1972" in cut and "Eurovision" not in cut
    assert len(cut.split()) <= 30 and cut.index("pop group") < cut.index("Stockholm")


def test_a_passage_within_the_budget_or_a_budget_of_zero_is_whole() -> None:
    assert focused("When was ABBA formed?", [ABBA], 200) == [ABBA]
    assert focused("When was ABBA formed?", [ABBA], 0) == [ABBA]


def test_no_shared_word_keeps_the_opening_unbroken() -> None:
    [cut] = focused("Tell me something nice", [ABBA], 20)
    assert cut == ABBA[: ABBA.index(" The group")]  # the first two sentences


def test_rarer_words_weigh_more() -> None:
    """The word "group" is in three sentences, "Eurovision" in one: the one naming it wins."""
    [cut] = focused("Which group song won Eurovision?", [ABBA], 30)
    assert "Waterloo, which won Eurovision" in cut and "Stockholm" not in cut


def test_the_config_refuses_a_negative_budget() -> None:
    with pytest.raises(ConfigError, match="corpus_focus_words"):
        ServerConfig(token="x" * 32, corpus_focus_words=-1)


def test_public_facts_stay_in_the_focused_prompt(public_corpus) -> None:
    """The evaluation's public questions whose article the 60-summary corpus holds: every fact
    the whole passages hold, the passages cut to 60 words still hold, and they are shorter."""
    data = tomllib.loads(QUESTIONS.read_text(encoding="utf-8"))
    asked = 0
    saved = 0
    for q in data["public"]:
        hits = public_corpus.search(q["question"], 3)
        whole = [h.text for h in hits]
        if not right(" ".join(whole), q["facts"]):
            continue  # the article is not among these 60 summaries
        cut = focused(q["question"], whole, 60)
        assert right(" ".join(cut), q["facts"]), (q["question"], cut)
        saved += sum(len(t.split()) for t in whole) - sum(len(t.split()) for t in cut)
        asked += 1
    assert asked >= 4 and saved > 0
