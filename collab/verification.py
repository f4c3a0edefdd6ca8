"""The decoding math of every collaborative mode, one function per equation (docs/math.md#math).

All distributions are 1-D float64 numpy arrays over the vocabulary V (rows of 2-D arrays for a
round of γ positions). Everything is vectorised over V; the only Python loops run over the γ
positions of a round. Randomness always comes from the caller's ``numpy.random.Generator``, so
device and cloud are reproducible at a fixed seed.

Exactness rule (docs/math.md#speculative-verification): a draft must be sampled from *exactly* the
q the verifier uses.
The verifiers here take that q as given; the functions that read q from the wire
(:func:`dssd_cloud_verify`, :func:`tkslt_cloud_verify`) refuse drafts that q could not have
produced (q(x) = 0) with ``ValueError``.

Known errors in the sources that are *not* repeated here (docs/math.md#errors-in-the-papers): DSSD
tests
min(1, q/p) — we test min(1, p/q); DSSD resamples from raw logits and keeps drafts after a
rejection — we resample from probabilities and stop at the first rejection; RAPID's claim that
η > 0 preserves p is false — :func:`rapid_verify_one` is exact only for η = 0; DRAGON without
its fair coin is biased — :func:`speculative_aggregation` always flips it.
"""

from __future__ import annotations

import math

import numpy as np

from collab.sampling import GREEDY, distribution, sample_from, softmax, top_candidates

# A residual whose total mass is at most this is treated as empty (p == q up to rounding). Its
# mass is exactly the rejection probability Σ max(0, p − q), so a rejection that needs it is
# (almost) impossible, and falling back to p costs at most this much total variation.
_EMPTY_MASS = 1e-12

# RAPID eq. (9) as restated in docs/math.md#rapid: the logit shift applies only where q ≥ 0.1·max q.
RAPID_MASK_FRACTION = 0.1


# ---------------------------------------------------------------------------------------------
# 5.1 Standard speculative verification (Leviathan et al. 2023; Chen et al. 2023)
# ---------------------------------------------------------------------------------------------


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p − q)): the distribution a rejected position is resampled from.

    Leviathan et al. 2023 / Chen et al. 2023, restated as RAPID eq. (2) and in DSSD §2.1
    ("Resample"). When p == q (up to rounding) the residual is empty and a rejection cannot
    happen; p itself is returned so callers never divide by zero."""
    p = np.asarray(p, dtype=np.float64)
    r: np.ndarray = np.maximum(p - np.asarray(q, dtype=np.float64), 0.0)
    mass: float = r.sum()
    if not mass > _EMPTY_MASS:
        return p / float(p.sum())
    return r / mass


def accept_probability(p_x: float, q_x: float) -> float:
    """min(1, p(x)/q(x)), the acceptance probability of draft x (p over q, not q over p).

    Leviathan et al. 2023 Algorithm 1; RAPID eq. (1)/(5). The DSSD paper (§2.1 footnote 3 and
    Algorithm 2) writes min(1, q/p), which is wrong (docs/math.md#errors-in-the-papers). A draft
    with q(x) = 0 cannot
    have been sampled from q (docs/math.md#speculative-verification): accepting it "in the limit"
    would let any token
    through, so it is a ValueError, as is a p(x) or q(x) that is not a probability (NaN too)."""
    if not (0.0 < q_x < math.inf):
        raise ValueError(f"a sampled draft has q(x) > 0, got {q_x}")
    if not (0.0 <= p_x < math.inf):
        raise ValueError(f"p(x) must be a probability, got {p_x}")
    return min(1.0, p_x / q_x)


def verify_one(x: int, p: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> tuple[bool, int]:
    """Verify one draft x ~ q against target p: accept with min(1, p(x)/q(x)), otherwise sample
    norm(max(0, p − q)). The returned token is distributed exactly as p.

    Leviathan et al. 2023 Algorithm 1 / Chen et al. 2023; RAPID eqs. (1)–(2);
    docs/math.md#speculative-verification.
    Returns (accepted, token) with token == x when accepted."""
    if rng.random() < accept_probability(float(p[x]), float(q[x])):
        return True, int(x)
    return False, sample_from(residual(p, q), rng)


def speculative_round(
    drafts: np.ndarray, P: np.ndarray, Q: np.ndarray, rng: np.random.Generator
) -> tuple[int, int]:
    """One multi-token speculative round: verify drafts x_1..x_γ left to right, stop at the first
    rejection (the later drafts are dropped) and return its resampled token; if all γ are
    accepted, return a bonus token sampled from P[γ].

    Leviathan et al. 2023 Algorithm 1; DSSD Algorithm 1 (with p/q,
    docs/math.md#errors-in-the-papers); docs/math.md#speculative-verification.
    P has γ+1 rows (row γ is the bonus position), Q has γ rows.
    Returns (n_accepted, next_token): the output is drafts[:n_accepted] + [next_token]."""
    drafts = np.asarray(drafts)
    gamma = drafts.shape[0]
    if P.shape[0] != gamma + 1 or Q.shape[0] != gamma:
        raise ValueError(f"need γ+1 = {gamma + 1} rows of P and γ = {gamma} rows of Q")
    for i in range(gamma):
        accepted, token = verify_one(int(drafts[i]), P[i], Q[i], rng)
        if not accepted:
            return i, token
    return gamma, sample_from(P[gamma], rng)


# ---------------------------------------------------------------------------------------------
# 5.2 Split verification: DSD, DSSD, TK-SLT, PicoSpec top-K downlink
# ---------------------------------------------------------------------------------------------


def dsd_round(
    drafts: np.ndarray, P: np.ndarray, Q: np.ndarray, rng: np.random.Generator
) -> tuple[int, int]:
    """DSD: the device uplinks tokens and the dense Q_1..Q_γ; the cloud runs the standard round.

    DSSD paper §2.1 and Algorithm 1 (DSD baseline), with the acceptance p/q
    (docs/math.md#errors-in-the-papers);
    docs/math.md#split-verification. Returns (n_accepted, next_token) as
    :func:`speculative_round`."""
    return speculative_round(drafts, P, Q, rng)


def dssd_cloud_verify(
    drafts: np.ndarray, q_of_drafts: np.ndarray, P: np.ndarray, rng: np.random.Generator
) -> tuple[int, int | None, int | None]:
    """DSSD cloud side: accept x_j while r_j < min(1, p_j(x_j)/q_j(x_j)), knowing only the
    uplinked scalars q_j(x_j); on full acceptance sample the bonus token from P[γ].

    DSSD §3 and Algorithm 2 ("Verification Process, Edge"), with p over q (the paper swaps
    them, docs/math.md#errors-in-the-papers); docs/math.md#split-verification. Returns (n_accepted,
    bonus, rejected_index): on a rejection
    at j, (j, None, j) and the cloud downlinks (j, P[j]) for :func:`dssd_device_resample`; on
    full acceptance, (γ, bonus token, None). Raises ValueError on a q(x) outside (0, 1]."""
    drafts = np.asarray(drafts)
    q_of_drafts = np.asarray(q_of_drafts, dtype=np.float64)
    gamma = drafts.shape[0]
    if q_of_drafts.shape != (gamma,) or P.shape[0] != gamma + 1:
        raise ValueError(f"need γ = {gamma} values q(x) and γ+1 rows of P")
    if not np.all((q_of_drafts > 0.0) & (q_of_drafts <= 1.0)):
        raise ValueError("q(x) of a sampled draft must lie in (0, 1]")
    for j in range(gamma):
        if not rng.random() < accept_probability(float(P[j, int(drafts[j])]), q_of_drafts[j]):
            return j, None, j
    return gamma, sample_from(P[gamma], rng), None


def dssd_device_resample(P_j: np.ndarray, Q_j: np.ndarray, rng: np.random.Generator) -> int:
    """DSSD device side: after a rejection at j, sample norm(max(0, P_j − Q_j)) with the device's
    own Q_j, in probability space at the same temperature (never from raw logits,
    docs/math.md#errors-in-the-papers).

    DSSD §3 ("Verification Process (on Device)") and Algorithm 2;
    docs/math.md#split-verification."""
    return sample_from(residual(P_j, Q_j), rng)


def top_k_truncate(q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference only (tests, benchmarks).

    Keep the K most likely tokens of q and renormalise: the TK-SLT draft distribution
    (equivalently, softmax over the K largest logits).

    TK-SLT Solution 1 (§III) and eq. (9)'s Y^(K); docs/math.md#split-verification. Returns (ids,
    probs), ids as
    int64 sorted by descending probability. If the probabilities are quantised for the wire,
    quantise *before* sampling so both sides use the same numbers."""
    q = np.asarray(q, dtype=np.float64)
    if k < 1:
        raise ValueError("k must be ≥ 1")
    k = min(int(k), q.size)
    cand = top_candidates(q, need=k)
    ids = cand[np.argsort(-q[cand], kind="stable")[:k]].astype(np.int64)
    probs = q[ids]
    return ids, probs / probs.sum()


def sample_draft_top_k(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    """Reference only (tests, benchmarks).

    Sample a draft from the transmitted top-K distribution itself, so that the q the cloud
    rebuilds is exactly the draft distribution (docs/math.md#speculative-verification's rule).

    TK-SLT Solution 1 (§III), drafting from Y^(K) of eq. (9); docs/math.md#split-verification."""
    return int(ids[sample_from(np.asarray(probs, dtype=np.float64), rng)])


def dense_from_top_k(ids: np.ndarray, probs: np.ndarray, vocab_size: int) -> np.ndarray:
    """Rebuild the dense draft distribution from transmitted (id, prob) pairs, renormalised the
    way :func:`collab.sampling.sample_from` normalises when the device samples from them.

    TK-SLT §III (the LLM side of Solution 1); docs/math.md#split-verification. ids/probs are [K]
    (one position,
    returns [V]) or [γ, K] (returns [γ, V]). Raises ValueError on ids outside the vocabulary,
    duplicate ids within a position, or negative/non-finite/all-zero probabilities."""
    ids = np.asarray(ids, dtype=np.int64)
    probs = np.asarray(probs, dtype=np.float64)
    if ids.shape != probs.shape or ids.ndim not in (1, 2) or ids.shape[-1] == 0:
        raise ValueError("ids and probs must be [K] or [γ, K] of the same shape, K ≥ 1")
    ids2, probs2 = np.atleast_2d(ids), np.atleast_2d(probs)
    if ids2.min() < 0 or ids2.max() >= vocab_size:
        raise ValueError("token id outside the vocabulary")
    ordered = np.sort(ids2, axis=1)
    if np.any(ordered[:, 1:] == ordered[:, :-1]):
        raise ValueError("duplicate token id in a top-K list")
    total = probs2.sum(axis=1, keepdims=True)  # NaN fails `>= 0`, +inf makes total not finite
    if not ((probs2 >= 0.0).all() and (total > 0.0).all() and np.isfinite(total).all()):
        raise ValueError("top-K probabilities must be finite, ≥ 0 and not all 0")
    q = np.zeros((ids2.shape[0], vocab_size), dtype=np.float64)
    q[np.arange(ids2.shape[0])[:, None], ids2] = probs2 / total
    return q[0] if ids.ndim == 1 else q


def tkslt_draft_rows(
    drafts: np.ndarray, topk_ids: np.ndarray, topk_probs: np.ndarray, vocab_size: int
) -> np.ndarray:
    """The dense Q_1..Q_γ [γ, V] the drafts were sampled from, rebuilt from the uplinked top-K
    pairs. A draft outside its transmitted top-K, or listed in it at probability 0, could not
    have been sampled from it: ValueError.

    TK-SLT §III (the LLM side of Solution 1); docs/math.md#split-verification."""
    drafts = np.asarray(drafts, dtype=np.int64)
    topk_ids = np.asarray(topk_ids, dtype=np.int64)
    gamma = drafts.shape[0]
    if topk_ids.ndim != 2 or topk_ids.shape[0] != gamma:
        raise ValueError(f"need γ = {gamma} top-K lists, [γ, K]")
    if not np.all(np.any(topk_ids == drafts[:, None], axis=1)):
        raise ValueError("a draft lies outside its transmitted top-K support")
    if gamma == 0:
        return np.zeros((0, vocab_size))
    Q = dense_from_top_k(topk_ids, topk_probs, vocab_size)
    if not np.all(Q[np.arange(gamma), drafts] > 0.0):
        raise ValueError("a draft's transmitted probability is 0: it was not sampled from it")
    return Q


def tkslt_cloud_verify(
    drafts: np.ndarray,
    topk_ids: np.ndarray,
    topk_probs: np.ndarray,
    P: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """TK-SLT exact split round: rebuild the sparse Q_1..Q_γ from the uplinked top-K pairs
    (:func:`tkslt_draft_rows`, which refuses drafts they could not have produced), run the
    standard round at the cloud (residual norm(max(0, P_j − Q_j)) resampled there) and
    downlink only (n_accepted, next_token). Exact with respect to P.

    TK-SLT Solution 1 (§III) with the acceptance rate of eq. (9); Leviathan et al. 2023
    Algorithm 1; docs/math.md#split-verification. topk_ids/topk_probs are [γ, K]; P is [γ+1, V]."""
    Q = tkslt_draft_rows(drafts, topk_ids, topk_probs, P.shape[1])
    return speculative_round(np.asarray(drafts, dtype=np.int64), P, Q, rng)


def picospec_residual_topk(
    P_j_ids: np.ndarray, P_j_probs: np.ndarray, Q_j: np.ndarray
) -> np.ndarray:
    """PicoSpec's approximate device-side residual from a top-K downlink of P_j:
    norm(max(0, P̃_j − Q_j)) with P̃_j the transmitted top-K probabilities (zero elsewhere, not
    renormalised). **Approximate**: mass of P_j outside the top K is lost; see
    :func:`picospec_topk_bias_tv`.

    PicoSpec eq. (4) (P_sent = TopK(P)) with the device resampling of §3.3;
    docs/math.md#split-verification. If
    the top K of P_j lie entirely below Q_j, falls back to norm(P̃_j)."""
    Q_j = np.asarray(Q_j, dtype=np.float64)
    p_sent = np.zeros_like(Q_j)
    p_sent[np.asarray(P_j_ids, dtype=np.int64)] = np.asarray(P_j_probs, dtype=np.float64)
    r: np.ndarray = np.maximum(p_sent - Q_j, 0.0)
    mass: float = r.sum()
    if not mass > _EMPTY_MASS:
        return p_sent / float(p_sent.sum())
    return r / mass


def picospec_topk_output(p: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """Reference only (tests, benchmarks).

    The exact output distribution of one position verified with a top-K P downlink:
    min(p, q) (accepted drafts) + (1 − Σ min(p, q)) · picospec_residual_topk(TopK(p), q).

    PicoSpec eq. (4) + §3.3 resampling, decomposed as in the correctness proof of
    Leviathan et al. 2023 (accepted mass + rejection mass × residual);
    docs/math.md#split-verification.
    Equals p when K = |V|."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    accepted: np.ndarray = np.minimum(p, q)
    reject_mass: float = max(0.0, 1.0 - accepted.sum())
    ids = np.argpartition(p, -k)[-k:] if k < p.size else np.arange(p.size)
    return accepted + reject_mass * picospec_residual_topk(ids, p[ids], q)


def picospec_topk_bias_tv(p: np.ndarray, q: np.ndarray, k: int) -> float:
    """Reference only (tests, benchmarks).

    Total-variation distance ½·Σ|out − p| between the output distribution of one position
    under PicoSpec's top-K P downlink (:func:`picospec_topk_output`) and the exact target p.
    0 (up to rounding) when K = |V|; the price of the approximation otherwise.

    PicoSpec eq. (4); docs/math.md#split-verification ("quantify the bias (total variation)")."""
    p = np.asarray(p, dtype=np.float64)
    return 0.5 * float(np.abs(picospec_topk_output(p, q, k) - p).sum())


def draw_distribution(
    p: np.ndarray,
    draft: int,
    q_ids: np.ndarray,
    q_probs: np.ndarray,
    eta: float = 0.0,
    coin: bool = False,
) -> np.ndarray:
    """One verification of draft x ~ q as ONE draw from a distribution, for an engine that
    samples tokens itself (vLLM: docs/architecture.md#split-on-vllm): the token drawn equals x
    exactly when x is accepted.

    - `coin` False: a·δ_x + (1 − a)·norm(max(0, p − q)), a = min(1, p(x)/q(x)) — the law of
      :func:`verify_one`'s token (a rejection never lands on x: a < 1 means p(x) < q(x), so
      the residual is 0 there). η must be 0.
    - `coin` True: a·δ_x + (1 − a)·δ_s with s = x + 1 (mod V), a = min(1, p̂(x)/q(x)),
      p̂ = rapid_shift(p, q, η): only the accept coin, where the correction needs what the
      engine lacks (DSSD's device Q, RAPID's residual over p, q and p̂ — with η > 0 a
      rejection may land on x, which a single draw could not tell from an acceptance).

    q comes sparse (ids, probabilities that sum to 1; DSSD: just x and q(x)); p is the
    target's distribution at the draft's position (`collab.sampling.distribution`)."""
    q_probs = np.asarray(q_probs, dtype=np.float64)
    q_ids = np.asarray(q_ids, dtype=np.int64)
    at = np.flatnonzero(q_ids == draft)
    if at.size != 1:
        raise ValueError("a draft lies outside its q's support")
    q_x = float(q_probs[at[0]])
    if eta == 0.0:
        a = accept_probability(float(p[draft]), q_x)
    else:
        q = np.zeros_like(p)
        q[q_ids] = q_probs
        a = accept_probability(float(rapid_shift(p, q, eta)[draft]), q_x)
    if coin or a >= 1.0:
        out = np.zeros_like(p, dtype=np.float64)
        out[draft] = a
        out[(draft + 1) % p.size] += 1.0 - a
        return out
    if eta != 0.0:
        raise ValueError("a verification against RAPID's target (η > 0) draws only the coin")
    q = np.zeros_like(p, dtype=np.float64)
    q[q_ids] = q_probs
    out = (1.0 - a) * residual(p, q)
    out[draft] += a
    return out


# ---------------------------------------------------------------------------------------------
# 5.4 RAPID retrieval-augmented target
# ---------------------------------------------------------------------------------------------


def rapid_target(z_p_logits: np.ndarray, q: np.ndarray, eta: float, T: float = 1.0) -> np.ndarray:
    """Reference only (tests, benchmarks).

    p̂ = softmax(z/T + η·(q − p)) with p = softmax(z/T), the shift applied only where
    q ≥ 0.1·max q (elsewhere p̂ keeps p's logits), renormalised. η = 0 gives p exactly.

    RAPID eq. (6) (≡ eq. (8)) with the tail mask of eq. (9), which docs/math.md#rapid places on q.
    T = 0 is the limit T → 0: z/T outgrows the bounded shift (|η·(q − p)| ≤ η), so p̂ is the
    greedy one-hot p and RAPID changes nothing."""
    if not (T >= 0.0 and math.isfinite(T)):
        raise ValueError(f"need a finite T ≥ 0, got {T}")
    if T == 0.0:
        return distribution(np.asarray(z_p_logits), GREEDY)
    return rapid_shift(softmax(np.asarray(z_p_logits, dtype=np.float64) / T), q, eta)


def rapid_shift(p: np.ndarray, q: np.ndarray, eta: float) -> np.ndarray:
    """RAPID's target from the target's distribution itself: softmax(log p + η·(q − p)) on
    q's mask, i.e. p·e^{η(q − p)} there, renormalised — the same p̂ as `rapid_target` when
    p = softmax(z/T), and the form a verifier holding only P (after its top-k/top-p) can
    compute. Tokens p excludes stay excluded.

    RAPID eq. (6) with the mask of eq. (9); docs/math.md#rapid."""
    if not (eta >= 0.0 and math.isfinite(eta)):
        raise ValueError(f"η must be finite and ≥ 0, got {eta}")
    p = np.asarray(p, dtype=np.float64)
    if eta == 0.0:
        return p
    q = np.asarray(q, dtype=np.float64)
    # exponentials only where q is large: the mask is a handful of ids out of 151,936
    shifted = np.flatnonzero(q >= RAPID_MASK_FRACTION * q.max())
    p_hat = p.copy()
    p_hat[shifted] *= np.exp(eta * (q[shifted] - p[shifted]))
    return p_hat / float(p_hat.sum())


def rapid_residual(p: np.ndarray, p_hat: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p − q, p − p̂)) (elementwise max of the three), RAPID's rejection residual.

    RAPID eq. (10) with the 0 of docs/math.md#rapid; with p̂ = p it is norm(max(0, p − q)) (5.1).
    Falls
    back to p when empty (then p ≤ min(q, p̂) everywhere, so p = q = p̂)."""
    p = np.asarray(p, dtype=np.float64)
    r: np.ndarray = np.maximum(
        np.maximum(p - np.asarray(q, dtype=np.float64), p - np.asarray(p_hat)), 0.0
    )
    mass: float = r.sum()
    if not mass > _EMPTY_MASS:
        return p / float(p.sum())
    return r / mass


def rapid_verify_one(
    x: int, p: np.ndarray, p_hat: np.ndarray, q: np.ndarray, rng: np.random.Generator
) -> tuple[bool, int]:
    """RAPID verification of draft x ~ q: accept with min(1, p̂(x)/q(x)); on rejection sample
    norm(max(0, p − q, p − p̂)). Exact (output ~ p) only for η = 0 (p̂ = p); for η > 0 the output
    deliberately leans toward q and is neither p nor p̂ (docs/math.md#rapid,
    docs/math.md#errors-in-the-papers).

    RAPID Algorithm 1 with eqs. (5)/(6) (acceptance) and (10) (residual)."""
    if rng.random() < accept_probability(float(p_hat[x]), float(q[x])):
        return True, int(x)
    return False, sample_from(rapid_residual(p, p_hat, q), rng)


def rapid_round(
    drafts: np.ndarray, P: np.ndarray, Q: np.ndarray, eta: float, rng: np.random.Generator
) -> tuple[int, int]:
    """One speculative round against RAPID's target: each draft x_i ~ Q[i] is accepted with
    min(1, p̂_i(x)/q_i(x)), p̂_i = rapid_shift(P[i], Q[i], η), the first rejection resampled
    from norm(max(0, p − q, p − p̂)); all γ accepted, a bonus token from P[γ] (no draft there,
    so no shift: the paper's Algorithm 1 leaves this position undefined). η = 0 is exactly
    :func:`speculative_round`.

    RAPID Algorithm 1 with eqs. (5)/(6) and (10); docs/math.md#rapid. Returns (n_accepted,
    token)."""
    drafts = np.asarray(drafts)
    gamma = drafts.shape[0]
    if P.shape[0] != gamma + 1 or Q.shape[0] != gamma:
        raise ValueError(f"need γ+1 = {gamma + 1} rows of P and γ = {gamma} rows of Q")
    for i in range(gamma):
        p_hat = rapid_shift(P[i], Q[i], eta)
        accepted, token = rapid_verify_one(int(drafts[i]), P[i], p_hat, Q[i], rng)
        if not accepted:
            return i, token
    return gamma, sample_from(P[gamma], rng)
