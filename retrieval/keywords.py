"""The keyword side of search: a user's question as an FTS5 query (BM25 over chunk text).

Each word of the question becomes one quoted FTS5 string, OR-ed with the others. FTS5 runs a
quoted string through the index's own tokenizer (`retrieval.store.FTS_TOKENIZER`), so a word
that the tokenizer splits (`max_file_mb`, `os.path.join`, `--dry-run`, `O'Brien`) becomes a
*phrase* of its parts, in order: an identifier matches where it is written and not where its
parts are scattered. Common English words are left out: they carry no evidence and their
posting lists are what makes a query slow on a large index.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["STOPWORDS", "affordable", "keyword_terms", "match_expression"]

# Function words only (no topic words), lower case; a question's "what does ... do" is noise.
_STOPWORD_TEXT = """
    a about above after again against all am an and any are as at be because been before being
    below between both but by can could did do does doing down during each few for from further
    had has have having he her here hers herself him himself his how i if in into is it its
    itself just me more most my myself no nor not now of off on once only or other our ours
    ourselves out over own same she should so some such than that the their theirs them
    themselves then there these they this those through to too under until up very was we were
    what when where which while who whom why will with would you your yours yourself yourselves
    s t d ll m re ve tell know explain please mean means happen happens
"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())

_WORD_CHAR = re.compile(r"\w")
# Anything FTS5 would treat as syntax inside a string is only the double quote (doubled).
_MAX_TERMS = 32


def keyword_terms(query: str) -> list[str]:
    """The question's words worth searching for, in order, without repeats: whitespace-separated
    words with at least one letter or digit that are not stop words (a word of several parts,
    such as an identifier, is kept whole)."""
    terms: list[str] = []
    seen: set[str] = set()
    for raw in query.split():
        word = raw.strip("\"'“”‘’()[]{}<>,;:!?.")
        key = word.lower()
        if not _WORD_CHAR.search(word) or key in STOPWORDS or key in seen:
            continue
        seen.add(key)
        terms.append(word)
    return terms[:_MAX_TERMS]


def match_expression(query: str | Sequence[str]) -> str | None:
    """The FTS5 MATCH expression for `query` (or for words already chosen from it); None when
    no word is worth searching for."""
    terms = keyword_terms(query) if isinstance(query, str) else list(query)
    if not terms:
        return None
    return " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)


def affordable(words: Sequence[str], postings: Sequence[int], budget: int) -> list[str]:
    """The words to search for, given how many index entries each one's search reads
    (`postings`): the rarest first, as long as their total stays within `budget`, and always
    the rarest one. A word that matches nothing is dropped (it cannot add a hit). BM25 gives a
    common word little weight anyway; reading its postings is what costs time on a large index
    (a word in 20 % of 100k chunks is 20,000 entries to score)."""
    order = sorted((n, i) for i, n in enumerate(postings) if n > 0)
    kept: list[int] = []
    total = 0
    for n, i in order:
        if kept and total + n > budget:
            break
        kept.append(i)
        total += n
    return [words[i] for i in sorted(kept)]
