"""The logits processor vLLM loads by name in its worker process (`build_vllm_engine`:
`logits_processors`) to verify split drafts inside the engine; the math is
`cloud_backend.vllm_draws`."""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm import SamplingParams as VllmParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from cloud_backend.vllm_draws import KEY, Draws, step_logits

log = logging.getLogger("tandem.cloud")


class VerificationDraws(AdapterLogitsProcessor):
    """vLLM's per-request logits processor for `Draws` (`cloud_backend.vllm_draws`)."""

    @classmethod
    def validate_params(cls, sampling_params: VllmParams) -> None:
        extra = (sampling_params.extra_args or {}).get(KEY)
        if extra is not None:
            Draws.read(extra)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins

    def new_req_logits_processor(self, params: VllmParams) -> Any:
        extra = (params.extra_args or {}).get(KEY)
        if extra is None:
            return None
        draws = Draws.read(extra)

        def apply(output: list[int], logits: torch.Tensor) -> torch.Tensor:
            row = logits.detach().to("cpu", torch.float32).numpy()
            try:
                out = step_logits(row, draws, len(output), output)
            except ValueError:  # cannot happen for what the cloud checked; never kill vLLM
                log.exception("verification draw failed; the raw row is sampled instead")
                return logits
            return torch.from_numpy(out).to(logits.device)

        return apply
