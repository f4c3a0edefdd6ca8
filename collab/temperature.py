"""The rules for what shapes the distribution an answer is sampled from — the temperature and
split's RAPID η — shared by the sampler, the wire protocol and the settings file. No numpy
here: the settings module imports it at start-up."""

from __future__ import annotations

import math

# Below this a temperature is greedy in all but name, and z/T overflows float64 for T near
# the smallest floats (1e-320 turns every logit into ±inf and the softmax into NaN).
MIN_TEMPERATURE = 1e-3


# RAPID's η (docs/math.md#rapid): the paper searches 5–50; past 100 the drafter alone decides.
MAX_ETA = 100.0


def temperature_problem(t: float) -> str | None:
    """Why `t` is not a usable temperature (0 = greedy), or None."""
    if t == 0 or (math.isfinite(t) and t >= MIN_TEMPERATURE):  # NaN fails both
        return None
    return f"temperature must be 0 (greedy) or a finite number ≥ {MIN_TEMPERATURE} (got {t})"


def eta_problem(eta: float) -> str | None:
    """Why `eta` is not a usable RAPID η (0 = exact verification), or None."""
    if 0 <= eta <= MAX_ETA:  # NaN fails
        return None
    return f"eta must be from 0 to {MAX_ETA:g} (got {eta})"
