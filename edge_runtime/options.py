"""What the user asks an answer for, with the one set of defaults the app, `tandem ask` and
the settings file share. Light on purpose: the settings module imports it at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from collab.sources import RELEVANCE_FLOOR

if TYPE_CHECKING:
    from collab.sampling import SamplingParams


@dataclass(frozen=True)
class AnswerOptions:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    k: int = 3  # private passages retrieved
    eta: float = 0.0  # split: RAPID's η, how far the device's drafts pull the cloud (0 = exact)
    pipeline: bool = True  # split: PicoSpec's pipeline (draft on while the cloud verifies)
    min_score: float | None = RELEVANCE_FLOOR  # relevance floor: below it, not cited
    # this answer may send a remote cloud content shaped by private passages (the user's
    # consent for one answer: `tandem ask --allow-private-in-cloud`; edge_runtime.consent)
    allow_private_in_cloud: bool = False
    # private passages only from the documents at or under these paths (`tandem ask --in`,
    # the TUI's @ mentions); the public side is not scoped
    scope: tuple[str, ...] = ()

    @property
    def sampling(self) -> SamplingParams:
        from collab.sampling import SamplingParams

        return SamplingParams(self.temperature, self.top_k, self.top_p)


DEFAULTS = AnswerOptions()
