"""The retrieval benchmark's documents and questions (issue 29): Python's language reference
written as Markdown pages, and the question set about it. Fast: no models, no index."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.retrieval_docs import (
    QUESTION_SET,
    SOURCE,
    Answer,
    Question,
    answers,
    collapse,
    load_questions,
    to_markdown,
    topics,
    write_reference_docs,
)

MINIMUM = {"semantic": 45, "keyword": 25, "offtopic": 25}
_ATX = re.compile(r"^(#{1,6}) (.*)$")


@pytest.fixture(scope="module")
def question_set() -> tuple[dict[str, object], list[Question]]:
    return load_questions()


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    """Each topic's text, whitespace collapsed."""
    return {name: collapse(text) for name, text in topics().items()}


# -- the question set


def test_the_set_loads_with_its_provenance(
    question_set: tuple[dict[str, object], list[Question]],
) -> None:
    header, questions = question_set
    assert header["source"] == SOURCE["module"] == "pydoc_data.topics"
    assert header["python"] == "3.11"
    assert SOURCE["python"].startswith("3.11.")
    assert header["written_by"] and header["notes"]
    assert questions


def test_each_kind_has_enough_questions_and_ids_are_unique(
    question_set: tuple[dict[str, object], list[Question]],
) -> None:
    _, questions = question_set
    counts = Counter(q.kind for q in questions)
    for kind, least in MINIMUM.items():
        assert counts[kind] >= least, (kind, counts[kind])
    ids = Counter(q.id for q in questions)
    assert [i for i, n in ids.items() if n > 1] == []
    assert all(q.text.strip() for q in questions)


def test_questions_spread_over_many_topics(
    question_set: tuple[dict[str, object], list[Question]],
) -> None:
    _, questions = question_set
    first_answers = {q.answers[0].topic for q in questions if q.answers}
    assert len(first_answers) >= 40, sorted(first_answers)


def test_every_answer_phrase_is_on_its_topic_page(
    question_set: tuple[dict[str, object], list[Question]], pages: dict[str, str]
) -> None:
    _, questions = question_set
    missing = [
        (q.id, a.topic, a.contains)
        for q in questions
        for a in q.answers
        if a.topic not in pages or collapse(a.contains) not in pages[a.topic]
    ]
    assert missing == []


def test_answerable_questions_have_answers_and_offtopic_ones_none(
    question_set: tuple[dict[str, object], list[Question]],
) -> None:
    _, questions = question_set
    assert [q.id for q in questions if q.kind == "offtopic" and q.answers] == []
    assert [q.id for q in questions if q.kind != "offtopic" and not q.answers] == []


def test_each_keyword_question_names_an_identifier_found_on_one_page_only(
    question_set: tuple[dict[str, object], list[Question]],
) -> None:
    _, questions = question_set
    texts = topics()
    for q in questions:
        if q.kind != "keyword":
            assert q.identifier is None, q.id
            continue
        assert q.identifier and q.identifier in q.text, q.id
        found_on = [name for name, text in texts.items() if q.identifier in text]
        assert found_on == [q.answers[0].topic], (q.id, q.identifier, found_on)
        assert {a.topic for a in q.answers} == {q.answers[0].topic}, q.id


def test_a_chunk_answers_only_from_its_topic_with_the_phrase() -> None:
    answer = Answer("with", "the exception is  suppressed")
    assert answers(answer, "with", "If true,\nthe exception is\tsuppressed, and so on")
    assert not answers(answer, "compound2", "the exception is suppressed")
    assert not answers(answer, "with", "The Exception is suppressed")  # case counts
    assert not answers(answer, "with", "the exception is")


def test_a_malformed_question_is_named_in_a_plain_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        'source = "x"\n[[question]]\nid = "a"\ntext = "t"\nkind = "semantic"\nanswers = []\n'
        '[[question]]\nid = "b"\ntext = "t"\nkind = "vague"\nanswers = []\n'
    )
    with pytest.raises(ValueError, match=r"bad.toml: question 2: kind 'vague'"):
        load_questions(path)
    path.write_text('[[question]]\nid = "a"\nkind = "semantic"\nanswers = []\n')
    with pytest.raises(ValueError, match=r"question 1: 'text'"):
        load_questions(path)


def test_the_shipped_set_is_the_default() -> None:
    assert QUESTION_SET.is_file()
    assert load_questions(QUESTION_SET) == load_questions()


# -- the pages


def _undo(markdown: str, original: str) -> tuple[str, list[tuple[int, str]]]:
    """`markdown` with each ATX heading turned back into the title and the underline line it
    came from (taken from `original`), so it can be compared with `original` exactly; and each
    heading's (level, underline character)."""
    source = original.split("\n")
    out: list[str] = []
    headings: list[tuple[int, str]] = []
    for line in markdown.split("\n"):
        m = _ATX.match(line)
        if m:
            out.append(m.group(2))
            out.append(source[len(out)])  # the underline line that followed the title
            headings.append((len(m.group(1)), out[-1][0]))
        else:
            out.append(line)
    return "\n".join(out), headings


def test_write_reference_docs_writes_every_topic_with_atx_headings(tmp_path: Path) -> None:
    texts = topics()
    paths = write_reference_docs(tmp_path / "pages")
    assert len(paths) == len(texts) == 79
    assert sorted(p.stem for p in paths) == sorted(texts)
    assert all(p.suffix == ".md" and p.parent == tmp_path / "pages" for p in paths)
    levels: Counter[int] = Counter()
    for path in paths:
        written = path.read_text(encoding="utf-8")
        original = texts[path.stem]
        # the text outside heading underlines is unchanged, line for line
        restored, headings = _undo(written, original)
        assert restored == original, path.name
        # levels: the order in which each underline character first appears on the page
        order = list(dict.fromkeys(char for _level, char in headings))
        assert [level for level, _ in headings] == [order.index(c) + 1 for _, c in headings]
        assert headings[0][0] == 1  # the page's title
        levels.update(level for level, _ in headings)
        # no underline survives: every line of one repeated punctuation char is gone,
        # except a transition (a rule after a blank line, as in the debugger page)
        lines = written.split("\n")
        for i, line in enumerate(lines[1:], 1):
            if line and line == line[0] * len(line) and line[0] in "*=-~":
                assert not lines[i - 1].strip(), (path.name, line)
    assert levels[1] == 79 and levels[2] > 40 and levels[3] > 20 and levels[4] >= 10
    with_page = (tmp_path / "pages" / "with.md").read_text(encoding="utf-8")
    assert with_page.startswith('# The "with" statement\n\nThe "with" statement is used')
    compound = (tmp_path / "pages" / "compound.md").read_text(encoding="utf-8").split("\n")
    for heading in ('## The "match" statement', "### Guards", "#### OR Patterns"):
        assert heading in compound


def test_heading_levels_follow_the_first_appearance_of_each_adornment() -> None:
    text = "\n".join(
        [
            "Page",
            "====",
            "",
            "Part",
            "~~~~~~",  # longer than the title is fine (reST)
            "text",
            "",
            "Other",
            "=====",
            "",
            "   indented",
            "   ----------",
            "   indented code",
            "------------------",  # under an indented line: not an underline
            "short title",
            "---",  # shorter than the title: not an underline
            "",
            "======",  # a transition after a blank line
        ]
    )
    assert to_markdown(text).split("\n") == [
        "# Page",
        "",
        "## Part",
        "text",
        "",
        "# Other",
        "",
        "   indented",
        "   ----------",
        "   indented code",
        "------------------",
        "short title",
        "---",
        "",
        "======",
    ]


def test_more_heading_levels_than_markdown_has_is_a_plain_error() -> None:
    marks = '*=-~^+"'
    text = "\n".join(f"T{i}\n{c * 2}" for i, c in enumerate(marks))
    with pytest.raises(ValueError, match="more than 6 heading levels"):
        to_markdown(text)
