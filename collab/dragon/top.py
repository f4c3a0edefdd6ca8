"""DRAGON's per-document rows as an engine that samples itself hands them out (vLLM,
docs/architecture.md#dragon-on-vllm): each document's K likeliest tokens with their exact
log-probabilities at the mixing temperature, instead of whole 151,936-entry rows.

That is enough to build a side's transmitted distribution *exactly as from the rows*
(`collab.dragon.ledger.side_distribution`) whenever the top of the mixture is certain: a
token a document did not list has at most that document's K-th probability there, so every
mixture value is known to within a bound, and where the tokens the wire keeps are known
exactly and each beats every bound below it, the cut is the rows' cut. Where documents
disagree (a token one lists, another does not), the engine is asked for those tokens'
values (`missing`, `with_values`); where even that cannot tell, `settle` says so and the
caller asks for the rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from collab.dragon.aggregation import logsumexp

TOP_K = 64  # tokens an engine lists per document and position
MAX_ASKED = 128  # token values one follow-up asks of a document (vLLM's logprob_token_ids cap)


class Unsettled(Exception):
    """The documents' top tokens do not settle the transmitted distribution."""


@dataclass(frozen=True)
class TopDocuments:
    """What an engine told of each document's next-token distribution at the mixing
    temperature (T, or 1 when greedy: `side_distribution`'s), normalised over the whole
    vocabulary: ids[d] with log p_d(x) in logp[d] (its K likeliest, and any asked for since),
    and `bound[d]`, its K-th probability, which no token it did not list exceeds."""

    ids: tuple[np.ndarray, ...]
    logp: tuple[np.ndarray, ...]
    bound: np.ndarray

    @classmethod
    def of(cls, ids: list[np.ndarray], logp: list[np.ndarray]) -> TopDocuments:
        """From each document's K likeliest tokens (its K-th value is its bound)."""
        bound = np.asarray([np.exp(np.min(lp)) for lp in logp], dtype=np.float64)
        return cls(
            tuple(np.asarray(i, np.int64) for i in ids),
            tuple(np.asarray(lp, np.float64) for lp in logp),
            bound,
        )

    def _table(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """The union of listed ids (ascending), the mixture's known part and its unknown
        bound at each, and the bound of a token nobody listed."""
        scores = np.asarray(scores, dtype=np.float64)
        if scores.shape != (len(self.ids),):
            raise ValueError(f"need {len(self.ids)} scores, got {scores.shape}")
        w = np.exp(scores - logsumexp(scores))
        union = np.unique(np.concatenate(self.ids))
        low = np.zeros(union.size)
        gap = np.zeros(union.size)
        for d, (ids, logp) in enumerate(zip(self.ids, self.logp, strict=True)):
            listed = np.zeros(union.size, dtype=bool)
            at = np.searchsorted(union, ids)
            listed[at] = True
            low[at] += w[d] * np.exp(logp)
            gap[~listed] += w[d] * self.bound[d]
        return union, low, gap, float(w @ self.bound)

    def settle(
        self, scores: np.ndarray, top_p: float, max_sparse: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mixture values) that `side_distribution` keeps from the rows, in its order
        (likeliest first, the lower id first on a tie), or `Unsettled`."""
        union, low, gap, outside = self._table(scores)
        order = np.argsort(-low, kind="stable")  # union ascending: ties go to the lower id
        low, gap = low[order], gap[order]
        high = low + gap
        beyond = np.append(np.maximum.accumulate(high[::-1])[::-1][1:], -np.inf)
        certain = (gap == 0.0) & (low > np.maximum(beyond, outside))
        known = int(np.argmin(certain)) if not certain.all() else certain.size
        reach = np.flatnonzero(np.cumsum(low) >= top_p)
        n = max_sparse if reach.size == 0 else min(int(reach[0]) + 1, max_sparse)
        if n > known:
            raise Unsettled(f"the top {known} of the mixture are certain; the wire keeps {n}")
        return union[order[:n]], low[:n]

    def missing(self, scores: np.ndarray) -> list[np.ndarray]:
        """Per document, the listed tokens (of any document) it did not list, the likeliest
        contenders first, at most `MAX_ASKED`: what to ask its engine."""
        union, low, gap, _ = self._table(scores)
        contenders = union[np.argsort(-(low + gap), kind="stable")]
        return [contenders[~np.isin(contenders, ids)][:MAX_ASKED] for ids in self.ids]

    def with_values(self, ids: list[np.ndarray], logp: list[np.ndarray]) -> TopDocuments:
        """These tokens' exact values added (the bounds stay: they cover the unlisted)."""
        return TopDocuments(
            tuple(
                np.concatenate([a, np.asarray(b, np.int64)])
                for a, b in zip(self.ids, ids, strict=True)
            ),
            tuple(
                np.concatenate([a, np.asarray(b, np.float64)])
                for a, b in zip(self.logp, logp, strict=True)
            ),
            self.bound,
        )
