"""What is applied when: each change at once to listeners and pools; rules by the runner.

The apply loop takes the changes since the last snapshot and serves them at once (no rule
commit); when a rule target changed, it asks the bounded-frequency runner for a sync, which
commits the rules (and, periodically, resyncs the complete state). After each apply and sync,
`_after` brings health, metrics, the latency tracker and the state file up to date.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any

from kube_userspace_proxy import collector, logs
from kube_userspace_proxy.app.latency import LatencyTracker
from kube_userspace_proxy.app.runner import BoundedFrequencyRunner
from kube_userspace_proxy.app.saver import StateSaver
from kube_userspace_proxy.cluster.state import ClusterState
from kube_userspace_proxy.model import Change, Snapshot
from kube_userspace_proxy.ops.health import ProxyHealth
from kube_userspace_proxy.ops.metrics import ProxyMetrics
from kube_userspace_proxy.ops.servicehealth import NoLocalEndpoints, ServiceHealthServers
from kube_userspace_proxy.proxier.reconciler import Proxier

log = logs.get(__name__)


class Pipeline:
    """The apply loop and the runner's sync: the cluster state -> the proxier, then reports."""

    def __init__(
        self,
        state: ClusterState,
        proxier: Proxier[Any],
        *,
        health: ProxyHealth,
        metrics: ProxyMetrics,
        service_health: ServiceHealthServers,
        saver: StateSaver,
        first_build: collector.Hold,
        configured: Callable[[Snapshot | Change], Snapshot | Change],
        sync_lock: asyncio.Lock,
        apply_lock: asyncio.Lock,
        min_sync_period: float,
        sync_period: float,
    ) -> None:
        self._state = state
        self._proxier = proxier
        self._health = health
        self._metrics = metrics
        self._service_health = service_health
        self._saver = saver
        self._first_build = first_build
        self._configured = configured
        self._sync_lock = sync_lock
        self._apply_lock = apply_lock
        self.synced_once = asyncio.Event()
        self.serving = asyncio.Event()
        """Set once something is served (restored from a file or a handover, or synced)."""
        self.syncs = 0
        """Syncs completed (listeners, workers and rules all updated)."""
        self.applies = 0
        """Changes applied to listeners and pools outside the sync runner (no rule commit)."""
        self.applied_once = False
        """True once a complete sync applied the state (until an apply fails)."""
        self._apply_wanted = asyncio.Event()
        self._no_local = NoLocalEndpoints()
        self._latency = LatencyTracker(metrics.network_programming)
        self._frozen_at = 0  # service ports at the last gc.freeze()
        self.runner = BoundedFrequencyRunner(
            self.sync_once,
            min_interval=min_sync_period,
            max_interval=sync_period,
            name="sync",
        )

    def changed(self) -> None:
        """The cluster state changed: queue an apply (the state's `on_change`)."""
        self._health.queued_update()
        self._metrics.sync_queued()
        self._apply_wanted.set()

    async def apply_loop(self) -> None:
        """Apply each change to listeners and pools at once (a root task); rules follow.

        An endpoint change that needs no rule change reaches the balancer pools (and the
        workers) here, without waiting for the sync runner's rate limit; a change that does
        (a new, changed or removed service port) is served here too, and the runner is asked
        for the rule commit, bounded by `--iptables-min-sync-period` as in kube-proxy.
        Changes that arrive while one batch is applied are coalesced into the next.
        """
        while True:
            await self._apply_wanted.wait()
            await asyncio.sleep(0)  # let the events of this turn in: one batch for them
            self._apply_wanted.clear()
            if not self._state.listed:
                continue
            if not self.applied_once:
                self.runner.request()  # the first sync is complete, and the runner's
                continue
            try:
                async with self._apply_lock:
                    await self.apply_changes()
            except Exception:
                # The changes taken are not applied: the runner's next sync takes the complete
                # state (and retries as any failed sync), and applies wait for it.
                log.exception("applying changes failed; a complete sync follows")
                self.applied_once = False
                self.runner.request()

    async def apply_changes(self) -> None:
        """Apply what changed since the last snapshot to listeners and pools (no rule commit)."""
        started = time.monotonic()
        snapshot = self._snapshot(self._state.changes())
        await self._proxier.sync(snapshot, full=False, rules=False)
        self.applies += 1
        await self._after(snapshot)
        if self._proxier.rules_pending:
            self.runner.request()
        else:  # nothing waits for a rule commit: this change is synced
            self._metrics.sync_done(time.monotonic() - started, full=False)
            self._health.synced()

    async def sync_once(self) -> bool:
        """One sync of listeners, workers and rules to the current state; False if not listed.

        The runner calls it for the rule commit the changes asked for (the changes since the
        last apply come with it), and periodically with the complete state (a full resync).
        """
        async with self._sync_lock:
            return await self._sync_once()

    async def _sync_once(self) -> bool:
        state = self._state
        if not state.listed:
            log.debug("sync skipped: waiting for the first complete list of Services and slices")
            return False
        started = time.monotonic()
        complete = self.runner.periodic or not self.applied_once
        snapshot = self._snapshot(state.snapshot() if complete else state.changes())
        proxier = self._proxier
        commits = proxier.rule_applies
        await proxier.sync(snapshot, full=self.runner.periodic)
        self.applied_once = True
        # A commit went live before its deferred deletes, which the sync waited for too.
        live = proxier.rules_live_at if proxier.rule_applies != commits else None
        await self._after(snapshot, live=live)
        self._first_build.end()
        self._metrics.sync_done(time.monotonic() - started, full=complete)
        self._health.synced()
        self.syncs += 1
        self.synced_once.set()
        self.serving.set()
        return True

    def _snapshot(self, snapshot: Snapshot | Change) -> Snapshot | Change:
        self._health.set_node_eligible(self._state.node_eligible)
        return self._configured(snapshot)

    async def _after(self, snapshot: Snapshot | Change, *, live: float | None = None) -> None:
        """What follows each sync and each apply: health servers, metrics, latency, state file.

        `live`: when (time.time) a rule commit of this sync made its rules live; changes are
        measured to then (default: now)."""
        proxier = self._proxier
        self._freeze_long_lived(proxier.served_count)
        await self._service_health.sync(snapshot)
        metrics = self._metrics
        metrics.set_no_local_endpoints(*self._no_local.update(snapshot))
        metrics.set_over_budget(proxier.over_budget())
        metrics.add_changes(snapshot.service_changes, snapshot.endpoint_changes)
        state = self._state
        metrics.set_pending(state.pending_service_changes, state.pending_endpoint_changes)
        self._latency.served(
            snapshot.trigger_times,
            at=time.time() if live is None else live,
            # Served only once the rules name the new ports: measured at that commit.
            awaiting=proxier.rules_generation if proxier.rules_pending else None,
            committed=proxier.committed_generation,
        )
        if not isinstance(snapshot, Change) or snapshot.changed:
            self._saver.later()

    def _freeze_long_lived(self, service_ports: int) -> None:
        """Keep the long-lived state out of the cyclic garbage collector's full passes.

        At 10,000 service ports a full pass over the state, listeners and pools takes
        ~600 ms, a stall of the event loop that allocation (an endpoint storm) triggers over
        and over. Freezing what is alive once the service ports have grown by half spares
        those passes; later garbage is collected as usual.
        """
        if service_ports > 1.5 * self._frozen_at + 100:
            gc.freeze()
            self._frozen_at = service_ports
            log.debug("%d objects kept out of garbage collection", gc.get_freeze_count())
