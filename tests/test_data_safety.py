"""The device's own files under SIGKILL and a full disk (issue 16): the conversation history
and the settings file. A child process writes; the parent kills it at random moments, or
limits how large its files may grow (RLIMIT_FSIZE: the kernel refuses the write, as a full
disk does). Whatever was acknowledged before is there afterwards, the files are never left
half-written, and the failing write is a plain error."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONVERSATION_WRITER = """
import sys
from app.conversations import ConversationStore
store = ConversationStore(sys.argv[1])
cid = store.create().id
i = 0
while True:
    mid = store.add_message(cid, "user", f"question {i}", "local")
    store.update_message(mid, text=f"question {i} (edited)")
    print(mid, flush=True)  # acknowledged: both writes returned
    i += 1
"""

SETTINGS_WRITER = """
import sys
from pathlib import Path
from app.settings import Settings, save_settings
a = Settings(cloud_token="token-a" * 50, k=3)
b = Settings(cloud_token="token-b" * 50, k=7)
i = 0
while True:
    save_settings(a if i % 2 else b, Path(sys.argv[1]))
    i += 1
"""

INDEX_WRITER = """
import os, sys
from pathlib import Path
import numpy as np
os.umask(0o022)  # a permissive umask: the store must not depend on the caller's
from retrieval.store import ChunkRecord, DocumentMeta, IndexStore
store = IndexStore(Path(sys.argv[1]), 64)
rng = np.random.default_rng(0)
i = 0
while True:
    meta = DocumentMeta(f"/docs/{i % 7}.txt", i, float(i), str(i))
    chunks = [ChunkRecord(n, f"private text {i} {n}") for n in range(20)]
    store.replace_document(meta, chunks, rng.standard_normal((20, 64)).astype("float32"))
    store.flush()  # vectors.faiss rewritten (a temporary sibling, renamed) every time
    i += 1
"""

FULL_DISK = """
import json, resource, signal, sys
from app.conversations import ConversationStore, ConversationStoreError
store = ConversationStore(sys.argv[1])
cid = store.create().id
saved = [store.add_message(cid, "user", f"q{i}", "local") for i in range(5)]
size = __import__("os").path.getsize(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 20_000, size + 20_000))
error = ""
try:
    while True:
        saved.append(store.add_message(cid, "assistant", "x" * 3000, "local"))
except ConversationStoreError as exc:
    error = str(exc)
print(json.dumps({"saved": saved, "error": error}))
"""


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _intact(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    return conn


def test_the_conversation_history_survives_sigkill_at_any_moment(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    rng = random.Random(7)
    acknowledged: list[int] = []
    for _ in range(6):
        child = _child(CONVERSATION_WRITER, str(path))
        assert child.stdout is not None
        time.sleep(1.0 + rng.uniform(0.0, 0.5))  # start-up, then some writes
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        acknowledged += [int(line) for line in out.split()]
        conn = _intact(path)
        rows = dict(conn.execute("SELECT id, text FROM messages").fetchall())
        conn.close()
        for mid in acknowledged:  # every acknowledged write is there, in full
            assert rows[mid].endswith("(edited)"), (mid, rows[mid])
    assert len(acknowledged) > 20


def test_the_settings_file_is_old_or_new_never_torn_and_stays_private(tmp_path):
    from app.settings import load_settings

    path = tmp_path / "config.toml"
    rng = random.Random(11)
    for _ in range(8):
        child = _child(SETTINGS_WRITER, str(path))
        time.sleep(0.8 + rng.uniform(0.0, 0.4))
        child.send_signal(signal.SIGKILL)
        child.communicate()
        settings = load_settings(path)  # parses: never half-written
        assert (settings.cloud_token, settings.k) in {("token-a" * 50, 3), ("token-b" * 50, 7)}
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        leftovers = [p for p in tmp_path.iterdir() if p != path]
        for p in leftovers:  # a temp file a kill left behind is private too
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


def test_an_index_killed_at_any_moment_leaves_nothing_other_users_can_read(tmp_path):
    """Under umask 022, kill the writer at random moments (mid-transaction, mid-FAISS-write):
    every file it left (the database, its WAL and SHM, vectors.faiss, a temporary FAISS file)
    is 0600 and the folder 0700, and the store reopens consistent."""
    from retrieval.store import IndexStore

    root = tmp_path / "index"
    rng = random.Random(5)
    seen: set[str] = set()
    for _ in range(5):
        child = _child(INDEX_WRITER, str(root))
        time.sleep(2.0 + rng.uniform(0.0, 0.6))  # start-up (numpy, FAISS), then some writes
        child.send_signal(signal.SIGKILL)
        child.communicate()
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        for path in root.iterdir():
            seen.add(path.name if not path.name.endswith(".tmp") else "(a temporary file)")
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert {"index.sqlite", "index.sqlite-wal", "index.sqlite-shm", "vectors.faiss"} <= seen
    with IndexStore(root, 64) as store:
        assert store.check_consistency() == []


def test_a_full_disk_while_saving_a_conversation_is_a_plain_error_and_loses_nothing(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    child = _child(FULL_DISK, str(path))
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    result = json.loads(out)
    assert "could not save the conversation" in result["error"]
    assert "disk full" in result["error"] and "Everything saved before is kept" in result["error"]
    conn = _intact(path)
    ids = [row[0] for row in conn.execute("SELECT id FROM messages ORDER BY id")]
    assert ids == result["saved"]  # what was acknowledged, and nothing half-written
    assert len(ids) >= 5


def test_a_full_disk_during_ingest_is_a_plain_error_and_the_index_stays_whole(
    tmp_path, embedder_dir, monkeypatch, capsys
):
    """A first folder ingests; a second one runs out of room half-way (the index may grow by
    200 KB): the user is told in plain words, the first folder's documents are intact, the
    store is consistent, and ingesting again once there is room finishes the job. Only the
    ingest that runs out of room is its own process (its file-size limit must not reach
    pytest); the others go through `app.cli.main` here, as `tandem` runs it (a process
    each paid ~12 s of imports)."""
    from app.cli import main
    from retrieval.store import IndexStore
    from tests.test_personal_index import big_folder, cli

    def snapshot(data: Path) -> dict[str, tuple[str, int]]:
        db = sqlite3.connect(data / "index" / "index.sqlite")
        rows = db.execute("SELECT path, sha256, chunk_count FROM documents").fetchall()
        db.close()
        return {path: (sha, n) for path, sha, n in rows}

    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    os.symlink(embedder_dir, data / "models" / "all-minilm-l6-v2-onnx")
    env = {**os.environ, "TANDEM_DATA_DIR": str(data)}
    monkeypatch.setenv("TANDEM_DATA_DIR", str(data))
    assert main(["ingest", str(big_folder(tmp_path / "first", n=5))]) == 0, capsys.readouterr()
    before = snapshot(data)
    index_dir = data / "index"
    grown = sum(f.stat().st_size for f in index_dir.iterdir() if f.is_file())

    def small_disk() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG), as on ENOSPC
        limit = grown + 200_000
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    second = big_folder(tmp_path / "second", n=40)
    full = cli("ingest", str(second), env=env, preexec_fn=small_disk)
    assert full.returncode != 0
    assert "Traceback" not in full.stderr, full.stderr
    assert "disk" in full.stderr.lower() or "space" in full.stderr.lower(), full.stderr
    after = snapshot(data)
    assert all(after[name] == row for name, row in before.items())  # nothing stored was lost
    store = IndexStore(index_dir, 384)
    try:
        assert store.check_consistency(deep=True) == []
    finally:
        store.close()
    capsys.readouterr()
    assert main(["ingest", str(second)]) == 0, capsys.readouterr()
    assert len(snapshot(data)) == len(before) + 40
