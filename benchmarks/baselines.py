"""DRAGON's baselines that are not Tandem modes (DRAGON §2.2, §7.2), built on the modes' parts.

DRDG/SW (sequence-wise output aggregation, REPLUG / RAG-Sequence): each side answers alone
from its own mixture over its own documents; then the two whole answers are exchanged once,
each is scored under both mixtures (teacher-forced, one batched step per side), and the device
keeps one: P(y) = η^device P^device(y) + η^cloud P^cloud(y)
(`collab.dragon.ledger.sequence_choice`).
Nothing streams: the answer appears when both sides are done. The cloud's half is
`cloud_backend.modes.dragon_sequence`. What crosses the wire: the two answers' token ids,
one log-probability per token, h and timing (the paper's version ships whole distributions).

DRCG/Text (context aggregation on the device): the cloud retrieves its public passages and
sends their text (a cloud-mode request for no tokens: Citations, then Done, no prefill); the
device puts both sides' passages in one prompt and answers alone. Private text still never
leaves the device; the public text does travel, and the device prefills all 2k passages, which
is what the paper's Figure 7 charges it for."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import numpy as np

from collab.dragon.aggregation import side_weight
from collab.dragon.ledger import DRAGON_MAX_SPARSE, DRAGON_TOP_P, sequence_choice
from collab.dragon.sequence import answer_alone, score
from collab.protocol import (
    AggregatorPolicy,
    Done,
    DragonScore,
    DragonSequence,
    DragonSetup,
    Generate,
    Mode,
    Side,
)
from collab.sources import Source
from edge_runtime.client import CloudError
from edge_runtime.device import retrieve_private
from edge_runtime.events import Event
from edge_runtime.modes.base import (
    STOP_IDS,
    Answer,
    AnswerOptions,
    ModeContext,
    Turn,
    device_generate,
    full_history,
    left_out_notice,
    need_device,
)
from edge_runtime.modes.cloud_link import CloudBacked
from edge_runtime.modes.dragon import DragonMode
from edge_runtime.modes.link import RequestLink
from model_runtime.prompting import clipped_prompt, prompt_budget


class DrcgTextMode(CloudBacked):
    """DRCG/Text: the public passages' text fetched from the cloud, every passage of both
    sides concatenated in the device's prompt, the device model answering."""

    name = "drcg-text"
    description = "the cloud's public passages fetched as text; the device answers from all"
    protocol_mode = Mode.CLOUD

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._question = ""  # this answer's, from prepare
        self._history: Sequence[Turn] = ()
        self._private: list[Source] = []

    async def prepare(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        self._question, self._history = question, history
        self._private = await retrieve_private(
            self.ctx.index, question, options.k, options.min_score
        )
        return
        yield

    def generate_message(
        self, rid: int, question: str, history: Sequence[Turn], options: AnswerOptions
    ) -> Generate:
        return replace(
            super().generate_message(rid, question, history, options),
            max_new_tokens=0,
            retrieve=True,
        )

    async def converse(
        self, link: RequestLink, options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        # a retrieval: its Done ends the request, not the answer, which the device writes
        while not isinstance(await link.recv(), Done):
            pass
        answer.finished = True
        public = [e for e in link.take_events() if isinstance(e, Source)]
        private = [replace(s, number=len(public) + n) for n, s in enumerate(self._private, 1)]
        for source in [*public, *private]:
            yield source
        device = need_device(self.ctx)
        budget = prompt_budget(device.lm.max_context, options.max_new_tokens)
        answer.prompt, dropped = clipped_prompt(  # DRCG saturates at the context budget
            device.tokenizer,
            self._question,
            full_history(self._history),
            [*public, *private],
            budget,
        )
        if dropped:
            yield left_out_notice(dropped, device.lm.max_context)
        async for event in device_generate(device, answer.prompt, answer, options):
            yield event


class DrdgSwMode(DragonMode):
    """DRDG/SW: both sides answer alone, the device aggregates the two answers once."""

    name = "drdg-sw"
    description = "each side answers alone; the two whole answers are aggregated once"

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self.decode_span_s: float | None = None  # the last answer's decoding, prefills excluded

    async def converse(
        self, link: RequestLink, options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        rid = link.rid
        docs = self._docs
        assert docs is not None  # prepare ran
        setup = DragonSetup(
            options.k,
            AggregatorPolicy.SEQUENCE,
            Side.DEVICE,
            DRAGON_TOP_P,
            DRAGON_MAX_SPARSE,
            0,
            request_id=rid,
        )
        await link.send(setup)
        first = await docs.batch.start(docs.prompts)
        ready = time.perf_counter()
        seed = options.seed
        rng = np.random.default_rng(None if seed is None else [seed, 0x5E])
        mine, my_logprobs = await answer_alone(
            docs.batch,
            first,
            docs.scores,
            options.sampling,
            DRAGON_TOP_P,
            DRAGON_MAX_SPARSE,
            options.max_new_tokens,
            STOP_IDS,
            rng,
        )
        await link.send(DragonScore(np.asarray(mine), request_id=rid))
        theirs = scored = None
        while not answer.finished:
            msg = await link.recv(DragonSequence)
            if isinstance(msg, Done):
                answer.finished = True  # the request, not the answer: the device commits it
            elif msg.scored:
                scored = msg
            else:
                theirs = msg
                cloud_ready = time.perf_counter() - msg.decode_time  # its prefill's end, here
        for event in link.take_events():
            yield event
        if theirs is None or scored is None:
            raise CloudError("the cloud ended the answer without its half of DRDG/SW")
        their_tokens = [int(t) for t in theirs.tokens]
        their_under_mine = await score(
            docs.batch, first, docs.scores, their_tokens, options.temperature
        )
        h = (side_weight(docs.scores), theirs.h)
        pick = sequence_choice(
            (float(my_logprobs.sum()), float(scored.logprobs.astype(np.float64).sum())),
            (float(their_under_mine.sum()), float(theirs.logprobs.astype(np.float64).sum())),
            h,
            options.temperature == 0.0,
            rng,
        )
        answer.stats.aggregator = pick.label  # whose answer was kept
        for event in answer.emit(
            answer.transcript.commit(mine if pick == Side.DEVICE else their_tokens)
        ):
            yield event
        self.decode_span_s = time.perf_counter() - max(ready, cloud_ready)


BASELINES: dict[str, type[CloudBacked]] = {"drcg-text": DrcgTextMode, "drdg-sw": DrdgSwMode}
