"""Which cloud a device talks to, as one stable string: what consent is remembered under and
what a shared turn's provenance names, so history goes back only to the cloud that saw it.

It is derived from the session URL (scheme, host, port, path: no user info, query or token)
and the server's own name for itself (the model it announced at handshake). The embedded
cloud this device starts on loopback is one identity whatever its port: it runs on this
device, and counts as on-device."""

from __future__ import annotations

from urllib.parse import urlsplit

EMBEDDED = "embedded"
"""The identity of the cloud Tandem starts on this device (its port changes every start)."""


def cloud_identity(url: str, server_name: str = "", *, embedded: bool = False) -> str:
    """`embedded`, or `scheme://host:port/path` and, after a space, the server's name in
    brackets (`wss://cloud.example:443/v1/session [Qwen2.5-1.5B-Instruct]`)."""
    if embedded:
        return EMBEDDED
    from edge_runtime.client import session_url

    try:
        parts = urlsplit(session_url(url.strip()))
        port = parts.port
    except ValueError:  # not a URL: still one identity, never another cloud's
        return url.strip()
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    port = port or (443 if scheme == "wss" else 80)
    identity = f"{scheme}://{host}:{port}{parts.path}"
    return f"{identity} [{server_name}]" if server_name else identity


def on_device(identity: str | None) -> bool:
    """Whether that cloud runs on this device (what it sees never left the device)."""
    return identity == EMBEDDED
