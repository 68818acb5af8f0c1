"""When rules are committed: rule generations, the early first commit, deferred deletes.

The proxier bumps the rule generation whenever a rule target changes; a commit hands the
portals the targets of one generation (in a thread), then the deletes the apply deferred, and
only then releases the ports in quarantine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from kube_userspace_proxy import logs
from kube_userspace_proxy.errors import DescriptorBudgetError, PortExhaustedError
from kube_userspace_proxy.model import Path, ProxiedPort, ServicePortInfo
from kube_userspace_proxy.proxier.contracts import RuleSink
from kube_userspace_proxy.proxier.portbook import PortBook

log = logs.get(__name__)

SLICE_SECONDS = 0.004
"""Longest run of work on service ports between two turns of the event loop."""


class CommitScheduler:
    """Decides when the rule targets go to the portals, and keeps what the last commit carried."""

    def __init__(
        self,
        book: PortBook,
        reconcile_lock: asyncio.Lock,
        targets: Callable[[], list[ProxiedPort]],
        portals: RuleSink | None = None,
    ) -> None:
        self._book = book
        self._reconcile_lock = reconcile_lock
        self._targets = targets
        self.portals = portals
        """Where the rule targets go (None: proxy ports only, no rules)."""
        # Rule targets change generation by generation (a service port came, went, or its info
        # changed); the generation and the node IPs the last successful commit used.
        self.generation = 0
        self.applied_generation = -1
        self.node_ips: tuple[str, ...] = ()
        self._applied_node_ips: tuple[str, ...] | None = None
        self._lock = asyncio.Lock()
        self.rule_applies = 0
        """Rule sets handed to the portals (a sync that changes no rule target hands none)."""
        self.rules_live_at = 0.0
        """When (time.time) the last rule commit made its rules live."""
        # The first commit, started before the listeners are made: (its task, its targets,
        # its node IPs), until `commit` takes it.
        self._early: tuple[asyncio.Task[bool], list[ProxiedPort], tuple[str, ...]] | None = None

    def target_changed(self) -> None:
        """A rule target changed: the next commit carries a new generation."""
        self.generation += 1

    @property
    def pending(self) -> bool:
        """True when a rule target changed (or a port waits for release) since the last commit."""
        book = self._book
        if self.portals is None:
            return book.quarantined or book.claiming
        return (
            self.generation != self.applied_generation
            or book.quarantined
            or self.node_ips != self._applied_node_ips
        )

    def first_commit_due(self, *, complete: bool) -> bool:
        """True when no commit has been made yet and a complete state can be committed early."""
        return (
            self.portals is not None
            and self.applied_generation == -1
            and self._early is None
            and complete
            and not self._book.quarantined
        )

    async def commit_early(
        self, services: Iterable[ServicePortInfo], node_ips: tuple[str, ...]
    ) -> None:
        """Start the first rule commit before the listeners are made, not after them.

        At 10,000 service ports making the listeners takes about as long as the commit (half
        a second each), and the commit is mostly iptables-restore's own work, off this loop.
        So each new service port's proxy port is reserved first, held as a claim (as an
        earlier run's ports are, `PortBook.load`) for the reconcile that follows to serve
        on, and the rules naming those ports are committed meanwhile. Until its listener
        starts, a connection to such a port is refused (TCP) or waits in the socket (UDP), as
        on a Service without endpoints: on a first start there were no rules at all.
        `commit` then waits for this commit and skips its own when the targets came out the
        same. A service port that cannot be reserved here is left to the reconcile (and to
        that commit), which reports why. The caller has started the descriptor budget.
        """
        book = self._book
        if not book.loaded:
            await book.load(self.portals)
        targets: list[ProxiedPort] = []
        yielded = time.perf_counter()
        for info in services:
            if time.perf_counter() - yielded > SLICE_SECONDS:
                await asyncio.sleep(0)
                yielded = time.perf_counter()
            try:
                cluster = book.reserve_early(info, Path.CLUSTER)
                external = book.reserve_early(info, Path.EXTERNAL) if info.paths_differ else 0
            except DescriptorBudgetError:
                break  # the reconcile refuses the rest, each with the reason
            except (PortExhaustedError, OSError):
                continue
            targets.append(ProxiedPort(info, cluster, external or cluster))
        portals = self.portals
        assert portals is not None

        async def commit() -> bool:
            try:
                await asyncio.to_thread(portals.apply, targets, node_ips)
            except Exception as exc:  # the commit after the reconcile tries again
                log.warning("the first rule commit failed (%s); trying again", exc)
                return False
            return True

        task = asyncio.get_running_loop().create_task(commit(), name="first-commit")
        self._early = (task, targets, node_ips)

    async def commit(self, *, force: bool = False) -> None:
        """Hand the rule targets to the portals when one changed (or `force`: a periodic check).

        The targets are taken between reconciles, so a rule never names a port before its
        listener serves; reconciles go on while the commit runs (in a thread). Once the commit
        is live (`rules_live_at`) the deletes it deferred follow, and only then are retired
        ports released: until that second commit, a stale rule may still name them.
        """
        book = self._book
        async with self._lock:
            early_done = False
            if self._early is not None:
                task, early_targets, early_ips = self._early
                self._early = None
                early_done = await task
                self.rule_applies += early_done
            async with self._reconcile_lock:
                releasable = book.take_quarantine()
                generation = self.generation
                node_ips = self.node_ips
                wanted = self.portals is not None and (
                    force
                    or bool(releasable)
                    or generation != self.applied_generation
                    or node_ips != self._applied_node_ips
                )
                targets = self._targets() if wanted else []
            if early_done:
                self.rules_live_at = time.time()
            if early_done and not releasable and (targets, node_ips) == (early_targets, early_ips):
                wanted = False  # the first commit, made early, named exactly these
                self.applied_generation = generation
                self._applied_node_ips = node_ips
            if wanted and self.portals is not None:
                try:
                    await asyncio.to_thread(self.portals.apply, targets, node_ips)
                except BaseException:
                    book.requarantine(releasable)
                    raise
                # Live now: the network-programming latency ends here, not after the deletes.
                self.rules_live_at = time.time()
                self.applied_generation = generation
                self._applied_node_ips = node_ips
                self.rule_applies += 1
                # A retired port is released only once no rule names it, stale ones included.
                if not await self._commit_deferred():
                    book.requarantine(releasable)
                    releasable = []
            for protocol, port in releasable:
                book.release(protocol, port)
            # The commit replaced the earlier run's rules: unclaimed ports name nothing now.
            book.drop_claims()

    async def _commit_deferred(self) -> bool:
        """The deletes the last apply deferred (in a thread); False if they failed (logged:
        the next commit deletes those rules, the periodic one at the latest)."""
        assert self.portals is not None
        try:
            await asyncio.to_thread(self.portals.commit_deferred)
        except Exception as exc:
            log.warning("deleting stale rules failed (%s): their proxy ports stay held", exc)
            return False
        return True

    async def settle(self) -> None:
        """At shutdown: let a first commit still running end."""
        if self._early is not None:
            await asyncio.gather(self._early[0], return_exceptions=True)
            self._early = None
