"""The private index end to end on real files of every format: citations, incremental
re-ingest, deletions, a SIGKILLed ingest, failures that do not stop the rest, the CLI."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import docx
import pytest
from fpdf import FPDF

from personal_index.index import PersonalIndex

TOPICS = [
    "The lighthouse keeper logged storms, ships and the colour of the sea every evening.",
    "Sourdough bread needs a lively starter, a long cold proof and a very hot oven.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The treaty was signed in a small town after three weeks of difficult negotiation.",
]


def make_corpus(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    pdf = FPDF()
    for text in (
        "Alpha page one talks about glaciers and ice ages.",
        "Beta page two explains how volcanoes form new islands.",
    ):
        pdf.add_page()
        pdf.set_font("Helvetica", size=12)
        pdf.multi_cell(0, 10, text)
    pdf.output(str(folder / "geology.pdf"))
    d = docx.Document()
    d.add_heading("Garden notes", level=1)
    d.add_paragraph("Tomatoes want six hours of sun and deep, infrequent watering.")
    d.save(str(folder / "garden.docx"))
    (folder / "recipe.html").write_text(
        "<html><head><title>Soup</title><script>var x = 'hidden';</script></head><body>"
        "<h1>Pumpkin soup</h1><p>Roast the pumpkin with garlic, then blend with stock.</p>"
        "</body></html>"
    )
    (folder / "notes.md").write_text(
        "# Travel\n\nThe night train to Vienna leaves at ten.\n\n"
        "# Chess\n\nThe Sicilian defence answers 1.e4 with c5.\n"
    )
    (folder / "log.txt").write_text("\n".join(TOPICS) + "\n")
    (folder / "image.gif").write_bytes(b"GIF89a not really")
    return {p.stem: p for p in folder.iterdir()}


class CountingEmbedder:
    """Wraps the real embedder to count what gets embedded (not a mock: it embeds)."""

    def __init__(self, inner) -> None:
        self.inner, self.texts = inner, 0

    @property
    def dim(self) -> int:
        return self.inner.dim

    def embed(self, texts):
        self.texts += len(texts)
        return self.inner.embed(texts)


@pytest.fixture
def index(tmp_path, embedder_dir):
    with PersonalIndex(tmp_path / "index", embedder_dir) as idx:
        idx.embedder = CountingEmbedder(idx.embedder)
        yield idx


def outcomes(results) -> dict[str, str]:
    return {Path(r.path).name: r.outcome for r in results}


def test_every_format_is_indexed_with_citations(index, tmp_path):
    make_corpus(tmp_path / "docs")
    results = index.ingest([tmp_path / "docs"])
    assert outcomes(results) == {
        "geology.pdf": "indexed",
        "garden.docx": "indexed",
        "recipe.html": "indexed",
        "notes.md": "indexed",
        "log.txt": "indexed",
        "image.gif": "skipped",
    }
    skipped = next(r for r in results if r.outcome == "skipped")
    assert "unsupported" in skipped.reason

    hit = index.search("how do volcanoes make islands", k=1)[0]
    assert hit.path.endswith("geology.pdf") and hit.page == 2 and "Beta page two" in hit.text
    hit = index.search("Sicilian defence chess opening", k=1)[0]
    assert hit.path.endswith("notes.md") and hit.title == "Chess"
    assert hit.line_start == 5 and "Sicilian" in hit.text
    hit = index.search("baking bread with a starter", k=1)[0]
    assert hit.path.endswith("log.txt") and hit.line_start == 1 and hit.line_end == 4
    hit = index.search("pumpkin soup recipe", k=1)[0]
    assert hit.path.endswith("recipe.html") and "hidden" not in hit.text
    hit = index.search("watering tomatoes", k=1)[0]
    assert hit.path.endswith("garden.docx") and hit.title == "Garden notes"
    assert not index.store.check_consistency(deep=True)


def test_reingest_is_incremental_and_deletions_are_purged(index, tmp_path):
    files = make_corpus(tmp_path / "docs")
    index.ingest([tmp_path / "docs"])
    embedded = index.embedder.texts

    again = index.ingest([tmp_path / "docs"])
    assert index.embedder.texts == embedded  # nothing re-embedded
    assert {r.outcome for r in again} == {"unchanged", "skipped"}

    os.utime(files["log"], None)  # touched, same content: checksum says unchanged
    assert outcomes(index.ingest([tmp_path / "docs"]))["log.txt"] == "unchanged"
    assert index.embedder.texts == embedded

    files["notes"].write_text("# Travel\n\nThe night train to Vienna now leaves at eleven.\n")
    edited = outcomes(index.ingest([tmp_path / "docs"]))
    assert edited["notes.md"] == "indexed"
    assert [n for n, o in edited.items() if o == "indexed"] == ["notes.md"]
    assert index.embedder.texts == embedded + 1  # only the edited file's one chunk
    assert "eleven" in index.search("train to Vienna", k=1)[0].text

    files["recipe"].unlink()
    purged = outcomes(index.ingest([tmp_path / "docs"]))
    assert purged["recipe.html"] == "removed"
    assert all(not h.path.endswith("recipe.html") for h in index.search("pumpkin soup", k=10))
    assert not index.store.check_consistency(deep=True)

    assert index.remove(tmp_path / "docs" / "notes.md") == 1
    assert index.remove(tmp_path / "docs") == 3  # pdf, docx, txt
    assert index.documents() == [] and not index.store.check_consistency(deep=True)


def test_a_corrupt_file_fails_with_a_reason_and_the_rest_are_indexed(index, tmp_path):
    make_corpus(tmp_path / "docs")
    (tmp_path / "docs" / "broken.pdf").write_bytes(os.urandom(2000))
    results = {Path(r.path).name: r for r in index.ingest([tmp_path / "docs"])}
    assert results["broken.pdf"].outcome == "failed"
    assert "PDF" in results["broken.pdf"].reason
    assert sum(r.outcome == "indexed" for r in results.values()) == 5
    failed = [d for d in index.documents() if d.status == "failed"]
    assert [Path(d.path).name for d in failed] == ["broken.pdf"]


def test_bad_queries_get_clear_errors(index, tmp_path):
    make_corpus(tmp_path / "docs")
    index.ingest([tmp_path / "docs"])
    with pytest.raises(ValueError, match="empty query"):
        index.search("   ")
    with pytest.raises(ValueError, match="k must be at least 1"):
        index.search("islands", k=0)
    assert len(index.search("islands", k=1000)) == index.stats().chunks


def test_rescore_ranks_by_the_new_text(index, tmp_path):
    make_corpus(tmp_path / "docs")
    index.ingest([tmp_path / "docs"])
    hits = index.search("nature and science", k=6)
    volcano = index.rescore(hits, "volcanoes and islands")
    best = hits[int(volcano.argmax())]
    assert "volcano" in best.text.lower()


# ---- the CLI, and a SIGKILLed ingest ---------------------------------------------------------


def big_folder(folder: Path, n: int = 80) -> Path:
    folder.mkdir(parents=True)
    for i in range(n):
        body = " ".join(TOPICS[(i + j) % len(TOPICS)] for j in range(30))
        (folder / f"note-{i:03d}.txt").write_text(f"Note {i}. {body}\n")
    return folder


def cli(*args: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        **kw,
    )


def snapshot(data: Path) -> dict[str, tuple[str, int]]:
    db = sqlite3.connect(data / "index" / "index.sqlite")
    rows = db.execute("SELECT path, sha256, chunk_count FROM documents").fetchall()
    db.close()
    return {Path(p).name: (sha, n) for p, sha, n in rows}


def test_sigkilled_ingest_resumes_to_the_same_store(tmp_path, embedder_dir, monkeypatch, capsys):
    """`tandem ingest` as its own process, SIGKILLed part way and run again, ends with the
    store a clean ingest makes (that one, the reference, runs in this process)."""
    from app.cli import main
    from retrieval.store import IndexStore

    folder = big_folder(tmp_path / "notes", 40)
    env_of = {}
    for name in ("killed", "clean"):
        data = tmp_path / name
        (data / "models").mkdir(parents=True)
        os.symlink(embedder_dir, data / "models" / "all-minilm-l6-v2-onnx")
        env_of[name] = {**os.environ, "TANDEM_DATA_DIR": str(data)}

    db_path = tmp_path / "killed" / "index" / "index.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "ingest", str(folder)],
        env=env_of["killed"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while True:  # kill once some, not all, documents are in
        assert proc.poll() is None, "ingest finished before it could be killed"
        assert time.monotonic() < deadline
        if db_path.exists():
            try:
                con = sqlite3.connect(db_path, timeout=0.1)
                n = con.execute("SELECT COUNT(*) FROM documents").fetchone()[0]
                con.close()
            except sqlite3.Error:
                n = 0
            if n >= 5:
                break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = snapshot(tmp_path / "killed")
    assert 5 <= len(partial) < 40

    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "clean"))
    assert main(["ingest", str(folder)]) == 0, capsys.readouterr().err
    resumed = cli("ingest", str(folder), "--json", env=env_of["killed"])
    assert resumed.returncode == 0, resumed.stderr
    counts = [r["outcome"] for r in json.loads(resumed.stdout)]
    assert counts.count("unchanged") >= len(partial) - 1  # finished documents were kept
    assert snapshot(tmp_path / "killed") == snapshot(tmp_path / "clean")
    store = IndexStore(db_path.parent, 384)
    try:
        assert store.check_consistency(deep=True) == []
    finally:
        store.close()


def test_cli_search_list_remove(tmp_path, embedder_dir, monkeypatch, capsys):
    """The commands' parsing, output and exit codes, through `app.cli.main` (what the `tandem`
    script runs) in this process: a process per command paid ~12 s of imports each, and the
    ingest and SIGKILL test above runs `tandem ingest` as its own process."""
    from app.cli import main

    def tandem(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    make_corpus(tmp_path / "docs")
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    os.symlink(embedder_dir, data / "models" / "all-minilm-l6-v2-onnx")
    monkeypatch.setenv("TANDEM_DATA_DIR", str(data))
    code, out, _ = tandem("ingest", str(tmp_path / "docs"))
    assert code == 0 and "5 indexed, 1 skipped" in out
    hits = json.loads(tandem("search", "volcanoes", "-k", "2", "--json")[1])
    assert hits[0]["path"].endswith("geology.pdf") and hits[0]["page"] == 2
    assert hits[0]["found_by"] in ("meaning", "both") and hits[0]["cited"] is True
    by = {
        m: json.loads(tandem("search", "volcanoes", "--mode", m, "--json")[1])
        for m in ("keyword", "dense")
    }
    assert by["keyword"] and {h["found_by"] for h in by["keyword"]} == {"keyword"}
    assert {h["found_by"] for h in by["dense"]} == {"meaning"}
    noise = tandem("search", "who won the football world cup in 2010")[1]
    assert "below the floor" in noise  # shown for inspection, marked: answers leave it out
    assert "geology.pdf" in tandem("docs", "list")[1]
    code, _, err = tandem("search", "")
    assert code == 2 and "empty query" in err
    assert tandem("docs", "remove", str(tmp_path / "docs" / "geology.pdf"))[0] == 0
    code, _, err = tandem("docs", "remove", str(tmp_path / "nowhere"))
    assert code == 2 and "no indexed document" in err


def test_a_second_ingest_at_the_same_time_is_refused(index, tmp_path):
    import fcntl

    from personal_index.index import IngestBusyError

    make_corpus(tmp_path / "docs")
    with open(index.store.root / ".ingest.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(IngestBusyError, match="another ingest"):
            index.ingest([tmp_path / "docs"])
    assert index.documents() == []
    assert len(index.ingest([tmp_path / "docs"])) == 6  # free again
