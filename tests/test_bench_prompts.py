"""Benchmark prompts from the flexeval wheel: both sets, English, first turns, stable order."""

from __future__ import annotations

import shutil

from benchmarks.prompts import WHEEL_NAME, cache_dir, ensure_wheel, load_prompts, select


def test_twenty_prompts_cover_both_sets_and_many_categories():
    prompts = load_prompts(n=20)  # downloads the wheel once into the user cache
    assert len(prompts) == 20
    assert len({p.id for p in prompts}) == 20
    assert {p.source for p in prompts} == {"mt-bench", "vicuna"}
    assert len({(p.source, p.category) for p in prompts}) >= 15
    for p in prompts:
        assert p.text.strip() and p.category
        assert p.text.isascii() or sum(c.isascii() for c in p.text) > 0.95 * len(p.text)
    assert load_prompts(n=20) == prompts  # deterministic


def test_full_sets_first_turns():
    mt, vicuna = load_prompts("mt-bench"), load_prompts("vicuna")
    assert len(mt) == 80 and len(vicuna) == 80
    assert mt[0].id == "mt-bench/81" and mt[0].category == "writing"
    assert mt[0].text.startswith(
        "Compose an engaging travel blog post about a recent trip to Hawaii"
    )
    assert "Rewrite your previous response" not in mt[0].text  # second turn is not included
    assert vicuna[0].id == "vicuna/1"
    both = load_prompts()
    assert both == mt + vicuna and len({p.id for p in both}) == 160
    assert select(both, 500) and len(select(both, 500)) == 160


def test_cached_wheel_is_reused_and_a_damaged_one_replaced(tmp_path, monkeypatch):
    good = tmp_path / "good"
    good.mkdir()
    shutil.copy(ensure_wheel(), good / WHEEL_NAME)
    assert ensure_wheel(good) == good / WHEEL_NAME  # cached: pip is not run
    assert cache_dir().name == "benchmarks"
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / WHEEL_NAME).write_bytes(b"truncated")
    # pip runs for real but finds the wheel in a local folder: no second registry download.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(good))
    assert len(load_prompts("vicuna", n=5, cache=damaged)) == 5  # fetched again, checked
    assert (damaged / WHEEL_NAME).read_bytes() == (good / WHEEL_NAME).read_bytes()
    assert [p.name for p in damaged.iterdir()] == [WHEEL_NAME]  # no download leftovers
