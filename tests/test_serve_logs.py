"""`tandem serve`'s log: repeated lines rate-limited (a device sending ten thousand malformed
frames costs a bounded number of lines and one count), and `--log-file` rotating by size.
The limiter is driven with real log records, and once through a real cloud on loopback."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest

from app.serve_log import serve_logging
from cloud_backend.logfilter import PER_EVENT, PER_SESSION, WINDOW_S, RepeatLimiter
from cloud_backend.logfmt import kv
from tests import test_server
from tests.test_server import raw

engine, start_cloud, cloud = test_server.engine, test_server.start_cloud, test_server.cloud


class Lines(logging.Handler):
    """Every line that reached it, formatted."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def limited() -> tuple[logging.Logger, Lines, RepeatLimiter, Clock]:
    logger = logging.getLogger("tandem.test.flood")
    logger.propagate, logger.level = False, logging.INFO
    lines, clock = Lines(), Clock()
    limiter = RepeatLimiter(lines, clock=clock)
    lines.addFilter(limiter)
    logger.addHandler(lines)
    yield logger, lines, limiter, clock
    logger.removeHandler(lines)


def _frame_error(session: str, n: int) -> str:
    return kv("error_frame", session=session, request=0, code="MALFORMED", message=f"bad {n}")


def test_a_flood_from_one_session_is_bounded_and_counted(limited):
    logger, lines, _, clock = limited
    for n in range(10_000):
        logger.info(_frame_error("flood", n))
    logger.info(_frame_error("other", 0))  # another device's line of the same event
    logger.info(kv("request_done", session="flood", request=1))  # another event of the flood
    assert len(lines.lines) == PER_SESSION + 2
    assert lines.lines[-2:] == [_frame_error("other", 0), "request_done session=flood request=1"]
    clock.now += WINDOW_S  # the window ends: the count comes before the next line
    logger.info(_frame_error("flood", 10_000))
    assert lines.lines[-2:] == [
        f"log_suppressed event=error_frame lines={10_000 - PER_SESSION} window_s=60",
        _frame_error("flood", 10_000),
    ]


def test_a_flood_that_stops_is_reported_with_any_later_line_or_at_close(limited):
    logger, lines, limiter, clock = limited
    for n in range(PER_SESSION + 5):
        logger.info(_frame_error("flood", n))
    clock.now += WINDOW_S
    logger.info(kv("session_closed", session="flood"))
    assert lines.lines[-2:] == [
        "log_suppressed event=error_frame lines=5 window_s=60",
        "session_closed session=flood",
    ]
    for n in range(PER_SESSION + 3):
        logger.warning(_frame_error("again", n))
    limiter.report()
    assert lines.lines[-1] == "log_suppressed event=error_frame lines=3 window_s=60"
    limiter.report()  # nothing more to say
    assert lines.lines[-1] == "log_suppressed event=error_frame lines=3 window_s=60"


def test_a_device_that_reconnects_for_every_few_frames_is_held_by_the_event_bound(limited):
    logger, lines, _, _ = limited
    for session in range(1000):
        for n in range(PER_SESSION):
            logger.info(_frame_error(f"s{session}", n))
    assert len(lines.lines) == PER_EVENT


def test_lines_without_a_session_are_limited_by_event(limited):
    logger, lines, limiter, _ = limited
    for n in range(5000):
        logger.info(kv("auth_refused", peer=f"10.0.0.{n % 250}", reason="wrong token"))
    limiter.report()
    assert len(lines.lines) == PER_EVENT + 1
    held = 5000 - PER_EVENT
    assert lines.lines[-1] == f"log_suppressed event=auth_refused lines={held} window_s=60"


def _restored_root() -> tuple[list[logging.Handler], int, list[list[logging.Filter]]]:
    root = logging.getLogger()
    return list(root.handlers), root.level, [list(h.filters) for h in root.handlers]


def test_the_log_file_rotates_by_size_and_stays_private(tmp_path):
    before = _restored_root()
    path = tmp_path / "logs" / "cloud.log"
    logs = serve_logging(path, max_mb=2000 / 1024**2, backups=2)
    log = logging.getLogger("tandem.cloud")
    try:
        for n in range(200):  # distinct sessions: nothing here is a repeat
            log.info(kv("request_done", session=f"s{n}", request=1, tokens=n))
        log.debug(kv("stale_frame", session="s0", request=0))  # below INFO without -v
    finally:
        logs.close()
    assert _restored_root() == before
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["cloud.log", "cloud.log.1", "cloud.log.2"]
    for p in path.parent.iterdir():
        assert p.stat().st_size <= 2000 + 200, p
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    last = path.read_text().splitlines()[-1]
    assert last.endswith("INFO tandem.cloud: request_done session=s199 request=1 tokens=199")
    assert "stale_frame" not in path.read_text()


def test_serve_refuses_a_log_file_it_cannot_write(tmp_path, capsys, monkeypatch):
    from app.cli import main

    monkeypatch.setenv("TANDEM_CLOUD_TOKEN", "t" * 24)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["serve", "--no-corpus", "--log-file", str(blocker / "cloud.log")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "log file" in err and "Traceback" not in err


async def test_ten_thousand_malformed_frames_cost_a_bounded_log(start_cloud, tmp_path: Path):
    """A real cloud on loopback, logging as `tandem serve --log-file` sets up: one device
    sends 10,000 malformed frames (each answered with an Error frame, the session survives);
    the log file holds PER_SESSION of them and one count of the rest."""
    path = tmp_path / "cloud.log"
    logs = serve_logging(path)
    try:
        cloud = await start_cloud()
        async with raw(cloud) as s:
            for _ in range(20):
                for _ in range(500):
                    await s.ws.send_bytes(b"\x00garbage\xff")
                for _ in range(500):
                    err = await s.recv()
                    assert type(err).__name__ == "Error", err
            await s.ping_pong()
    finally:
        logs.close()
    lines = path.read_text().splitlines()
    errors = [line for line in lines if ": error_frame " in line]
    summaries = [line for line in lines if ": log_suppressed " in line]
    assert len(errors) == PER_SESSION
    assert [s.split(": ", 1)[1] for s in summaries] == [
        f"log_suppressed event=error_frame lines={10_000 - PER_SESSION} window_s=60"
    ]
    assert any(": session_open " in line for line in lines)  # the operator's INFO lines
    assert len(lines) < PER_SESSION + 20, lines


async def test_the_embedded_clouds_log_rotates_with_its_stderr(tmp_path: Path, monkeypatch):
    """cloud.log is the embedded cloud's stderr and its `--log-file` (issue 44): a log past
    its size moves to cloud.log.1 at the child's first line, and what the child writes after,
    logged or printed on stderr (its error on the way out), is in the fresh file, once."""
    import secrets

    from app.embedded import EmbeddedCloud, EmbeddedCloudError
    from app.serve_token import ARGV_WARNING

    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    log = tmp_path / "logs" / "cloud.log"
    log.parent.mkdir()
    old = "an older session's line\n" * 50_000  # 1.2 MB: past the 1 MiB asked for below
    log.write_text(old)
    log.chmod(0o600)
    # --token: a warning logged (`=`: a token may start with "-"); the missing model: an error
    # printed on stderr, and the child exits
    token = f"--token={secrets.token_urlsafe(32)}"
    serve = ["--no-corpus", "--model-dir", str(tmp_path / "missing"), "--log-max-mb", "1", token]
    with pytest.raises(EmbeddedCloudError, match="exited"):
        await EmbeddedCloud.start(serve, timeout_s=120, log_path=log)
    assert log.with_name("cloud.log.1").read_text() == old
    fresh = log.read_text()
    assert fresh.count(ARGV_WARNING) == 1, fresh  # the file's line, not stderr's as well
    assert "error: model folder" in fresh and "does not exist" in fresh, fresh
    assert len(fresh) < 10_000
    for path in (log, log.with_name("cloud.log.1")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
