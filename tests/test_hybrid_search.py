"""Keyword + dense search (issue 29): the FTS5 index commits with the chunks, survives a kill,
migrates old indexes, keeps identifiers findable and forgets removed text; fusion, found-by
labels and the relevance floor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sqlite_utils import Database

from retrieval.keywords import keyword_terms, match_expression
from retrieval.search import Searcher, reciprocal_rank_fusion
from retrieval.store import (
    CHUNK_FORMAT,
    ChunkRecord,
    DocumentMeta,
    IndexStore,
    migrate,
)

DIM = 16
REPO = Path(__file__).resolve().parents[1]


def vectors(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


def put(store: IndexStore, path: str, texts: list[str], heading: str | None = None) -> None:
    meta = DocumentMeta(path=path, size=len(texts), mtime=0.0, sha256=path, title=heading)
    records = [ChunkRecord(i, t, heading=heading) for i, t in enumerate(texts)]
    store.replace_document(meta, records, vectors(len(texts), seed=hash(path) % 1000))


def keyword_paths(store: IndexStore, query: str) -> list[str]:
    return [h.path for h in store.keyword_search(query, 10)]


# --------------------------------------------------------------------------- the FTS5 index


def test_identifiers_are_found_as_written_not_as_scattered_parts(tmp_path: Path) -> None:
    with IndexStore(tmp_path, DIM) as store:
        put(store, "/a.md", ["Set max_file_mb in the config to cap the size of a file."])
        put(store, "/b.md", ["The max size of a file in MB is printed."])  # the parts, apart
        put(store, "/c.md", ["Call os.path.join to build a path; pass --dry-run to test."])
        put(store, "/d.md", ["Join the path of the OS to the dry run."])
        assert keyword_paths(store, "what is max_file_mb?") == ["/a.md"]
        assert keyword_paths(store, "os.path.join") == ["/c.md"]
        # a flag is its words in order: found, as is prose that says them in that order
        assert set(keyword_paths(store, "the --dry-run flag")) == {"/c.md", "/d.md"}
        assert keyword_paths(store, "MAX_FILE_MB") == ["/a.md"]  # case does not matter
        assert set(keyword_paths(store, "files")) == {"/a.md", "/b.md"}  # stemmed: file


def test_headings_are_searched_and_weigh_more_than_text(tmp_path: Path) -> None:
    with IndexStore(tmp_path, DIM) as store:
        put(store, "/h.md", ["It returns nothing useful."], heading="Guide › Teardown hooks")
        put(store, "/t.md", ["A note that mentions teardown once among many other words."])
        hits = store.keyword_search("teardown", 5)
        assert [h.path for h in hits] == ["/h.md", "/t.md"]
        assert hits[0].heading == "Guide › Teardown hooks" and hits[0].found_by == "keyword"
        assert hits[0].bm25 is not None and hits[0].bm25 > hits[1].bm25 > 0


def test_a_question_of_stop_words_or_punctuation_searches_nothing(tmp_path: Path) -> None:
    assert match_expression("what is it?") is None
    assert match_expression("?? -- !!") is None
    assert keyword_terms('How do "quotes" and ""bad"" input work?') == [
        "quotes",
        "bad",
        "input",
        "work",
    ]
    with IndexStore(tmp_path, DIM) as store:
        put(store, "/a.md", ['He said "hello" NEAR the AND OR door*'])
        assert store.keyword_search("what is it?", 5) == []
        # FTS5 syntax in a question is text, never an operator or an error
        for hostile in ('"', 'hello" OR "x', "NEAR(hello door)", "door*", "AND OR NOT", "^x"):
            store.keyword_search(hostile, 5)
        # the quotes are part of the words: 'hello"' is searched as the word hello
        assert keyword_paths(store, 'hello" OR "x') == ["/a.md"]


def test_keyword_index_changes_with_the_chunks_in_one_transaction(tmp_path: Path) -> None:
    with IndexStore(tmp_path, DIM) as store:
        put(store, "/a.md", ["the walrus protocol"])
        assert keyword_paths(store, "walrus") == ["/a.md"]
        put(store, "/a.md", ["the narwhal protocol"])  # a new version replaces the old
        assert keyword_paths(store, "walrus") == [] and keyword_paths(store, "narwhal") == ["/a.md"]
        store.remove_paths(["/a.md"])
        assert keyword_paths(store, "narwhal") == []
        assert store.check_consistency(deep=True) == []


def test_check_consistency_notices_a_keyword_index_that_disagrees(tmp_path: Path) -> None:
    with IndexStore(tmp_path, DIM) as store:
        put(store, "/a.md", ["the walrus protocol", "second chunk"])
        with store.db.atomic():  # delete a chunk behind the triggers' back
            store.db.conn.execute("DROP TRIGGER chunks_fts_delete")
            store.db.conn.execute("DELETE FROM chunks WHERE ordinal = 0")
            store.db.conn.execute("UPDATE documents SET chunk_count = 1")
        problems = store.check_consistency()
        assert any("keyword index" in p for p in problems), problems


def test_removed_text_leaves_no_terms_in_the_keyword_index_files(tmp_path: Path) -> None:
    """FTS5 keeps a deleted row's terms in its segments until they merge: the removal must
    not leave a private word readable in index.sqlite or its WAL."""
    word = b"quokkazanzibar"  # unchanged by the Porter stemmer: the stored term is the word
    with IndexStore(tmp_path, DIM) as store:
        put(store, "/secret.md", [f"the {word.decode()} plan part {i}" for i in range(30)])
        put(store, "/other.md", ["an ordinary note about bicycles"])
        store.flush()
        files = [p for p in tmp_path.glob("index.sqlite*") if p.is_file()]
        assert sum(p.read_bytes().count(word) for p in files) > 0
        store.remove_paths(["/secret.md"])
        files = [p for p in tmp_path.glob("index.sqlite*") if p.is_file()]
        assert sum(p.read_bytes().count(word) for p in files) == 0
        assert keyword_paths(store, "bicycles") == ["/other.md"]
        # an edited document's old words: gone when the ingest's last flush returns
        put(store, "/other.md", [f"the {word.decode()} plan again {i}" for i in range(30)])
        store.flush()
        put(store, "/other.md", ["nothing private now"])
        store.flush(final=False)  # an ingest's periodic flush leaves the merge to its end
        store.flush()
        files = [p for p in tmp_path.glob("index.sqlite*") if p.is_file()]
        assert sum(p.read_bytes().count(word) for p in files) == 0


_CHILD = """
import sys
from pathlib import Path
import numpy as np
from retrieval.store import ChunkRecord, DocumentMeta, IndexStore

root = Path(sys.argv[1])
rng = np.random.default_rng(int(sys.argv[2]))
with IndexStore(root, 16) as store:
    print("ready", flush=True)
    for i in range(10**6):
        path = f"/d/{int(rng.integers(0, 20))}.md"
        if rng.random() < 0.15:
            store.remove_paths([path])
            continue
        n = int(rng.integers(1, 20))
        meta = DocumentMeta(path, n, float(i), str(i))
        words = [f"word{int(rng.integers(0, 500))} version{i} part{j}" for j in range(n)]
        records = [ChunkRecord(j, w, heading=f"doc {i}") for j, w in enumerate(words)]
        store.replace_document(meta, records, rng.standard_normal((n, 16)))
        if i % 4 == 0:
            store.flush()
"""


def test_sigkill_leaves_the_keyword_index_level_with_the_chunks(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for trial in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path), str(trial)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.2 + 0.15 * trial)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with IndexStore(tmp_path, DIM) as store:
            assert store.check_consistency(deep=True) == []
            # every stored chunk is found by its own unique words, and only stored ones are
            rows = store.db.execute("SELECT id, text FROM chunks").fetchall()
            assert rows, "the child wrote something"
            for cid, text in rows[:: max(1, len(rows) // 25)]:
                version, part = text.split()[1:]
                assert cid in [h.chunk_id for h in store.keyword_search(f"{version} {part}", 50)]


def test_an_index_of_schema_3_is_migrated_and_searchable_by_keyword(tmp_path: Path) -> None:
    db = Database(tmp_path / "index.sqlite")
    assert migrate(db, target=3) == 3
    doc = db.conn.execute(
        "INSERT INTO documents (path, size, mtime, sha256, status, title, chunk_count, "
        "indexed_at) VALUES ('/old.md', 3, 1.0, 'h', 'indexed', 'Old notes', 2, 0)"
    ).lastrowid
    for ordinal, (title, text) in enumerate([("Setup", "use the frobnicate flag"), (None, "x")]):
        db.conn.execute(
            "INSERT INTO chunks (document_id, ordinal, text, title, vector) VALUES (?,?,?,?,?)",
            [doc, ordinal, text, title, vectors(1)[0].tobytes()],
        )
    db.conn.commit()
    db.close()
    with IndexStore(tmp_path, DIM) as store:
        hits = store.keyword_search("frobnicate", 5)
        assert [h.text for h in hits] == ["use the frobnicate flag"]
        assert hits[0].heading == "Old notes › Setup"
        assert keyword_paths(store, "old notes") == ["/old.md", "/old.md"]  # by the title
        (row,) = store.documents()
        assert row.chunk_format == 1 < CHUNK_FORMAT  # the next ingest embeds it again
        assert store.check_consistency(deep=True) == []


# --------------------------------------------------------------------------- fusion


def test_reciprocal_rank_fusion_rewards_agreement() -> None:
    fused = reciprocal_rank_fusion([[1, 2, 3], [3, 4, 1]], k=60)
    assert fused[1] == pytest.approx(1 / 61 + 1 / 63)
    assert fused[3] == pytest.approx(1 / 63 + 1 / 61)
    assert fused[2] == pytest.approx(1 / 62) and fused[4] == pytest.approx(1 / 62)
    assert max(fused, key=fused.__getitem__) in (1, 3)


def _bag_of_words(texts: list[str]) -> np.ndarray:
    """A test embedding: hashed word counts (meaning = shared words)."""
    out = np.zeros((len(texts), DIM), dtype=np.float32)
    for row, text in enumerate(texts):
        for word in text.lower().split():
            out[row, sum(word.encode()) % DIM] += 1.0
    out[:, 0] += 1e-3  # never a zero vector
    return out


def test_hybrid_labels_what_found_each_passage_and_the_floor_drops(tmp_path: Path) -> None:
    with IndexStore(tmp_path, DIM) as store:
        texts = ["apples and pears", "the zygomorphic flower", "apples grow on trees"]
        for i, t in enumerate(texts):
            meta = DocumentMeta(f"/{i}.md", 1, 0.0, str(i))
            store.replace_document(meta, [ChunkRecord(0, t)], _bag_of_words([t]))
        searcher = Searcher(store, _bag_of_words)
        hits = searcher.search("apples zygomorphic", 3)
        found = {h.path: h.found_by for h in hits}
        assert found["/1.md"] in ("keyword", "both")
        assert all(h.cosine is not None for h in hits)  # judged by meaning too
        assert {h.path for h in hits if h.bm25 is not None} >= {"/0.md", "/1.md", "/2.md"} - {
            p for p, f in found.items() if f == "meaning"
        }
        dense = searcher.search("apples zygomorphic", 3, mode="dense")
        assert all(h.found_by == "meaning" for h in dense)
        kw = searcher.search("zygomorphic", 3, mode="keyword")
        assert [h.path for h in kw] == ["/1.md"]
        assert searcher.search("apples zygomorphic", 3, floor=1.01) == []
        with pytest.raises(ValueError, match="search mode"):
            searcher.search("x", 3, mode="fuzzy")  # type: ignore[arg-type]


def test_a_keyword_hit_removed_between_the_searches_is_not_cited(tmp_path: Path) -> None:
    with IndexStore(tmp_path, DIM) as store:
        put(store, "/a.md", ["the walrus protocol"])
        hits = store.hits([(999_999, 1.0)], found_by="keyword")
        assert hits == []


def test_common_words_are_left_out_when_they_would_cost_too_much(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a large index a word in thousands of chunks is thousands of entries to score for
    almost no BM25 weight: past the budget the rarest words are searched, never none."""
    import retrieval.store_keywords as store_module
    from retrieval.keywords import affordable

    assert affordable(["a", "b", "c", "d"], [50, 0, 5, 30], budget=40) == ["c", "d"]
    assert affordable(["a", "b"], [900, 700], budget=10) == ["b"]  # always the rarest one
    assert affordable(["a"], [0], budget=10) == []  # matches nothing: nothing to read
    with IndexStore(tmp_path, DIM) as store:
        put(store, "/common.md", [f"the river number {i}" for i in range(60)])
        put(store, "/rare.md", ["the river axolotl"])
        assert store._affordable_words("river axolotl os.path") == ["river", "axolotl"]
        monkeypatch.setattr(store_module, "KEYWORD_POSTINGS", 20)
        assert store._affordable_words("river axolotl os.path") == ["axolotl"]
        assert keyword_paths(store, "river axolotl") == ["/rare.md"]
