"""Split speculative decoding, device side: the device drafts, the cloud verifies.

The device model reads the private passages (a RAG drafter); the cloud verifies with a prompt
built from the question and the cloud-visible history only. What a draft carries, how the
cloud judges it and who samples a correction is the variant's business (`collab.variants`:
TK-SLT, DSSD, DSSD-topK, DSD); when frames go is the loop's: stop-and-wait rounds
(`split_run.SplitRun`) or PicoSpec's pipeline, which drafts on while the cloud verifies
(`split_pipeline.PipelinedRun`, docs/math.md#picospec). RAPID's η (docs/math.md#rapid) moves the
cloud's
target toward the drafts for variants whose cloud holds the drafts' distributions."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

from collab.protocol import Generate, Mode
from collab.variants import get_variant, rapid_variants
from collab.variants.base import SplitVariant
from edge_runtime.consent import refused
from edge_runtime.device import retrieve_private
from edge_runtime.events import Event, Failure, Notice
from edge_runtime.modes.base import (
    Answer,
    AnswerOptions,
    ModeContext,
    Turn,
    need_device,
    searched_by,
    shared_history,
)
from edge_runtime.modes.cloud_link import CloudBacked
from edge_runtime.modes.link import RequestLink
from edge_runtime.modes.split_declared import DECLARED
from edge_runtime.modes.split_pipeline import PipelinedRun
from edge_runtime.modes.split_run import SplitRun
from edge_runtime.split_costs import SplitCosts


class SplitMode(CloudBacked):
    name = "split"
    declared = DECLARED  # its figures and settings
    description = "device drafts (with private documents), cloud verifies"
    protocol_mode = Mode.SPLIT

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self.scheme: SplitVariant = get_variant(ctx.variant)
        self.costs = SplitCosts()

    @property
    def variant(self) -> str:
        return self.scheme.name

    @property
    def retrieve_public(self) -> bool:
        return self.ctx.split_retrieve_public

    async def generate(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        if options.eta and not self.scheme.rapid:
            yield Failure(
                f"RAPID (η = {options.eta:g}) needs a split variant whose cloud holds the "
                f"drafts' distributions ({', '.join(rapid_variants())}); {self.scheme.name} "
                "sends only q(x)"
            )
            return
        if options.eta:
            answer.stats.rapid_eta = options.eta
            if options.temperature == 0:
                yield Notice(
                    f"RAPID (η = {options.eta:g}) acts only when sampling: this "
                    "greedy answer follows the cloud model exactly"
                )
        async for event in super().generate(question, history, options, answer):
            yield event

    def generate_message(
        self, rid: int, question: str, history: Sequence[Turn], options: AnswerOptions
    ) -> Generate:
        message = super().generate_message(rid, question, history, options)
        return dataclasses.replace(message, eta=options.eta)

    async def prepare(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        """The drafter's prompt: the private passages and the whole conversation, where the
        user agreed to let this cloud take part in answers shaped by them (the drafts are);
        else only what this cloud may see: its own turns, no passage (and a notice)."""
        passages = await retrieve_private(
            self.ctx.index,
            searched_by(question, history),
            options.k,
            options.min_score,
            options.scope,
        )
        withheld = await self.shaped_by_private(passages, history)
        withheld = withheld and not await self.private_allowed(options)
        if withheld:
            identity = self.cloud_identity()
            yield Notice(
                f"drafting without your documents and private turns: "
                f"{refused(identity or 'this cloud')}"
            )
            history, passages = shared_history(history, identity), []
        for event in self.prompt_with(
            question, history, passages, options, answer, withheld=withheld
        ):
            yield event

    async def converse(
        self, link: RequestLink, options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        loop = PipelinedRun if options.pipeline else SplitRun
        run = loop(link, self.scheme, self.costs, need_device(self.ctx), options, answer)
        async for event in run.decode(answer.prompt):
            yield event
