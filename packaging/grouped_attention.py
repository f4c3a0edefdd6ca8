"""Grouped-query attention written so the ONNX export never materialises repeated K/V.

transformers' eager and sdpa paths (with a mask) expand the 2 key/value heads of Qwen2.5 to
all query heads (`repeat_kv`) on every step: traced into ONNX, that copies the whole KV cache
7× per token (14 query heads / 2 KV heads in the 0.5B) and dominates decoding at long context.
Here the query heads of a group are stacked along the sequence axis instead, so each KV head
is multiplied once, in place. Registered under the name `tandem_grouped` for export only."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

NAME = "tandem_grouped"


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """softmax(Q Kᵀ·scale + mask) V with query head h reading KV head h // groups, as
    transformers' `repeat_kv` orders them, without expanding K or V."""
    batch, heads, steps, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * steps, dim)
    scores = torch.matmul(q, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :keys].unsqueeze(2)  # [B, 1, 1, T, S]
        scores = (scores.reshape(batch, kv_heads, groups, steps, keys) + mask).reshape(
            batch, kv_heads, groups * steps, keys
        )
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value).reshape(batch, heads, steps, dim)
    return out.transpose(1, 2).contiguous(), None


def _eager_mask(*args, **kwargs) -> torch.Tensor:
    """The additive mask of eager attention, looked up when called: optimum swaps in a
    traceable (vmap-free) version while it exports."""
    return ALL_MASK_ATTENTION_FUNCTIONS["eager"](*args, **kwargs)


def register() -> str:
    AttentionInterface.register(NAME, grouped_attention)
    AttentionMaskInterface.register(NAME, _eager_mask)
    return NAME
