"""The sentences of a passage that answer a question, for prompts that pay per token (issue 46).

A cloud answer's first token waits for the prefill of its passages: three Wikipedia lead
summaries are about 750 tokens, which the 1.5B on one core reads at about 25 tokens a second.
Most of a summary is not what was asked. `focused` keeps a passage's first sentence (a lead
says what its subject is) and then the sentences that hold the question's words, the rarer
among the passages' sentences the heavier, best first until `budget` words, in the
passage's own order. A passage that shares no word with the question keeps its opening
sentences. The citation still shows the whole passage: only the prompt is shorter.

Words match by their first five letters ("formed" and "formation", "census" and "censuses"),
a crude stem that needs no model and no language data."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from retrieval.keywords import keyword_terms

__all__ = ["focused", "sentences"]

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]*[A-Z0-9])")
_WORD = re.compile(r"\w+")
_STEM = 5


def sentences(text: str) -> list[str]:
    """`text` cut after each ., ! or ? followed by a space and a capital or digit (lines are
    sentences too); abbreviations cost a cut, never a lost word."""
    out: list[str] = []
    for line in text.splitlines():
        out += [s.strip() for s in _SENTENCE_END.split(line) if s.strip()]
    return out


def _stem(word: str) -> str:
    return word.lower()[:_STEM]


def _stems(text: str) -> set[str]:
    return {_stem(w) for w in _WORD.findall(text)}


def focused(question: str, passages: Sequence[str], budget: int) -> list[str]:
    """Each passage cut to about `budget` words of the sentences that answer `question` (see
    the module's docstring); a passage within the budget is kept whole. `budget` ≤ 0: as is."""
    if budget <= 0:
        return list(passages)
    terms = {_stem(w) for t in keyword_terms(question) for w in _WORD.findall(t)}
    cut = [sentences(p) for p in passages]
    held = [[_stems(s) & terms for s in ss] for ss in cut]
    found = [t for hs in held for h in hs for t in h]
    count = sum(len(ss) for ss in cut)
    weight = {t: math.log(1 + count / found.count(t)) for t in set(found)}
    return [
        passage if len(passage.split()) <= budget else _pick(ss, hs, weight, budget)
        for passage, ss, hs in zip(passages, cut, held, strict=True)
    ]


def _pick(cut: list[str], held: list[set[str]], weight: dict[str, float], budget: int) -> str:
    """The first sentence, then the best scored ones while they fit, in the passage's order;
    with no sentence scored, the opening sentences that fit."""
    scores = [sum(weight[t] for t in h) for h in held]
    order = [0] + sorted(range(1, len(cut)), key=lambda i: (-scores[i], i))
    if not any(scores[1:]):
        order = list(range(len(cut)))
    kept: list[int] = []
    words = 0
    for i in order:
        n = len(cut[i].split())
        if kept and words + n > budget:
            if not any(scores[1:]):
                break  # the opening, unbroken
            continue  # a shorter one further down may still fit
        kept.append(i)
        words += n
    return " ".join(cut[i] for i in sorted(kept))
