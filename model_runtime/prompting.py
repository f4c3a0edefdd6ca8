"""The chat prompt both sides build, so a question means the same tokens on each.

The device puts private passages in its own prompt only; the cloud puts public passages in
its prompt. The layout is one function so the sides can never drift apart: the system turn,
the conversation, the numbered sources in a system turn of their own, the question. The
sources sit after the conversation, not in the first turn, so that a conversation's next
prompt extends the last one's up to them and its KV is reused (docs/architecture.md#kv-reuse);
DRAGON's per-document prompts keep theirs in the first turn, which makes [instructions;
document] a cacheable prefix."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from collab.sources import Source
from model_runtime.tokenizer import chat_prompt_ids, chat_turn_ids

SYSTEM = "You are Tandem, a concise and helpful assistant."
GROUNDING = "Use these sources when they are relevant and cite them as [n]:"


def build_messages(
    question: str,
    history: Sequence[str] = (),
    passages: Sequence[Source] = (),
    sources_in_system: bool = False,
) -> list[dict[str, str]]:
    """System turn, earlier user/assistant turns, the numbered sources if any in a system
    turn of their own, the question. With `sources_in_system` the sources close the first
    system turn instead (DRAGON's per-document prompts: a cacheable prefix)."""
    if len(history) % 2:
        raise ValueError("history must hold user/assistant pairs")
    sources = ""
    if passages:
        listed = "\n\n".join(
            f"[{p.number or i}] {p.heading}\n{p.text}" for i, p in enumerate(passages, 1)
        )
        sources = f"{GROUNDING}\n\n{listed}"
    first = f"{SYSTEM}\n\n{sources}" if sources and sources_in_system else SYSTEM
    messages = [{"role": "system", "content": first}]
    for i in range(0, len(history), 2):
        messages.append({"role": "user", "content": history[i]})
        messages.append({"role": "assistant", "content": history[i + 1]})
    if sources and not sources_in_system:
        messages.append({"role": "system", "content": sources})
    messages.append({"role": "user", "content": question})
    return messages


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    question: str,
    history: Sequence[str] = (),
    passages: Sequence[Source] = (),
    budget: int | None = None,
) -> list[int]:
    """Token ids of the whole prompt, ending with the assistant's turn opened (within
    `budget` tokens if given: see `fit_prompt`)."""
    return fit_prompt(tokenizer, question, history, passages, budget)[0]


def fit_prompt(
    tokenizer: PreTrainedTokenizerBase,
    question: str,
    history: Sequence[str] = (),
    passages: Sequence[Source] = (),
    budget: int | None = None,
    sources_in_system: bool = False,
) -> tuple[list[int], int]:
    """(prompt ids, earlier exchanges left out). A long conversation must not end the chat:
    the oldest user/assistant pairs are left out until the prompt fits `budget` tokens. The
    system turn, the passages and the question always stay; if they alone overflow, the
    runtime refuses the prompt with a plain error."""

    def ids_with(kept: Sequence[str]) -> list[int]:
        return chat_prompt_ids(
            tokenizer, build_messages(question, kept, passages, sources_in_system)
        )

    ids = ids_with(history)
    pairs = len(history) // 2
    if budget is None or len(ids) <= budget or pairs == 0:
        return ids, 0
    # The prompt only shrinks as pairs are dropped: binary search the fewest to drop.
    best = (ids_with(()), pairs)
    lo, hi = 1, pairs - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = ids_with(history[2 * mid :])
        if len(trial) <= budget:
            best, hi = (trial, mid), mid - 1
        else:
            lo = mid + 1
    return best


def prompt_budget(max_context: int, max_new_tokens: int) -> int:
    """Tokens a prompt may take: the context less room for the answer, but never less than
    half the context (an answer longer than that is cut at the context's end anyway)."""
    return max(max_context - max_new_tokens, max_context // 2)


def stable_prefix(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], first_turn: str) -> int:
    """How many of `ids` are the chat's first turn (`first_turn`'s text, closed), tokenised
    on its own: the turn ends at a special token, so the tokens before it cannot merge with
    what follows and are the same whatever the rest of the prompt is. 0 if they differ."""
    turn = chat_turn_ids(tokenizer, [{"role": "system", "content": first_turn}])
    return len(turn) if list(ids[: len(turn)]) == turn else 0


def document_prompt(
    tokenizer: PreTrainedTokenizerBase,
    question: str,
    history: Sequence[str],
    passage: Source | None,
    budget: int,
) -> tuple[list[int], int, int]:
    """(ids, exchanges left out, stable prefix length) of one document's prompt [d; history;
    question] for per-document decoding (DRAGON), the passage clipped to fit
    (`clipped_prompt`). ids[:stable] is the first turn, [instructions; the numbered document],
    the same whatever the question: its KV can be cached and reused exactly. (The number is
    the document's rank, so it stays in the prefix: moved to a turn of its own, after the
    document, the 0.5B answered a bare "[3]" to 4 of 32 questions it had answered right,
    docs/benchmarks/dragon.md#caches.)"""
    ids, dropped, used = _clipped(
        tokenizer, question, history, [passage] if passage else [], budget, sources_in_system=True
    )
    first = build_messages(question, (), used, sources_in_system=True)[0]["content"]
    return ids, dropped, stable_prefix(tokenizer, ids, first)


def clipped_prompt(
    tokenizer: PreTrainedTokenizerBase,
    question: str,
    history: Sequence[str],
    passages: Sequence[Source],
    budget: int,
) -> tuple[list[int], int]:
    """(ids, exchanges left out) of the prompt with `passages`; passages too long for the
    budget are clipped (each keeps its start, all by the same share) until the prompt fits,
    rather than refused: a context budget limits how much retrieved text a prompt holds."""
    ids, dropped, _ = _clipped(tokenizer, question, history, passages, budget)
    return ids, dropped


def _clipped(
    tokenizer: PreTrainedTokenizerBase,
    question: str,
    history: Sequence[str],
    passages: Sequence[Source],
    budget: int,
    sources_in_system: bool = False,
) -> tuple[list[int], int, Sequence[Source]]:
    """`clipped_prompt`, and the passages as clipped."""
    ids, dropped = fit_prompt(tokenizer, question, history, passages, budget, sources_in_system)
    while len(ids) > budget and any(len(p.text) > 40 for p in passages):
        share = 1 - (len(ids) - budget) / max(len(ids), 1)
        passages = [p.clipped(max(40, int(len(p.text) * share) - 40)) for p in passages]
        ids, dropped = fit_prompt(tokenizer, question, history, passages, budget, sources_in_system)
    return ids, dropped, passages
