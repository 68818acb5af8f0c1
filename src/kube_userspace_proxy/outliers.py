"""Passive outlier ejection: which endpoints to take out after runs of failed dials, for how
long, and the node's record of it (logged, counted for /metrics).

The control process decides for the workers (they report each failed dial, and a success
after one); a single process decides in its pools (`balancer.EndpointPool.outliers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Callable, Sequence

from kube_userspace_proxy import logs
from kube_userspace_proxy.model import MAX_EJECTION_SECONDS, Address, ServicePortName

log = logs.get(__name__)


def endpoint_label(address: Address) -> str:
    """An endpoint as a metric label and log word: `ip:port`, `[ip]:port` for IPv6."""
    ip, port = address
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class EjectionRecord:
    """The node's ejections for /metrics, read from the live pools' `Outliers` at scrape
    time: a service port or an endpoint that goes takes its series with it."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[Outliers] = weakref.WeakSet()

    def add(self, outliers: Outliers) -> None:
        self._live.add(outliers)

    @property
    def totals(self) -> dict[tuple[str, str], int]:
        """(service port, endpoint) -> its ejections so far (endpoints still in the pool)."""
        out: dict[tuple[str, str], int] = {}
        for outliers in list(self._live):
            name = str(outliers.name)
            for address, times in outliers.ejections.items():
                key = (name, endpoint_label(address))
                out[key] = out.get(key, 0) + times
        return out

    def ejected_now(self) -> int:
        """Endpoints ejected now, on every service port."""
        return sum(len(outliers.ejected()) for outliers in list(self._live))


ejections = EjectionRecord()
"""The process's record of ejections (the control process's: it decides every one)."""


class Outliers:
    """Passive outlier ejection for one pool: Envoy's consecutive-failure detector on dials.

    `failures` consecutive failed dials to an endpoint (0: never) eject it for `base` seconds
    times its ejections so far, at most `MAX_EJECTION_SECONDS`; a success ends the run. At
    most max(1, 10 %) of the pool's endpoints are out at once, and none is ejected when fewer
    than half would be left (Envoy's panic threshold). An endpoint back from an ejection is
    dialed again; its next failure, before a success, ejects it again.
    """

    __slots__ = (
        "__weakref__",  # the process's record reads the live ones
        "_clock",
        "_ejections",
        "_probation",
        "_streak",
        "_until",
        "base",
        "failures",
        "name",
    )

    def __init__(
        self,
        name: ServicePortName,
        *,
        failures: int = 5,
        base: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.failures = failures
        self.base = base
        self._clock = clock
        self._streak: dict[Address, int] = {}
        self._ejections: dict[Address, int] = {}
        self._until: dict[Address, float] = {}
        self._probation: set[Address] = set()
        ejections.add(self)

    def failed(self, address: Address, endpoints: int) -> float:
        """A dial to `address` (one of `endpoints` usable ones) failed: the seconds it is
        ejected for from now (0: it is not)."""
        if self.failures <= 0:
            return 0.0
        now = self._clock()
        until = self._until.get(address)
        if until is not None:
            if until > now:
                return 0.0  # out already: dials begun before it went
            self._return(address)
        streak = self._streak.get(address, 0) + 1
        self._streak[address] = streak
        if streak < self.failures and address not in self._probation:
            return 0.0
        out = sum(1 for u in self._until.values() if u > now)
        if out + 1 > max(1, endpoints // 10):
            return 0.0  # as many out as may be: it stays in, its run goes on
        if endpoints - out - 1 < endpoints / 2:
            return 0.0  # panic threshold: fewer than half would be left
        times = self._ejections.get(address, 0) + 1
        seconds = min(self.base * times, MAX_EJECTION_SECONDS)
        self._ejections[address] = times
        self._until[address] = now + seconds
        del self._streak[address]
        self._probation.discard(address)
        log.warning(
            "%s: endpoint %s ejected for %gs after %d consecutive failed dials (ejection %d)",
            self.name,
            endpoint_label(address),
            seconds,
            streak,
            times,
        )
        with contextlib.suppress(RuntimeError):  # no loop (tests): seen when next read
            asyncio.get_running_loop().call_later(seconds, _check_returns, weakref.ref(self))
        return seconds

    @property
    def ejections(self) -> dict[Address, int]:
        """Each endpoint's ejections so far (while it stays in the pool)."""
        return self._ejections

    def succeeded(self, address: Address) -> None:
        """A dial to `address` connected: its run of failures (and its probation) ends."""
        self._streak.pop(address, None)
        self._probation.discard(address)

    def ejected(self) -> list[tuple[Address, float]]:
        """The endpoints out now: (endpoint, seconds left)."""
        self.check_returns()
        now = self._clock()
        return [(a, u - now) for a, u in self._until.items()]

    def check_returns(self) -> None:
        """Log the return of every endpoint whose ejection is over."""
        now = self._clock()
        for address in [a for a, u in self._until.items() if u <= now]:
            self._return(address)

    def _return(self, address: Address) -> None:
        del self._until[address]
        self._probation.add(address)
        log.warning(
            "%s: endpoint %s returns after its ejection; one more failed dial ejects it again",
            self.name,
            endpoint_label(address),
        )

    def keep(self, addresses: Sequence[Address]) -> None:
        """Forget the endpoints not among `addresses` (gone from the pool)."""
        alive = set(addresses)
        for table in (self._streak, self._ejections, self._until):
            for gone in [a for a in table if a not in alive]:
                del table[gone]
        self._probation &= alive


def _check_returns(ref: weakref.ref[Outliers]) -> None:
    """An ejection's time is up: log the return, unless its pool is gone meanwhile."""
    outliers = ref()
    if outliers is not None:
        outliers.check_returns()
