"""Vectors shipped with the project for the public corpus (issue 46): a build takes them where
this machine's embedder agrees with them on a spot check, embeds only what they lack, and
ignores a file that disagrees or is damaged; the file in the tree covers the installed corpus."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from cloud_backend import corpus as corpus_mod
from cloud_backend import corpus_build, corpus_vectors
from cloud_backend.corpus import PublicCorpus, write_shipped_vectors
from cloud_backend.corpus_build import corpus_texts, source_info
from cloud_backend.corpus_vectors import MIN_COSINE, ShippedVectors, spot_check, text_key, write
from retrieval.embedder import OnnxEmbedder

LIMIT = 40


class CountingEmbedder(OnnxEmbedder):
    """The real embedder, counting the texts it embeds (class-wide: the build makes its own)."""

    texts = 0

    def embed(self, texts):
        type(self).texts += len(texts)
        return super().embed(texts)


@pytest.fixture
def counting(monkeypatch) -> type[CountingEmbedder]:
    CountingEmbedder.texts = 0
    monkeypatch.setattr(corpus_mod, "OnnxEmbedder", CountingEmbedder)
    monkeypatch.setattr(corpus_build, "OnnxEmbedder", CountingEmbedder)
    return CountingEmbedder


@pytest.fixture(scope="module")
def made(tmp_path_factory, embedder_dir) -> Path:
    """Shipped vectors for the first LIMIT summaries, made as `--write-vectors` makes them."""
    path = tmp_path_factory.mktemp("vectors") / "public-vectors.npz"
    written = write_shipped_vectors(path, embedder_dir, limit=LIMIT)
    assert written["vectors"] == written["chunks"] == len(corpus_texts(LIMIT))
    return path


def shipping(monkeypatch, path: Path) -> None:
    monkeypatch.setattr(corpus_vectors, "SHIPPED", path)


def stored_against_embedded(corpus: PublicCorpus, embedder_dir: Path) -> np.ndarray:
    """Cosine of every stored vector with this machine's embedding of its chunk."""
    ids = sorted(corpus.store.stored_chunks(range(1, corpus.stats().chunks + 1)))
    chunks = corpus.store.get_chunks(ids)
    texts = [f"{c.heading}\n{c.text}" if c.heading else c.text for c in chunks]
    mine = OnnxEmbedder(embedder_dir).embed(texts)
    return np.sum(mine * corpus.store.get_vectors(ids), axis=1)


def test_build_takes_shipped_vectors_and_embeds_only_the_spot_check(
    made, embedder_dir, tmp_path, monkeypatch, counting
):
    shipping(monkeypatch, made)
    with PublicCorpus.open(tmp_path / "a", embedder_dir, limit=LIMIT, progress=False) as c:
        chunks = c.stats().chunks
        check = c.manifest["shipped_vectors"]
        assert check["used"] and check["same_embedder_file"]
        assert check["spot_check_min_cosine"] >= MIN_COSINE
        assert c.manifest["embedded_this_run"]["shipped_vectors"] == chunks
        assert counting.texts <= corpus_vectors.SPOT_CHECKS < chunks  # the spot check only
        assert stored_against_embedded(c, embedder_dir).min() > 0.999
        assert not c.store.check_consistency(deep=True)
        first = corpus_mod.load_summaries(limit=1)[0]
        assert c.search(first[1][:200], k=1)[0].title == first[0]
    counting.texts = 0  # the negative control: without the file, every chunk is embedded
    kwargs = {"limit": LIMIT, "progress": False, "shipped_vectors": False}
    with PublicCorpus.open(tmp_path / "b", embedder_dir, **kwargs) as c:
        assert counting.texts == chunks
        assert c.manifest["shipped_vectors"] == {"used": False, "reason": "not asked"}


def test_a_file_that_lacks_chunks_gives_what_it_has(
    made, embedder_dir, tmp_path, monkeypatch, counting
):
    """A corpus larger than the file (a newer summaries package adds articles): the file's
    chunks come from it, the others are embedded here."""
    shipping(monkeypatch, made)
    with PublicCorpus.open(tmp_path / "c", embedder_dir, limit=LIMIT + 20, progress=False) as c:
        held = len(corpus_texts(LIMIT))
        assert c.manifest["embedded_this_run"]["shipped_vectors"] == held
        assert c.stats().chunks - held <= counting.texts <= c.stats().chunks - held + 16
        assert stored_against_embedded(c, embedder_dir).min() > 0.999


def disagreeing(made: Path, tmp_path: Path, cosine: float) -> Path:
    """The same keys, each vector turned away from what it was by `cosine`, as another
    embedder (or another quantisation of it) would give."""
    shipped = ShippedVectors.load(made)
    assert shipped is not None
    texts = corpus_texts(LIMIT)
    _, vectors = shipped.lookup(texts)
    rng = np.random.default_rng(0)
    noise = rng.standard_normal(vectors.shape).astype(np.float32)
    noise -= np.sum(noise * vectors, axis=1, keepdims=True) * vectors  # orthogonal to each
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    turned = cosine * vectors + np.sqrt(1 - cosine**2) * noise
    path = tmp_path / f"turned-{cosine}.npz"
    write(path, texts, turned, shipped.info)
    return path


@pytest.mark.parametrize("cosine", [0.98, 0.0])
def test_a_file_this_embedder_disagrees_with_is_not_used(
    made, embedder_dir, tmp_path, monkeypatch, counting, caplog, cosine
):
    shipping(monkeypatch, disagreeing(made, tmp_path, cosine))
    with (
        caplog.at_level(logging.WARNING, logger="cloud_backend.corpus_build"),
        PublicCorpus.open(tmp_path / "d", embedder_dir, limit=LIMIT, progress=False) as c,
    ):
        check = c.manifest["shipped_vectors"]
        assert not check["used"] and check["spot_check_min_cosine"] < MIN_COSINE
        assert c.manifest["embedded_this_run"]["shipped_vectors"] == 0
        assert counting.texts >= c.stats().chunks  # all of it embedded here
        assert stored_against_embedded(c, embedder_dir).min() > 0.9999
    assert "disagree with this machine's embedder" in caplog.text


def test_the_spot_check_is_what_refuses(made, embedder_dir, tmp_path):
    """Its bound sits between a faithful file and a turned one, so the test above can fail."""
    embed = OnnxEmbedder(embedder_dir).embed
    texts = corpus_texts(LIMIT)
    faithful = ShippedVectors.load(made)
    turned = ShippedVectors.load(disagreeing(made, tmp_path, 0.98))
    assert faithful is not None and turned is not None
    assert spot_check(faithful, texts, embed) > 0.999
    assert 0.97 < spot_check(turned, texts, embed) < MIN_COSINE
    assert spot_check(faithful, ["a text no file holds"], embed) is None


@pytest.mark.parametrize(
    "damage", [b"", b"not a zip at all" * 50, b"PK\x03\x04broken"], ids=["empty", "text", "zip"]
)
def test_a_damaged_file_is_ignored(embedder_dir, tmp_path, monkeypatch, counting, caplog, damage):
    path = tmp_path / "damaged.npz"
    path.write_bytes(damage)
    shipping(monkeypatch, path)
    with (
        caplog.at_level(logging.WARNING, logger="cloud_backend.corpus_vectors"),
        PublicCorpus.open(tmp_path / "e", embedder_dir, limit=10, progress=False) as c,
    ):
        assert counting.texts == c.stats().chunks
        assert c.manifest["shipped_vectors"]["reason"] == "no file"
    assert "unreadable" in caplog.text


def test_round_trip_keeps_direction_and_knows_what_it_lacks(tmp_path):
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((300, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    texts = [f"chunk {i}" for i in range(300)]
    write(tmp_path / "v.npz", [*texts, texts[0]], np.vstack([vectors, -vectors[:1]]), {"x": 1})
    shipped = ShippedVectors.load(tmp_path / "v.npz")
    assert shipped is not None and len(shipped) == 300  # one vector per distinct text: the first
    assert shipped.info == {"x": 1}
    found, back = shipped.lookup([*texts, "never written"])
    assert found[:300].all() and not found[300] and not back[300].any()
    assert np.sum(back[:300] * vectors, axis=1).min() > 0.9999
    assert text_key("chunk 0") == int(
        shipped.keys[np.searchsorted(shipped.keys, text_key("chunk 0"))]
    )


def test_the_shipped_file_covers_the_installed_corpus_and_agrees_here(embedder_dir):
    """Fails when the summaries package or the chunker changes without the file being made
    again (`python -m cloud_backend.corpus --write-vectors`)."""
    shipped = ShippedVectors.load(corpus_vectors.SHIPPED)
    assert shipped is not None, f"{corpus_vectors.SHIPPED} is missing or unreadable"
    here = source_info()
    assert shipped.info["source"] == here["source"] and shipped.info["chunker"] == here["chunker"]
    assert shipped.info["format"] == here["format"] and shipped.info["limit"] is None
    texts = corpus_texts()
    found, _ = shipped.lookup(texts)
    assert found.all(), f"{int((~found).sum())} of {len(texts)} chunks have no shipped vector"
    cosine = spot_check(shipped, texts, OnnxEmbedder(embedder_dir).embed)
    assert cosine is not None and cosine >= MIN_COSINE
    assert json.dumps(shipped.info)  # provenance is plain JSON
