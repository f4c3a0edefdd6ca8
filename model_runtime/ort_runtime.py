"""`CausalLM` on ONNX Runtime, for models exported by `tandem models prepare` (optimum,
task text-generation-with-past)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from model_runtime.runtime import Cancelled, CausalLM


def session_options(threads: int | None = None, allow_spinning: bool = True) -> ort.SessionOptions:
    """Spinning intra-op threads cut latency for one session but make two sessions sharing
    the cores fight (docs/models.md#models); turn it off when the device and cloud share a
    machine."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads or os.cpu_count() or 1
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    return opts


class OrtCausalLM(CausalLM):
    """ONNX Runtime backend, for graphs whose lm_head runs only at the positions asked for
    (`logits_positions`, added at export). With `io_binding` the KV cache stays in ORT-owned
    buffers from one step to the next (no copy into numpy and back per token);
    `io_binding=False` uses plain `session.run`, kept to measure the difference."""

    def __init__(
        self,
        model_dir: str | Path,
        threads: int | None = None,
        allow_spinning: bool = True,
        io_binding: bool = True,
        max_context: int | None = None,
    ) -> None:
        model_dir = Path(model_dir)
        self.model_dir = model_dir
        self.session = ort.InferenceSession(
            str(model_dir / "model.onnx"),
            session_options(threads, allow_spinning),
            providers=["CPUExecutionProvider"],
        )
        self.io_binding = io_binding
        inputs = {i.name: i for i in self.session.get_inputs()}
        self._past_names = [n for n in inputs if n.startswith("past_key_values.")]
        self._present_names = [n.replace("past_key_values.", "present.") for n in self._past_names]
        first = inputs[self._past_names[0]]
        self._kv_heads, self._head_dim = int(first.shape[1]), int(first.shape[3])
        self._kv_dtype = np.float16 if "float16" in first.type else np.float32
        self._has_positions = "position_ids" in inputs
        if "logits_positions" not in inputs:
            raise ValueError(
                f"{model_dir} was not exported by `tandem models prepare` (no logits_positions "
                "input); run `tandem models prepare` again"
            )
        config = json.loads((model_dir / "config.json").read_text())
        vocab = int(self.session.get_outputs()[0].shape[-1])
        limit = int(config.get("max_position_embeddings", 32768))
        self._run_options: ort.RunOptions | None = None
        self._cache: list = []
        self._run_lock = threading.Lock()
        super().__init__(vocab, min(limit, max_context or limit))

    @property
    def num_layers(self) -> int:
        return len(self._past_names) // 2

    # ---- backend hooks ---------------------------------------------------------------------
    def _clear_cache(self, batch_size: int) -> None:
        empty = np.zeros((batch_size, self._kv_heads, 0, self._head_dim), dtype=self._kv_dtype)
        self._cache = [empty] * len(self._past_names)

    def _truncate_cache(self, slots: int) -> None:
        self._cache = [np.ascontiguousarray(_as_numpy(v)[:, :, :slots]) for v in self._cache]

    def _gather_cache(self, index: np.ndarray) -> None:
        rows = np.arange(index.shape[0])[:, None]
        self._cache = [
            np.ascontiguousarray(
                _as_numpy(v).transpose(0, 2, 1, 3)[rows, index].transpose(0, 2, 1, 3)
            )
            for v in self._cache
        ]

    def _concat_caches(
        self, caches: Sequence[list], sizes: Sequence[int], pads: Sequence[int]
    ) -> list:
        widths = ((0, 0), (0, 0))
        return [
            np.concatenate(
                [
                    np.pad(_as_numpy(cache[i]), (*widths, (pad, 0), (0, 0)))
                    for cache, pad in zip(caches, pads, strict=True)
                ]
            )
            for i in range(len(self._past_names))
        ]

    def _slice_cache(self, start: int, stop: int, lo: int, hi: int, copy: bool = False) -> list:
        # OrtValue.numpy() is a view of ORT's buffer, and a contiguous slice of it stays one
        take = np.array if copy else np.ascontiguousarray
        return [take(_as_numpy(v)[start:stop, :, lo:hi]) for v in self._cache]

    def _get_cache(self) -> list:
        return self._cache

    def _set_cache(self, cache: list) -> None:
        self._cache = cache

    def _bytes_per_slot(self) -> int:
        return (
            len(self._past_names)
            * self._kv_heads
            * self._head_dim
            * np.dtype(self._kv_dtype).itemsize
        )

    def _cancel_in_flight(self) -> None:
        if self._run_options is not None:
            self._run_options.terminate = True

    def _run(
        self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, wanted: np.ndarray
    ) -> np.ndarray:
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self._has_positions:
            feeds["position_ids"] = positions
        feeds["logits_positions"] = wanted
        options = ort.RunOptions()
        with self._run_lock:
            with self._cancel_lock:
                self._run_options = options
            try:
                if self.io_binding:
                    logits, cache = self._run_bound(feeds, options)
                else:
                    outputs = self.session.run(
                        ["logits", *self._present_names],
                        {**feeds, **dict(zip(self._past_names, self._cache, strict=True))},
                        options,
                    )
                    logits, cache = outputs[0], outputs[1:]
            except Exception as exc:
                if options.terminate:
                    raise Cancelled("step cancelled") from exc
                raise
            finally:
                with self._cancel_lock:
                    self._run_options = None
        self._cache = cache
        return logits

    def _run_bound(self, feeds: dict, options: ort.RunOptions):
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name, value in zip(self._past_names, self._cache, strict=True):
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, value)
        binding.bind_output("logits", "cpu")
        for name in self._present_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding, options)
        outputs = binding.get_outputs()
        return outputs[0].numpy(), list(outputs[1:])


def _as_numpy(value) -> np.ndarray:
    return value.numpy() if isinstance(value, ort.OrtValue) else value
