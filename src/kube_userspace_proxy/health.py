"""kube-proxy's health semantics for `/healthz` and `/livez` (pkg/proxy/healthcheck).

`/healthz`: the proxy is healthy while it starts and whenever no queued change has waited
longer than twice the sync period for a successful sync; it is also unhealthy while the node is
being deleted or tainted `ToBeDeletedByClusterAutoscaler`, so that cloud load balancers stop
sending traffic to a node about to go.

`/livez` differs from kube-proxy's on purpose: it reports only whether the process and its
event loop are alive (a heartbeat task beats every second; 503 once no beat came for
`LOOP_STALL_SECONDS`). A rules-sync failure never fails it: the data plane of a proxy whose
iptables runs fail still carries every Service already programmed, and a kubelet restart
would cut those connections without fixing iptables. `/healthz` and
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

_ZERO_TIME = "0001-01-01T00:00:00Z"
"""What kube-proxy (Go's zero time.Time) reports as lastUpdated before the first sync."""


def rfc3339(timestamp: float) -> str:
    """Format epoch seconds as RFC 3339 in UTC with milliseconds: `2024-05-01T12:00:00.123Z`."""
    moment = datetime.fromtimestamp(timestamp, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _status(healthy: bool) -> int:
    return HTTP_OK if healthy else HTTP_UNAVAILABLE


class ProxyHealth:
    """Tracks queued changes, successful syncs and node eligibility; answers health probes.

    Called from the event loop only (sync runner, node watch, HTTP handlers): no locking.
    """

    def __init__(self, sync_period: float, clock: Callable[[], float] = time.time) -> None:
        self._timeout = 2.0 * sync_period
        self._clock = clock
        self._last_updated: float | None = None
        self._oldest_queued: float | None = None
        # Eligible until the first node event says otherwise (kube-proxy does the same).
        self._node_eligible = True
        self._last_beat: float | None = None  # None: no heartbeat task runs (yet)

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
        if self._last_beat is None:
            return True
        return self._clock() - self._last_beat <= LOOP_STALL_SECONDS

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
        # kube-proxy reports lastUpdated = now while healthy (older releases showed the time of
        # the last sync loop run, which was always recent when healthy); keep that contract.
        if healthy:
            last = rfc3339(now)
        elif self._last_updated is None:
            last = _ZERO_TIME
        else:
            last = rfc3339(self._last_updated)
        return {"lastUpdated": last, "currentTime": rfc3339(now)}
