"""Split verification inside vLLM, the math: what its logits processor
(`cloud_backend.vllm_processor`) makes of the model's raw row at a position — the
distribution of that position's verification draw — so vLLM's own sampler draws the verdict
and only a token id comes back (docs/architecture.md#split-on-vllm). No vLLM import here: the
row math is tested where vLLM is not installed.

A request asks for it in `SamplingParams.extra_args[KEY]`, a `Draws` as plain data:

    {"temperature": T, "top_k": k, "top_p": p,
     "steps": [[draft, q_ids, q_probs, eta, coin] or None, ...]}

The request's i-th generated token is drawn at step i: None samples the model's distribution
under (T, top-k, top-p) (the bonus position); a draft draws
`collab.verification.draw_distribution` of that distribution — the same functions the
built-in engine verifies with, on the same float32 logits, in float64. The request itself runs
at temperature 1 with no truncation and no penalty, so vLLM samples exactly what is returned.
Once a generated token differs from its step's draft, the steps after it are moot (their
context holds a correction, not the draft): a cheap one-hot goes back while the caller aborts.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from collab.sampling import SamplingParams, distribution
from collab.variants.base import DraftTarget
from collab.verification import draw_distribution

KEY = "tandem_draws"


class Draws(NamedTuple):
    params: SamplingParams
    steps: list[DraftTarget | None]  # None: the bonus position (no draft)

    def extra_args(self) -> dict[str, Any]:
        """As `SamplingParams.extra_args` (msgspec-serialisable plain data)."""
        steps = [
            None if s is None else [s.draft, s.q_ids.tolist(), s.q_probs.tolist(), s.eta, s.coin]
            for s in self.steps
        ]
        p = self.params
        return {
            KEY: {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "steps": steps}
        }

    @classmethod
    def read(cls, extra: dict[str, Any]) -> Draws:
        """Back from `extra_args` (a ValueError for anything malformed)."""
        params = SamplingParams(
            float(extra["temperature"]), int(extra["top_k"]), float(extra["top_p"])
        )
        steps: list[DraftTarget | None] = []
        for s in extra["steps"]:
            if s is None:
                steps.append(None)
                continue
            draft, ids, probs, eta, coin = s
            steps.append(
                DraftTarget(
                    int(draft),
                    np.asarray(ids, dtype=np.int64),
                    np.asarray(probs, dtype=np.float64),
                    float(eta),
                    bool(coin),
                )
            )
        return cls(params, steps)


def step_logits(row: np.ndarray, draws: Draws, i: int, output: list[int]) -> np.ndarray:
    """What vLLM samples from at the request's i-th generated token, as log-probabilities."""
    if any(
        s is not None and s.draft != t for s, t in zip(draws.steps, output, strict=False)
    ):  # an earlier step was rejected: nothing here is used
        out = np.full(row.shape, -np.inf, dtype=np.float32)
        out[0] = 0.0
        return out
    p = distribution(row, draws.params)
    step = draws.steps[i] if i < len(draws.steps) else None
    if step is not None:
        p = draw_distribution(p, *step)
    with np.errstate(divide="ignore"):
        return np.log(p).astype(np.float32)
