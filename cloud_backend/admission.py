"""Who may come in, and how often: wrong access tokens throttled per client (as seen through
the trusted proxies), and each access token's requests held to a rate (a token bucket), so one
credential cannot take the cloud."""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class AuthThrottle:
    """Wrong tokens are counted per client; past `limit` within `window` seconds a wrong token
    from that client gets 429 with Retry-After until the oldest failure ages out. A right
    token is let in whatever its client's count (so no one can lock a user out by guessing
    from the same address: a shared NAT, the balancer, or 127.0.0.1 on the embedded cloud).
    At most `max_clients` clients are remembered, the longest quiet forgotten first."""

    def __init__(self, limit: int, window: float, max_clients: int = 10_000) -> None:
        self.limit, self.window, self.max_clients = limit, window, max_clients
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._failures)

    def retry_after(self, client: str) -> float:
        """0 if `client` is under its limit, else the seconds until it is."""
        failures, now = self._failures.get(client), time.monotonic()
        if failures is None:
            return 0.0
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        if not failures:
            del self._failures[client]
            return 0.0
        return failures[0] + self.window - now if len(failures) >= self.limit else 0.0

    def failed(self, client: str) -> None:
        failures = self._failures.setdefault(client, deque(maxlen=self.limit))
        failures.append(time.monotonic())
        self._failures.move_to_end(client)
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)


def client_address(peer: str | None, forwarded_for: str, proxies: Sequence[IPNetwork]) -> str:
    """The client a request comes from: its peer, unless the peer is a trusted proxy; then
    the nearest address in X-Forwarded-For that is not one (each proxy appends the address
    it saw, so only the entries our own proxies wrote can be believed)."""
    if peer is None:
        return "?"
    if not proxies or not _trusted(peer, proxies):
        return peer
    for hop in reversed([h.strip() for h in forwarded_for.split(",") if h.strip()]):
        if not _trusted(hop, proxies):
            return hop
    return peer


def _trusted(address: str, proxies: Sequence[IPNetwork]) -> bool:
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return False  # not an address (a proxy's "unknown"): never a proxy of ours
    return any(ip.version == net.version and ip in net for net in proxies)


class RequestRate:
    """`per_minute` requests per access token, in bursts of up to a minute's worth (a token
    bucket per token name; 0 turns it off). Sessions of the same token share one bucket."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._buckets: dict[str, tuple[float, float]] = {}  # name -> (tokens left, when)

    def take(self, name: str) -> float:
        """Spend one request of `name`'s: 0 if it may run now, else the seconds until one is
        available (nothing is spent then)."""
        if self.per_minute <= 0:
            return 0.0
        now, rate = time.monotonic(), self.per_minute / 60.0
        left, then = self._buckets.get(name, (float(self.per_minute), now))
        left = min(float(self.per_minute), left + (now - then) * rate)
        if left < 1.0:
            self._buckets[name] = (left, now)
            return (1.0 - left) / rate
        self._buckets[name] = (left - 1.0, now)
        return 0.0
