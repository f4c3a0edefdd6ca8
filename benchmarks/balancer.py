"""The shipped HAProxy config (deploy/haproxy.cfg) run for real on loopback, for the balancer
tests (tests/test_balancer.py) and `python -m benchmarks.load --balancer`.

The copy that runs is the shipped file with only what cannot run here replaced: the TLS bind
on :443 becomes a plain loopback bind (no certificate to serve), the DNS-discovered
`server-template` becomes one `server` line per replica (no container DNS), the `resolvers`
section goes, and the global `maxconn` is lowered to what this process's open-file limit
allows (HAProxy refuses to start otherwise). A stats socket and a log on stdout are added, so
a test can read which replica took what. Every other line (balancing, health checks, retries,
timeouts, forwarded address) is the shipped line, which `render` checks."""

from __future__ import annotations

import contextlib
import resource
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "deploy" / "haproxy.cfg"
HAPROXY_INSTALL = "HAProxy is not installed (Debian: apt-get install -y haproxy)"
#: line keywords of the shipped file that the loopback copy replaces (or drops)
ADAPTED = ("bind", "server-template", "maxconn")


def haproxy() -> str | None:
    """The haproxy executable, or None where it is not installed."""
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if Path(p).is_file()), None
    )


def free_port() -> int:
    """A loopback port nothing listens on now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fd_maxconn(wanted: int) -> int:
    """HAProxy needs two descriptors a connection and refuses to start past the hard limit."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return wanted
    return max(64, min(wanted, (hard - 200) // 2))


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """(header, body lines) in order; the lines before the first header under ""."""
    out: list[tuple[str, list[str]]] = [("", [])]
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            out.append((line.split("#")[0].strip(), []))
        else:
            out[-1][1].append(line)
    return out


def _keyword(line: str) -> str:
    words = line.split("#")[0].split()
    return words[0] if words else ""


def render(
    port: int,
    servers: Sequence[tuple[str, int]],
    stats_socket: Path | None = None,
    shipped: str | None = None,
) -> str:
    """The shipped config adapted to loopback: `port` for devices, `servers` as (name, port)
    replicas on 127.0.0.1. Raises ValueError if the shipped file lost a line it adapts."""
    text = SHIPPED.read_text() if shipped is None else shipped
    out: list[str] = []
    replaced: set[str] = set()
    for header, body in _sections(text):
        if header.startswith("resolvers"):
            continue  # container DNS only (server-template's); loopback has fixed servers
        if header:
            out.append(header)
        for line in body:
            key = _keyword(line)
            if header == "global" and key == "maxconn":
                out.append(f"    maxconn {fd_maxconn(int(line.split()[1]))}")
            elif header.startswith("frontend") and key == "bind":
                out.append(f"    bind 127.0.0.1:{port}")
            elif header.startswith("backend") and key == "server-template":
                out += [f"    server {name} 127.0.0.1:{p}" for name, p in servers]
            else:
                out.append(line)
                continue
            replaced.add(key)
        if header == "global":
            out.append("    log stdout format raw local0")
            if stats_socket is not None:
                out.append(f"    stats socket {stats_socket} level admin")
        elif header == "defaults":
            out += ["    log global", "    option httplog"]
    if missing := set(ADAPTED) - replaced:
        raise ValueError(f"{SHIPPED.name} has no {', '.join(sorted(missing))} line to adapt")
    return "\n".join(out) + "\n"


def check(config: Path) -> subprocess.CompletedProcess[str]:
    """`haproxy -c -f config`: HAProxy's own parse of a config, nothing started."""
    exe = haproxy()
    if exe is None:
        raise RuntimeError(HAPROXY_INSTALL)
    return subprocess.run(
        [exe, "-c", "-f", str(config)], capture_output=True, text=True, timeout=30
    )


@dataclass
class ServerStat:
    """One replica as HAProxy sees it (a row of `show stat`)."""

    name: str
    status: str  # UP, DOWN, MAINT, "UP 1/2" while rising...
    current: int  # connections open now (websockets count while they last)
    total: int  # connections it was given
    retries: int  # connections to it that were retried (503, refused...)
    redispatches: int  # ... and sent to another replica
    responses_1xx: int  # 101 Switching Protocols: websockets opened
    responses_5xx: int


class Balancer:
    """HAProxy with the loopback copy of the shipped config, in the foreground (`-db`), its
    log kept; read and steer it through its stats socket."""

    def __init__(
        self, folder: Path, servers: Sequence[tuple[str, int]], port: int | None = None
    ) -> None:
        exe = haproxy()
        if exe is None:
            raise RuntimeError(HAPROXY_INSTALL)
        self.port = port or free_port()
        self.socket = folder / "haproxy.sock"
        self.config = folder / "haproxy.cfg"
        self.config.write_text(render(self.port, servers, self.socket))
        self.url = f"ws://127.0.0.1:{self.port}/v1/session"
        self.log: list[str] = []
        self.process = subprocess.Popen(
            [exe, "-db", "-f", str(self.config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 10
        while not self.socket.exists() or not self._listening():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("HAProxy did not start:\n" + "\n".join(self.log[-20:]))
            time.sleep(0.02)

    def _read(self) -> None:  # keep draining: a full pipe would stall HAProxy
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line.rstrip())

    def _listening(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 1):
            return True
        return False

    def command(self, line: str) -> str:
        """One command on the stats socket (HAProxy's runtime API); its answer."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(self.socket))
            sock.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def stats(self, backend: str = "clouds") -> dict[str, ServerStat]:
        """Each server of `backend` as HAProxy sees it now."""
        lines = self.command("show stat").splitlines()
        head = lines[0].lstrip("# ").split(",")
        out = {}
        for line in lines[1:]:
            row = dict(zip(head, line.split(","), strict=False))
            if row.get("pxname") != backend or row["svname"] in ("FRONTEND", "BACKEND"):
                continue
            counts = [
                int(row[key] or 0)
                for key in ("scur", "stot", "wretr", "wredis", "hrsp_1xx", "hrsp_5xx")
            ]
            out[row["svname"]] = ServerStat(row["svname"], row["status"], *counts)
        return out

    def wait_status(self, server: str, status: str, timeout: float) -> float:
        """Seconds until HAProxy says `server` is `status` (its health checks decide)."""
        t0 = time.monotonic()
        while self.stats()[server].status != status:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(
                    f"{server} not {status} within {timeout} s: {self.stats()[server]}"
                )
            time.sleep(0.1)
        return time.monotonic() - t0

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
