"""kube-proxy's health semantics for `/healthz` and `/livez` (pkg/proxy/healthcheck).

`/healthz`: the proxy is healthy while it starts and whenever no queued change has waited
longer than twice the sync period for a successful sync; it is also unhealthy while the node is
being deleted or tainted `ToBeDeletedByClusterAutoscaler`, so that cloud load balancers stop
sending traffic to a node about to go.

`/livez` differs from kube-proxy's on purpose: it reports only whether the process and its
event loops are alive (a heartbeat task beats every second, and each worker process answers a
ping every second; 503 once one of them missed `LOOP_STALL_SECONDS`). A rules-sync failure
never fails it: the data plane of a proxy whose iptables runs fail still carries every Service
already programmed, and a kubelet restart would cut those connections without fixing
iptables. `/healthz` and
`kubeproxy_sync_proxy_rules_iptables_restore_failures_total` show that failure instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

HTTP_OK = 200
HTTP_UNAVAILABLE = 503

LOOP_STALL_SECONDS = 10.0
"""A heartbeat older than this means the event loop stalled: `/livez` answers 503."""
HEARTBEAT_SECONDS = 1.0
LAG_SAMPLE_SECONDS = 0.02
"""How often the control loop's lag is sampled while the loop is busy (`watch_lag`): 500
samples in a 10 s storm."""
LAG_IDLE_SECONDS = 0.25
"""How often it is sampled while the loop is idle: on this 2-vCPU VM each wake-up of an idle
process costs ~0.2 ms of CPU, so 50 a second would cost 1 % of a core by themselves."""
LAG_BUSY_SHARE = 0.05
"""The loop thread's CPU share over the last interval above which the loop counts as busy."""

_ZERO_TIME = "0001-01-01T00:00:00Z"
"""What kube-proxy (Go's zero time.Time) reports as lastUpdated before the first sync."""


def rfc3339(timestamp: float) -> str:
    """Epoch seconds as Go's RFC3339Nano in UTC, as kube-proxy's JSON has its times:
    `2024-05-01T12:00:00.123456789Z`, trailing zeros of the fraction dropped."""
    # A float clock carries microseconds at best; more digits would be noise.
    micros = round(timestamp * 1e6)
    seconds, fraction = divmod(micros, 1_000_000)
    text = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    digits = f"{fraction:06d}".rstrip("0")
    return f"{text}.{digits}Z" if digits else f"{text}Z"


def _status(healthy: bool) -> int:
    return HTTP_OK if healthy else HTTP_UNAVAILABLE


class ProxyHealth:
    """Tracks queued changes, successful syncs and node eligibility; answers health probes.

    Called from the event loop only (sync runner, node watch, HTTP handlers): no locking.
    """

    def __init__(
        self,
        sync_period: float,
        clock: Callable[[], float] = time.time,
        families: tuple[str, ...] = ("IPv4",),
    ) -> None:
        self._families = families
        self._timeout = 2.0 * sync_period
        self._clock = clock
        self._last_updated: float | None = None
        self._oldest_queued: float | None = None
        # Eligible until the first node event says otherwise (kube-proxy does the same).
        self._node_eligible = True
        self._last_beat: float | None = None  # None: no heartbeat task runs (yet)
        self._other_loops: Callable[[], float] | None = None

    @property
    def timeout(self) -> float:
        """Seconds a queued change may wait for a sync before the proxy turns unhealthy."""
        return self._timeout

    @property
    def node_eligible(self) -> bool:
        return self._node_eligible

    @property
    def last_updated(self) -> float | None:
        """Epoch seconds of the last successful sync; None before the first one."""
        return self._last_updated

    def queued_update(self) -> None:
        """A change arrived that needs a sync; only the oldest unsynced one counts."""
        if self._oldest_queued is None:
            self._oldest_queued = self._clock()

    def synced(self) -> None:
        """A sync succeeded: everything queued so far is applied."""
        self._oldest_queued = None
        self._last_updated = self._clock()

    def set_node_eligible(self, eligible: bool) -> None:
        """False while our Node is being deleted or tainted ToBeDeletedByClusterAutoscaler."""
        self._node_eligible = eligible

    def watch_loops(self, stalest: Callable[[], float]) -> None:
        """Also require other event loops (the workers'): `stalest()` is the seconds since
        the slowest of them last answered."""
        self._other_loops = stalest

    def beat(self) -> None:
        """The event loop ran the heartbeat: it is alive now."""
        self._last_beat = self._clock()

    async def heartbeat(self, interval: float = HEARTBEAT_SECONDS) -> None:
        """Beat every `interval` seconds, forever (a root task of the process)."""
        while True:
            self.beat()
            await asyncio.sleep(interval)

    def is_alive(self) -> bool:
        """False when the event loop missed its heartbeat for `LOOP_STALL_SECONDS`."""
        if self._other_loops is not None and self._other_loops() > LOOP_STALL_SECONDS:
            return False
        if self._last_beat is None:
            return True
        return self._clock() - self._last_beat <= LOOP_STALL_SECONDS

    def is_ready(self) -> bool:
        """True once a complete sync has programmed the proxy, while it stays healthy.

        What the chart's readiness probe asks (`/readyz`): unlike `/healthz`, which is healthy
        while the proxy starts (kube-proxy's rule), a pod that cannot reach the API server and
        has programmed nothing is not Ready.
        """
        return self._last_updated is not None and self.is_healthy()

    def readyz(self) -> tuple[int, dict[str, Any]]:
        """HTTP status and JSON body of `/readyz`: the first complete sync is done, healthy."""
        now = self._clock()
        ready = self.is_ready()
        body = self._body(ready, now)
        body["ready"] = ready
        return _status(ready), body

    def is_healthy(self) -> bool:
        """The proxier's own health, ignoring the node: no change waits too long for a sync."""
        if self._oldest_queued is None:
            return True
        return self._clock() - self._oldest_queued <= self._timeout

    def livez(self) -> tuple[int, dict[str, Any]]:
        """HTTP status and JSON body of `/livez`: the event loop's liveness only."""
        now = self._clock()
        alive = self.is_alive()
        return _status(alive), self._body(self.is_healthy() and alive, now)

    def healthz(self) -> tuple[int, dict[str, Any]]:
        """HTTP status and JSON body of `/healthz`: sync health and node eligibility."""
        now = self._clock()
        healthy = self.is_healthy() and self._node_eligible
        body = self._body(healthy, now)
        body["nodeEligible"] = self._node_eligible
        return _status(healthy), body

    def _body(self, healthy: bool, now: float) -> dict[str, Any]:
        # kube-proxy's body: lastUpdated = now while healthy (older releases showed the time of
        # the last sync loop run, which was always recent when healthy), `healthy`, and a
        # `status` per IP family (one sync programs every family here, so they agree).
        if healthy:
            last = rfc3339(now)
        elif self._last_updated is None:
            last = _ZERO_TIME
        else:
            last = rfc3339(self._last_updated)
        synced = rfc3339(self._last_updated) if self._last_updated is not None else _ZERO_TIME
        proxier_healthy = self.is_healthy()
        return {
            "lastUpdated": last,
            "currentTime": rfc3339(now),
            "healthy": healthy,
            "status": {
                family: {"lastUpdated": synced, "healthy": proxier_healthy}
                for family in self._families
            },
        }


async def watch_lag(
    observe: Callable[[float], None],
    interval: float = LAG_SAMPLE_SECONDS,
    idle_interval: float = LAG_IDLE_SECONDS,
    cpu_clock: Callable[[], float] = time.thread_time,
) -> None:
    """Forever: observe how late a timer fires on this event loop (run it on the loop's thread).

    The loop's lag is what every callback on it waits beyond its time: a collector pass, a
    long step of work, or no CPU free for the process all show up here, from inside the
    process (a probe from outside adds its own wait for a CPU). The timer is `interval` while
    the loop's thread used more than LAG_BUSY_SHARE of a CPU over the last one, else
    `idle_interval`: an idle proxy is not woken 50 times a second for it. (`cpu_clock` is the
    thread's CPU clock; tests give one whose business they choose.)
    """
    loop = asyncio.get_running_loop()
    wait = idle_interval
    cpu = cpu_clock()
    while True:
        due = loop.time() + wait
        await asyncio.sleep(wait)
        now = loop.time()
        observe(max(0.0, now - due))
        spent = cpu_clock()
        used, cpu = spent - cpu, spent
        wait = interval if used > LAG_BUSY_SHARE * (now - due + wait) else idle_interval
