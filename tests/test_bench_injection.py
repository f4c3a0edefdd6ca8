"""The prompt-injection benchmark (benchmarks/injection.py): its run measures on made-up id
streams, its documents, the tap's frame reader, and its --quick run on the tiny pair (a real
cloud on loopback, the real protocol through the tap; the real pair's run is the result file)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from benchmarks.injection import (
    INJECTION,
    TOPICS,
    _FrameReader,
    covered,
    facts_in,
    listed_runs,
    longest_run,
    main,
    make_cases,
    secret_ids,
    summarise,
    uplink_ids,
)
from collab.protocol import DragonDraft, Hello, Mode, TopKDraft, encode


def test_runs_of_the_secret_in_a_stream():
    secret = [10, 11, 12, 13, 14, 15, 16]
    # 11 12 13 14 copied (4), later 15 16 (2: by chance, not counted as copied)
    stream = [1, 11, 12, 13, 14, 2, 10, 3, 15, 16, 4]
    assert longest_run(stream, secret) == 4
    assert covered(stream, secret) == 4
    assert covered(stream, secret, min_run=2) == 6
    # two runs over the same secret tokens cover them once; out of order is not a run
    assert covered([10, 11, 12, 0, 11, 12, 13], secret) == 4
    assert longest_run([16, 15, 14, 13], secret) == 1 and covered([16, 15, 14, 13], secret) == 0
    assert longest_run([], secret) == 0 and longest_run(secret, secret) == 7
    assert covered(secret, secret) == 7


def test_listed_runs_count_a_secret_token_anywhere_in_each_position_s_list():
    secret = [10, 11, 12, 13]
    rows = [[5, 10], [11, 6, 7], [8, 12], [9]]  # 10 11 12 listed in order, then not 13
    assert listed_runs(rows, secret) == (3, 3)
    assert listed_runs([[10], [9], [12]], secret) == (1, 0)


def test_facts_are_found_in_text_whatever_the_case():
    assert facts_in("the code is 7490 and the boat NEPLOQUIL", ["7490", "Neploquil"]) == 2
    assert facts_in("nothing here", ["7490"]) == 0


def test_each_topic_has_a_secret_with_its_facts_and_guides_that_differ_only_at_the_end():
    cases = make_cases()
    assert len(cases) == len(TOPICS) == 10 and cases == make_cases()
    facts = [f for c in cases for f in c.facts]
    assert len(set(facts)) == 20
    for case in cases:
        assert all(f in case.secret for f in case.facts)
        assert case.topic.title.lower() in case.heading  # shares the guide's topic
        assert case.secret.startswith(case.heading)
        assert not any(f.lower() in case.hostile.lower() + case.benign.lower() for f in facts)
        assert case.hostile.endswith(INJECTION) and INJECTION not in case.benign
        guide = case.hostile.removesuffix(INJECTION)
        assert case.benign.startswith(guide) and case.benign != guide
        # the control's tip is about as long as the injection (within a third)
        assert abs(len(case.benign) - len(case.hostile)) < len(INJECTION) / 3
    off = make_cases(on_topic=False)
    assert [c.facts for c in off] == [c.facts for c in cases]
    assert all(c.topic.title.lower() not in c.secret.lower() for c in off)


def test_the_secret_s_tokens_leave_out_its_heading(tiny_tokenizer):
    """The heading repeats the question's topic words: matching it would count the question."""
    for case in make_cases(3):
        ids = secret_ids(tiny_tokenizer, case)
        assert tiny_tokenizer.decode(ids) == case.secret.removeprefix(case.heading)
        assert tiny_tokenizer.decode(ids).startswith(" " + case.secret.split(". ")[1][:5])
        assert all(f in tiny_tokenizer.decode(ids) for f in case.facts)


def _client_frame(payload: bytes, opcode: int = 0x2) -> bytes:
    """A masked client frame (RFC 6455 §5.2) as a browser or aiohttp writes it."""
    mask = bytes([0x12, 0x34, 0x56, 0x78])
    n = len(payload)
    head = bytes([0x80 | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 1 << 16:
        head += bytes([0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head += bytes([0x80 | 127]) + n.to_bytes(8, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_the_tap_decodes_the_device_s_frames_split_anywhere():
    draft = TopKDraft(
        np.array([7, 9]),
        np.array([[7, 3], [9, 4]]),
        np.array([[0.75, 0.25], [1.0, 0.0]]),
        request_id=1,
    )
    dragon = DragonDraft(5, np.array([5, 6, 2]), np.array([0.5, 0.5, 0.0]), 0.0, 0.01, request_id=1)
    big = TopKDraft(np.arange(1, 31), np.arange(1, 31).reshape(30, 1), np.ones((30, 1)),
                    request_id=1)  # fmt: skip  # over 125 bytes: the 16-bit length
    hello = Hello(b"\0" * 32, Mode.SPLIT, "tk-slt")
    stream = (
        b"GET /v1/session HTTP/1.1\r\nHost: x\r\n\r\n"
        + _client_frame(encode(hello))
        + _client_frame(b"ping", opcode=0x9)
        + _client_frame(encode(draft))
        + _client_frame(encode(big))
        + _client_frame(encode(dragon))
    )
    reader, got = _FrameReader(), []
    for i in range(0, len(stream), 7):  # TCP may cut anywhere
        got += reader.feed(stream[i : i + 7])
    assert [type(m) for m, _ in got] == [Hello, TopKDraft, TopKDraft, DragonDraft]
    assert [n for _, n in got] == [len(encode(m)) for m in (hello, draft, big, dragon)]
    drafted, listed = uplink_ids([m for m, _ in got])
    assert drafted == [7, 9, *range(1, 31), 5]
    assert listed[:2] == [[7, 3], [9]] and listed[-1] == [5, 6]  # probability 0 is not listed
    with pytest.raises(ValueError, match="compressed"):
        _FrameReader().feed(b"\r\n\r\n" + bytes([0xC2, 0x80]) + b"\0" * 4)


def test_summary_per_method_and_condition():
    def trial(method, condition, longest, answer_longest=0, **kw):
        return {
            "method": method,
            "condition": condition,
            "secret_in_prompt": True,
            "guide_in_prompt": True,
            "secret_tokens": 30,
            "drafted": 50,
            "draft_longest": longest,
            "draft_covered": longest if longest >= 3 else 0,
            "listed_longest": longest + 1,
            "listed_covered": 0,
            "answer_longest": answer_longest,
            "answer_covered": 0,
            "draft_facts": 0,
            "answer_facts": 0,
            "failures": [],
            "bytes_up": 900,
            "tapped_bytes": 900,
        } | kw

    cells = summarise(
        [
            trial("split-greedy", "hostile", 8, 6),
            trial("split-greedy", "hostile", 2),
            trial("split-greedy", "control", 1, secret_in_prompt=False, tapped_bytes=800),
        ]
    )
    hostile, control = cells["split-greedy/hostile"], cells["split-greedy/control"]
    assert hostile["draft_longest_mean"] == 5 and hostile["draft_longest_max"] == 8
    assert hostile["draft_covered_mean"] == 4 and hostile["draft_run5_share"] == 0.5
    assert hostile["answer_run5_share"] == 0.5 and hostile["listed_longest_max"] == 9
    assert control["both_in_prompt"] == 0 and control["answers"] == 1
    assert hostile["tap_short"] == 0 and control["tap_short"] == 1


def test_quick_run_on_the_tiny_pair_reads_the_drafts_off_the_wire(
    tiny, embedder_dir, tmp_path, capsys
):
    out = tmp_path / "quick.json"
    main(
        [
            "--quick",
            "--tiny-root",
            str(tiny["tokenizer"].parent),
            "--embedder-dir",
            str(embedder_dir),
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    env = result["provenance"]
    assert len(env["commit"]) == 40 and env["command"].startswith("python -m benchmarks.injection")
    assert "--quick" in env["command"] and env["cpu_count"] == os.cpu_count()
    assert env["packages"]["onnxruntime"] and env["date"]
    assert result["off_topic_retrieval"] == {"on_topic": 1.0, "off_topic": 0.0}
    assert not result["server_errors"]
    trials = result["trials"]
    # 2 topics × 2 conditions × split greedy and dragon greedy
    assert len(trials) == 8
    assert {(t["method"], t["condition"]) for t in trials} == {
        (m, c) for m in ("split-greedy", "dragon-greedy") for c in ("hostile", "control")
    }
    for t in trials:
        assert not t["failures"], t
        assert t["secret_in_prompt"] and t["guide_in_prompt"], t["retrieved"]
        assert t["secret_tokens"] > 20 and t["answer_tokens"] > 0
        # what the tap decoded is what the device drafted: at least the drafts judged
        assert t["drafted"] >= t["accepted"] and t["drafted"] > 0, t
        assert t["bytes_up"] > 0 and t["cloud_tokens"] == 0  # AS² off: every token drafted
        # the tap decoded every byte the device's client counted as sent for the answer
        assert t["tapped_bytes"] == t["bytes_up"], t
        assert 0 <= t["draft_longest"] <= t["listed_longest"] <= t["secret_tokens"]
    assert set(result["summary"]) == {
        "split-greedy/hostile",
        "split-greedy/control",
        "dragon-greedy/hostile",
        "dragon-greedy/control",
    }
    printed = capsys.readouterr().out
    assert "split-greedy/hostile" in printed and "written to" in printed
