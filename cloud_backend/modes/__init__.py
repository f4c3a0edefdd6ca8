"""The cloud side of every mode, one module each, and the registry the server serves from:
a mode the cloud serves is a `Request` subclass in its own module and one line in
`REQUESTS` (keyed by the protocol's `Mode`; `register_request` adds one from outside)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from cloud_backend.modes.base import Request, serve
from cloud_backend.modes.cloud import CloudRequest
from cloud_backend.modes.dragon import DragonRequest
from cloud_backend.modes.split import SplitRequest
from collab.protocol import Done, Generate, Mode

if TYPE_CHECKING:
    from cloud_backend.context import RequestContext

REQUESTS: dict[Mode, type[Request]] = {
    Mode.CLOUD: CloudRequest,
    Mode.SPLIT: SplitRequest,
    Mode.DRAGON: DragonRequest,
}


def register_request(mode: Mode, request: type[Request]) -> type[Request]:
    REQUESTS[mode] = request
    return request


async def serve_request(gen: Generate, ctx: RequestContext) -> Done:
    """Serve one Generate with its session's mode; every frame, Done included, is sent."""
    return await serve(REQUESTS[ctx.mode](gen, ctx, time.perf_counter()))
