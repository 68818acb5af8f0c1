"""The workers' counters, summed into the proxier's ConnStats; and their debug reports.

`collect` asks every live worker for a report (`Collect`); each answers in `Collected` parts
(worker.REPORT_PART service ports each), taken in one per turn of the loop. A worker that dies
leaves its totals behind (`bury`), so that a service port's counters never go backwards.
Pins and balancers are kept per worker, packed, and merged for one pool at a time when a view
asks: no step walks all 10,000 service ports at once.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from kube_userspace_proxy.balancer import PINS_SHOWN, BalancerView
from kube_userspace_proxy.dataplane import ConnStats
from kube_userspace_proxy.dataplane.stats import COUNTERS
from kube_userspace_proxy.model import Address
from kube_userspace_proxy.workers import protocol
from kube_userspace_proxy.workers.link import Replies, WorkerLink
from kube_userspace_proxy.workers.protocol import Collect, Collected, Pin, PoolView

GAUGES = frozenset({"active", "udp_sessions_active"})
"""Counters that are a level now, not a total: a dead worker's do not carry over."""
COLLECT_TIMEOUT = 2.0
"""Seconds a worker has to answer `collect` (else its last report stands)."""
SUM_PART = 200
"""Ports whose counters `collect` sums between two yields to the event loop."""


class Report(NamedTuple):
    """One worker's whole answer to a `Collect`, its parts put together."""

    worker: int
    counters: dict[str, tuple[int, ...]]
    views: dict[int, bytes]


class Counters:
    """The last report of every worker, the totals of dead ones, and the sums of both."""

    def __init__(self, replies: Replies) -> None:
        self._replies = replies
        self._reports: dict[int, dict[str, tuple[int, ...]]] = {}
        self._dead_totals: dict[str, list[int]] = {}
        # The last debug report of each worker (by index): pool id -> its `PoolView`,
        # `protocol.pack_view`ed; read a pool at a time by the views.
        self._views: dict[int, dict[int, bytes]] = {}
        # Reports being received, part by part: (worker, request) -> what came so far.
        self._parts: dict[tuple[WorkerLink, int], Report] = {}

    async def collect(
        self, live: list[WorkerLink], stats: dict[str, ConnStats], *, debug: bool = False
    ) -> None:
        """Ask every worker in `live` for its counters and sum them into `stats` (by service
        port name)."""
        request = self._replies.next_seq()
        waiting = []
        for worker in live:
            waiting.append(self._replies.expect(worker, Report, request))
            worker.send(Collect(request, debug))
        replies = await asyncio.gather(
            *(asyncio.wait_for(w, COLLECT_TIMEOUT) for w in waiting), return_exceptions=True
        )
        for worker in live:  # what is left of a worker that timed out or died
            self._replies.forget(worker, Report, request)
            self._parts.pop((worker, request), None)
        views: dict[int, dict[int, bytes]] = {}
        for reply in replies:
            if isinstance(reply, BaseException):
                continue
            self._reports[reply.worker] = reply.counters
            views[reply.worker] = reply.views
        if debug:
            self._views = views
        await self._sum(stats)

    def take_part(self, worker: WorkerLink, part: Collected) -> None:
        """Add one part of a report; the last one completes the request."""
        if not self._replies.waiting(worker, Report, part.seq):
            return  # the collect gave up on this worker
        key = (worker, part.seq)
        report = self._parts.setdefault(key, Report(part.worker, {}, {}))
        # Only the ports that counted something: a report is kept until the next one (a dead
        # worker's totals carry over), and at 10,000 mostly idle ports the all-zero rows were
        # ~4 MiB per worker held for nothing. A port without a row counted nothing.
        report.counters.update((name, row) for name, row in part.counters.items() if any(row))
        report.views.update(part.views)
        if part.last:
            del self._parts[key]
            self._replies.answer(worker, Report, part.seq, report._replace(worker=part.worker))

    async def _sum(self, stats: dict[str, ConnStats]) -> None:
        """Each port's counters: the workers' reports and the dead workers' totals, summed
        SUM_PART ports per turn of the loop (10,000 at once took ~50 ms)."""
        self._dead_totals = {n: t for n, t in self._dead_totals.items() if n in stats}
        reports = list(self._reports.values())
        zeros = [0] * len(COUNTERS)
        for done, (name, port_stats) in enumerate(stats.items()):
            if done and done % SUM_PART == 0:
                await asyncio.sleep(0)
            total = list(self._dead_totals.get(name, zeros))
            for report in reports:
                values = report.get(name)
                if values is not None:
                    for i in range(len(COUNTERS)):
                        total[i] += values[i]
            for field, value in zip(COUNTERS, total, strict=True):
                setattr(port_stats, field, value)

    def bury(self, index: int) -> None:
        """The worker of slot `index` exited: keep its totals (not its gauges)."""
        report = self._reports.pop(index, {})
        for name, values in report.items():
            base = self._dead_totals.setdefault(name, [0] * len(COUNTERS))
            for i, field in enumerate(COUNTERS):
                if field not in GAUGES:
                    base[i] += values[i]

    # ---- the debug views -------------------------------------------------------------------

    def affinity_summary(self, pool_id: int | None) -> tuple[int, list[Pin]]:
        """The pin count and the pins shown of pool `pool_id`, as the workers reported them
        at the last `collect(debug=True)`."""
        count = 0
        shown: list[Pin] = []
        for _, view in self._reported_views(pool_id):
            count += view.pins
            shown += view.shown[: PINS_SHOWN - len(shown)]
        return count, shown

    def balancer_view(self, pool_id: int | None, addresses: tuple[Address, ...]) -> BalancerView:
        """What each worker's copy of pool `pool_id` reported at the last
        `collect(debug=True)`.

        Endpoint counters are summed over the running workers (a dead worker's are lost);
        each worker balances on its own, so picks are listed per worker.
        """
        sums: dict[Address, list[int]] = {a: [0] * 5 for a in addresses}
        penalized: dict[Address, float] = {}
        picks: list[tuple[int | None, list[tuple[Address, str]]]] = []
        for worker, view in self._reported_views(pool_id):
            for address, values in view.tallies:
                total = sums.get(address)
                if total is not None:
                    for i, value in enumerate(values):
                        total[i] += value
            picks.append((worker, list(view.recent)))
            for address, left in view.penalized:
                penalized[address] = max(left, penalized.get(address, 0.0))
        endpoints = [(a, (v[0], v[1], v[2], v[3], v[4])) for a, v in sums.items()]
        return BalancerView(endpoints, picks, sorted(penalized.items()))

    def _reported_views(self, pool_id: int | None) -> list[tuple[int, PoolView]]:
        """(worker, view) of pool `pool_id` as each worker reported it at the last
        `collect(debug=True)`, in worker order."""
        if pool_id is None:
            return []
        return [
            (worker, protocol.unpack_view(reported[pool_id]))
            for worker, reported in sorted(self._views.items())
            if pool_id in reported
        ]
