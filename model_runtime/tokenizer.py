"""Loading the Qwen2.5 tokenizer saved by `tandem models prepare`, and the chat prompt."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# Qwen2.5's end-of-turn token. Generation stops here, not at `tokenizer.eos_token`
# (<|endoftext|>, 151643), which an instruct model rarely emits (docs/models.md#models).
IM_END_ID = 151645


class _DropSpuriousRegexWarning(logging.Filter):
    """transformers 4.57 warns about an "incorrect regex pattern" for every saved local
    tokenizer. For Qwen it is spurious: the saved tokenizer.json carries Qwen2's own split
    regex, and ids match the GGUF tokenizer (tests/test_tokenizer.py proves it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "incorrect regex pattern" not in record.getMessage()


@contextmanager
def quiet_spurious_regex_warning() -> Iterator[None]:
    """Silence only that warning, while loading tokenizers (ours or a library's)."""
    log = logging.getLogger("transformers.tokenization_utils_base")
    regex_filter = _DropSpuriousRegexWarning()
    log.addFilter(regex_filter)
    try:
        yield
    finally:
        log.removeFilter(regex_filter)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a saved tokenizer. `fix_mistral_regex=False`, never True: True swaps in
    Mistral's pre-tokenizer and breaks Qwen's ids."""
    with quiet_spurious_regex_warning():
        return AutoTokenizer.from_pretrained(str(path), fix_mistral_regex=False)


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
) -> list[int]:
    """Token ids of a chat (the model's own template) ending with the assistant's turn opened."""
    # return_dict=False: transformers 5 (the vLLM cloud's) returns a dict by default
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def chat_turn_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of chat turns as the template writes them, closed, with no turn opened after
    (a prompt's first turns, to find where they end in the whole prompt's ids)."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=True, return_dict=False
    )
    return list(ids)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the id→token map (vocabulary and added tokens): two models can share
    drafts and distributions only if this is equal."""
    import hashlib
    import json

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
