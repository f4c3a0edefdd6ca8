"""Who may come in, and how often: wrong access tokens throttled per address, and each access
token's requests held to a rate (a token bucket), so one credential cannot take the cloud."""

from __future__ import annotations

import time
from collections import defaultdict, deque


class AuthThrottle:
    """Wrong tokens are counted per address; past `limit` within `window` seconds every try
    from that address gets 429 with Retry-After until the oldest failure ages out (guessing
    the token costs time). The right token does not reset the count."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit, self.window = limit, window
        self._failures: defaultdict[str, deque[float]] = defaultdict(deque)

    def retry_after(self, peer: str) -> float:
        """0 if `peer` may try now, else the seconds until it may."""
        failures, now = self._failures[peer], time.monotonic()
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        if not failures:
            del self._failures[peer]
            return 0.0
        return failures[0] + self.window - now if len(failures) >= self.limit else 0.0

    def failed(self, peer: str) -> None:
        self._failures[peer].append(time.monotonic())


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
