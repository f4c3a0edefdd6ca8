"""Scoped questions (issue 47, item 2): a question asked of some documents or folders only
(`tandem ask --in PATH`, the TUI's @ mentions) retrieves and cites only from inside them, by
meaning and by keyword alike; a path with nothing indexed under it is an error, not an answer
from no document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from personal_index.index import PersonalIndex

TRIP = "The kayak for the lake trip belongs to Ines. It is red and has two seats.\n"
WORK = "The kayak in the office photo belongs to Ines's manager Teodor. It is a blue kayak.\n"
QUESTION = "Whose blue kayak is in the office photo?"


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    trip, work = tmp_path / "docs" / "trip", tmp_path / "docs" / "trip-work"  # a shared prefix
    for folder, text in ((trip, TRIP), (work, WORK)):
        folder.mkdir(parents=True)
        (folder / "kayak.md").write_text(text, encoding="utf-8")
    return trip, work


@pytest.fixture
def index(tmp_path: Path, embedder_dir: Path, folders):
    idx = PersonalIndex(tmp_path / "index", embedder_dir)
    idx.ingest(list(folders))
    yield idx
    idx.close()


@pytest.mark.parametrize("mode", ["hybrid", "dense", "keyword"])
def test_a_scoped_search_finds_only_inside_its_scope(index, folders, mode) -> None:
    trip, work = folders
    everywhere = index.search(QUESTION, 2, None, mode=mode)
    assert Path(everywhere[0].path).parent == work.resolve()  # the negative control
    scoped = index.search(QUESTION, 2, None, mode=mode, within=[str(trip.resolve())])
    assert scoped and {Path(h.path).parent for h in scoped} == {trip.resolve()}
    one_file = str((work / "kayak.md").resolve())
    assert {h.path for h in index.search(QUESTION, 2, None, mode=mode, within=[one_file])} == {
        one_file
    }
    assert index.search(QUESTION, 2, None, mode=mode, within=[str(work.parent / "none")]) == []


def _tandem(capsys, *argv: str) -> tuple[int, str, str]:
    from app.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def home(tmp_path: Path, monkeypatch, embedder_dir: Path, tiny) -> Path:
    """A data folder whose embedder is the tests' (linked, not exported again) and settings
    naming the tiny device model."""
    from app.settings import Settings, save_settings
    from collab.plumbing.paths import EMBEDDER_NAME

    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("TANDEM_CLOUD_URL", raising=False)
    (tmp_path / "data" / "models").mkdir(parents=True)
    (tmp_path / "data" / "models" / EMBEDDER_NAME).symlink_to(embedder_dir)
    save_settings(Settings(device_model=str(tiny["onnx-quant"]), k=2, max_tokens=6))
    return tmp_path


def test_ask_in_cites_only_from_inside(home: Path, folders, capsys) -> None:
    trip, work = folders
    assert _tandem(capsys, "ingest", str(trip), str(work))[0] == 0
    code, out, _ = _tandem(capsys, "ask", "--mode", "local", "--json", QUESTION)
    assert code == 0
    cited = {Path(c["path"]).parent for c in json.loads(out)["citations"]}
    assert work.resolve() in cited  # unscoped, the office note answers
    code, out, _ = _tandem(capsys, "ask", "--mode", "local", "--json", "--in", str(trip), QUESTION)
    assert code == 0
    got = json.loads(out)["citations"]
    assert got and {Path(c["path"]).parent for c in got} == {trip.resolve()}
    both = ["--in", str(trip / "kayak.md"), "--in", str(work)]
    code, out, _ = _tandem(capsys, "ask", "--mode", "local", "--json", *both, QUESTION)
    assert code == 0 and json.loads(out)["citations"]


def test_ask_in_a_path_with_nothing_indexed_is_an_error(home: Path, folders, capsys) -> None:
    trip, work = folders
    assert _tandem(capsys, "ingest", str(trip))[0] == 0
    code, out, err = _tandem(capsys, "ask", "--mode", "local", "--in", str(work), QUESTION)
    assert code == 2 and out == ""
    assert f"nothing is indexed at or under {work.resolve()}" in err
