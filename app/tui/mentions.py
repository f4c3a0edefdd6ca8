"""@ mentions in the prompt (issue 47, item 2): `@trip/`, `@kayak.md` or `@~/docs/trip` ask
the question of those documents only (the private search is scoped to them: `tandem ask
--in`). A mention is a document's or a folder's name, or a path; typing one, the prompt
suggests the rest of an indexed name (→ takes it). An e-mail address is not a mention: a
mention starts a word."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import PurePath

from textual.suggester import Suggester

__all__ = ["ScopeSuggester", "mention_names", "resolve", "split_mentions"]

# a mention starts a word and ends before the punctuation that ends its sentence or clause
_MENTION = re.compile(r"(?<!\S)@(\S+?)(?=[.,;:!?)]*(?:\s|$))")
_TYPING = re.compile(r"(?:^|\s)@(\S*)$")


def split_mentions(text: str) -> tuple[str, list[str]]:
    """(the question without its mentions, the mentions without their @)."""
    found = _MENTION.findall(text)
    question = " ".join(_MENTION.sub(" ", text).split())
    return question, found


def _folders(path: str) -> Iterable[str]:
    """The folders above a document's path, nearest first (not the root)."""
    parent = PurePath(path).parent
    while parent != parent.parent:
        yield str(parent)
        parent = parent.parent


def resolve(mentions: Sequence[str], documents: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the paths the mentions name among the indexed `documents`, the mentions that name
    none). A path mention (`/…`, `~/…`) names that file or folder; a name names every indexed
    file of that name and every folder of that name holding an indexed file."""
    scope: dict[str, None] = {}
    unknown: list[str] = []
    for mention in mentions:
        if mention.startswith(("/", "~")):
            path = os.path.expanduser(mention).rstrip("/") or "/"
            hits = [path] if any(d == path or d.startswith(path + "/") for d in documents) else []
        else:
            name = mention.rstrip("/")
            hits = [d for d in documents if PurePath(d).name == name]
            hits += [f for d in documents for f in _folders(d) if PurePath(f).name == name]
        if hits:
            scope.update(dict.fromkeys(hits))
        else:
            unknown.append(mention)
    return list(scope), unknown


def mention_names(documents: Sequence[str]) -> list[str]:
    """What a mention can complete to: each indexed file's name and, with a trailing slash,
    the name of each folder holding one (below the home folder: not `home/` itself), sorted."""
    above = {
        str(p)
        for p in (PurePath(os.path.expanduser("~")), *PurePath(os.path.expanduser("~")).parents)
    }
    names = {PurePath(d).name for d in documents}
    names |= {PurePath(f).name + "/" for d in documents for f in _folders(d) if f not in above}
    return sorted(n for n in names if n and n != "/")


class ScopeSuggester(Suggester):
    """Suggests the rest of an indexed document's or folder's name after an @."""

    def __init__(self, documents: Callable[[], Sequence[str]]) -> None:
        super().__init__(use_cache=False, case_sensitive=True)
        self.documents = documents

    async def get_suggestion(self, value: str) -> str | None:
        typing = _TYPING.search(value)
        if typing is None or not typing.group(1) or typing.group(1).startswith(("/", "~")):
            return None
        typed = typing.group(1)
        # on a thread: the store serialises readers behind a running ingest (the UI must not wait)
        documents = await asyncio.to_thread(self.documents)
        for name in mention_names(documents):
            if name.startswith(typed) and name != typed:
                return value + name[len(typed) :]
        return None
