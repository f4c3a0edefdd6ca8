"""The embedded cloud: with no cloud URL configured, Tandem runs the backend itself on
loopback, in a child process (its own cores and GIL), with a freshly generated token passed
through the environment (never on a command line other users can read)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sys
from collections.abc import Sequence

log = logging.getLogger("tandem.embedded")
READY_PREFIX = "ready "


class EmbeddedCloudError(RuntimeError):
    pass


class EmbeddedCloud:
    def __init__(self, proc: asyncio.subprocess.Process, url: str, token: str) -> None:
        self.proc, self.url, self.token = proc, url, token

    @classmethod
    async def start(
        cls,
        serve_args: Sequence[str] = (),
        timeout_s: float = 900.0,
        cores: set[int] | None = None,
    ) -> EmbeddedCloud:
        """Start `tandem serve` on a free loopback port and wait until it accepts sessions
        (the first start also builds the public corpus index: minutes, with a progress bar).
        `cores` pins the backend (`taskset -c`), so it does not steal the device's core."""
        token = secrets.token_urlsafe(32)
        env = {**os.environ, "TANDEM_CLOUD_TOKEN": token}
        cmd = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--announce", *serve_args]  # fmt: skip
        if cores:
            cmd = ["taskset", "-c", ",".join(map(str, sorted(cores))), *cmd]
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, env=env, start_new_session=True
        )
        try:
            url = await asyncio.wait_for(cls._ready_url(proc), timeout_s)
        except BaseException:
            await cls._stop(proc)
            raise
        log.info("embedded cloud at %s (pid %d)", url, proc.pid)
        return cls(proc, url, token)

    @staticmethod
    async def _ready_url(proc: asyncio.subprocess.Process) -> str:
        assert proc.stdout is not None
        while line := (await proc.stdout.readline()).decode(errors="replace"):
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX) :].strip()
        code = await proc.wait()
        raise EmbeddedCloudError(
            f"the embedded cloud backend exited (code {code}) before it was ready; "
            "run `tandem serve -v` to see why"
        )

    async def stop(self) -> None:
        await self._stop(self.proc)

    @staticmethod
    async def _stop(proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def __aenter__(self) -> EmbeddedCloud:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
