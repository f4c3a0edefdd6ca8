"""collab.plumbing: the one atomic write, file hash and migration engine."""

from __future__ import annotations

import hashlib
import io
import os
import sqlite3
import stat
from pathlib import Path

import pytest

from collab.plumbing.files import (
    atomic_write,
    discard_temp_files,
    fresh_partial,
    publish,
    sha256_file,
    sha256_files,
)
from collab.plumbing.migrations import SchemaTooNewError, migrate, user_version


def test_atomic_write_replaces_whole_and_sets_the_mode(tmp_path: Path) -> None:
    path = tmp_path / "f.toml"
    atomic_write(path, "old")
    atomic_write(path, "new ☃", mode=0o600)
    assert path.read_text(encoding="utf-8") == "new ☃"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["f.toml"]  # no temp file left


def test_a_secret_is_never_in_a_file_others_can_read_even_mid_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill between the write and the rename leaves the temporary file: it must already have
    the target's mode (it used to be 0o644 until a chmod just before the rename)."""
    path = tmp_path / "settings.toml"
    modes = []

    def killed_after_the_write(fd: int) -> None:
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        raise KeyboardInterrupt  # stands for the kill

    monkeypatch.setattr(os, "fsync", killed_after_the_write)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, 'token = "s3cret"', mode=0o600)
    assert modes == [0o600]
    monkeypatch.undo()
    atomic_write(path, "plain")  # without a mode: a new file's usual permissions
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    atomic_write(path, b"old")
    with pytest.raises(TypeError):
        atomic_write(path, 42)  # type: ignore[arg-type]
    assert path.read_bytes() == b"old"
    (tmp_path / ".f.dead.tmp").write_bytes(b"left by a kill")
    discard_temp_files(path)
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_hashes_stream_with_progress_and_copy(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 5_000_000)
    b.write_bytes(b"yz")
    seen: list[int] = []
    sink = io.BytesIO()
    digest = sha256_files([a, b], seen.append, copy_to=sink)
    assert digest == hashlib.sha256(a.read_bytes() + b.read_bytes()).hexdigest()
    assert sum(seen) == 5_000_002 and len(seen) == 3
    assert sink.getvalue() == a.read_bytes() + b.read_bytes()
    assert sha256_file(b) == hashlib.sha256(b"yz").hexdigest()


def test_publish_replaces_a_folder(tmp_path: Path) -> None:
    final = tmp_path / "model"
    final.mkdir()
    (final / "stale").write_text("old")
    partial = fresh_partial(final)
    partial.mkdir()
    (partial / "fresh").write_text("new")
    publish(partial, final)
    assert [p.name for p in final.iterdir()] == ["fresh"] and not partial.exists()
    partial = fresh_partial(final)
    partial.mkdir()
    assert fresh_partial(final) == partial and not partial.exists()  # leftovers discarded


def _step(sql: str):
    def run(conn: sqlite3.Connection) -> None:
        conn.execute(sql)

    return run


def _broken(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE half (x)")
    raise RuntimeError("migration bug")


def test_each_step_commits_with_its_version(tmp_path: Path) -> None:
    """A failing step rolls back only itself: the file stays at the last version reached."""
    conn = sqlite3.connect(tmp_path / "db.sqlite", isolation_level=None)
    steps = [_step("CREATE TABLE a (x)"), _broken]
    with pytest.raises(RuntimeError, match="migration bug"):
        migrate(conn, steps)
    assert user_version(conn) == 1 and not conn.in_transaction
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == {"a"}
    steps[1] = _step("CREATE TABLE b (x)")
    assert migrate(conn, steps, target=1) == 1
    assert migrate(conn, steps) == 2 == user_version(conn)


def test_a_newer_file_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA user_version = 5")
    before = path.read_bytes()
    with pytest.raises(SchemaTooNewError, match=r"db has schema version 5.*up to 1"):
        migrate(conn, [_step("CREATE TABLE a (x)")], name="db")
    assert path.read_bytes() == before
