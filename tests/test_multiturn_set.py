"""benchmarks/data/multiturn/conversations.toml holds what it claims. A hand-written set is only
as good as its key: a private fact missing from its note, a public fact absent from its article's
summary, a question that gives its own answer away, or a refusal left as a conversation's last turn
would score the set's mistakes, not the models'. Fast: no models, no index."""

from __future__ import annotations

import functools
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

SET = Path(__file__).resolve().parents[1] / "benchmarks/data/multiturn/conversations.toml"
KINDS = {"private", "public", "both", "chat", "refusal"}
KEYS = {  # which of source (a note) and article (a summary) each kind names
    "private": {"source"},
    "public": {"article"},
    "both": {"source", "article"},
    "chat": set(),
    "refusal": set(),
}

Turn = dict[str, Any]


@functools.cache
def load() -> dict[str, Any]:
    return tomllib.loads(SET.read_text(encoding="utf-8"))


def conversations() -> list[dict[str, Any]]:
    return load()["conversation"]


def turns() -> list[Turn]:
    return [t for c in conversations() for t in c["turn"]]


def holds(text: str, spellings: list[str]) -> bool:
    return any(s.lower() in text.lower() for s in spellings)


def test_the_set_is_twenty_odd_conversations_of_four_to_eight_turns() -> None:
    convs = conversations()
    assert len(convs) >= 20
    assert len({c["id"] for c in convs}) == len(convs)
    for c in convs:
        assert 4 <= len(c["turn"]) <= 8, c["id"]
        for t in c["turn"]:
            assert t["kind"] in KINDS, (c["id"], t)
            assert {"source", "article"} & t.keys() == KEYS[t["kind"]], (c["id"], t["question"])
            assert (t["facts"] == []) == (t["kind"] == "refusal"), (c["id"], t["question"])
            if t["kind"] == "both":
                assert len(t["facts"]) == 2, t["question"]  # [private, public]


def test_every_fact_is_where_it_says() -> None:
    from cloud_backend.corpus_build import load_summaries

    notes = {n["file"]: n["text"] for n in load()["note"]}
    assert len(notes) == len(load()["note"])
    summaries = dict(load_summaries())
    for t in turns():
        private = t["facts"][:1] if t["kind"] == "both" else t["facts"]
        public = t["facts"][1:] if t["kind"] == "both" else t["facts"]
        if "source" in t:
            for spellings in private:
                assert holds(notes[t["source"]], spellings), (t["source"], spellings)
        if "article" in t:
            for spellings in public:
                assert holds(summaries[t["article"]], spellings), (t["article"], spellings)


def test_no_question_gives_its_answer_and_follow_ups_are_rewritten() -> None:
    for t in turns():
        for text in (t["question"], t["standalone"]):
            assert not any(holds(text, spellings) for spellings in t["facts"]), text
        if t["follows"]:
            assert t["standalone"] != t["question"], t["question"]
        else:
            assert t["standalone"] == t["question"], t["question"]


def test_every_refusal_is_followed_by_a_scored_turn() -> None:
    for c in conversations():
        for here, after in zip(c["turn"], [*c["turn"][1:], None], strict=True):
            if here["kind"] == "refusal":
                assert after is not None and after["facts"], (c["id"], here["question"])


def test_the_mix_has_enough_follow_ups_refusals_and_chat() -> None:
    kinds = Counter(t["kind"] for t in turns())
    assert kinds.keys() == KINDS
    assert kinds["refusal"] >= 10 and kinds["chat"] >= 15, kinds
    assert sum(t["follows"] for t in turns()) >= 40
    # a follow-up that leans on a turn other than the one just before is marked in a comment
    assert SET.read_text(encoding="utf-8").count("\n# long-range: leans on turn") >= 10
