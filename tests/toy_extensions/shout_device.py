"""A toy mode, device side: the cloud answers with the question in capitals. It rides on
the protocol's DRAGON mode number, which the built-in cloud does not serve yet."""

from __future__ import annotations

from collections.abc import AsyncIterator

from collab.protocol import Done, Mode, TokenChunk
from edge_runtime.client import CloudClient
from edge_runtime.events import Event
from edge_runtime.modes.base import Answer, AnswerOptions
from edge_runtime.modes.cloud_link import CloudBacked


class ShoutMode(CloudBacked):
    name = "shout"
    description = "the cloud repeats the question in capitals (a test of the mode registry)"
    protocol_mode = Mode.DRAGON

    async def converse(
        self, client: CloudClient, rid: int, options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        while True:
            msg = await self.recv(client, rid)
            if isinstance(msg, TokenChunk):
                for event in answer.emit(answer.transcript.commit(msg.token_ids.tolist())):
                    yield event
            elif isinstance(msg, Done):
                answer.stats.finish = msg.reason.name.lower()
                answer.finished = True
                return
