"""The private-facts evaluation's set and its arithmetic (the run itself needs the real pair:
`python -m benchmarks.private_facts --quick`)."""

from __future__ import annotations

import json

from benchmarks.private_facts import holds_fact, make_notes, method_names, summarise


def test_the_notes_are_fixed_by_the_seed_and_each_fact_is_only_in_its_note():
    notes = make_notes(32)
    assert notes == make_notes(32) and notes != make_notes(32, seed=1)
    assert len({n.fact for n in notes}) == 32 and len({n.question for n in notes}) == 32
    for note in notes:
        assert note.fact in note.text and note.fact.lower() not in note.question.lower()
        assert sum(note.fact in other.text for other in notes) == 1


def test_an_answer_is_right_when_it_holds_the_fact():
    assert holds_fact("The code is 4417, I think.", "4417")
    assert holds_fact("It is called QUILLOMAR.", "Quillomar")
    assert not holds_fact("I do not know that.", "4417")


def test_summary_picks_the_best_eta_and_compares_it_with_local_and_cloud():
    def rows(method, right, tps, acc=None):
        return [
            {"method": method, "right": r, "tokens_per_s": tps, "acceptance": acc} for r in right
        ]

    data = (
        rows("local", [1, 1, 1, 0], 20.0)
        + rows("cloud", [0, 0, 0, 0], 4.0)
        + rows("split-eta-0", [0, 0, 0, 0], 8.0, 0.5)
        + rows("split-eta-2", [1, 1, 0, 0], 7.0, 0.7)
    )
    out = summarise(data)
    assert out["best_split"] == "split-eta-2"
    assert out["right_vs_local"] == 2 / 3 and out["speed_vs_cloud"] == 7.0 / 4.0
    assert out["methods"]["split-eta-2"]["acceptance"] == 0.7
    assert method_names([0.0, 1.0]) == ["local", "cloud", "dragon", "split-eta-0", "split-eta-1"]


def test_report_pools_runs_made_in_pieces_per_engine_and_note_set(tmp_path, capsys):
    from benchmarks.private_facts import report

    def run(engine, notes, method, right):
        rows = [
            {"method": method, "right": r, "tokens_per_s": 5.0, "acceptance": None} for r in right
        ]
        return {"config": {"engine": engine, "notes": notes}, "rows": rows}

    runs = [
        run("ort", 2, "local", [1, 1]),
        run("ort", 2, "split-eta-20", [1, 0]),
        run("torch", 2, "local", [1, 0]),
    ]
    paths = []
    for i, data in enumerate(runs):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(data))
    report(paths)
    out = capsys.readouterr().out
    assert "ort cloud, 2 notes (4 answers)" in out and "torch cloud, 2 notes (2 answers)" in out
    assert "best split (split-eta-20) answers 50% of what local mode answers" in out
