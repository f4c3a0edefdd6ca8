"""A toy mode, device side: the cloud answers with the question in capitals and as many
exclamation marks as the `shout_marks` setting asks (sent in the mode's own ShoutSetup
message). It rides on the protocol's EXPERIMENTAL mode number, reserved for modes added
outside Tandem, and declares its figures and setting here."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from collab.protocol import Mode
from edge_runtime.declared import Declaration, Figure, Setting
from edge_runtime.events import Event
from edge_runtime.modes.base import Answer, AnswerOptions, Turn
from edge_runtime.modes.cloud import CloudMode
from edge_runtime.modes.link import RequestLink
from tests.toy_extensions.shout_wire import MAX_MARKS, ShoutSetup


def marks_problem(value: int) -> str | None:
    if not 0 <= value <= MAX_MARKS:
        return f"shout_marks must be in 0..{MAX_MARKS} (got {value})"
    return None


class ShoutMode(CloudMode):
    """Streams what the cloud sends, as cloud mode does, after saying how loud."""

    name = "shout"
    description = "the cloud repeats the question in capitals (a test of the mode registry)"
    protocol_mode = Mode.EXPERIMENTAL
    declared = Declaration(
        figures=(
            Figure("shout_marks", 0, "marks", status=True),
            Figure("shout_raised", 0, "raised", "{} letters", status=True),
        ),
        settings=(
            Setting(
                "shout_marks",
                int,
                1,
                "Shout marks",
                check=marks_problem,
                help="shout: exclamation marks the cloud ends its answer with",
            ),
        ),
    )

    async def prepare(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        answer.stats.shout_raised = sum(c.islower() for c in question)  # what the cloud raises
        async for event in super().prepare(question, history, options, answer):
            yield event

    async def converse(
        self, link: RequestLink, options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        marks = int(self.ctx.setting("shout_marks"))
        await link.send(ShoutSetup(marks, request_id=link.rid))
        answer.stats.shout_marks = marks
        async for event in super().converse(link, options, answer):
            yield event
