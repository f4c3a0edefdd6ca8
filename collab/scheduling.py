"""Choosing how to collaborate: draft length, aggregation side, and the estimates they need.

Scalar cost models, one function per equation (docs/math.md#split-verification,
docs/math.md#picospec, docs/math.md#dragon):

- TK-SLT (Top-K Sparse Logits Transmission): speedup S(γ) (eq. 11/15), the closed-form
  optimum γ₀ with the Lambert W function (eq. 21/35), Algorithm 1 (ODLD) and Algorithm 2 (AS²).
- A numeric γ chooser for our link, whose round trip TK-SLT's model leaves out.
- PicoSpec's expected round time of the asynchronous pipeline (eq. 9).
- DRAGON's greedy aggregator scheduler (eq. 6–8) and its profiler (§5.2): least-squares decode
  latency against context length offline, EWMA updates online; its expected acceptance (eq. 5).

Times are in seconds (any unit works if used consistently). numpy only at import; scipy's
Lambert W is imported where the closed-form optimum γ₀ needs it (`tk_slt_gamma0`), so the cost
models load where scipy is not installed (benchmarks/gpu_check.py on a GPU machine)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import overload

import numpy as np

# --------------------------------------------------------------------------------------------
# TK-SLT: closed-form draft length (docs/math.md#split-verification)
# --------------------------------------------------------------------------------------------


def tk_slt_relative_cost(t_vocab: float, t_slm: float, t_llm: float) -> float:
    """Reference only (tests, benchmarks).

    L = b + c with b = T_V/T_LLM, c = T_SLM/T_LLM — TK-SLT eq. (5)–(6).

    T_V is the time to transmit one drafted position's vocabulary payload, T_SLM one draft
    model run, T_LLM one target model run (the verification of a whole round)."""
    if t_llm <= 0:
        raise ValueError("t_llm must be > 0")
    return (t_vocab + t_slm) / t_llm


@overload
def tk_slt_speedup(alpha: float, gamma: float, L: float) -> float: ...
@overload
def tk_slt_speedup(
    alpha: float | np.ndarray, gamma: float | np.ndarray, L: float | np.ndarray
) -> float | np.ndarray: ...
def tk_slt_speedup(
    alpha: float | np.ndarray, gamma: float | np.ndarray, L: float | np.ndarray
) -> float | np.ndarray:
    """Reference only (tests, benchmarks).

    S_inf(γ) = (1 − α^{γ+1}) / ([1 + γL](1 − α)) — TK-SLT Theorem 1, eq. (11)/(15).

    Throughput of distributed speculative decoding relative to the standalone LLM, for a round
    time of (1 + γL)·T_LLM (eq. 7). Evaluated literally in this operation order: Table I's 1*
    marks depend on it at two exact ties (see `tk_slt_optimal_draft_length`)."""
    alpha = np.asarray(alpha, dtype=np.float64)
    gamma = np.asarray(gamma, dtype=np.float64)
    L = np.asarray(L, dtype=np.float64)
    out = (1 - alpha ** (gamma + 1)) / ((1 + gamma * L) * (1 - alpha))
    return float(out) if out.ndim == 0 else out


def _lambertw_m1_of_minus_exp(y: float) -> float:
    """W₋₁(−e^y) for y < −1, also where e^y underflows (very small L).

    Uses scipy's branch −1 when e^y is a normal float (scipy returns NaN for a subnormal
    argument: (α, L) = (0.23, 0.002) gives e^y ≈ 1e-319); otherwise solves w + ln(−w) = y (the
    logarithm of w·e^w = −e^y) by Newton's method from the asymptotic start y − ln(−y)."""
    from scipy.special import lambertw  # here, not at import: see the module's docstring

    arg = -math.exp(y)
    if -arg >= sys.float_info.min:
        w = float(lambertw(arg, k=-1).real)
        if math.isfinite(w):
            return w
    w = y - math.log(-y)
    for _ in range(50):
        step = (w + math.log(-w) - y) / (1 + 1 / w)
        w -= step
        if abs(step) <= 1e-15 * abs(w):
            break
    return w


def tk_slt_gamma0(alpha: float, L: float) -> float:
    """Reference only (tests, benchmarks).

    Real optimum γ₀ = (1/ln α)·[W₋₁(−e⁻¹·α^{1/L−1}) + 1] − 1/L — TK-SLT Theorem 2, eq. (21)/(35).

    The stationary point of S_inf(γ) on the −1 branch of Lambert W (the 0 branch gives γ ≤ −1/L).
    Defined for 0 < α < 1 and 0 < L < 1 (constraints 17 and 19)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError("alpha must be in (0, 1)")
    if not 0.0 < L < 1.0:
        raise ValueError("L = b + c must be in (0, 1) (TK-SLT constraint 19)")
    ln_alpha = math.log(alpha)
    # −e⁻¹·α^{1/L−1} = −exp(y), computed in log space so tiny L does not underflow.
    y = -1.0 + (1.0 / L - 1.0) * ln_alpha
    w = _lambertw_m1_of_minus_exp(y)
    return (w + 1.0) / ln_alpha - 1.0 / L


@dataclass(frozen=True)
class DraftLengthDecision:
    """Reference only (tests, benchmarks).

    γ* with its speedup; use_llm_only is TK-SLT's "1*": speculative decoding would be slower
    than the standalone LLM, so AS² decodes with the LLM alone."""

    gamma: int
    speedup: float
    use_llm_only: bool


def tk_slt_optimal_draft_length(alpha: float, L: float) -> DraftLengthDecision:
    """Reference only (tests, benchmarks).

    Integer γ* by TK-SLT Algorithm 1 (ODLD) plus the AS² decision of Algorithm 2.

    γ* = 1 if γ₀ < 1; otherwise ⌈γ₀⌉ if S(⌊γ₀⌋) ≤ S(⌈γ₀⌉), else ⌊γ₀⌋ (ties go to ⌈γ₀⌉ as in the
    paper). use_llm_only is set when S(γ*) < 1, the rule under which Table I marks 1*.

    Note: Algorithm 2 as printed employs DSD only if S* > 1, i.e. falls back at S* = 1. Table I
    disagrees at the two cells where S(1) = 1 exactly — (α, L) = (0.4, 0.4) is printed "1",
    (0.6, 0.6) "1*". In IEEE-754 eq. (11) evaluates to 1.0 and 0.9999999999999998 there, so the
    table follows the strict S < 1 rule in double precision; we do the same. At S = 1 the two
    choices are equally fast, so nothing real hangs on it.

    L ≥ 1 lies outside the theorem (constraint 19): then S(γ) < 1 for every γ (the mean of
    α⁰..α^γ is below 1 and 1 + γL ≥ 1 + γ), so the answer is γ = 1 with use_llm_only."""
    if not 0.0 < alpha < 1.0:
        raise ValueError("alpha must be in (0, 1)")
    if L <= 0:
        raise ValueError("L must be > 0")
    if L >= 1.0:
        s1 = tk_slt_speedup(alpha, 1, L)
        return DraftLengthDecision(gamma=1, speedup=s1, use_llm_only=True)
    gamma0 = tk_slt_gamma0(alpha, L)
    if gamma0 < 1:
        gamma = 1
    else:
        lo, hi = math.floor(gamma0), math.ceil(gamma0)
        gamma = hi if tk_slt_speedup(alpha, lo, L) <= tk_slt_speedup(alpha, hi, L) else lo
    speedup = tk_slt_speedup(alpha, gamma, L)
    return DraftLengthDecision(gamma=gamma, speedup=speedup, use_llm_only=speedup < 1.0)


# --------------------------------------------------------------------------------------------
# Numeric γ chooser with the round trip (docs/math.md#split-verification, our model)
# --------------------------------------------------------------------------------------------

VerifyCost = float | tuple[float, float] | Callable[[int], float]


def expected_tokens_per_round(
    alpha: float | np.ndarray, gamma: int | np.ndarray
) -> float | np.ndarray:
    """E[#tokens] = (1 − α^{γ+1}) / (1 − α) — Leviathan et al. eq. (1), TK-SLT eq. (12).

    Committed tokens per speculative round (accepted drafts plus the correction/bonus token),
    for i.i.d. acceptance with rate α; γ + 1 at α = 1."""
    alpha = np.asarray(alpha, dtype=np.float64)
    gamma = np.asarray(gamma, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(alpha >= 1.0, gamma + 1, (1 - alpha ** (gamma + 1)) / (1 - alpha))
    return float(out) if out.ndim == 0 else out


def verify_time(t_verify: VerifyCost, gamma: int) -> float:
    """T_verify(γ) from a constant, an (intercept, per-token slope) pair a + b·γ, or a callable."""
    if callable(t_verify):
        return float(t_verify(gamma))
    if isinstance(t_verify, tuple):
        a, b = t_verify
        return float(a + b * gamma)
    return float(t_verify)


def speculative_round_time(
    gamma: int,
    *,
    t_draft: float,
    t_rtt: float,
    t_verify: VerifyCost,
    t_uplink_per_token: float = 0.0,
) -> float:
    """Synchronous round time γ·(T_draft + T_up) + T_RTT + T_verify(γ).

    TK-SLT eq. (4) with the network round trip added (PicoSpec eq. 1/6 has the same shape):
    t_draft is one device draft step, t_uplink_per_token the payload time of one drafted
    position (TK-SLT's T_V), t_rtt the fixed round-trip latency of the link."""
    return gamma * (t_draft + t_uplink_per_token) + t_rtt + verify_time(t_verify, gamma)


@dataclass(frozen=True)
class GammaChoice:
    """Best γ under the measured cost model, its throughput, and the AS² decision."""

    gamma: int
    tokens_per_second: float
    cloud_only_tokens_per_second: float
    use_cloud_only: bool

    @property
    def speedup(self) -> float:
        return self.tokens_per_second / self.cloud_only_tokens_per_second


def choose_draft_length(
    alpha: float,
    *,
    t_draft: float,
    t_rtt: float,
    t_verify: VerifyCost,
    t_cloud_step: float,
    t_cloud_network: float = 0.0,
    t_uplink_per_token: float = 0.0,
    gamma_max: int = 16,
    pipelined: bool = False,
) -> GammaChoice:
    """argmax over γ ∈ {1..γ_max} of E[#tokens](γ) / round time(γ), with AS² fallback.

    `pipelined`: PicoSpec's pipeline (docs/math.md#picospec), whose rounds cost eq. (9)
    (:func:`picospec_expected_round_time`, drafting overlapping the round trip when a batch is
    accepted whole) and commit (1 − α^γ)/(1 − α) tokens: a batch accepted whole has no bonus
    token, the next batch's first draft is checked against that position instead.

    Tokens/s of split speculative decoding = (1 − α^{γ+1})/(1 − α) over
    γ·(t_draft + t_uplink_per_token) + t_rtt + T_verify(γ) — TK-SLT eq. (12)–(13) generalised
    with a round trip and a γ-dependent verification cost, maximised numerically. It is compared
    with cloud-only decoding, 1/(t_cloud_step + t_cloud_network) tokens/s (t_cloud_network is the
    per-token network cost of streaming from the cloud), as TK-SLT Algorithm 2 (AS²) compares
    with the standalone LLM: use_cloud_only when the best speculative rate is below the
    cloud-only rate (the S < 1 rule of Table I).

    With t_rtt = 0, t_cloud_network = 0, t_verify = t_cloud_step = T_LLM and
    t_draft + t_uplink_per_token = (b + c)·T_LLM this is exactly TK-SLT's model, and the result
    agrees with `tk_slt_optimal_draft_length` (integer ties go to the smaller γ here)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError("alpha must be in [0, 1]")
    if gamma_max < 1:
        raise ValueError("gamma_max must be ≥ 1")
    if t_cloud_step + t_cloud_network <= 0:
        raise ValueError("cloud-only time per token must be > 0")
    gammas = np.arange(1, gamma_max + 1)
    if pipelined:
        tokens = expected_tokens_per_round(alpha, gammas - 1)
        times = np.array(
            [
                picospec_expected_round_time(
                    alpha,
                    int(g),
                    int(g) * (t_draft + t_uplink_per_token),
                    t_rtt,
                    verify_time(t_verify, int(g)),
                )
                for g in gammas
            ]
        )
    else:
        tokens = expected_tokens_per_round(alpha, gammas)
        times = np.array(
            [
                speculative_round_time(
                    int(g),
                    t_draft=t_draft,
                    t_rtt=t_rtt,
                    t_verify=t_verify,
                    t_uplink_per_token=t_uplink_per_token,
                )
                for g in gammas
            ]
        )
    if np.any(times <= 0):
        raise ValueError("round times must be > 0")
    rates = tokens / times
    best = int(np.argmax(rates))
    cloud_rate = 1.0 / (t_cloud_step + t_cloud_network)
    return GammaChoice(
        gamma=int(gammas[best]),
        tokens_per_second=float(rates[best]),
        cloud_only_tokens_per_second=cloud_rate,
        use_cloud_only=bool(rates[best] < cloud_rate),
    )


# --------------------------------------------------------------------------------------------
# PicoSpec (docs/math.md#picospec)
# --------------------------------------------------------------------------------------------


def picospec_expected_round_time(
    alpha: float | np.ndarray,
    gamma: int | np.ndarray,
    t_draft: float | np.ndarray,
    t_rtt: float | np.ndarray,
    t_verify: float | np.ndarray,
) -> float | np.ndarray:
    """E[T_async] = α^γ·max(T_draft, T_RTT + T_verify) + (1 − α^γ)(T_draft + T_RTT + T_verify)
    — PicoSpec eq. (9).

    With probability α^γ the whole batch is accepted and the pre-drafted next batch is valid, so
    drafting overlaps the round trip (eq. 2); otherwise the pipeline is flushed and the round is
    serial (eq. 1). Here T_draft is the time to draft all γ tokens of a batch (PicoSpec §3), not
    one step."""
    alpha = np.asarray(alpha, dtype=np.float64)
    hit = alpha ** np.asarray(gamma, dtype=np.float64)
    t_draft = np.asarray(t_draft, dtype=np.float64)
    remote = np.asarray(t_rtt, dtype=np.float64) + np.asarray(t_verify, dtype=np.float64)
    out = hit * np.maximum(t_draft, remote) + (1 - hit) * (t_draft + remote)
    return float(out) if out.ndim == 0 else out


# --------------------------------------------------------------------------------------------
# DRAGON: profiler (docs/math.md#dragon)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearLatencyFit:
    """Decode latency model ĉ_dec(t) = intercept + slope·t, t the context length."""

    intercept: float
    slope: float

    def predict(self, context_length: float | np.ndarray) -> float | np.ndarray:
        out = self.intercept + self.slope * np.asarray(context_length, dtype=np.float64)
        return float(out) if out.ndim == 0 else out


def fit_decode_latency(context_lengths: np.ndarray, latencies: np.ndarray) -> LinearLatencyFit:
    """Least-squares fit of decode latency against context length — DRAGON §5.2 (offline stage).

    Solves min ‖[1, t]·[k_c, k]ᵀ − c_dec(t)‖² with numpy.linalg.lstsq over the profiled steps."""
    t = np.asarray(context_lengths, dtype=np.float64).ravel()
    c = np.asarray(latencies, dtype=np.float64).ravel()
    if t.size != c.size or t.size < 2:
        raise ValueError("need at least two (context length, latency) pairs of equal count")
    design = np.column_stack([np.ones_like(t), t])
    (intercept, slope), *_ = np.linalg.lstsq(design, c, rcond=None)
    return LinearLatencyFit(intercept=float(intercept), slope=float(slope))


def verify_line(samples: Iterable[tuple[int, float]], rows: int) -> float:
    """The verifier's compute for `rows` positions from measured passes (rows, seconds): a line
    a + b·rows through the median time of each size seen (medians: a cold first pass must not
    skew it); with one size seen so far, half fixed and half proportional (between memory- and
    compute-bound); 0 before any."""
    groups: dict[int, list[float]] = {}
    for r, t in samples:
        groups.setdefault(r, []).append(t)
    if not groups:
        return 0.0
    x = np.array(sorted(groups), dtype=np.float64)
    y = np.array([np.median(groups[int(r)]) for r in x])
    if x.size == 1:
        return float(0.5 * y[0] + 0.5 * y[0] / x[0] * rows)
    b, a = np.polyfit(x, y, 1)
    return float(max(a + b * rows, 1e-4))


def ewma_update(old: float | None, new: float, weight: float) -> float:
    """(1 − ω)·old + ω·new — the moving average of DRAGON §5.2; the first sample initialises."""
    if old is None:
        return float(new)
    return (1.0 - weight) * old + weight * float(new)


@dataclass
class DecodeSlopeEstimator:
    """Online decode-latency slope with the intercept frozen — DRAGON §5.2 (runtime stage).

    ĉ_dec(t) = k_c + (k_a / k_b)·t with k_a ← (1 − ω)k_a + ω(c̃(t) − k_c)·t and
    k_b ← (1 − ω)k_b + ω·t²: an exponentially weighted least-squares slope through the frozen
    intercept k_c. Started from an offline fit with k_b = mean(t²) of the profiled steps and
    k_a = slope·k_b, so the first prediction equals the offline one."""

    intercept: float
    k_a: float
    k_b: float
    weight: float = 0.1

    @classmethod
    def from_fit(
        cls, fit: LinearLatencyFit, context_lengths: np.ndarray, weight: float = 0.1
    ) -> DecodeSlopeEstimator:
        k_b = float(np.mean(np.square(np.asarray(context_lengths, dtype=np.float64))))
        return cls(intercept=fit.intercept, k_a=fit.slope * k_b, k_b=k_b, weight=weight)

    @property
    def slope(self) -> float:
        return self.k_a / self.k_b

    def update(self, context_length: float, latency: float) -> float:
        """Fold in one measured decode time at context length t; returns the new slope."""
        w, t = self.weight, float(context_length)
        self.k_a = (1 - w) * self.k_a + w * (float(latency) - self.intercept) * t
        self.k_b = (1 - w) * self.k_b + w * t * t
        return self.slope

    def predict(self, context_length: float) -> float:
        return self.intercept + self.slope * float(context_length)


@dataclass
class OnlineProfiler:
    """Reference only (tests, benchmarks).

    Runtime estimates for the schedulers, by EWMA with weight ω on each new observation.

    - decode[side]: `DecodeSlopeEstimator` per side (DRAGON §5.2), fed the decode time each draft
      message carries.
    - rtt: application-level ping round trips (seconds); DRAGON uses ICMP ping, we ping on the
      protocol connection so the estimate includes framing and the event loop.
    - bandwidth[direction]: bytes/s, one sample per frame = frame bytes / (receive time − send
      time − rtt/2) where the caller can time a frame; DRAGON uses iperf3.
    - acceptance[side]: EWMA of the 0/1 event "this side's draft equals the target token" —
      the quantity of DRAGON eq. (5), coin included. Not "the draft survived its own Sample":
      when both drafts survive and differ, the coin makes only one of them the target, so the
      survival rate overstates acceptance by up to 2×, and eq. (7) is about rollbacks.
    """

    weight: float = 0.1
    decode: dict[str, DecodeSlopeEstimator] = field(default_factory=dict)
    rtt: float | None = None
    bandwidth: dict[str, float] = field(default_factory=dict)
    acceptance: dict[str, float] = field(default_factory=dict)

    def update_decode(self, side: str, context_length: float, latency: float) -> float:
        """New slope for side after one measured decode step (needs `decode[side]` set)."""
        return self.decode[side].update(context_length, latency)

    def update_rtt(self, rtt: float) -> float:
        self.rtt = ewma_update(self.rtt, rtt, self.weight)
        return self.rtt

    def update_bandwidth(self, direction: str, nbytes: int, seconds: float) -> float:
        """Fold in one frame of nbytes that took `seconds` to transfer (latency excluded)."""
        if seconds <= 0:
            raise ValueError("transfer time must be > 0")
        value = ewma_update(self.bandwidth.get(direction), nbytes / seconds, self.weight)
        self.bandwidth[direction] = value
        return value

    def update_acceptance(self, side: str, draft_became_target: bool | float) -> float:
        value = ewma_update(self.acceptance.get(side), float(draft_became_target), self.weight)
        self.acceptance[side] = value
        return value

    def transmission_delay(self, nbytes_by_direction: dict[str, int]) -> float:
        """c^l_trans + c^r_trans = (L^l + L^r) + Σ g/B — DRAGON §5.2, ĉ_trans(g) = L + g/B, with the
        two one-way latencies measured together as the round trip."""
        if self.rtt is None:
            raise ValueError("no RTT measured yet")
        return self.rtt + sum(g / self.bandwidth[d] for d, g in nbytes_by_direction.items())
