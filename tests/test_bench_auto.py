"""benchmarks.auto: its question set holds what it claims, its scoring and verdicts can fail,
its socket count sees a connection, and its loop runs every method over a real cloud (tiny
models; the real pair's run is the benchmark itself)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from benchmarks import auto as bench
from cloud_backend.config import ServerConfig
from edge_runtime.device import DeviceModel
from model_runtime.ort_runtime import OrtCausalLM
from tests.cloud import TOKEN


def test_the_question_set_is_sixty_questions_whose_facts_are_where_it_says():
    from cloud_backend.corpus_build import load_summaries

    notes, questions = bench.question_set()
    assert len(questions) == 60
    assert {g: sum(q.group == g for q in questions) for g in bench.GROUPS} == dict.fromkeys(
        bench.GROUPS, 15
    )
    assert len({q.text for q in questions}) == 60
    summaries = dict(load_summaries())
    data = bench.tomllib.loads(bench.QUESTIONS.read_text(encoding="utf-8"))
    for item in data["public"] + data["both"]:
        text = summaries[item["article"]].lower()
        for spellings in item["facts"]:
            assert any(s.lower() in text for s in spellings), (item["article"], spellings)
    facts = {n.fact for n in notes}
    for q in questions:
        if q.group in ("private", "both"):
            assert q.facts[0][0] in facts  # a note holds it
            assert not any(s.lower() in q.text.lower() for f in q.facts for s in f)
        if q.group == "both":
            assert len(q.facts) == 2


def test_an_answer_is_right_only_with_every_fact():
    facts = (("Jordan",), ("4417", "4,417"))
    assert bench.right("The code is 4,417 and Petra is in jordan.", facts)
    assert not bench.right("Petra is in Jordan.", facts)
    assert not bench.right("", facts)


def rows_for(auto_picks: dict[str, str]) -> list[dict]:
    """Synthetic rows: each fixed mode right exactly on its own group (dragon on both), auto
    answering as the mode it picks, every answer 1 s (auto's `slow` s on public questions)."""
    good = {
        "private": {"local", "dragon"},
        "public": {"cloud", "dragon"},
        "both": {"dragon"},
        "chat": {"local", "cloud", "split", "dragon"},
    }
    rows = []
    for g in bench.GROUPS:
        for i in range(5):
            q = f"{g}-{i}"
            for m in bench.FIXED:
                rows.append(
                    {
                        "method": m,
                        "question": q,
                        "group": g,
                        "right": m in good[g],
                        "elapsed_s": 1.0,
                        "ttft_s": 0.1,
                        "chose": None,
                    }
                )
            pick = auto_picks[g]
            rows.append(
                {
                    "method": "auto",
                    "question": q,
                    "group": g,
                    "right": pick in good[g],
                    "elapsed_s": 1.02,
                    "ttft_s": 0.12,
                    "chose": pick,
                }
            )
    return rows


def test_the_summary_passes_a_good_router_and_fails_a_bad_one():
    good = bench.summarise(
        rows_for({"private": "local", "public": "cloud", "both": "dragon", "chat": "cloud"})
    )
    assert good["accuracy"]["auto"]["all"] == good["accuracy"]["oracle"]["all"] == 1.0
    assert good["best_fixed"] == "dragon"
    assert good["confusion"]["both"] == {"dragon": 5}
    assert good["public_time_vs_cloud"]["ratio"] == pytest.approx(1.02)
    lines = bench.verdicts(good, {"questions": 20, "sockets_opened": 0, "chose": ["local"]})
    # as right as the best fixed mode: its paired interval holds 0, so "≥" is not shown
    assert len(lines) == 4 and lines[0].startswith("NOT SHOWN"), lines
    assert all(line.startswith("PASS") for line in lines[1:]), lines
    # a router that sends the public questions to the device: worse than dragon alone
    bad = bench.summarise(
        rows_for({"private": "local", "public": "local", "both": "dragon", "chat": "cloud"})
    )
    lines = bench.verdicts(bad, {"questions": 20, "sockets_opened": 1, "chose": ["local"]})
    assert [line[:4] for line in lines] == ["FAIL", "FAIL", "PASS", "FAIL"], lines
    assert bad["auto_vs"]["dragon"]["verdict"] == "auto worse"


async def test_the_socket_count_sees_a_connection_and_nothing_else():
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with bench.counting_sockets() as opened:
        pass
    assert opened == []
    with bench.counting_sockets() as opened:
        _, writer = await asyncio.open_connection("127.0.0.1", port)  # the event loop's way
        writer.close()
    assert ("127.0.0.1", port) in opened
    with bench.counting_sockets() as opened, socket.create_connection(("127.0.0.1", port)):
        pass  # the blocking way
    assert opened == [("127.0.0.1", port)]
    server.close()


@pytest.fixture
def cloud_corpus(public_corpus):
    return public_corpus


@pytest.fixture
def cloud_config():
    return ServerConfig(token=TOKEN, corpus_enabled=False, corpus_k=2)


async def test_every_method_answers_every_question_and_the_policy_pass_opens_nothing(
    tiny, tiny_tokenizer, embedder_dir, tmp_path, cloud_url
):
    from personal_index.index import PersonalIndex

    notes, _ = bench.question_set()
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / notes[0].file).write_text(notes[0].text)
    index = PersonalIndex(tmp_path / "index", embedder_dir)
    index.ingest([folder])
    device = DeviceModel(OrtCausalLM(tiny["onnx-quant"]), tiny_tokenizer, "tiny-device")
    questions = [
        bench.Question("private-00", "private", notes[0].question, ((notes[0].fact,),)),
        bench.Question("public-00", "public", "In which city was ABBA formed?", (("Stockholm",),)),
    ]
    modes = bench.contexts(device, index, cloud_url, TOKEN)
    try:
        rows = await bench.ask_all(modes, questions, 6, lambda rows: None)
        private_pass = await bench.device_only_pass(modes["auto"], questions)
    finally:
        for mode in modes.values():
            await mode.close()
        index.close()
    assert sorted((r["question"], r["method"]) for r in rows) == sorted(
        (q.id, m) for q in questions for m in bench.METHODS
    )
    chose = {r["question"]: r["chose"] for r in rows if r["method"] == "auto"}
    assert chose == {"private-00": "local", "public-00": "cloud"}
    assert private_pass == {"questions": 2, "sockets_opened": 0, "chose": ["local"], "bytes": 0}
    summary = bench.summarise(rows)
    assert set(summary["accuracy"]) == {*bench.METHODS, "oracle"}


def test_pieces_pool_with_the_later_answer_winning(tmp_path):
    first = {
        "rows": [
            {"method": "auto", "question": "chat-00", "right": False},
            {"method": "auto", "question": "both-00", "right": True},
        ]
    }
    second = {
        "rows": [{"method": "auto", "question": "chat-00", "right": True}],
        "device_only": {"questions": 60, "sockets_opened": 0},
    }
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, data in zip(paths, (first, second), strict=True):
        path.write_text(bench.json.dumps(data))
    rows, private_pass = bench.pooled(paths)
    assert sorted((r["question"], r["right"]) for r in rows) == [
        ("both-00", True),
        ("chat-00", True),
    ]
    assert private_pass == second["device_only"]


def test_the_decision_bound_is_the_slowest_decision_on_each_cloud_answer():
    times = {"public-00": 10.0, "public-01": 2.0, "chat-00": 1.0}
    rows = [
        {"method": "cloud", "question": q, "group": q.split("-")[0], "elapsed_s": t}
        for q, t in times.items()
    ]
    slow = (("public-00", 0.1), ("public-00", 0.5), ("public-01", 0.1), ("chat-00", 9.0))
    decided = [{"question": q, "decide_s": t} for q, t in slow]
    bound = bench.decision_bound(rows, decided)
    assert bound is not None and bound["questions"] == 2
    assert bound["worst"] == pytest.approx(1.05) and bound["worst_question"] == "public-00"
    line = bench.verdicts({"accuracy": {}}, None, bound)
    assert line == []  # no auto rows: no verdicts at all


def test_an_end_to_end_ratio_whose_interval_holds_the_bound_is_not_a_pass():
    rows = rows_for({"private": "local", "public": "cloud", "both": "dragon", "chat": "cloud"})
    for i, r in enumerate(r for r in rows if r["group"] == "public"):
        r["elapsed_s"] = [1.0, 1.5, 0.8, 1.1, 1.3][i // 5 % 5] if r["method"] == "auto" else 1.0
    lines = bench.verdicts(bench.summarise(rows), None)
    assert any(line.startswith("NOT SHOWN") for line in lines), lines


def test_a_piece_in_some_methods_judges_only_what_it_measured():
    """`--methods cloud`: the public speed is judged, accuracy against the best fixed mode and
    the oracle is not (one fixed mode is not every one); a save before any question has every
    method's answer has no summary, and says so."""
    every = rows_for({"private": "local", "public": "cloud", "both": "dragon", "chat": "cloud"})
    piece = [r for r in every if r["group"] == "public" and r["method"] in ("cloud", "auto")]
    summary = bench.summarise(piece)
    assert summary["methods"] == ["cloud", "auto"] and summary["best_fixed"] == "cloud"
    lines = bench.verdicts(summary, None)
    assert [line.split(" ")[:3] for line in lines] == [["PASS", "public", "questions:"]], lines
    crossed = [
        r
        for r in piece
        if (r["method"], r["question"]) in (("cloud", "public-0"), ("auto", "public-1"))
    ]
    assert len(crossed) == 2 and bench.summarise(crossed) == {}
    bench.print_summary({}, None)  # a save with nothing to judge prints, not fails
