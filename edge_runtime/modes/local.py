"""Local mode: private retrieval + the device model. Opens no socket."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from edge_runtime.events import Event
from edge_runtime.modes.base import (
    Answer,
    AnswerOptions,
    Orchestrator,
    Turn,
    device_generate,
    need_device,
)


class LocalMode(Orchestrator):
    name = "local"
    description = "device model + private documents; works offline"

    async def generate(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        device = need_device(self.ctx)
        async for event in self.private_prompt(question, history, options, answer):
            yield event
        async for event in device_generate(device, answer.prompt, answer, options):
            yield event
