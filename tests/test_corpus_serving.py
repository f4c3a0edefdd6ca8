"""A first start answers public questions at once (issue 46): by keyword, each hit judged by its
cosine with the question against the same floor, while the meaning index builds on a thread;
then by meaning. Real summaries (the first 200), the real embedder, no shipped vectors."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from cloud_backend import corpus_vectors
from cloud_backend.corpus_serving import KEYWORDS_PREFIX, MEANING, ServingCorpus
from collab.sources import PUBLIC_FLOOR

LIMIT = 200
QUESTION = "In which city was the pop group ABBA formed?"
WAIT_S = 300.0


SHIPPED = corpus_vectors.SHIPPED  # the project's file, before a test points elsewhere


@pytest.fixture(autouse=True)
def no_shipped_vectors(monkeypatch, tmp_path) -> None:
    """The build embeds everything here: the case where keyword-first matters."""
    monkeypatch.setattr(corpus_vectors, "SHIPPED", tmp_path / "none.npz")


def keyword_stores(root: Path) -> list[Path]:
    return sorted(root.glob(f"{KEYWORDS_PREFIX}*"))


def test_a_first_start_serves_by_keyword_at_once_then_by_meaning(tmp_path, embedder_dir):
    root = tmp_path / "corpus"
    hold = threading.Event()
    said: list[str] = []
    serving = ServingCorpus.start(
        root, embedder_dir, LIMIT, threads=1, on_status=said.append, before_build=hold.wait
    )
    with serving:
        assert not serving.ready.is_set()
        assert serving.status() == said[-1] == "keywords; meaning 0 %"
        assert len(keyword_stores(root)) == 1

        early = serving.search(QUESTION, 3, PUBLIC_FLOOR)
        assert early and early[0].title == "ABBA", [h.title for h in early]
        assert all(h.found_by == "keyword" and not h.vector_stored for h in early)
        scores = [h.score for h in early]
        assert scores == sorted(scores, reverse=True) and min(scores) >= PUBLIC_FLOOR
        # the floor judges keyword hits too: one too high for anything leaves nothing
        assert serving.search(QUESTION, 3, 0.99) == []
        assert serving.search("zzqx unknownword", 3, None) == []
        keyword_cosines = serving.rescore(early, QUESTION)
        np.testing.assert_allclose(keyword_cosines, scores, atol=1e-5)  # the score is the cosine
        embedder = serving._keywords.embedder
        embedded: list[int] = []
        embed = embedder.embed
        embedder.embed = lambda texts: embedded.append(len(texts)) or embed(texts)
        assert serving.search(QUESTION, 3, PUBLIC_FLOOR) == early
        assert embedded == [1]  # only the question: each chunk is embedded once
        embedder.embed = embed

        hold.set()
        assert serving.ready.wait(WAIT_S)
        assert serving.status() == said[-1] == MEANING

        late = serving.search(QUESTION, 3, PUBLIC_FLOOR)
        assert late[0].title == "ABBA" and all(h.vector_stored for h in late)
        # the same chunk, the same cosine: a keyword-first answer passes the floor as it
        # would later (a stored int8 vector against one embedded now: within 0.01)
        assert abs(late[0].score - early[0].score) < 0.01
        # a request that began on the keyword store keeps re-ranking its own hits
        np.testing.assert_allclose(serving.rescore(early, QUESTION), keyword_cosines, atol=1e-5)
        assert len(serving.rescore(late, QUESTION)) == len(late)
    assert keyword_stores(root) == []


def test_a_built_corpus_serves_by_meaning_from_the_start(tmp_path, embedder_dir):
    root = tmp_path / "corpus"
    with ServingCorpus.start(root, embedder_dir, LIMIT, threads=1) as first:
        assert first.ready.wait(WAIT_S)
    dead = root / f"{KEYWORDS_PREFIX}999999999"  # a killed server's keyword store
    dead.mkdir()
    said: list[str] = []
    with ServingCorpus.start(root, embedder_dir, LIMIT, on_status=said.append) as again:
        assert again.ready.is_set() and again.status() == MEANING and said == []
        assert keyword_stores(root) == []  # the dead server's is gone
        assert again.search(QUESTION, 3, PUBLIC_FLOOR)[0].vector_stored


def test_a_failed_build_keeps_keyword_search_and_says_why(tmp_path, embedder_dir):
    def fail() -> None:
        raise RuntimeError("disk full")

    root = tmp_path / "corpus"
    with ServingCorpus.start(root, embedder_dir, LIMIT, threads=1, before_build=fail) as serving:
        assert serving.ready.wait(WAIT_S)
        assert serving.status() == "keywords (the meaning index failed: disk full)"
        assert serving.search(QUESTION, 3, PUBLIC_FLOOR)[0].title == "ABBA"


def test_a_server_stopped_mid_build_leaves_it_to_resume(tmp_path, embedder_dir):
    """close() stops the build at its next batch, unfinished (never served as complete); the
    next start serves by keyword again and completes it."""
    root = tmp_path / "corpus"
    hold = threading.Event()
    serving = ServingCorpus.start(root, embedder_dir, LIMIT, threads=1, before_build=hold.wait)
    serving._stopping.set()  # what close() sets first, here before the build's first batch
    hold.set()
    serving.close()
    assert not serving.ready.is_set()
    assert list(root.glob("corpus-*/corpus.json")) == []  # not taken for a finished cache
    with ServingCorpus.start(root, embedder_dir, LIMIT, threads=1) as again:
        assert again.ready.wait(WAIT_S) and again.status() == MEANING
        assert again.search(QUESTION, 3, PUBLIC_FLOOR)[0].vector_stored


def test_a_first_start_the_shipped_vectors_cover_is_built_before_it_serves(
    tmp_path, embedder_dir, monkeypatch
):
    """Seconds with the shipped vectors: no keyword stage then, meaning from the first answer."""
    monkeypatch.setattr(corpus_vectors, "SHIPPED", SHIPPED)
    root = tmp_path / "corpus"
    said: list[str] = []
    with ServingCorpus.start(root, embedder_dir, LIMIT, threads=1, on_status=said.append) as c:
        assert c.ready.is_set() and c.status() == MEANING and said == []
        assert keyword_stores(root) == []
        assert c.search(QUESTION, 3, PUBLIC_FLOOR)[0].vector_stored
        manifest = json.loads(next(root.glob("corpus-*/corpus.json")).read_text())
        assert manifest["shipped_vectors"]["used"]
    # the negative control: refused (not asked for) -> the keyword stage
    with ServingCorpus.start(
        tmp_path / "other", embedder_dir, LIMIT, threads=1, shipped_vectors=False
    ) as c:
        assert c.status().startswith("keywords")
        assert c.ready.wait(WAIT_S)
