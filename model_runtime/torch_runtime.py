"""`CausalLM` on PyTorch + transformers, with the same interface as the ONNX Runtime backend.

float32 is the exact reference for tests; bfloat16 is ~2.4× faster on this CPU and, like a
large model on a GPU server, verifies 5–9 tokens for about the cost of one decode step."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from model_runtime.runtime import Cancelled, CausalLM


class _Stop(Exception):
    pass


def _slots(cache: DynamicCache | None) -> int:
    """Cache slots held (0 for a cache no step has filled yet)."""
    return 0 if cache is None or not cache.layers else int(cache.get_seq_length())


class TorchCausalLM(CausalLM):
    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        threads: int | None = None,
        max_context: int | None = None,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, attn_implementation="sdpa"
        ).eval()
        self.dtype = dtype
        self._stop = threading.Event()
        for module in [*self.model.model.layers, self.model.lm_head]:
            module.register_forward_pre_hook(self._check_stop)
        config = self.model.config
        self._cache_obj: DynamicCache | None = None
        limit = int(config.max_position_embeddings)
        super().__init__(int(config.vocab_size), min(limit, max_context or limit))

    def _check_stop(self, module, args) -> None:
        if self._stop.is_set():
            raise _Stop

    # ---- backend hooks ---------------------------------------------------------------------
    def _clear_cache(self, batch_size: int) -> None:
        self._cache_obj = DynamicCache()

    def _truncate_cache(self, slots: int) -> None:
        if self._cache_obj is not None and self._cache_obj.get_seq_length() > slots:
            self._cache_obj.crop(slots)

    def _gather_cache(self, index: np.ndarray) -> None:
        idx = torch.from_numpy(index)
        rows = torch.arange(idx.shape[0])[:, None]
        assert self._cache_obj is not None  # a batch was started (`_clear_cache`)
        for layer in self._cache_obj.layers:
            assert layer.keys is not None and layer.values is not None  # the prompt is in
            layer.keys = layer.keys.transpose(1, 2)[rows, idx].transpose(1, 2).contiguous()
            layer.values = layer.values.transpose(1, 2)[rows, idx].transpose(1, 2).contiguous()

    def _concat_caches(
        self, caches: Sequence[DynamicCache | None], sizes: Sequence[int], pads: Sequence[int]
    ) -> DynamicCache:
        merged = DynamicCache()
        slots = max(pad + _slots(cache) for cache, pad in zip(caches, pads, strict=True))
        if slots == 0:
            return merged
        config = self.model.config
        shape = (config.num_key_value_heads, self._head_dim())
        for layer in range(config.num_hidden_layers):
            keys, values = [], []
            for cache, size, pad in zip(caches, sizes, pads, strict=True):
                if _slots(cache) == 0:
                    empty = torch.zeros((size, shape[0], slots, shape[1]), dtype=self.dtype)
                    keys.append(empty)
                    values.append(empty)
                    continue
                assert cache is not None
                k, v = cache.layers[layer].keys, cache.layers[layer].values
                assert k is not None and v is not None  # filled: it holds slots
                keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)) if pad else k)
                values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)) if pad else v)
            merged.update(torch.cat(keys), torch.cat(values), layer)
        return merged

    def _slice_cache(
        self, start: int, stop: int, lo: int, hi: int, copy: bool = False
    ) -> DynamicCache:  # always a copy (clone)
        part = DynamicCache()
        if hi <= lo or _slots(self._cache_obj) == 0:
            return part
        assert self._cache_obj is not None
        for index, layer in enumerate(self._cache_obj.layers):
            assert layer.keys is not None and layer.values is not None
            part.update(
                layer.keys[start:stop, :, lo:hi].clone(),
                layer.values[start:stop, :, lo:hi].clone(),
                index,
            )
        return part

    def _get_cache(self) -> DynamicCache | None:
        return self._cache_obj

    def _set_cache(self, cache: DynamicCache | None) -> None:
        self._cache_obj = cache

    def _head_dim(self) -> int:
        config = self.model.config
        return int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )

    def _bytes_per_slot(self) -> int:
        config = self.model.config
        itemsize = torch.finfo(self.dtype).bits // 8
        layers, heads = config.num_hidden_layers, config.num_key_value_heads
        return 2 * layers * heads * self._head_dim() * itemsize

    def _cancel_in_flight(self) -> None:
        self._stop.set()

    def _run(
        self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, wanted: np.ndarray
    ) -> np.ndarray:
        assert self._cache_obj is not None  # a batch was started (`_clear_cache`)
        slots = self._cache_obj.get_seq_length()
        self._stop.clear()
        try:
            with torch.inference_mode():
                hidden = self.model.model(
                    input_ids=torch.from_numpy(ids),
                    attention_mask=torch.from_numpy(mask),
                    position_ids=torch.from_numpy(positions),
                    past_key_values=self._cache_obj,
                    use_cache=True,
                ).last_hidden_state
                rows = torch.arange(hidden.shape[0])[:, None]
                logits = self.model.lm_head(hidden[rows, torch.from_numpy(wanted)])
        except _Stop as exc:
            self._truncate_cache(slots)  # layers that ran before the stop appended to the cache
            raise Cancelled("step cancelled") from exc
        finally:
            self._stop.clear()
        return logits.float().numpy()
