"""The test cloud the modules share (their fixtures are in `conftest.py`): its access token
and a real aiohttp server on loopback around an engine."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp.test_utils import TestServer

from cloud_backend.config import ServerConfig
from cloud_backend.server import create_app

TOKEN = "test-token-0123456789"


@contextlib.asynccontextmanager
async def serving(
    config: ServerConfig, engine: Any, corpus: Any | None = None
) -> AsyncIterator[str]:
    """The session URL of a server for `engine` (and `corpus`) while the block runs."""
    server = TestServer(create_app(config, engine, corpus), host="127.0.0.1")
    await server.start_server()
    try:
        yield f"ws://127.0.0.1:{server.port}/v1/session"
    finally:
        await server.close()
