"""Cloud mode: the cloud model answers from its public corpus; only the question (and the
history the cloud may see) leaves the device."""

from __future__ import annotations

from collections.abc import AsyncIterator

from collab.protocol import Citations, Done, Error, Mode, TokenChunk
from edge_runtime.client import CloudClient
from edge_runtime.events import Event
from edge_runtime.modes.base import Answer, AnswerOptions
from edge_runtime.modes.cloud_link import CloudBacked, refusal


class CloudMode(CloudBacked):
    name = "cloud"
    description = "cloud model + public corpus; private documents never sent"
    protocol_mode = Mode.CLOUD

    async def converse(
        self, client: CloudClient, rid: int, options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        while True:
            msg = await self.recv(client, rid)
            if isinstance(msg, Citations):
                for event in self.cite(msg):
                    yield event
            elif isinstance(msg, TokenChunk):
                for event in answer.emit(answer.transcript.commit(msg.token_ids.tolist())):
                    yield event
            elif isinstance(msg, Error):
                raise refusal(msg)
            elif isinstance(msg, Done):
                answer.stats.finish = msg.reason.name.lower()
                answer.finished = True
                return
