"""What of a conversation's earlier turns a new answer uses (docs/usage.md#conversations; the
rules were chosen by `benchmarks.multiturn`, docs/benchmarks/multiturn.md):

* a turn whose answer refused or said it found nothing steers nothing: the small model copies
  its own refusal into the next answer, even when the next question's passage is in its
  prompt (issue 45: "I'm sorry, but I can't assist with that." twice, the second time with the
  right passage cited at 0.66);
* a follow-up ("And how much was it?") is searched with the question it follows: its bare words
  name nothing a search can find.

Pure functions of text: the modes apply them (edge_runtime.modes.base), on each side to the
turns that side may see."""

from __future__ import annotations

import re
from collections.abc import Sequence

from retrieval.search import clauses

REFUSAL = re.compile(
    r"^\W*(?:(?:i'?m|i am) (?:sorry|afraid|unable|not able)|sorry, (?:but )?i\b|i apologi[sz]e"
    r"|unfortunately\b|i (?:can(?:no|')t|cannot|could(?:n't| not)|do(?:n't| not)"
    r" (?:have|know)|have no)\b|as an ai\b"
    r"|(?:there is|there's|i found) no (?:information|mention|record)"
    r"|(?:the|your) (?:provided )?(?:sources?|notes?|documents?|passages?|context)"
    r" (?:do(?:es)? not|don't|doesn't) (?:mention|contain|say|include|provide|specify|state))",
    re.IGNORECASE,
)
"""An answer that opens by refusing or by saying nothing answers it (what Qwen2.5's small
models write when they do not answer: "I'm sorry, but…", "Unfortunately…", "The provided
sources do not mention…")."""

_WORDS = re.compile(r"[a-z0-9'][a-z0-9'-]*")


def _wordset(text: str) -> frozenset[str]:
    return frozenset(_WORDS.findall(text))


LEANING = _wordset(
    "it its it's they them their theirs there those these this he him his she her hers "
    "one ones same else also too"
)
"""Words that point back at something said before: a question holding one leans on the
conversation (pronouns and deictics; "one" as in "the cheaper one")."""
OPENERS = ("and ", "but ", "so ", "what about", "how about", "and?", "also ", "then ")
STOP = _wordset(
    "a an the of to in on at for by with from about is are was were be been do does did what "
    "which who whom whose where when why how much many can could would should will shall "
    "may might must i you we me my your our us please tell give show say"
)
SHORT = 1
"""A question of at most this many content words (stop words aside) leans on the
conversation too ("The price?", "Which year?")."""


def refused(answer: str) -> bool:
    """Whether an answer refused, or said nothing it knows answers the question."""
    return bool(REFUSAL.match(answer.strip()))


def leans_on_earlier(question: str) -> bool:
    """Whether a question points back at the conversation (a pronoun, an opener such as
    "and…" or "what about…", or almost no words of its own) and so cannot be searched alone."""
    text = question.strip().lower()
    words = _WORDS.findall(text)
    if text.startswith(OPENERS) or any(w in LEANING for w in words):
        return True
    return len([w for w in words if w not in STOP]) <= SHORT


def search_questions(questions: Sequence[str]) -> list[str]:
    """The question each turn of a conversation is searched by, oldest first. A question that
    stands alone is searched alone, and names the topic; one that leans on the conversation
    is searched after the topic's question and the turn before it (a chain of follow-ups
    keeps its topic, and its search stays three questions long however long the chain)."""
    out: list[str] = []
    topic: str | None = None
    last = ""
    for raw in questions:
        question = raw.strip()
        if topic is not None and leans_on_earlier(question):
            out.append(" ".join(dict.fromkeys((topic, last, question))))
        else:
            topic = question
            out.append(question)
        last = question
    return out


def search_candidates(questions: Sequence[str]) -> list[str]:
    """What the last of `questions` may be searched by, best guess first: with the question it
    follows where it leans on the conversation (`search_questions`), else with its topic's
    question as well (a follow-up that names nothing as a pronoun, "What's my bib number?");
    and alone. The search keeps whichever finds the most relevant passage
    (`retrieval.search.best_of`), so a question that changed the topic is searched alone. Each
    clause of a compound question comes last (`retrieval.search.clauses`): "What is my locker
    code, and where was ABBA formed?" finds the locker's note by its own half, as the cloud
    finds ABBA's article by the other, so neither side's relevance is diluted by the half it
    cannot answer."""
    last = questions[-1].strip()
    if len(questions) < 2:
        return [last, *clauses(last)]
    chained = search_questions(questions)[-1]
    if chained == last:
        earlier = questions[:-1]
        chained = f"{earlier[topic_start(earlier)].strip()} {last}"
    return list(dict.fromkeys([chained, last, *clauses(last)]))


def topic_start(questions: Sequence[str]) -> int:
    """Where the last question's topic began: the index of the latest question that stood
    alone, counting the last one (a question that stands alone starts a topic of its own and
    needs none of the turns before it)."""
    start = len(questions) - 1
    while start > 0 and leans_on_earlier(questions[start]):
        start -= 1
    return max(start, 0)


def search_question(question: str, earlier: Sequence[str]) -> str:
    """The question `question` is searched by after the `earlier` questions (oldest first)."""
    return search_questions([*earlier, question])[-1]
