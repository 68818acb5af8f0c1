"""Bounded-frequency runner: coalesce change notifications into syncs.

Like kube-proxy's BoundedFrequencyRunner: a requested sync runs as soon as `min_interval` has
passed since the previous one started, however many requests arrived meanwhile; with no request
a sync still runs every `max_interval` (the periodic resync that repairs tampered rules). A
failed sync is retried after `min_interval` (at least `retry_interval`). `fn` returning False
means "nothing to do yet" (no sync happened): it does not count against `min_interval`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from kube_userspace_proxy import logs

log = logs.get(__name__)


class BoundedFrequencyRunner:
    """Runs `fn` no more often than `min_interval` and at least every `max_interval`."""

    def __init__(
        self,
        fn: Callable[[], Awaitable[bool | None]],
        *,
        min_interval: float,
        max_interval: float,
        retry_interval: float = 1.0,
        name: str = "sync",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fn = fn
        self._min = min_interval
        self._max = max_interval
        self._retry = max(retry_interval, min_interval)
        self._name = name
        self._clock = clock
        self._wake = asyncio.Event()
        self._last_start = float("-inf")
        self.runs = 0
        self.failures = 0

    def request(self) -> None:
        """Ask for a sync soon; cheap and safe to call from any callback on the loop."""
        self._wake.set()

    async def _wait(self, seconds: float) -> bool:
        """Wait until requested or `seconds` pass; True when requested."""
        if seconds <= 0:
            return self._wake.is_set()
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def loop(self) -> None:
        """Run forever (a root task): sync when requested, rate-limited, and periodically."""
        next_periodic = self._clock()  # the first sync runs at once
        while True:
            now = self._clock()
            requested = self._wake.is_set() or await self._wait(next_periodic - now)
            if requested:
                # Hold back until min_interval since the previous start has passed.
                delay = self._last_start + self._min - self._clock()
                if delay > 0:
                    await asyncio.sleep(delay)
            self._wake.clear()
            started = self._clock()
            try:
                done = await self._fn()
            except asyncio.CancelledError:
                raise
            except Exception:
                self._last_start = started
                self.failures += 1
                log.exception("%s failed; retrying in %.1fs", self._name, self._retry)
                next_periodic = self._clock() + self._retry
                continue
            if done is False:
                # Nothing was synced (e.g. still waiting for the first lists): the next
                # request may run at once, and the periodic clock has not started.
                next_periodic = self._clock() + self._max
                continue
            self._last_start = started
            self.runs += 1
            next_periodic = self._clock() + self._max
