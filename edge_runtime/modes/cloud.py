"""Cloud mode: the cloud model answers from its public corpus; only the question (and the
history the cloud may see) leaves the device."""

from __future__ import annotations

from collections.abc import AsyncIterator

from collab.protocol import Mode, TokenChunk
from edge_runtime.events import Event
from edge_runtime.modes.base import Answer, AnswerOptions
from edge_runtime.modes.cloud_link import CloudBacked
from edge_runtime.modes.link import RequestLink


class CloudMode(CloudBacked):
    name = "cloud"
    description = "cloud model + public corpus; private documents never sent"
    protocol_mode = Mode.CLOUD

    async def converse(
        self, link: RequestLink, options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        while True:
            msg = await link.recv(TokenChunk)
            for event in link.take_events():
                yield event
            if link.ended(msg):
                return
            for event in answer.emit(answer.transcript.commit(msg.token_ids.tolist())):
                yield event
