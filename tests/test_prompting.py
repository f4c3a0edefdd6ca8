"""The one prompt builder both sides use, and how it keeps a long conversation answerable."""

from __future__ import annotations

from collab.sources import Source
from model_runtime.prompting import fit_prompt, prompt_budget, prompt_ids

HISTORY = [
    text
    for i in range(12)
    for text in (
        f"Question number {i} about tandem bicycles?",
        f"Answer number {i}: " + "pedal " * 20,
    )
]
PASSAGE = Source("garage.txt", "lines 1-2", text="The spare key is under the blue flower pot.")


def test_without_a_budget_or_within_it_nothing_is_left_out(tiny_tokenizer):
    whole = prompt_ids(tiny_tokenizer, "Where is the key?", HISTORY, [PASSAGE])
    assert fit_prompt(tiny_tokenizer, "Where is the key?", HISTORY, [PASSAGE]) == (whole, 0)
    assert fit_prompt(tiny_tokenizer, "Where is the key?", HISTORY, [PASSAGE], len(whole)) == (
        whole,
        0,
    )


def test_the_oldest_exchanges_go_first_and_no_more_than_needed(tiny_tokenizer):
    whole = prompt_ids(tiny_tokenizer, "Where is the key?", HISTORY, [PASSAGE])
    for budget in (len(whole) - 1, len(whole) // 2, 120):
        ids, dropped = fit_prompt(tiny_tokenizer, "Where is the key?", HISTORY, [PASSAGE], budget)
        assert 0 < dropped < len(HISTORY) // 2 and len(ids) <= budget
        # exactly the newest pairs remain, and one more pair would not have fitted
        assert ids == prompt_ids(
            tiny_tokenizer, "Where is the key?", HISTORY[2 * dropped :], [PASSAGE]
        )
        longer = prompt_ids(
            tiny_tokenizer, "Where is the key?", HISTORY[2 * dropped - 2 :], [PASSAGE]
        )
        assert len(longer) > budget
        text = tiny_tokenizer.decode(ids)
        assert "Question number 11" in text and "blue flower pot" in text
        assert f"Question number {dropped - 1} " not in text


def test_question_and_passages_always_stay(tiny_tokenizer):
    bare = prompt_ids(tiny_tokenizer, "Where is the key?", (), [PASSAGE])
    ids, dropped = fit_prompt(tiny_tokenizer, "Where is the key?", HISTORY, [PASSAGE], 10)
    assert (ids, dropped) == (bare, len(HISTORY) // 2)  # too long even so: the runtime says so


def test_the_next_turns_prompt_extends_the_last_one_up_to_its_sources(tiny_tokenizer):
    """Sources sit in a turn of their own after the conversation, so everything before them
    (system turn, earlier exchanges) is the previous prompt token for token: its KV is reused
    (conversation reuse); with the sources in the first turn, as DRAGON's per-document prompts
    keep them, nothing past the first tokens would be."""
    first = prompt_ids(tiny_tokenizer, "Where is the key?", HISTORY, [PASSAGE])
    answer = "Under the blue flower pot [1]."
    follow_up = HISTORY + ["Where is the key?", answer]
    lock = Source("shed.txt", "line 4", text="The bike lock's code is 4-1-7.")  # new sources
    second = prompt_ids(tiny_tokenizer, "And the bike lock?", follow_up, [lock])
    conversation = prompt_ids(tiny_tokenizer, "", HISTORY)[:-8]  # up to its last "<|im_end|>\n"
    assert tiny_tokenizer.decode(conversation).endswith(HISTORY[-1] + "<|im_end|>\n")
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= len(conversation) > len(HISTORY) * 10
    assert first[:shared] == second[:shared]
    text = tiny_tokenizer.decode(second[shared:])
    assert "Where is the key?" in text and "4-1-7" in text and "bike lock" in text

    def in_system(question: str, history: list[str], passage: Source) -> list[int]:
        return fit_prompt(tiny_tokenizer, question, history, [passage], sources_in_system=True)[0]

    old_first = in_system("Where is the key?", HISTORY, PASSAGE)
    old_second = in_system("And the bike lock?", follow_up, lock)
    assert old_first[:shared] != old_second[:shared]  # the negative control


def test_prompt_budget_leaves_room_for_the_answer_but_not_all_the_context():
    assert prompt_budget(32768, 512) == 32256
    assert prompt_budget(256, 100) == 156
    assert prompt_budget(256, 512) == 128
