"""A toy mode, cloud side: the answer is the question in capitals, sent as one chunk."""

from __future__ import annotations

from cloud_backend.modes.base import Request
from collab.protocol import TokenChunk


class ShoutRequest(Request):
    async def decode_answer(self) -> None:
        ids = self.ctx.engine.tokenizer.encode(self.gen.question.upper(), add_special_tokens=False)
        kept = self.commit(ids)
        await self.ctx.send(TokenChunk(kept, request_id=self.gen.request_id, step=0))
