"""Real documents for the retrieval benchmark (issue 29): Python's own language reference as
it ships with the interpreter, `pydoc_data.topics` (what `help("with")` prints), written out as
one Markdown page per topic. Nobody on the team wrote it and every machine running us has it,
so the benchmark needs no download. The questions about it are in
`benchmarks/data/retrieval/python311-reference.toml` (`load_questions`).

reST-style underlined headings (a title line, then a line of one punctuation character at
least as long) become ATX headings, so our Markdown parser splits sections at them and records
their titles; every other line is written unchanged.

    python -m benchmarks.retrieval_docs FOLDER      # write the pages, print their count"""

from __future__ import annotations

import argparse
import logging
import platform
import tomllib
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MODULE = "pydoc_data.topics"
SOURCE = {
    "module": MODULE,
    "python": platform.python_version(),
    "what": "The Python Language Reference's topics as shipped with the interpreter "
    "(pydoc's help texts), one page per topic",
}
QUESTION_SET = Path(__file__).parent / "data" / "retrieval" / "python311-reference.toml"
KINDS = ("semantic", "keyword", "offtopic")
# reST accepts any of these as a section adornment (docutils' list).
_ADORNMENTS = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_MAX_LEVEL = 6  # the deepest ATX heading


def topics() -> dict[str, str]:
    """Topic name -> its text, from the running interpreter."""
    from pydoc_data.topics import topics as all_topics

    return dict(all_topics)


def _is_underline(line: str, title: str) -> bool:
    """`line` adorns `title` as a reST section underline: one punctuation character repeated,
    at least as long as a non-blank, unindented title that is not itself an adornment line."""
    return (
        bool(line)
        and line[0] in _ADORNMENTS
        and line == line[0] * len(line)
        and bool(title.strip())
        and not title[0].isspace()
        and len(line) >= len(title.rstrip())
        and set(title.rstrip()) != {line[0]}
    )


def to_markdown(text: str) -> str:
    """`text` with each underlined heading made an ATX heading: the underline line is dropped
    and the title gets `#` × its level, levels counted by the order in which each adornment
    character first appears on the page (reST's rule). Every other line is kept as is."""
    lines = text.split("\n")
    levels: dict[str, int] = {}
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and _is_underline(lines[i + 1], line):
            level = levels.setdefault(lines[i + 1][0], len(levels) + 1)
            if level > _MAX_LEVEL:
                raise ValueError(f"more than {_MAX_LEVEL} heading levels at line {i + 1}")
            out.append(f"{'#' * level} {line}")
            i += 2
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def write_reference_docs(folder: Path) -> list[Path]:
    """Write every topic as `<topic>.md` in `folder` (created if missing); the paths, sorted."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in sorted(topics().items()):
        path = folder / f"{name}.md"
        path.write_text(to_markdown(text), encoding="utf-8")
        paths.append(path)
    log.info("wrote %d reference pages to %s", len(paths), folder)
    return paths


# --- the question set ------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """A chunk answers when it comes from `topic`'s page and holds `contains`."""

    topic: str
    contains: str


@dataclass(frozen=True)
class Question:
    id: str
    text: str
    kind: str  # one of KINDS
    answers: tuple[Answer, ...]  # empty for "offtopic"
    identifier: str | None = None  # "keyword" questions: the exact name they ask about


def collapse(text: str) -> str:
    """`text` with every run of whitespace made one space, for comparing phrases with chunks
    cut at any line break."""
    return " ".join(text.split())


def answers(answer: Answer, topic: str, chunk: str) -> bool:
    """Whether a chunk of `topic`'s page holds `answer` (whitespace collapsed, case kept)."""
    return topic == answer.topic and collapse(answer.contains) in collapse(chunk)


def load_questions(path: Path = QUESTION_SET) -> tuple[dict[str, object], list[Question]]:
    """The set's header (source, python, written_by, notes) and its questions.

    A malformed entry raises ValueError naming it."""
    with path.open("rb") as fh:
        data = tomllib.load(fh)
    header = {k: v for k, v in data.items() if k != "question"}
    questions = []
    for n, entry in enumerate(data.get("question", []), 1):
        try:
            kind = entry["kind"]
            if kind not in KINDS:
                raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
            found = tuple(Answer(str(a["topic"]), str(a["contains"])) for a in entry["answers"])
            identifier = entry.get("identifier")
            questions.append(
                Question(
                    str(entry["id"]),
                    str(entry["text"]),
                    kind,
                    found,
                    None if identifier is None else str(identifier),
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path.name}: question {n}: {e}") from e
    return header, questions


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_reference_docs(args.folder)


if __name__ == "__main__":
    main()
