"""Bounded-frequency runner: coalesce change notifications into syncs.

In the manner of kube-proxy's BoundedFrequencyRunner: requests are coalesced, and syncs are
rate-limited by a token bucket that earns one sync per `min_interval` and holds at most
`burst` of them. After a quiet spell two changes that arrive together (a Service, then its
EndpointSlice) both go live at once; a sustained storm still gets one sync per `min_interval`.
With no request a sync still runs every `max_interval` (the periodic resync that repairs
tampered rules). A failed sync is retried after `retry_interval` (at least `min_interval`).
`fn` returning False means "nothing to do yet" (no sync happened): its token is given back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from kube_userspace_proxy import logs

log = logs.get(__name__)

BURST_SYNCS = 2
"""kube-proxy's burstSyncs: syncs allowed back to back after a quiet spell."""


class BoundedFrequencyRunner:
    """Runs `fn` on request, at most `burst` at once and one per `min_interval` on average."""

    def __init__(
        self,
        fn: Callable[[], Awaitable[bool | None]],
        *,
        min_interval: float,
        max_interval: float,
        retry_interval: float = 1.0,
        burst: int = BURST_SYNCS,
        name: str = "sync",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fn = fn
        self._min = min_interval
        self._max = max_interval
        self._retry = max(retry_interval, min_interval)
        self._burst = float(max(1, burst))
        self._name = name
        self._clock = clock
        self._wake = asyncio.Event()
        self._tokens = self._burst
        self._refilled = clock()
        self.runs = 0
        self.failures = 0
        self.held = 0
        """Requested syncs that waited for a token: held back by `min_interval`."""
        self.periodic = True
        """True while `fn` runs for the periodic resync (or a retry), not for a request."""

    def request(self) -> None:
        """Ask for a sync soon; cheap and safe to call from any callback on the loop."""
        self._wake.set()

    def _refill(self) -> None:
        now = self._clock()
        if self._min > 0:
            self._tokens = min(self._burst, self._tokens + (now - self._refilled) / self._min)
        else:
            self._tokens = self._burst
        self._refilled = now

    async def _take_token(self) -> None:
        """Wait until a sync is allowed, then spend one."""
        self._refill()
        if self._tokens < 1:
            self.held += 1
            await asyncio.sleep((1 - self._tokens) * self._min)
            self._refill()
        self._tokens = max(0.0, self._tokens - 1)

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
                await self._take_token()
            else:
                # The periodic resync is not held back, but it spends what it can: a
                # storm that starts right after it still waits its turn.
                self._refill()
                self._tokens = max(0.0, self._tokens - 1)
            self._wake.clear()
            self.periodic = not requested
            try:
                done = await self._fn()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.failures += 1
                log.exception("%s failed; retrying in %.1fs", self._name, self._retry)
                next_periodic = self._clock() + self._retry
                continue
            if done is False:
                # Nothing was synced (e.g. still waiting for the first lists): the token is
                # given back, and the periodic clock has not started.
                self._tokens = min(self._burst, self._tokens + 1)
                next_periodic = self._clock() + self._max
                continue
            self.runs += 1
            next_periodic = self._clock() + self._max
