"""One link per request, on each side (issue 30): the loops take the request's link, and the
handling of a request's frames (citations, Done, errors, anything unexpected, stale frames) is
written once per side, in that link."""

from __future__ import annotations

import ast
import asyncio
import time

import numpy as np
import pytest

from collab.protocol import Citations, Done, Error, ErrorCode, FinishReason, TokenChunk, Verdict
from collab.sources import Source
from collab.split import Transcript
from edge_runtime.client import CloudError
from edge_runtime.events import Stats
from edge_runtime.modes.base import Answer
from edge_runtime.modes.link import RequestLink
from tests.import_graph import REPO


class Wire:
    """The frames a cloud sent, in order, as `CloudClient.recv` hands them over."""

    def __init__(self, *frames: object) -> None:
        self.frames = list(frames)
        self.bytes_up = self.bytes_down = 0
        self.rtt_s = None

    async def recv(self, timeout: float | None = None) -> object:
        await asyncio.sleep(0)
        return self.frames.pop(0)

    async def send(self, msg: object) -> None:
        self.bytes_up += 10


def link_over(*frames: object) -> tuple[RequestLink, Answer]:
    answer = Answer(Stats("cloud", ""), time.perf_counter(), Transcript(8, frozenset()), None)
    return RequestLink(Wire(*frames), 7, answer, None), answer  # type: ignore[arg-type]


async def test_the_link_drops_older_requests_and_turns_citations_into_events() -> None:
    source = Source("Lima", score=0.7)
    link, answer = link_over(
        TokenChunk(np.asarray([1]), request_id=6),  # an older request's: dropped
        Citations((source,), request_id=7),
        TokenChunk(np.asarray([2]), request_id=7),
        Done(FinishReason.LENGTH, request_id=7),
    )
    msg = await link.recv(TokenChunk)
    assert isinstance(msg, TokenChunk) and msg.token_ids.tolist() == [2]
    (citation,) = link.take_events()
    assert citation.number == 1 and citation.side == "cloud"  # type: ignore[union-attr]
    done = await link.recv(TokenChunk)
    assert not answer.finished  # the loop decides when the Done is taken
    assert link.ended(done) and answer.finished
    assert answer.stats.finish == "length" and answer.transcript.finish == FinishReason.LENGTH
    assert link.bytes_up == 0 and await link.send(Done(FinishReason.STOP, request_id=7)) == 10


async def test_an_error_is_a_refusal_and_an_unasked_frame_is_a_cloud_error() -> None:
    link, _ = link_over(Error(ErrorCode.EVICTED, "cache gone", request_id=7))
    with pytest.raises(CloudError, match="dropped this answer's cache"):
        await link.recv(TokenChunk)
    link, _ = link_over(TokenChunk(np.asarray([1]), request_id=7))
    with pytest.raises(CloudError, match="unexpected TokenChunk"):
        await link.recv(Verdict)


async def test_a_frame_put_back_comes_first() -> None:
    link, _ = link_over(Done(FinishReason.STOP, request_id=7))
    link.unread(TokenChunk(np.asarray([3]), request_id=7))
    assert isinstance(await link.recv(TokenChunk), TokenChunk)
    assert isinstance(await link.recv(TokenChunk), Done)


def _calls(folder: str, name: str) -> dict[str, int]:
    """Per module under `folder`: how often it calls or names `name` (an attribute or not)."""
    found: dict[str, int] = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        n = sum(
            (isinstance(node, ast.Attribute) and node.attr == name)
            or (isinstance(node, ast.Name) and node.id == name)
            for node in ast.walk(tree)
        )
        if n:
            found[str(path.relative_to(REPO))] = n
    return found


def test_each_side_handles_a_requests_frames_in_one_place() -> None:
    """On main before issue 30 the device handled them in cloud_link, split_run and dragon
    (each reading frames, mapping errors with `refusal`, numbering citations) and the cloud
    read its inbox in split, dragon and dragon_sequence."""
    refusals = _calls("edge_runtime", "refusal")
    assert list(refusals) == ["edge_runtime/modes/link.py"], refusals
    cites = _calls("edge_runtime", "Citations")
    assert list(cites) == ["edge_runtime/modes/link.py"], cites
    inbox = {m: n for m, n in _calls("cloud_backend/modes", "inbox").items()}
    assert list(inbox) == ["cloud_backend/modes/link.py"], inbox
