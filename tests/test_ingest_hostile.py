"""Ingest that cannot be hung or tricked (issue 28 item 2): FIFOs, devices and sockets are
skipped, symlinks stay inside the folder, a size cap, a parse deadline enforced by killing a
worker process, a decompression budget for .docx, a PDF page cap, linear regexes, the parsed
bytes are the hashed bytes; and a brief fuzz run of the five parsers."""

from __future__ import annotations

import bz2
import hashlib
import io
import os
import socket
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import docx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pypdf import PdfWriter

from fuzzing import parsers as fuzz
from personal_index.index import PersonalIndex
from personal_index.ingest import Ingestor
from personal_index.parse_worker import ParseWorker
from personal_index.parsers import ParseError, parse
from tests import ingest_hooks as hooks

MB = 1_000_000


# ---- hostile files ------------------------------------------------------------------------


def docx_bytes(text: str = "A small document.") -> bytes:
    d = docx.Document()
    d.add_paragraph(text)
    out = io.BytesIO()
    d.save(out)
    return out.getvalue()


def zip_bomb_docx(path: Path, unpacked: int = 250 * MB) -> Path:
    """A valid .docx whose document.xml is padded with `unpacked` bytes of blanks (legal after
    the root element): a few hundred KB on disk."""
    src = zipfile.ZipFile(io.BytesIO(docx_bytes("bomb")))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            body = src.read(info)
            if info.filename != "word/document.xml":
                out.writestr(info.filename, body)
                continue
            with out.open(info.filename, "w", force_zip64=True) as f:
                f.write(body)
                for _ in range(unpacked // MB):
                    f.write(b" " * MB)
    return path


def lying_docx(path: Path, padding: int = 150 * MB, method: int = zipfile.ZIP_DEFLATED) -> Path:
    """A .docx whose document.xml entry inflates to `padding` more bytes than its directory
    declares (declared size and CRC are those of the real XML): whoever reads the entry in one
    `read()` inflates all of it. `method`: deflate, bzip2 (150 MB of padding: 145 bytes) or
    LZMA, in zipfile's own entry format."""
    src = zipfile.ZipFile(io.BytesIO(docx_bytes("liar")))
    xml = src.read("word/document.xml")
    comp = {
        zipfile.ZIP_DEFLATED: lambda: zlib.compressobj(6, zlib.DEFLATED, -15),
        zipfile.ZIP_BZIP2: lambda: bz2.BZ2Compressor(9),
        zipfile.ZIP_LZMA: zipfile.LZMACompressor,  # type: ignore[attr-defined]  # (zipfile's format)
    }[method]()
    stream = comp.compress(xml) + b"".join(comp.compress(b" " * MB) for _ in range(padding // MB))
    stream += comp.flush()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            if info.filename != "word/document.xml":
                z.writestr(info.filename, src.read(info))
    entries = out.getvalue()
    # Hand-made entry: local header + data, then the central directory of everything.
    name = b"word/document.xml"
    crc, size = zlib.crc32(xml), len(xml)
    head = zipfile.ZipFile(io.BytesIO(entries))
    body = bytearray(entries[: head.start_dir])
    local_at = len(body)
    sizes = (crc, len(stream), size, len(name))
    version = 20 if method == zipfile.ZIP_DEFLATED else 63
    local = (0x04034B50, version, 0, method, 0, 0, *sizes, 0)
    body += struct.pack("<IHHHHHIIIHH", *local) + name + stream
    central = bytearray(entries[head.start_dir : entries.rfind(b"PK\x05\x06")])
    entry = (0x02014B50, version, version, 0, method, 0, 0, *sizes, 0, 0, 0, 0, 0, local_at)
    central += struct.pack("<IHHHHHHIIIHHHHHII", *entry)
    central += name
    count = len(head.infolist()) + 1
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, len(central), len(body), 0)
    path.write_bytes(bytes(body + central + end))
    return path


def many_pages_pdf(path: Path, pages: int) -> Path:
    writer = PdfWriter()
    for _ in range(pages):
        writer.add_blank_page(72, 72)
    with open(path, "wb") as f:
        writer.write(f)
    return path


# ---- parsers: linear regexes, caps ---------------------------------------------------------


def _timed_parse(path: Path):
    start = time.perf_counter()
    doc = parse(path)
    return doc, time.perf_counter() - start


def test_a_heading_line_of_spaces_parses_in_linear_time(tmp_path: Path) -> None:
    # parsers._ATX took seconds at 8,000 spaces between two words and grew with the square.
    path = tmp_path / "wide.md"
    path.write_text("# a" + " " * 20_000 + "x\n\nbody\n")
    doc, seconds = _timed_parse(path)
    assert seconds < 1.0, f"{seconds:.2f} s for one 20 kB line"
    assert doc.sections[0].title == "a" + " " * 20_000 + "x"


@pytest.mark.parametrize(
    "line",
    [
        "#" + " " * 200_000 + "x",
        "# a" + " " * 200_000 + "x",
        "# x" + " " * 200_000 + "#a",
        "#" + " \t" * 100_000 + "#" * 1000 + "x",
        "# " + "#" * 200_000 + " x",
        "   " + "=" * 200_000 + " " * 200_000 + "x",
        "-" * 200_000 + "\t" * 200_000 + "x",
        "`" * 200_000 + " x",
        "x\n" + "=" * 200_000 + " " * 200_000 + "x",
        "- " * 200_000,
    ],
    ids=lambda line: repr(line[:12]),
)
def test_every_markdown_regex_is_linear_on_long_lines(tmp_path: Path, line: str) -> None:
    path = tmp_path / "long.md"
    path.write_text(f"intro\n{line}\n{line}\nend\n")
    _doc, seconds = _timed_parse(path)
    assert seconds < 1.5, f"{seconds:.2f} s"


@pytest.mark.parametrize(
    ("text", "title"),
    [
        ("# Title #\n", "Title"),
        ("## Title ##   \n", "Title"),
        ("# Title#\n", "Title#"),
        ("   ### Deep\n", "Deep"),
        ("#\tTabbed\n", "Tabbed"),
        ("# ###\n", None),
        ("#\n", None),
    ],
)
def test_atx_headings_keep_their_meaning(tmp_path: Path, text: str, title: str | None) -> None:
    path = tmp_path / "h.md"
    path.write_text(f"intro\n\n{text}\nbody\n")
    doc = parse(path)
    assert [s.title for s in doc.sections] == [None, title]


@pytest.mark.parametrize("text", ["#5 bolts\n", "####### seven\n", "    # code\n"])
def test_non_headings_stay_text(tmp_path: Path, text: str) -> None:
    path = tmp_path / "n.md"
    path.write_text(f"intro\n{text}body\n")
    assert [s.title for s in parse(path).sections] == [None]


def test_a_docx_zip_bomb_is_refused_unread(tmp_path: Path) -> None:
    path = zip_bomb_docx(tmp_path / "bomb.docx")
    assert path.stat().st_size < 1 * MB
    start = time.perf_counter()
    with pytest.raises(ParseError, match=r"^compressed content too large"):
        parse(path)
    assert time.perf_counter() - start < 2.0


def test_a_docx_that_lies_about_its_size_is_inflated_only_as_far_as_declared(
    tmp_path: Path,
) -> None:
    path = lying_docx(tmp_path / "liar.docx")
    tracemalloc.start()
    try:
        doc = parse(path)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 * MB, f"peak {peak / MB:.0f} MB for a 150 MB inflation"
    assert doc.sections[0].text == "liar"


@pytest.mark.parametrize("method", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA], ids=["bzip2", "lzma"])
def test_a_docx_compressed_other_than_deflate_is_refused_unread(
    tmp_path: Path, method: int
) -> None:
    # zipfile bounds a read's output by the size asked for with deflate only: a bzip2 entry
    # was decompressed whole by the first block read, whatever size it declares (150 MB from
    # 145 bytes: a .docx of a few kB took gigabytes, past the parse worker's 4 GB cap).
    path = lying_docx(tmp_path / "liar.docx", padding=60 * MB, method=method)
    assert path.stat().st_size < 1 * MB
    tracemalloc.start()
    try:
        with pytest.raises(ParseError, match=r"^unsupported compression in the zip \(method"):
            parse(path)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 * MB, f"peak {peak / MB:.0f} MB"


def test_a_pdf_over_the_page_cap_is_refused(tmp_path: Path) -> None:
    path = many_pages_pdf(tmp_path / "pages.pdf", 2001)
    with pytest.raises(ParseError, match=r"^too many pages \(2,001 > 2,000 cap\)$"):
        parse(path)
    assert parse(many_pages_pdf(tmp_path / "ok.pdf", 3)).sections == ()


# ---- the parse worker ----------------------------------------------------------------------


def test_the_deadline_kills_a_stuck_parser_and_the_next_file_parses(tmp_path: Path) -> None:
    with ParseWorker(timeout_s=2, target=hooks.HANG) as worker:
        assert worker.parse(Path("a.txt"), b"first").sections[0].text == "first"
        pid = worker._proc.pid if worker._proc else None
        start = time.monotonic()
        with pytest.raises(ParseError, match=r"^parse took longer than 2 s$"):
            worker.parse(Path("stuck.txt"), b"HANG for ever")
        assert time.monotonic() - start < 8
        assert pid is not None and not Path(f"/proc/{pid}").exists()  # killed and reaped
        assert worker.parse(Path("b.txt"), b"after").sections[0].text == "after"
        assert worker.starts == 2


def test_a_crashing_parser_fails_only_its_file() -> None:
    with ParseWorker(timeout_s=30, target=hooks.CRASH) as worker:
        with pytest.raises(ParseError, match=r"^the parser stopped unexpectedly \(exit code -11\)"):
            worker.parse(Path("c.txt"), b"CRASH")
        assert worker.parse(Path("d.txt"), b"fine").sections[0].text == "fine"


def test_one_worker_parses_many_files() -> None:
    """The child is started once, not per file (a start costs about a second of imports)."""
    with ParseWorker() as worker:
        start = time.perf_counter()
        worker.parse(Path("0.md"), b"# zero\n")
        first = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(1, 51):
            assert worker.parse(Path(f"{i}.md"), f"# n{i}\n".encode()).title == f"n{i}"
        rest = (time.perf_counter() - start) / 50
        assert worker.starts == 1
    print(f"\nparse worker: first file (start + parse) {first:.2f} s, then {rest * 1e3:.1f} ms")


# ---- ingest --------------------------------------------------------------------------------


def ordinary_files(folder: Path, n: int = 100) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        words = f"Ordinary note number {i} about topic {i % 7} and the weather on day {i}."
        if i % 3 == 0:
            path = folder / f"note-{i:03d}.md"
            path.write_text(f"# Note {i}\n\n{words}\n")
        elif i % 3 == 1:
            path = folder / f"note-{i:03d}.txt"
            path.write_text(words + "\n")
        else:
            path = folder / f"note-{i:03d}.html"
            path.write_text(f"<html><body><h1>Note {i}</h1><p>{words}</p></body></html>")
        out.append(path)
    return out


@pytest.fixture
def index(tmp_path, embedder_dir):
    with PersonalIndex(tmp_path / "index", embedder_dir) as idx:
        yield idx


@pytest.mark.timeout(300)
def test_a_hostile_folder_next_to_100_ordinary_files(index, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    ordinary = ordinary_files(docs)
    outside = tmp_path / "outside" / "secret.txt"
    outside.parent.mkdir()
    outside.write_text("The outside secret is 4242.\n")
    os.mkfifo(docs / "fifo.txt")
    os.symlink("/dev/zero", docs / "zero.md")
    os.symlink(outside, docs / "outside.txt")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(docs / "socket.txt"))
    zip_bomb_docx(docs / "bomb.docx")
    (docs / "wide.md").write_text("# a" + " " * 900_000 + "x\n")  # hours for parsers._ATX
    (docs / "big.txt").write_bytes(b"big file " * 170_000)  # 1.53 MB
    many_pages_pdf(docs / "pages.pdf", 2001)
    (docs / "stuck.txt").write_bytes(b"HANG: a parser that never returns")
    # CPython's html.parser is quadratic on "<a<a<a..." (hours at this size on 3.11.7)
    (docs / "slow.html").write_text("<html><body>" + "<a" * 200_000)
    worker = ParseWorker(timeout_s=5, target=hooks.HANG)
    ingestor = Ingestor(index.store, index.embedder, index.chunker, max_file_mb=1, worker=worker)
    start = time.monotonic()
    try:
        results = ingestor.ingest([docs])
    finally:
        server.close()
    seconds = time.monotonic() - start
    got = {Path(r.path).name: (r.outcome, r.reason) for r in results}
    print(
        f"\nhostile ingest: {len(results)} files ({len(ordinary)} ordinary) in {seconds:.1f} s,"
        f" {worker.starts} worker start(s), {os.cpu_count()} CPUs"
    )
    assert {p.name for p in ordinary} <= {n for n, (o, _r) in got.items() if o == "indexed"}
    assert got["fifo.txt"] == ("skipped", "not a regular file (FIFO)")
    assert got["socket.txt"] == ("skipped", "not a regular file (socket)")
    assert got["zero.md"] == ("skipped", "symlink leads outside the folder")
    assert got["outside.txt"] == ("skipped", "symlink leads outside the folder")
    assert got["bomb.docx"][0] == "failed"
    assert got["bomb.docx"][1].startswith("compressed content too large")
    assert got["wide.md"] == ("indexed", None)
    assert got["big.txt"] == ("failed", "too large (1.5 MB > 1 MB cap)")
    assert got["pages.pdf"] == ("failed", "too many pages (2,001 > 2,000 cap)")
    assert got["stuck.txt"] == ("failed", "parse took longer than 5 s")
    assert got["slow.html"] in {("failed", "parse took longer than 5 s"), ("indexed", None)}
    assert len(results) == len(ordinary) + 10
    hits = index.search("outside secret 4242", k=3)
    assert all("secret" not in h.text for h in hits)
    assert seconds < 240


def test_a_named_device_or_fifo_is_skipped_with_its_reason(index, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "named.txt")
    results = index.ingest(["/dev/zero", tmp_path / "named.txt"])
    assert [(r.path, r.outcome, r.reason) for r in results] == [
        ("/dev/zero", "skipped", "not a regular file (character device)"),
        (str(tmp_path / "named.txt"), "skipped", "not a regular file (FIFO)"),
    ]


def test_a_file_replaced_by_a_symlink_leading_out_leaves_the_index(index, tmp_path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.txt").write_text("Lighthouse keepers log the storms.\n")
    inside = docs / "sub" / "target.txt"
    inside.parent.mkdir()
    inside.write_text("An inside target is fine.\n")
    os.symlink(inside, docs / "link.txt")
    assert {r.outcome for r in index.ingest([docs])} == {"indexed"}
    outside = tmp_path / "private.txt"
    outside.write_text("Outside the folder.\n")
    (docs / "notes.txt").unlink()
    os.symlink(outside, docs / "notes.txt")
    results = {Path(r.path).name: (r.outcome, r.reason) for r in index.ingest([docs])}
    assert results["notes.txt"] == ("skipped", "symlink leads outside the folder")
    assert results["link.txt"] == ("unchanged", None)
    assert str(docs / "notes.txt") not in {d.path for d in index.documents()}


def test_the_parsed_bytes_are_the_hashed_bytes(index, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    files = ordinary_files(docs, 6)
    worker = ParseWorker(target=hooks.TITLED_BY_SHA)
    Ingestor(index.store, index.embedder, index.chunker, worker=worker).ingest([docs])
    rows = {d.path: d for d in index.documents()}
    for path in files:
        row = rows[str(path)]
        assert row.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
        assert row.title == row.sha256  # the child parsed exactly the bytes that were hashed


@pytest.mark.timeout(600)
def test_cli_ingest_skips_a_fifo_and_applies_the_size_setting(
    tmp_path, embedder_dir, monkeypatch, capsys
) -> None:
    """`tandem ingest` through `app.cli.main` (what the script runs) in this process: a
    process of its own paid ~9 s of imports again."""
    from app.cli import main

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ok.txt").write_text("An ordinary note.\n")
    (docs / "big.txt").write_bytes(b"x" * 2_100_000)
    os.mkfifo(docs / "x.txt")
    data, config = tmp_path / "data", tmp_path / "config"
    (data / "models").mkdir(parents=True)
    config.mkdir()
    (config / "config.toml").write_text("ingest_max_mb = 2\n")
    os.symlink(embedder_dir, data / "models" / "all-minilm-l6-v2-onnx")
    monkeypatch.setenv("TANDEM_DATA_DIR", str(data))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(config))
    capsys.readouterr()
    code = main(["ingest", str(docs)])
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    assert f"skipped    {docs / 'x.txt'}  not a regular file (FIFO)" in lines, stdout
    assert f"failed     {docs / 'big.txt'}  too large (2.1 MB > 2 MB cap)" in lines
    assert lines[-1] == "1 indexed, 1 failed, 1 skipped"
    assert code == 1


# ---- fuzzing -------------------------------------------------------------------------------

SEEDS = fuzz.seeds()


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A seed of some format with a few bytes overwritten, inserted or cut."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(1, len(data)))
        op = draw(st.sampled_from(["set", "insert", "cut"]))
        chunk = draw(st.binary(min_size=1, max_size=16))
        if op == "set":
            data[at : at + len(chunk)] = chunk
        elif op == "insert":
            data[at:at] = chunk
        else:
            del data[at : at + len(chunk)]
    return bytes(data)


@pytest.mark.timeout(600)
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
@given(st.one_of(mutated(), st.binary(max_size=2048)))
def test_the_parsers_on_fuzzed_bytes_return_sections_or_parse_errors(data: bytes) -> None:
    start = time.perf_counter()
    fuzz.test_one(data)
    assert time.perf_counter() - start < 10, fuzz.split(data)[0]


def test_the_fuzz_seeds_parse_into_sections() -> None:
    for data in SEEDS:
        kind, body = fuzz.split(data)
        doc = parse_from_bytes(kind, body)
        fuzz.check(doc, kind)
        assert doc.sections, kind


def parse_from_bytes(kind: str, body: bytes):
    from personal_index.parsers import parse_bytes

    return parse_bytes(Path(f"seed.{kind}"), body)


@pytest.mark.timeout(300)
def test_the_parser_fuzz_command_runs_briefly(tmp_path: Path) -> None:
    """`python -m fuzzing parsers` under libFuzzer (where atheris is installed: the fuzz extra),
    started from a process whose peak memory is above the fuzzer's limit."""
    pytest.importorskip("atheris")
    command = ["-m", "fuzzing", "parsers", "--minutes", "0.15", "--corpus", str(tmp_path / "c")]
    out = subprocess.run(
        [sys.executable, "-c", FROM_A_LARGE_PROCESS, *command],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Done" in out.stderr


FROM_A_LARGE_PROCESS = """
import subprocess, sys
held = b"x" * (4200 << 20)  # a peak RSS above the parser fuzzer's 4,096 MB limit
del held
sys.exit(subprocess.call([sys.executable, *sys.argv[1:]]))
"""
"""Start a command from a process whose peak RSS is 4.2 GB, as a long test run's is: the peak
is carried over the exec (getrusage), and libFuzzer read it as its own (CI failed so)."""
