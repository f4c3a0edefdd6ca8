"""The embedded cloud: with no cloud URL configured, Tandem runs the backend itself on
loopback, in a child process (its own cores and GIL), with a freshly generated token passed
through the environment (never on a command line other users can read).

Both ends of the parent/child contract live here. The child (`tandem serve --announce`) writes
its stdout and stderr to a log file, never to the parent's terminal (a TUI's screen), and
announces on a pipe instead: `ready <url>`, and `search <what>` whenever what its public search
can do changes (a first start serves by keyword while the meaning index builds on a thread,
`cloud_backend.corpus_serving`). It
ends with its parent however the parent ends (a closed terminal's SIGHUP, SIGTERM, a crash,
SIGKILL): Linux's parent-death signal and, independently, end of file on its stdin, a pipe only
the parent holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from cloud_backend.config import METRICS_TOKEN_ENV, TOKEN_ENV
from collab.plumbing.files import make_private_dir, private_opener

log = logging.getLogger("tandem.embedded")
READY_PREFIX = "ready "
SEARCH_PREFIX = "search "
PARENT_ENV = "TANDEM_EMBEDDED_PARENT"  # the parent's pid: set only for the embedded child
LOG_NAME = "cloud.log"

OnSearch = Callable[[str], None]
"""Called with what the child's public search can do ("keywords; meaning 42 %", "meaning")."""


class EmbeddedCloudError(RuntimeError):
    pass


# --------------------------------------------------------------------------- the parent


def default_log_path() -> Path:
    """`<data dir>/cloud.log`, beside the TUI's own `tandem.log`."""
    from collab.plumbing.paths import data_dir

    return data_dir() / LOG_NAME


def serve_command(
    serve_args: Sequence[str],
    log_path: Path,
    *,
    cores: set[int] | None = None,
    python: str | None = None,
) -> list[str]:
    """The child's command line. `-P`: `-m` would put the working folder first on its
    sys.path, so an `app.py` or `app/` in the folder the user started Tandem from would run
    instead of Tandem (the installed package is found through site-packages either way).
    `--log-file` is the same file as its stderr: `tandem serve` rotates it by size."""
    cmd = [
        python or sys.executable,
        "-P",
        "-m",
        "app.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--announce",
        "--log-file",
        str(log_path),
        *serve_args,
    ]
    if cores:
        cmd = ["taskset", "-c", ",".join(map(str, sorted(cores))), *cmd]
    return cmd


class EmbeddedCloud:
    def __init__(
        self, proc: asyncio.subprocess.Process, url: str, token: str, metrics_token: str = ""
    ) -> None:
        self.proc, self.url, self.token = proc, url, token
        self.metrics_token = metrics_token  # its /metrics (benchmarks and tests read them)
        self._follower: asyncio.Task[None] | None = None

    async def metrics(self) -> str:
        """Its /metrics page (Prometheus text)."""
        return await read_metrics(self.url, self.metrics_token)

    @classmethod
    async def start(
        cls,
        serve_args: Sequence[str] = (),
        timeout_s: float = 900.0,
        cores: set[int] | None = None,
        log_path: Path | None = None,
        python: str | None = None,
        on_search: OnSearch | None = None,
    ) -> EmbeddedCloud:
        """Start `tandem serve` on a free loopback port and wait until it accepts sessions
        (a first start serves public search by keyword while its meaning index builds:
        `on_search` hears what public search can do, before and after). `cores` pins the
        backend (`taskset -c`), so it does not steal the device's core. Its output goes to
        `log_path` (default `<data dir>/cloud.log`), which rotates by size as `tandem serve
        --log-file` does (10 MiB, 5 kept).
        `python` runs it from another environment (the vLLM cloud's; default: this one).
        Call from the thread that keeps running (the event loop's): Linux ends the child
        when the thread that started it ends."""
        token, metrics_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        env = {
            **os.environ,
            TOKEN_ENV: token,
            METRICS_TOKEN_ENV: metrics_token,
            PARENT_ENV: str(os.getpid()),
        }
        log_path = log_path or default_log_path()
        cmd = serve_command(serve_args, log_path, cores=cores, python=python)
        make_private_dir(log_path.parent)
        # 0600: the child keeps its own copy of the fd
        with open(log_path, "ab", opener=private_opener) as log_file:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.PIPE,  # never written: its end of file is our death
                stdout=asyncio.subprocess.PIPE,  # the announcements
                stderr=log_file,
                env=env,
                start_new_session=True,  # the terminal's ctrl+c and SIGHUP reach only us
            )
        try:
            url = await asyncio.wait_for(cls._ready_url(proc, on_search, log_path), timeout_s)
        except BaseException:
            await cls._stop(proc)
            raise
        log.info("embedded cloud at %s (pid %d, log %s)", url, proc.pid, log_path)
        cloud = cls(proc, url, token, metrics_token)
        cloud._follower = asyncio.ensure_future(cls._follow(proc, on_search))
        return cloud

    @staticmethod
    async def _ready_url(
        proc: asyncio.subprocess.Process,
        on_search: OnSearch | None,
        log_path: Path,
    ) -> str:
        assert proc.stdout is not None
        while line := (await proc.stdout.readline()).decode(errors="replace"):
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX) :].strip()
            _searching(line, on_search)
        code = await proc.wait()
        raise EmbeddedCloudError(
            f"the embedded cloud backend exited (code {code}) before it was ready; see {log_path}"
        )

    @staticmethod
    async def _follow(proc: asyncio.subprocess.Process, on_search: OnSearch | None) -> None:
        """After `ready`: read the announcements to the end (a pipe left unread would block
        the child once full), passing on what public search can do."""
        assert proc.stdout is not None
        while line := (await proc.stdout.readline()).decode(errors="replace"):
            _searching(line, on_search)

    async def stop(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
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


def _searching(line: str, on_search: OnSearch | None) -> None:
    if line.startswith(SEARCH_PREFIX) and on_search is not None:
        on_search(line[len(SEARCH_PREFIX) :].strip())


# --------------------------------------------------------------------------- the child


async def read_metrics(ws_url: str, metrics_token: str) -> str:
    """The /metrics page of the cloud serving `ws_url`, read with its metrics token."""
    import aiohttp

    http_url = re.sub(r"^ws", "http", ws_url).rsplit("/v1/", 1)[0] + "/metrics"
    headers = {"Authorization": f"Bearer {metrics_token}"}
    async with aiohttp.ClientSession() as http, http.get(http_url, headers=headers) as resp:
        resp.raise_for_status()
        return await resp.text()


def announcer() -> Callable[[str], None]:
    """The child's side of the pipe: a writer of announcement lines. Stdout is the pipe, so it
    is kept for announcements alone and fd 1 is pointed at stderr (the log): a stray print
    cannot reach the parent, nor break the protocol."""
    channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    lock = threading.Lock()  # the corpus build's thread announces too

    def announce(line: str) -> None:
        with lock:
            channel.write(" ".join(line.split()) + "\n")  # one line, whatever it quotes
            channel.flush()

    return announce


def tie_to_parent() -> None:
    """End this process with the parent that started it (named in the environment; nothing
    happens when it is not set). SIGKILL of the parent included: the parent-death signal
    where the platform has one, and a thread that waits for end of file on stdin."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    if sys.platform.startswith("linux"):
        _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before the signal was armed
        log.warning("the parent process %s is gone: not starting", parent)
        os._exit(1)
    threading.Thread(target=_end_with_stdin, daemon=True, name="parent-watch").start()


def _set_parent_death_signal(sig: signal.Signals) -> None:
    import ctypes

    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (AttributeError, OSError) as exc:  # the stdin watch still covers it
        log.warning("no parent-death signal: %s", exc)


def _end_with_stdin() -> None:
    """Nobody writes to stdin: it ends when the parent's end closes, i.e. when it exits."""
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    log.warning("the parent process is gone: stopping")
    os.kill(os.getpid(), signal.SIGTERM)
