"""Private data at rest (issue 28, part 5): under a permissive umask (022) everything Tandem
writes in its data folder is private to the user from creation (folders 0700, files 0600),
an install an older Tandem left readable is tightened when opened (and that is logged once),
a removed document's text is gone from the raw bytes of the index, and the log rotates."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

SECRET = "zanzibar-quokka-7731"  # appears nowhere else: found in the raw bytes or not


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The common default umask, under which new files are readable by every local user."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Data and config folders under tmp_path (neither exists yet); returns the data folder."""
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("TANDEM_CLOUD_URL", raising=False)
    monkeypatch.delenv("TANDEM_CLOUD_TOKEN", raising=False)
    return tmp_path / "data"


@pytest.fixture
def root_logging() -> Iterator[None]:
    """Put the root logger back as it was after a test that adds a file handler."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(level)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def loose(folder: Path) -> list[str]:
    """Every folder under (and including) `folder` that is not 0700 and file that is not
    0600, with its mode."""
    found = [] if mode(folder) == 0o700 else [f". {oct(mode(folder))}"]
    for here, dirs, files in os.walk(folder):
        for name, want in [(d, 0o700) for d in dirs] + [(f, 0o600) for f in files]:
            path = Path(here, name)
            if mode(path) != want:
                found.append(f"{path.relative_to(folder)} {oct(mode(path))}")
    return found


def written(folder: Path) -> set[str]:
    """The files under `folder`, relative to it."""
    return {str(Path(here, f).relative_to(folder)) for here, _, fs in os.walk(folder) for f in fs}


def vectors(n: int, dim: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


# --------------------------------------------------------------------------- a fresh install


async def test_a_fresh_install_is_private_everywhere_tandem_wrote(
    umask_022, dirs, root_logging, tmp_path, tiny, tiny_tokenizer, embedder_dir
):
    """Ingest a document, ask a question (the conversation is saved), export it, with the TUI's
    log on: every folder Tandem made is 0700 and every file 0600, while the stores are open
    (-wal, -shm) and after they close."""
    from app.assistant import Assistant
    from app.cli import tui_logging
    from app.settings import Settings
    from collab.plumbing.paths import index_dir
    from edge_runtime.device import DeviceModel
    from model_runtime.ort_runtime import OrtCausalLM
    from personal_index.index import PersonalIndex

    tui_logging()
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "garage.txt").write_text(f"The tandem bicycle belongs to Ada. {SECRET}\n")
    index = PersonalIndex(index_dir(), embedder_dir, chunk_tokens=48, overlap_tokens=8)
    index.ingest([docs])
    device = DeviceModel(OrtCausalLM(tiny["onnx-quant"]), tiny_tokenizer, "tiny-device")
    settings = Settings(k=1, max_tokens=6, default_mode="local")
    assistant = Assistant(settings, device=device, index=index)
    try:
        exchange = assistant.exchange("Who owns the tandem bicycle?", "local")
        async for _ in exchange.events():
            pass
        assert exchange.conversation_id is not None and exchange.citations  # quotes SECRET
        exports = tmp_path / "exports" / "tandem"
        md, js = assistant.conversations.export_files(exchange.conversation_id, exports)
        logging.getLogger("tandem.test").info("asked about %s", SECRET)

        assert {
            "index/index.sqlite",
            "index/index.sqlite-wal",
            "index/index.sqlite-shm",
            "index/vectors.faiss",
            "index/.ingest.lock",
            "conversations.sqlite",
            "tandem.log",
        } <= written(dirs)
        assert loose(dirs) == []
        assert loose(tmp_path / "exports") == [] and {md.name, js.name} <= written(exports)
        assert SECRET in js.read_text()  # the JSON export quotes the cited passage
    finally:
        await assistant.close()
    assert loose(dirs) == []


def test_a_cli_command_on_a_new_install_writes_only_private_files(umask_022, dirs):
    """`tandem docs list` creates the data folder and an empty index; the command runs under
    umask 077 (a belt for files no store knows about) and gives the caller's umask back."""
    from app.cli import main

    assert main(["docs", "list"]) == 0
    assert loose(dirs) == [] and "index/index.sqlite" in written(dirs)
    assert os.umask(0o022) == 0o022  # restored


def test_the_embedded_clouds_log_is_private_from_creation(umask_022, tmp_path):
    from collab.plumbing.files import private_opener

    path = tmp_path / "cloud.log"
    with open(path, "ab", opener=private_opener) as fh:
        fh.write(b"x")
    assert mode(path) == 0o600


# --------------------------------------------------------------------------- an older install


def _older_install(data: Path) -> dict[str, Path]:
    """An install as an older Tandem left it: real stores and logs, everything 0644 / 0755."""
    from app.conversations import ConversationStore
    from collab.plumbing.paths import conversations_path, index_dir, log_path
    from retrieval.embedder import DIM
    from retrieval.store import ChunkRecord, DocumentMeta, IndexStore

    with IndexStore(index_dir(), DIM) as store:
        meta = DocumentMeta(path="/docs/a.txt", size=1, mtime=0.0, sha256="a")
        store.replace_document(meta, [ChunkRecord(0, SECRET)], vectors(1, DIM))
    with ConversationStore(conversations_path()) as conversations:
        conversations.add_message(conversations.create().id, "user", SECRET, "local")
    log_path().write_text(f"asked about {SECRET}\n")
    log_path().with_name("tandem.log.1").write_text("older\n")
    (data / "cloud.log").write_text("cloud\n")
    (index_dir() / ".ingest.lock").write_text("")
    model = data / "models" / "some-model" / "model.onnx"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"onnx")
    for here, _, files in os.walk(data):
        os.chmod(here, 0o755)
        for name in files:
            os.chmod(Path(here, name), 0o644)
    return {"model": model}


def test_an_older_install_is_tightened_when_opened_and_that_is_logged_once(umask_022, dirs, caplog):
    from app.cli import main

    dirs.mkdir()
    made = _older_install(dirs)
    assert mode(dirs) == 0o755 and mode(dirs / "index" / "index.sqlite") == 0o644

    with caplog.at_level(logging.WARNING):
        assert main(["docs", "list"]) == 0
    tightened = [r for r in caplog.records if "private to this user" in r.getMessage()]
    assert len(tightened) == 1, caplog.text
    assert "readable by other local users" in tightened[0].getMessage()
    models = made["model"]
    assert loose(dirs) == [f"{models.relative_to(dirs)} 0o644"]  # models are not private

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["docs", "list"]) == 0
    assert not [r for r in caplog.records if "private to this user" in r.getMessage()]


def test_the_stores_tighten_their_own_files_without_the_cli(umask_022, dirs, caplog):
    """Library code is right on its own: tests and other processes open the stores directly."""
    from app.conversations import ConversationStore
    from collab.plumbing.paths import conversations_path, index_dir
    from retrieval.embedder import DIM
    from retrieval.store import IndexStore

    dirs.mkdir()
    _older_install(dirs)
    with caplog.at_level(logging.WARNING):
        IndexStore(index_dir(), DIM).close()
        ConversationStore(conversations_path()).close()
    assert len([r for r in caplog.records if "private to this user" in r.getMessage()]) == 2
    index = dirs / "index"
    assert loose(index) == []
    assert mode(conversations_path()) == 0o600


def test_the_tui_log_setup_tightens_an_older_log(umask_022, dirs, root_logging):
    from app.cli import tui_logging

    dirs.mkdir(mode=0o755)
    (dirs / "tandem.log").write_text("old\n")
    os.chmod(dirs / "tandem.log", 0o644)
    tui_logging()
    assert mode(dirs / "tandem.log") == 0o600 and mode(dirs) == 0o700


# --------------------------------------------------------------------------- secure delete


def _raw(folder: Path, name: str) -> dict[str, int]:
    """How often SECRET occurs in the raw bytes of a SQLite file and its side files."""
    return {
        p.name: p.read_bytes().count(SECRET.encode())
        for p in sorted(folder.glob(name + "*"))
        if p.is_file()
    }


def test_a_removed_documents_text_is_gone_from_the_index_files(tmp_path):
    from retrieval.store import ChunkRecord, DocumentMeta, IndexStore

    dim = 8
    with IndexStore(tmp_path, dim) as store:
        for i, text in enumerate((f"{SECRET} " * 40, "an ordinary note about bicycles")):
            meta = DocumentMeta(path=f"/docs/{i}.txt", size=1, mtime=0.0, sha256=str(i))
            records = [ChunkRecord(n, f"{text} part {n}") for n in range(30)]
            store.replace_document(meta, records, vectors(30, dim, seed=i))
        store.flush()
        assert sum(_raw(tmp_path, "index.sqlite").values()) > 0  # it was there
        assert store.remove_paths(["/docs/0.txt"]) == 1
        # while the store stays open (the TUI): gone from the database and its WAL
        assert sum(_raw(tmp_path, "index.sqlite").values()) == 0, _raw(tmp_path, "index.sqlite")
        assert store.stats().chunks == 30
    assert sum(_raw(tmp_path, "index.sqlite").values()) == 0


def test_a_removal_held_back_by_a_reader_is_scrubbed_at_the_next_flush(tmp_path):
    """Another process reading (`tandem search` beside the TUI) can hold the WAL back; the
    removal still succeeds, and the next flush finishes the job."""
    import sqlite3

    from retrieval.store import ChunkRecord, DocumentMeta, IndexStore

    dim = 8
    with IndexStore(tmp_path, dim) as store:
        meta = DocumentMeta(path="/docs/a.txt", size=1, mtime=0.0, sha256="1")
        store.replace_document(
            meta, [ChunkRecord(n, f"{SECRET} {n}") for n in range(20)], vectors(20, dim)
        )
        store.flush()
        reader = sqlite3.connect(tmp_path / "index.sqlite", isolation_level=None)
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM chunks").fetchone() == (20,)
        assert store.remove_paths(["/docs/a.txt"]) == 1  # not an error
        reader.execute("COMMIT")
        reader.close()
        store.flush()
        assert sum(_raw(tmp_path, "index.sqlite").values()) == 0, _raw(tmp_path, "index.sqlite")


def test_a_replaced_documents_old_text_is_gone_after_the_flush(tmp_path):
    """A document edited to take a secret out: the old version's chunks leave the files at
    the ingester's next flush."""
    from retrieval.store import ChunkRecord, DocumentMeta, IndexStore

    dim = 8
    with IndexStore(tmp_path, dim) as store:
        meta = DocumentMeta(path="/docs/a.txt", size=1, mtime=0.0, sha256="1")
        store.replace_document(
            meta, [ChunkRecord(n, f"{SECRET} {n}") for n in range(20)], vectors(20, dim)
        )
        store.flush()
        meta = DocumentMeta(path="/docs/a.txt", size=2, mtime=1.0, sha256="2")
        store.replace_document(meta, [ChunkRecord(0, "nothing secret now")], vectors(1, dim))
        store.flush()
        assert sum(_raw(tmp_path, "index.sqlite").values()) == 0


def test_a_deleted_conversations_text_is_gone_from_the_history_file(tmp_path):
    """Only a guard on this machine: Debian's SQLite is built with SQLITE_SECURE_DELETE, so the
    store's explicit pragma changes nothing here (this passes on the code before it). SQLite's
    own default is off: on a build without that option, the pragma is what zeroes the text."""
    from app.conversations import ConversationStore

    path = tmp_path / "conversations.sqlite"
    with ConversationStore(path) as store:
        keep = store.create("kept")
        store.add_message(keep.id, "user", "an ordinary question", "local")
        gone = store.create("secret")
        store.add_message(
            gone.id,
            "user",
            f"tell me about {SECRET} " * 30,
            "local",
            citations=[{"title": "notes", "text": SECRET * 20}],
        )
        assert sum(_raw(tmp_path, path.name).values()) > 0
        store.delete(gone.id)
        assert sum(_raw(tmp_path, path.name).values()) == 0
        assert [c.title for c in store.list()] == ["kept"]


def test_exports_are_private_and_replace_an_older_readable_one(umask_022, tmp_path):
    from app.conversations import ConversationStore, export_paths

    with ConversationStore(tmp_path / "c.sqlite") as store:
        cid = store.create("notes").id
        store.add_message(cid, "user", SECRET, "local")
        folder = tmp_path / "Documents" / "Tandem"
        md, js = export_paths(folder, store.get(cid))
        folder.mkdir(parents=True)
        md.write_text("an older export")
        os.chmod(md, 0o644)
        assert store.export_files(cid, folder) == (md, js)
    assert mode(md) == mode(js) == 0o600 and SECRET in md.read_text()
    assert {p.name for p in folder.iterdir()} == {md.name, js.name}  # no temporary file left


# --------------------------------------------------------------------------- log rotation


def test_the_log_rotates_and_every_file_is_private(umask_022, tmp_path, root_logging):
    from app.logfile import LOG_BACKUPS, LOG_MAX_BYTES, log_to_file

    assert 1 << 20 <= LOG_MAX_BYTES <= 50 << 20 and 1 <= LOG_BACKUPS <= 10
    path = tmp_path / "logs" / "tandem.log"
    handler = log_to_file(path, max_bytes=2_000, backups=2)
    logger = logging.getLogger("tandem.test.rotation")
    for i in range(200):
        logger.info("line %d %s", i, "x" * 60)
    handler.flush()
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == ["tandem.log", "tandem.log.1", "tandem.log.2"]
    assert all(mode(path.parent / n) == 0o600 for n in names) and mode(path.parent) == 0o700
    assert all((path.parent / n).stat().st_size <= 2_000 for n in names)
    assert "line 199" in path.read_text()


def test_the_tui_log_is_a_rotating_private_file(umask_022, dirs, root_logging):
    from logging.handlers import RotatingFileHandler

    from app.cli import tui_logging
    from app.logfile import LOG_BACKUPS, LOG_MAX_BYTES

    handler = tui_logging()
    assert isinstance(handler, RotatingFileHandler)
    assert (handler.maxBytes, handler.backupCount) == (LOG_MAX_BYTES, LOG_BACKUPS)
    assert Path(handler.baseFilename) == dirs / "tandem.log"
    assert mode(dirs / "tandem.log") == 0o600 and mode(dirs) == 0o700
