"""Scrubs that survive a kill (issue 44, item 8): a removed document's text leaves the raw
bytes of the index on both FTS5 paths (SQLite before 3.42: 'optimize' merges the keyword
index; from 3.42: FTS5's own secure-delete), a scrub a killed process owed is paid by the next
opener, and text an older Tandem deleted is scrubbed once at the upgrade.

Each scenario runs in a child process, since the path is fixed by the SQLite a process loads:
"optimize" forces the older path on any SQLite; "secure-delete" uses this system's SQLite if it
is 3.42 or newer, else the newer one bundled in the `sqlean-py` wheel (a dev dependency), put
in place of the standard `sqlite3` before anything imports it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECRET = b"zanzibar-quokka-7731"  # the chunk text, found in the raw bytes or not
WORD = b"wombatzanzibar"  # a keyword-index term stored whole (not stemmed, no prefix shared)
PATHS = ["optimize", "secure-delete"]

_CHILD = """
import logging, os, sys
from pathlib import Path

path, root = sys.argv[1], Path(sys.argv[2])
if path == "secure-delete":
    import sqlite3
    if sqlite3.sqlite_version_info < (3, 42, 0):
        import sqlean
        sys.modules["sqlite3"], sys.modules["sqlite3.dbapi2"] = sqlean, sqlean.dbapi2
        del sqlite3
import sqlite3
import numpy as np
from retrieval import scrub
from retrieval.store import SCHEMA_VERSION, ChunkRecord, DocumentMeta, IndexStore, migrate
from tests.test_scrub import SECRET, WORD, raw

if path == "optimize":
    scrub.fts_secure_delete = lambda: False  # the path of SQLite < 3.42, on any SQLite
assert scrub.fts_secure_delete() == (path == "secure-delete"), sqlite3.sqlite_version
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")

def put(store, name, secret):
    text = f"{SECRET.decode()} {WORD.decode()}" if secret else "an ordinary note about bicycles"
    meta = DocumentMeta(path=name, size=1, mtime=0.0, sha256=f"{name}{secret}")
    records = [ChunkRecord(n, f"{text} part {n}") for n in range(30)]
    store.replace_document(meta, records, np.random.default_rng(len(name)).standard_normal((30, 8)))
"""


def child(path: str, root: Path, script: str) -> str:
    """Run `script` after the prelude on FTS5 path `path`; its output, or its failure."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD + script, path, str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def raw(root: Path) -> int:
    """How often the secret and its word occur in index.sqlite and its side files."""
    files = [p for p in root.glob("index.sqlite*") if p.is_file()]
    return sum(p.read_bytes().count(s) for p in files for s in (SECRET, WORD))


@pytest.mark.parametrize("path", PATHS)
def test_removed_and_replaced_text_leaves_the_files(path: str, tmp_path: Path) -> None:
    """At once for a removal, while the store stays open (the TUI); at the ingest's last
    flush for a replaced version's. (A reader holding a removal's scrub back is
    `tests/test_private_at_rest.py`: the checkpoint, the same on both paths.)"""
    child(
        path,
        tmp_path,
        """
with IndexStore(root, 8) as store:
    on = store.db.execute("SELECT v FROM chunks_fts_config WHERE k = 'secure-delete'").fetchall()
    assert on == ([(1,)] if path == "secure-delete" else []), on
    put(store, "/a.md", True)
    put(store, "/b.md", False)
    store.flush()
    assert raw(root) > 0
    assert store.remove_paths(["/a.md"]) == 1
    assert raw(root) == 0

    put(store, "/b.md", True)
    store.flush()
    put(store, "/b.md", False)
    store.flush(final=False)  # an ingest's periodic flush
    store.flush()  # and its last one
    assert raw(root) == 0
    assert [h.path for h in store.keyword_search("bicycles", 1)] == ["/b.md"]
""",
    )


@pytest.mark.parametrize("path", PATHS)
def test_a_scrub_a_killed_process_owed_is_paid_by_the_next_opener(
    path: str, tmp_path: Path
) -> None:
    """The process dies right after the removal commits, before its scrub (and after an
    unflushed new version): the text is still in the files, and gone once a store opens
    them, while that store is open (the TUI's)."""
    child(
        path,
        tmp_path,
        """
with IndexStore(root, 8) as store:
    put(store, "/a.md", True)
    put(store, "/b.md", True)
    store.flush()
    put(store, "/b.md", False)  # an edit, not flushed yet
    IndexStore._scrub = lambda self, keywords=True: os._exit(0)
    store.remove_paths(["/a.md"])
    os._exit(1)  # not reached: the removal scrubs at once
""",
    )
    assert raw(tmp_path) > 0
    child(
        path,
        tmp_path,
        """
with IndexStore(root, 8) as store:
    assert raw(root) == 0
    assert [d.path for d in store.documents()] == ["/b.md"]
    assert store.check_consistency(deep=True) == []
""",
    )


@pytest.mark.parametrize("path", PATHS)
def test_text_an_older_version_deleted_is_scrubbed_once_at_the_upgrade(
    path: str, tmp_path: Path
) -> None:
    """A schema-4 index as a Tandem without overwriting deletes left it: the deleted text sits
    in free pages and keyword-index segments. The first open compacts it, once."""
    child(
        path,
        tmp_path,
        """
from sqlite_utils import Database

conn = sqlite3.connect(root / "index.sqlite")
conn.execute("PRAGMA secure_delete = OFF")
db = Database(conn)
db.enable_wal()
assert migrate(db, target=4) == 4
for name, text in (("/a.md", f"{SECRET.decode()} {WORD.decode()}"), ("/b.md", "bicycles")):
    doc = conn.execute(
        "INSERT INTO documents (path, size, mtime, sha256, status, chunk_count, indexed_at, "
        "chunk_format) VALUES (?, 1, 0, 'h', 'indexed', 30, 0, 2)", [name]
    ).lastrowid
    for n in range(30):
        conn.execute(
            "INSERT INTO chunks (document_id, ordinal, text, vector) VALUES (?, ?, ?, ?)",
            [doc, n, f"{text} part {n}", np.ones(8, dtype="<f4").tobytes()],
        )
conn.commit()
conn.execute("DELETE FROM chunks WHERE document_id = 1")
conn.execute("DELETE FROM documents WHERE id = 1")
conn.commit()
conn.close()
""",
    )
    assert raw(tmp_path) > 0
    out = child(
        path,
        tmp_path,
        """
for _ in range(2):
    with IndexStore(root, 8) as store:
        assert raw(root) == 0
        assert store.db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
        assert [h.path for h in store.keyword_search("bicycles", 1)] == ["/b.md"]
        assert store.check_consistency(deep=True) == []
    print("opened")
""",
    )
    assert out.count("compacting") == 1 and out.index("compacting") < out.index("opened"), out
