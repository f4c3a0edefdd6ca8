"""A cloud URL typed without its path (`ws://host:port`, as people type a server's address and
as earlier versions accepted) reaches the session endpoint; a URL with a path is kept as given.
Against a real cloud on loopback (tiny model)."""

from __future__ import annotations

import json

import pytest

from app.ask import run_ask
from app.cli import build_parser
from app.settings import Settings, save_settings
from collab.protocol import SESSION_PATH, Mode
from edge_runtime.client import CloudClient, CloudUnavailable, session_url
from tests import test_server
from tests.test_server import TOKEN, Cloud

engine, start_cloud, cloud = test_server.engine, test_server.start_cloud, test_server.cloud


def _bare(cloud: Cloud) -> str:
    return cloud.http.replace("http://", "ws://", 1)


def test_the_server_serves_sessions_where_the_device_looks():
    from cloud_backend.server import SESSION_PATH as served

    assert served == SESSION_PATH == "/v1/session"


@pytest.mark.parametrize(
    ("typed", "completed"),
    [
        ("ws://cloud.example:8765", "ws://cloud.example:8765/v1/session"),
        ("wss://cloud.example/", "wss://cloud.example/v1/session"),
        ("ws://[::1]:8765?x=1", "ws://[::1]:8765/v1/session?x=1"),
        ("wss://cloud.example/v1/session", "wss://cloud.example/v1/session"),
        ("wss://balancer.example/tandem/v1/session", "wss://balancer.example/tandem/v1/session"),
        ("ws://[::1", "ws://[::1"),  # not a URL: connecting says so
    ],
)
def test_session_url_completes_only_a_missing_path(typed, completed):
    assert session_url(typed) == completed


@pytest.mark.parametrize("suffix", ["", "/"])
async def test_a_url_without_a_path_opens_a_session(cloud, suffix):
    client = CloudClient(
        _bare(cloud) + suffix, TOKEN, Mode.CLOUD, "", cloud.engine.tokenizer_hash, "device"
    )
    async with client:
        assert client.connected and client.cloud_model_name == test_server.ENGINE_NAME
    assert client.url == cloud.url


async def test_a_url_with_another_path_is_kept_and_refused_in_plain_words(cloud):
    client = CloudClient(
        _bare(cloud) + "/v2/chat", TOKEN, Mode.CLOUD, "", cloud.engine.tokenizer_hash, "device"
    )
    with pytest.raises(CloudUnavailable, match=r"/v2/chat did not open a session \(HTTP 404\)"):
        await client.connect()


async def test_ask_answers_with_a_bare_url_in_the_environment(
    cloud, tiny, tmp_path, monkeypatch, capsys
):
    """`$TANDEM_CLOUD_URL=ws://host:port` (the settings' cloud_url and --cloud-url reach the
    same client): `tandem ask --mode cloud` answers."""
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("TANDEM_CLOUD_URL", _bare(cloud))
    monkeypatch.setenv("TANDEM_CLOUD_TOKEN", TOKEN)
    save_settings(Settings(device_model=str(tiny["onnx-quant"]), k=1, max_tokens=6))
    args = build_parser().parse_args(["ask", "Hello there", "--mode", "cloud", "--json"])
    assert await run_ask(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["answer"] and not out["errors"], out
    assert out["stats"]["mode"] == "cloud" and out["stats"]["bytes_down"] > 0


@pytest.mark.parametrize(
    "url",
    [
        "ws://127.0.0.1:9/v1/session?token=SECRET-IN-URL",
        "ws://me:SECRET-IN-URL@127.0.0.1:9/v1/session",
        "ws://127.0.0.1:9/v1/session#SECRET-IN-URL",
    ],
)
async def test_a_token_written_into_the_url_is_never_shown(url, caplog):
    """A cloud that cannot be reached is named in the message, the status bar and the log
    without its user info, query or fragment (where a token pasted into the URL would be)."""
    from app.assistant import Assistant
    from edge_runtime.client import shown_url

    assert shown_url(url) == "ws://127.0.0.1:9/v1/session"
    client = CloudClient(url, TOKEN, Mode.CLOUD, "", b"\0" * 32, "device", connect_timeout=2)
    with pytest.raises(CloudUnavailable) as refused:
        await client.connect()
    assert "SECRET" not in str(refused.value) and "127.0.0.1:9/v1/session" in str(refused.value)
    heard = []  # no device model: the status goes starting → ready without a handshake
    assistant = Assistant(Settings(cloud_url=url, cloud_token=TOKEN))
    await assistant.connect_cloud(on_status=heard.append)
    assert [s.state for s in heard] == ["starting", "ready"]
    assert all(s.detail == "ws://127.0.0.1:9/v1/session" for s in heard)
    assert "SECRET" not in caplog.text
