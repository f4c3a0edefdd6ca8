"""A toy mode, cloud side: the answer is the question in capitals and the exclamation marks
the device's ShoutSetup asks for, sent as one chunk."""

from __future__ import annotations

from cloud_backend.modes.base import Request
from collab.protocol import TokenChunk
from tests.toy_extensions.shout_wire import ShoutSetup


class ShoutRequest(Request):
    async def decode_answer(self) -> None:
        setup = await self.link.recv(ShoutSetup)  # the device's ShoutSetup follows its Generate
        text = self.gen.question.upper() + "!" * setup.marks
        ids = self.ctx.engine.tokenizer.encode(text, add_special_tokens=False)
        kept = self.commit(ids)
        await self.link.send(TokenChunk(kept, request_id=self.gen.request_id, step=0))
