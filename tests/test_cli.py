"""The command line is headless and explains itself."""

from __future__ import annotations

import os
import subprocess
import sys


def test_listing_commands_on_an_empty_install(tmp_path, monkeypatch, capsys):
    """What the listing commands say before anything is set up (that they never import Textual
    is checked by tests/test_imports.py)."""
    from app.cli import main

    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path))
    for argv in (["models", "list"], ["docs", "list"], ["paths"]):
        main(argv)
    out = capsys.readouterr().out
    assert "No models prepared" in out and "0 documents" in out
    assert f"config         {tmp_path / 'config.toml'}" in out  # `tandem paths`


def test_ask_without_prepared_models_says_what_to_run(tmp_path):
    env = {**os.environ, "TANDEM_DATA_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "ask", "hi"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2
    assert "tandem models prepare" in out.stderr


def test_ask_offers_dragon_and_its_aggregator(capsys):
    """dragon is a --mode choice (from the registry); --aggregator takes only the three
    policies; -k says what it means in dragon."""
    import pytest

    from app.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["ask", "q", "--mode", "dragon", "--aggregator", "cloud", "-k", "2"])
    assert (args.mode, args.aggregator, args.k) == ("dragon", "cloud", 2)
    assert parser.parse_args(["ask", "q"]).aggregator is None  # the settings file's
    with pytest.raises(SystemExit):
        parser.parse_args(["ask", "q", "--aggregator", "both"])
    with pytest.raises(SystemExit):
        parser.parse_args(["ask", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "dragon" in usage and "--aggregator {auto,device,cloud}" in usage
    assert "in dragon, documents per side" in usage


async def test_ask_dragon_json_and_last_line_carry_its_figures_and_both_sides_sources(
    tmp_path, monkeypatch, capsys, tiny, embedder_dir
):
    """`tandem ask --mode dragon` end to end: the tiny device model from the settings file, a
    real private index, a real cloud on loopback (tiny model, public corpus)."""
    import json

    from aiohttp.test_utils import TestServer

    from app.ask import run_ask
    from app.cli import build_parser
    from app.settings import Settings, save_settings
    from cloud_backend.config import ServerConfig
    from cloud_backend.corpus import PublicCorpus
    from cloud_backend.engine import LLMEngine
    from cloud_backend.server import create_app
    from collab.plumbing.paths import embedder_dir as prepared_embedder
    from collab.plumbing.paths import index_paths
    from model_runtime.tokenizer import load_tokenizer
    from model_runtime.torch_runtime import TorchCausalLM
    from personal_index.index import PersonalIndex

    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("TANDEM_CLOUD_URL", raising=False)
    monkeypatch.delenv("TANDEM_CLOUD_TOKEN", raising=False)
    prepared_embedder().parent.mkdir(parents=True)
    prepared_embedder().symlink_to(embedder_dir)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "garage.txt").write_text("The tandem bicycle in the garage belongs to Ada.\n")
    with PersonalIndex(*index_paths(), chunk_tokens=48, overlap_tokens=8) as index:
        index.ingest([docs])
    corpus = PublicCorpus.open(
        tmp_path / "public",
        embedder_dir,
        limit=40,
        progress=False,
        chunk_tokens=48,
        overlap_tokens=8,
    )
    engine = LLMEngine(TorchCausalLM(tiny["hf"]), load_tokenizer(tiny["tokenizer"]), "tiny")
    server = TestServer(create_app(ServerConfig(token="t" * 24), engine, corpus), host="127.0.0.1")
    await server.start_server()
    try:
        save_settings(
            Settings(
                device_model=str(tiny["onnx-quant"]),
                k=1,
                max_tokens=10,
                cloud_url=f"ws://127.0.0.1:{server.port}/v1/session",
                cloud_token="t" * 24,
            )
        )
        question = "Who owns the tandem bicycle, and what was the 1755 Lisbon earthquake?"
        parser = build_parser()
        # a cloud that is not this device's own: dragon takes part only with consent
        args = parser.parse_args(["ask", question, "--mode", "dragon", "--json"])
        assert await run_ask(args) == 0
        out = json.loads(capsys.readouterr().out)
        assert any("answered on this device alone" in n for n in out["notices"])
        assert out["stats"]["aggregator"] is None and out["stats"]["bytes_up"] == 0
        assert question not in [t for row in out["sent"] for t in row.get("texts", [])]
        args = parser.parse_args(
            [
                "ask",
                question,
                "--mode",
                "dragon",
                "--aggregator",
                "cloud",
                "--json",
                "--allow-private-in-cloud",
            ]
        )
        assert await run_ask(args) == 0
        out = json.loads(capsys.readouterr().out)
        stats = out["stats"]
        assert out["answer"] and not out["errors"]
        assert (stats["mode"], stats["aggregator"], stats["switches"]) == ("dragon", "cloud", 0)
        assert stats["cloud_acceptance"] is not None and stats["device_acceptance"] is not None
        assert stats["ttft_s"] > 0 and stats["bytes_up"] > 0 and stats["bytes_down"] > 0
        assert "tokens_per_s" in stats
        # what left, by kind (edge_runtime.sent), beside the figures rather than among them
        assert "sent" not in stats and sum(row["bytes"] for row in out["sent"]) >= stats["bytes_up"]
        assert question in [t for row in out["sent"] for t in row.get("texts", [])]
        cited = [(c["number"], c["side"]) for c in out["citations"]]
        assert cited == sorted(cited) and {side for _, side in cited} == {"device", "cloud"}

        args = parser.parse_args(
            [
                "ask",
                question,
                "--mode",
                "dragon",
                "--aggregator",
                "device",
                "--allow-private-in-cloud",
            ]
        )
        assert await run_ask(args) == 0
        printed = capsys.readouterr()
        last = printed.err.strip().splitlines()[-1]
        assert last.startswith("[dragon · tiny") and "aggregator device · accept device" in last
        assert "0 switches" in last and "TTFT" in last and "↑" in last
        listed = [line for line in printed.out.splitlines() if line.startswith("[")]
        assert [line.split()[1] for line in listed] == [side for _, side in cited]
    finally:
        await server.close()
        corpus.close()


def test_ask_json_is_valid_json_whatever_the_numbers_and_text():
    """A NaN citation score made `--json` print NaN, which is not JSON; C1 controls went out
    raw (json.dumps escapes only C0 ones when ensure_ascii is off)."""
    import json
    import math

    from app.plain import safe_json

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    row = {"title": "\x1b]0;pwned\x07 notes \x9b2J", "score": math.nan}
    out = safe_json(
        {
            "citations": [row],
            "stats": {"tokens_per_s": math.inf, "ttft_s": 0.5, "rates": (1.0, -math.inf)},
            "answer": "é\tok\n",
        }
    )
    parsed = json.loads(out, parse_constant=refuse)
    assert parsed["citations"][0] == {"title": row["title"], "score": None}  # nothing lost
    assert parsed["stats"] == {"tokens_per_s": None, "ttft_s": 0.5, "rates": [1.0, None]}
    assert parsed["answer"] == "é\tok\n"
    assert "\n" not in out and all(c >= " " and not "\x7f" <= c <= "\x9f" for c in out)


async def test_ask_strips_control_characters_from_all_it_prints(
    tmp_path, monkeypatch, capsys, tiny, embedder_dir
):
    """`tandem ask` in local mode over a document whose name and text carry escape sequences:
    the answer, the notices, the citation lines and the figures reach the terminal without
    a control character; `--json` keeps them, escaped."""
    import json

    from app.ask import run_ask
    from app.cli import build_parser
    from app.settings import Settings, save_settings
    from collab.plumbing.paths import embedder_dir as prepared_embedder
    from collab.plumbing.paths import index_paths
    from personal_index.index import PersonalIndex

    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("TANDEM_CLOUD_URL", raising=False)
    prepared_embedder().parent.mkdir(parents=True)
    prepared_embedder().symlink_to(embedder_dir)
    docs = tmp_path / "docs"
    docs.mkdir()
    name = "\x1b[31mred\x1b[0m \x9b2J notes.md"
    (docs / name).write_text("The \x1b]0;pwned\x07 cabin key is under the \x1b[5mmat.\n")
    with PersonalIndex(*index_paths(), chunk_tokens=48, overlap_tokens=8) as index:
        index.ingest([docs])
    save_settings(Settings(device_model=str(tiny["onnx-quant"]), k=1, max_tokens=12))
    parser = build_parser()
    assert (
        await run_ask(
            parser.parse_args(["ask", "Where is the cabin key?", "--mode", "local", "--json"])
        )
        == 0
    )
    raw = capsys.readouterr().out
    assert all(c in "\n" or (c >= " " and not "\x7f" <= c <= "\x9f") for c in raw), repr(raw)
    out = json.loads(raw)
    assert out["citations"][0]["title"] == name  # escaped in the JSON, not lost
    assert out["sent"] == []  # local: nothing left the device
    assert (
        await run_ask(parser.parse_args(["ask", "Where is the cabin key?", "--mode", "local"])) == 0
    )
    printed = capsys.readouterr()
    for stream in (printed.out, printed.err):
        assert all(c in "\n\t" or (c >= " " and not "\x7f" <= c <= "\x9f") for c in stream), repr(
            stream
        )
    assert "[31mred[0m 2J notes.md" in printed.out  # the citation line, less its controls
