"""The cloud's public corpus on the real summaries and the real embedder (first 200 titles):
retrieval by paraphrase, a cache that reopens without embedding, rebuilds when its recipe
changes, repairs or resumes after damage, and never serves a SIGKILLed half build."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloud_backend import corpus as corpus_mod
from cloud_backend import corpus_build, corpus_vectors
from cloud_backend.corpus import LOCATION, PublicCorpus, default_corpus_dir
from cloud_backend.corpus_build import MANIFEST
from retrieval.embedder import OnnxEmbedder
from retrieval.store import FAISS_NAME, IndexStore

LIMIT = 200
REPO = Path(__file__).resolve().parents[1]


class CountingEmbedder(OnnxEmbedder):
    """The real embedder, counting the texts it embeds (class-wide: the corpus builds its own)."""

    texts = 0

    def embed(self, texts):
        type(self).texts += len(texts)
        return super().embed(texts)


@pytest.fixture(autouse=True)
def no_shipped_vectors(monkeypatch, tmp_path) -> None:
    """These tests count what a build embeds: no shipped vectors (tests/test_corpus_vectors.py
    tests those)."""
    monkeypatch.setattr(corpus_vectors, "SHIPPED", tmp_path / "none.npz")


@pytest.fixture
def counting(monkeypatch) -> type[CountingEmbedder]:
    CountingEmbedder.texts = 0
    monkeypatch.setattr(corpus_mod, "OnnxEmbedder", CountingEmbedder)  # the query embedder
    monkeypatch.setattr(corpus_build, "OnnxEmbedder", CountingEmbedder)  # the build's
    return CountingEmbedder


@pytest.fixture(scope="module")
def built_root(tmp_path_factory, embedder_dir) -> Path:
    """A corpus of the first 200 summaries, built once for the module (then closed)."""
    root = tmp_path_factory.mktemp("corpus")
    with PublicCorpus.open(root, embedder_dir, limit=LIMIT, progress=False) as c:
        assert len(c) == LIMIT
    return root


def folder_of(root: Path) -> Path:
    (folder,) = [p for p in root.iterdir() if p.name.startswith("corpus-")]
    return folder


def copy_of(built_root: Path, tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    shutil.copytree(built_root, root)
    return root


def test_search_finds_articles_by_paraphrase(built_root, embedder_dir):
    summaries = dict(corpus_mod.load_summaries(limit=LIMIT))
    with PublicCorpus.open(built_root, embedder_dir, limit=LIMIT, progress=False) as c:
        cases = {
            "Which city is Ghana's capital, on the Atlantic coast by the Gulf of Guinea?": "Accra",
            "Seurat's most famous pointillist painting of Parisians relaxing on a river island": (
                "A Sunday Afternoon on the Island of La Grande Jatte"
            ),
            "the molecule that carries free energy to drive processes in living cells": (
                "Adenosine triphosphate"
            ),
        }
        for query, title in cases.items():
            hits = c.search(query, k=5)
            assert hits[0].title == title, (query, [h.title for h in hits])
            assert len(hits) == 5 and len({h.chunk_id for h in hits}) == 5
            # hybrid: ranked by fusion; each score is the passage's cosine (its relevance)
            assert all(h.found_by in ("meaning", "keyword", "both") for h in hits)
            for h in hits:
                assert h.location == LOCATION and "CC BY-SA 4.0" in h.location
                assert -1.0 <= h.score <= 1.0 + 1e-5
                assert h.text and h.text in summaries[h.title]  # an exact slice, citable
                assert h.url.startswith("https://en.wikipedia.org/wiki/")
        assert hits[0].score > 0.4
        stats = c.stats()
        assert (stats.documents, stats.limit) == (LIMIT, LIMIT)
        assert stats.chunks >= LIMIT and stats.bytes_on_disk > 0 and stats.build_seconds > 0
        assert not c.store.check_consistency(deep=True)
        rescored = c.rescore(hits, "Ghana's capital city")
        assert rescored.shape == (5,)
        with pytest.raises(ValueError):
            c.search("   ", k=3)
        with pytest.raises(ValueError):
            c.search("Accra", k=0)


def test_second_open_is_fast_and_does_not_embed(built_root, embedder_dir, counting):
    manifest = json.loads((folder_of(built_root) / MANIFEST).read_text())
    started = time.perf_counter()
    c = PublicCorpus.open(built_root, embedder_dir, limit=LIMIT, progress=False)
    elapsed = time.perf_counter() - started
    with c:
        assert elapsed < 1.0, f"reopening took {elapsed:.2f} s"
        assert counting.texts == 0
        assert c.manifest["built_at"] == manifest["built_at"]
        assert len(c) == LIMIT
        c.warm_up()
        assert counting.texts == 1
        assert c.search("capital of Ghana", k=1)[0].title == "Accra"
        assert counting.texts == 2  # the query only


def test_changed_limit_rebuilds_and_drops_the_old_cache(
    built_root, embedder_dir, tmp_path, counting
):
    root = copy_of(built_root, tmp_path)
    old = folder_of(root)
    with PublicCorpus.open(root, embedder_dir, limit=120, progress=False) as c:
        assert len(c) == 120 and counting.texts >= 120
        assert c.manifest["recipe"]["limit"] == 120
        assert not old.exists() and folder_of(root) != old
        assert not c.store.check_consistency()


def test_missing_faiss_file_is_rebuilt_from_sqlite(built_root, embedder_dir, tmp_path, counting):
    root = copy_of(built_root, tmp_path)
    (folder_of(root) / FAISS_NAME).unlink()
    with PublicCorpus.open(root, embedder_dir, limit=LIMIT, progress=False) as c:
        assert counting.texts == 0  # vectors come from SQLite
        assert (folder_of(root) / FAISS_NAME).is_file()
        assert not c.store.check_consistency(deep=True)
        assert c.search("capital of Ghana", k=1)[0].title == "Accra"


def test_missing_marker_and_lost_summaries_are_completed(
    built_root, embedder_dir, tmp_path, counting
):
    """The state a kill mid-build leaves: no manifest, some summaries missing. Only those are
    embedded again."""
    root = copy_of(built_root, tmp_path)
    folder = folder_of(root)
    (folder / MANIFEST).unlink()
    with IndexStore(folder, 384) as store:
        lost = [d for d in store.documents()][:25]
        store.remove_paths([d.path for d in lost])
    with PublicCorpus.open(root, embedder_dir, limit=LIMIT, progress=False) as c:
        assert counting.texts == sum(d.chunk_count for d in lost)
        assert len(c) == LIMIT and (folder / MANIFEST).is_file()
        assert not c.store.check_consistency(deep=True)


def test_manifest_that_disagrees_with_the_store_is_not_trusted(
    built_root, embedder_dir, tmp_path, counting
):
    root = copy_of(built_root, tmp_path)
    folder = folder_of(root)
    with IndexStore(folder, 384) as store:
        gone = store.documents()[-3:]
        store.remove_paths([d.path for d in gone])
    with PublicCorpus.open(root, embedder_dir, limit=LIMIT, progress=False) as c:
        assert counting.texts == sum(d.chunk_count for d in gone)
        assert c.stats().documents == LIMIT


def test_corrupt_database_is_rebuilt(built_root, embedder_dir, tmp_path, counting):
    root = copy_of(built_root, tmp_path)
    folder = folder_of(root)
    chunks = json.loads((folder / MANIFEST).read_text())["chunks"]
    for name in ("index.sqlite-wal", "index.sqlite-shm"):
        (folder / name).unlink(missing_ok=True)
    (folder / "index.sqlite").write_bytes(b"this is not a database" * 100)
    with PublicCorpus.open(root, embedder_dir, limit=LIMIT, progress=False) as c:
        assert counting.texts == chunks
        assert len(c) == LIMIT and not c.store.check_consistency(deep=True)


BUILD_SCRIPT = """
import sys
from pathlib import Path
from cloud_backend import corpus, corpus_build
corpus_build.EMBED_BATCH = 8  # many small transactions, so the kill lands mid-build
corpus.PublicCorpus.open(Path(sys.argv[1]), Path(sys.argv[2]), limit=int(sys.argv[3]),
                         progress=False, shipped_vectors=False)
print("finished", flush=True)
"""


def indexed_count(root: Path) -> int:
    dbs = list(root.glob("corpus-*/index.sqlite"))
    if not dbs:
        return 0
    try:
        db = sqlite3.connect(f"file:{dbs[0]}?mode=ro", uri=True, timeout=1)
        try:
            return int(db.execute("SELECT count(*) FROM documents").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def test_sigkilled_build_is_never_served_and_resumes(tmp_path, embedder_dir, counting):
    root = tmp_path / "corpus"
    proc = subprocess.Popen(
        [sys.executable, "-c", BUILD_SCRIPT, str(root), str(embedder_dir), str(LIMIT)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while indexed_count(root) < 20:
            assert proc.poll() is None, "the build ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"finished" not in proc.stdout.read()
    folder = folder_of(root)
    assert not (folder / MANIFEST).exists()  # a half build never looks complete
    done = indexed_count(root)
    assert 20 <= done < LIMIT

    with PublicCorpus.open(root, embedder_dir, limit=LIMIT, progress=False) as c:
        assert len(c) == LIMIT and c.stats().documents == LIMIT
        assert 0 < counting.texts < c.stats().chunks  # resumed, not rebuilt
        assert c.manifest["embedded_this_run"]["summaries"] == LIMIT - done
        assert not c.store.check_consistency(deep=True)
        assert c.search("capital of Ghana", k=1)[0].title == "Accra"


def test_arguments_and_default_dir(tmp_path, monkeypatch, embedder_dir):
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    assert default_corpus_dir() == tmp_path / "cloud" / "corpus"
    with pytest.raises(ValueError):
        PublicCorpus.open(tmp_path / "c", embedder_dir, limit=0)
    with pytest.raises(ValueError):
        PublicCorpus.open(tmp_path / "c", embedder_dir, chunk_tokens=32, overlap_tokens=32)
