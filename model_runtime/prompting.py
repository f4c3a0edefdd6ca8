"""The chat prompt both sides build, so a question means the same tokens on each.

The device puts private passages in its own prompt only; the cloud puts public passages in
its prompt. The layout (system turn with numbered sources, then the conversation, then the
question) is one function so the sides can never drift apart."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from model_runtime.tokenizer import chat_prompt_ids

SYSTEM = "You are Tandem, a concise and helpful assistant."
GROUNDING = "Use these sources when they are relevant and cite them as [n]:"


@dataclass(frozen=True)
class Passage:
    """A retrieved text shown to a model: its number in the answer is its place in the list."""

    title: str
    location: str
    text: str


def build_messages(
    question: str, history: Sequence[str] = (), passages: Sequence[Passage] = ()
) -> list[dict[str, str]]:
    """System turn (with numbered sources if any), earlier user/assistant turns, the question."""
    if len(history) % 2:
        raise ValueError("history must hold user/assistant pairs")
    system = SYSTEM
    if passages:
        listed = "\n\n".join(
            f"[{i}] {p.title}" + (f" ({p.location})" if p.location else "") + f"\n{p.text}"
            for i, p in enumerate(passages, 1)
        )
        system = f"{SYSTEM}\n\n{GROUNDING}\n\n{listed}"
    messages = [{"role": "system", "content": system}]
    for i in range(0, len(history), 2):
        messages.append({"role": "user", "content": history[i]})
        messages.append({"role": "assistant", "content": history[i + 1]})
    messages.append({"role": "user", "content": question})
    return messages


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    question: str,
    history: Sequence[str] = (),
    passages: Sequence[Passage] = (),
) -> list[int]:
    """Token ids of the whole prompt, ending with the assistant's turn opened."""
    return chat_prompt_ids(tokenizer, build_messages(question, history, passages))
