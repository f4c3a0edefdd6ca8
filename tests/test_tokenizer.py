"""The tokenizer we save and load gives the GGUF tokenizer's ids and round-trips text."""

from __future__ import annotations

import unicodedata

import pytest

from model_runtime.tokenizer import (
    IM_END_ID,
    chat_prompt_ids,
    load_tokenizer,
    tokenizer_fingerprint,
)
from tandem_packaging.steps import TOKENIZER_PROBE

TEXTS = [
    TOKENIZER_PROBE,
    "   leading and trailing spaces   ",
    "\n\n\t\t  mixed\r\nline endings\r",
    "1234567890 0.5 1e10 007 ١٢٣ 12,345.67",
    "SELECT name, COUNT(*) FROM users WHERE id > 10 GROUP BY name;",
    'fn main() { let v: Vec<u8> = vec![1, 2, 3]; println!("{:?}", v); }',
    "机器学习是人工智能的一个分支。深度学习使用多层神经网络。",
    "東京は日本の首都です。カタカナとひらがな。",
    "Ελληνικά, русский текст, עברית, العربية",
    "emoji 👩‍💻🧑🏽‍🚀 and combining é (e\u0301)",
    "a" * 300,
    "don't, it's, we'll, they've, I'm, you'd",
    "CamelCaseIdentifier getHTTPResponse XMLHttpRequest",
    "",
]


@pytest.fixture(scope="module")
def gguf_tok(gguf_tokenizer):
    return gguf_tokenizer  # converted once a session (tests/conftest.py)


def test_saved_tokenizer_matches_gguf_ids_and_round_trips(gguf_tok, tiny):
    saved = load_tokenizer(tiny["tokenizer"])
    for text in TEXTS:
        ids = saved.encode(text, add_special_tokens=False)
        assert ids == gguf_tok.encode(text, add_special_tokens=False), text
        assert saved.decode(ids) == unicodedata.normalize("NFC", text)  # Qwen normalises NFC
    assert tokenizer_fingerprint(saved) == tokenizer_fingerprint(gguf_tok)


def test_saved_tokenizer_differs_from_mistral_regex_fix(tiny):
    """The control that makes the test above meaningful: `fix_mistral_regex=True` swaps the
    pre-tokenizer and changes ids, so a wrong flag would be caught."""
    from transformers import AutoTokenizer

    # (the swap only happens beside a config.json, as in every prepared model folder)
    ours = load_tokenizer(tiny["hf"])
    mistral = AutoTokenizer.from_pretrained(str(tiny["hf"]), fix_mistral_regex=True)
    assert any(
        ours.encode(t, add_special_tokens=False) != mistral.encode(t, add_special_tokens=False)
        for t in TEXTS
    )


def test_chat_prompt_ends_with_an_open_assistant_turn(tiny_tokenizer):
    ids = chat_prompt_ids(tiny_tokenizer, [{"role": "user", "content": "Hi"}])
    text = tiny_tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert tiny_tokenizer.convert_ids_to_tokens(IM_END_ID) == "<|im_end|>"
