"""A toy mode, cloud side: the answer is the question in capitals and the exclamation marks
the device's ShoutSetup asks for, sent as one chunk."""

from __future__ import annotations

from cloud_backend.modes.base import Request, Stop
from collab.protocol import Cancel, ErrorCode, FinishReason, TokenChunk
from tests.toy_extensions.shout_wire import ShoutSetup


class ShoutRequest(Request):
    async def decode_answer(self) -> None:
        setup = await self._setup()
        text = self.gen.question.upper() + "!" * setup.marks
        ids = self.ctx.engine.tokenizer.encode(text, add_special_tokens=False)
        kept = self.commit(ids)
        await self.ctx.send(TokenChunk(kept, request_id=self.gen.request_id, step=0))

    async def _setup(self) -> ShoutSetup:
        """The device's ShoutSetup, which follows its Generate."""
        while True:
            msg = await self.ctx.inbox.get()
            if isinstance(msg, Cancel):
                raise Stop(FinishReason.CANCELLED)
            if isinstance(msg, ShoutSetup):
                return msg
            await self.error(ErrorCode.MALFORMED, f"expected ShoutSetup, got {type(msg).__name__}")
