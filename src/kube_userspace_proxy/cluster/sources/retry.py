"""Retry timing for the API client: rate limit, backoff, Retry-After.

A token bucket and jittered exponential backoff in the manner of client-go's flowcontrol and
wait.Backoff, and the parsing of an API server's Retry-After header.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Callable

MAX_RETRY_AFTER = 600.0  # seconds; a longer Retry-After is honoured only this far


class RateLimiter:
    """Token bucket: `qps` requests per second on average, bursts of `burst` (client-go's)."""

    def __init__(
        self, qps: float, burst: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._qps = qps
        self._burst = float(max(1, burst))
        self._tokens = self._burst
        self._clock = clock
        self._last = clock()

    async def acquire(self) -> None:
        """Wait for a token; qps <= 0 means unlimited."""
        if self._qps <= 0:
            return
        while True:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._qps)
            self._last = now
            if self._tokens >= 1:
                self._tokens -= 1
                return
            await asyncio.sleep((1 - self._tokens) / self._qps)


class Backoff:
    """Exponential backoff with jitter: each delay is drawn from [base/2, base], base doubling."""

    def __init__(
        self,
        initial: float,
        maximum: float,
        *,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self._initial = initial
        self._maximum = maximum
        self._rng = rng
        self._base = initial
        self.failures = 0

    def next(self, at_least: float = 0.0) -> float:
        """The delay before the next attempt; never below `at_least` (a Retry-After)."""
        delay = self._base * (0.5 + self._rng() / 2)
        self._base = min(self._maximum, self._base * 2)
        self.failures += 1
        return max(delay, at_least)

    def reset(self) -> None:
        self._base = self._initial
        self.failures = 0


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
