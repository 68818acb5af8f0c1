"""A worker's side of what the node's workers share about balancing: its column of the `lc`
counts (`nodecounts`), the successes after failed dials it reports (`Recovered`), and the
ejections the control process decides (`Eject`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol

from kube_userspace_proxy.model import SCHEDULERS, Address
from kube_userspace_proxy.nodecounts import NodeCounts
from kube_userspace_proxy.workers import protocol
from kube_userspace_proxy.workers.protocol import Eject, Recovered, Scheduled


class Pool(Protocol):
    """A worker's pool as this module drives it (`process._Pool`)."""

    sched: Scheduled

    def set_scheduler(self, name: str) -> None: ...

    def share_counts(
        self, counts: NodeCounts | None, worker: int, slots: tuple[int, ...]
    ) -> None: ...

    def penalize(self, address: Address, seconds: float) -> None: ...

    def take_slot(self, slot: int, slots: int) -> None: ...


class NodeWide:
    """The shared counts as worker `index` uses them, and its reports and ejections."""

    def __init__(
        self,
        counts: NodeCounts | None,
        index: int,
        writer: asyncio.StreamWriter,
        pools: Mapping[int, Pool],
    ) -> None:
        self.counts = counts
        """The node's shared active-connection counts (lc); None: this worker's own only."""
        self.index = index
        self._writer = writer
        self._pools = pools  # the worker's, by pool id (the same mapping, kept up to date)
        self._cleared = False

    def take(self, pool: Pool, scheduled: Scheduled) -> None:
        """Have `pool` pick as the table says; lc counts in this worker's column."""
        pool.sched = scheduled
        code, slots = scheduled
        pool.set_scheduler(SCHEDULERS[code] if 0 <= code < len(SCHEDULERS) else "rr")
        pool.share_counts(self._counting(slots), self.index, slots)

    def become(self, index: int, slots: int) -> None:
        """This worker (a spare) took slot `index` of `slots`: its pools start their round
        robins at the slot's place if they have not picked yet, and lc counts in its column."""
        self.index = index
        self._cleared = False
        for pool in self._pools.values():
            pool.take_slot(index, slots)
            if pool.sched[1]:
                self.take(pool, pool.sched)

    def report_recovered(self, pool_id: int, address: Address) -> None:
        """A dial to `address` connected after a failed one: the run of failures is over."""
        protocol.send(self._writer, Recovered(pool_id, address))

    async def on_eject(self, eject: Eject) -> None:
        """The control process ejected this endpoint: skip it for the time it says."""
        pool = self._pools.get(eject.pool_id)
        if pool is not None:
            pool.penalize(eject.address, eject.seconds)

    def _counting(self, slots: tuple[int, ...]) -> NodeCounts | None:
        """The shared counts for a pool with `slots` (None: none, or no column here); this
        worker's column is cleared at its first use (its predecessor in the slot may have
        died with connections counted)."""
        counts = self.counts
        if counts is None or not slots or not 0 <= self.index < counts.workers:
            return None
        if not self._cleared:
            counts.clear_column(self.index)
            self._cleared = True
        return counts
