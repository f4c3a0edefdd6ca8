"""Cloud mode, cloud side: the cloud model answers the question from its public corpus."""

from __future__ import annotations

from cloud_backend.modes.base import Request


class CloudRequest(Request):
    async def decode_answer(self) -> None:
        await self.decode(self.transcript.max_new_tokens)
