"""Proxier: reconcile a full Snapshot against the open proxy ports, the balancer and the rules.

The only module that knows the listeners, the endpoint pools, the port book and the rule
commits at once; none of those know each other. Every sync receives the complete desired
state (as kpng's full-state sinks do), or the change since the last one, and changes only
what differs.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, cast

from kube_userspace_proxy import logs
from kube_userspace_proxy.dataplane import ConnStats, native
from kube_userspace_proxy.errors import DescriptorBudgetError, PortExhaustedError, PortInUseError
from kube_userspace_proxy.model import (
    DEFAULT_BALANCING,
    Change,
    ClaimKey,
    Path,
    ProxiedPort,
    ServicePortInfo,
    ServicePortName,
    Snapshot,
    SocketKey,
    SourcePolicy,
)
from kube_userspace_proxy.ports import DescriptorBudget, PortAllocator
from kube_userspace_proxy.proxier import debugview
from kube_userspace_proxy.proxier.commits import SLICE_SECONDS, CommitScheduler
from kube_userspace_proxy.proxier.contracts import DataPlane, Listener, PoolT, RuleSink
from kube_userspace_proxy.proxier.local import LocalDataPlane
from kube_userspace_proxy.proxier.nodeports import NodePorts
from kube_userspace_proxy.proxier.portbook import PortBook, ports_of
from kube_userspace_proxy.proxier.served import Retired, Served, handover_sockets
from kube_userspace_proxy.restart.sockets import SocketDescription

log = logs.get(__name__)

LOG_EACH_OPENED = 100
"""New service ports in one sync up to which each gets an INFO line."""


class Proxier(Generic[PoolT]):
    """Owns the proxy ports: opens, updates and closes listeners to match each Snapshot."""

    def __init__(
        self,
        allocator: PortAllocator,
        *,
        portals: RuleSink | None = None,
        udp_idle_timeout: float = 0.25,
        node_port_addresses: Callable[[], Sequence[str]] | None = None,
        dataplane: DataPlane[PoolT] | None = None,
        budget: DescriptorBudget | None = None,
    ) -> None:
        self._budget = budget or DescriptorBudget()
        # Service ports refused because the descriptor budget is spent.
        self._over_budget: set[ServicePortName] = set()
        self._reconcile_lock = asyncio.Lock()
        # Without one (tests, tools): this process's own, whose pools are EndpointPools.
        self._dataplane: DataPlane[PoolT] = dataplane or cast(
            "DataPlane[PoolT]", LocalDataPlane(udp_idle_timeout=udp_idle_timeout)
        )
        self._book = PortBook(allocator, self._budget)
        self._commits = CommitScheduler(
            self._book, self._reconcile_lock, self.proxied_ports, portals
        )
        self._retired: Retired[PoolT] = Retired()
        self._node_ports = NodePorts(
            self._dataplane,
            self._budget,
            node_port_addresses or (lambda: (allocator.host,)),
            self._retired,
        )
        self._served: dict[ServicePortName, Served[PoolT]] = {}
        self._errors: dict[ServicePortName, str] = {}
        self._opened: list[Served[PoolT]] = []  # announced once they serve
        self.node_name: str | None = None
        self.source: SourcePolicy | None = None
        self.balancing = DEFAULT_BALANCING
        """The scheduler and outlier ejection of every Service port its annotations leave."""
        self._node_zone = ""
        self._node_port_now: tuple[str, ...] | None = None  # set while the node's IPs moved

    @property
    def node_ips(self) -> tuple[str, ...]:
        """The node IPs of the sync in progress (or the last one)."""
        return self._commits.node_ips

    @property
    def rule_applies(self) -> int:
        """Rule sets handed to the portals (a sync that changes no rule target hands none)."""
        return self._commits.rule_applies

    @property
    def rules_live_at(self) -> float:
        """When (time.time) the last rule commit made its rules live: before the deletes it
        deferred (`RuleSink.commit_deferred`), which the same `commit_rules` makes after."""
        return self._commits.rules_live_at

    @property
    def rule_sink(self) -> RuleSink | None:
        """Where each sync's rule targets go (None: proxy ports only)."""
        return self._commits.portals

    def set_rule_sink(self, portals: RuleSink | None) -> None:
        """Send each sync's rule targets to `portals` (None: serve proxy ports only)."""
        self._commits.portals = portals

    def prefer_ports(self, ports: dict[ClaimKey, int]) -> None:
        """Before the first sync: serve these service ports on these proxy ports if free
        (an earlier run's, from the state file; the installed rules' win over them)."""
        self._book.prefer(ports)

    def adopt(
        self,
        claims: dict[ClaimKey, socket.socket],
        node_ports: dict[SocketKey, socket.socket],
    ) -> None:
        """Before the first sync: serve on these sockets, handed over by the process this one
        replaces, instead of binding new ones (same sockets: same backlogs, same groups)."""
        self._book.adopt(claims)
        self._node_ports.adopt(node_ports)

    def handover_sockets(self) -> list[tuple[SocketDescription, int]]:
        """What this process serves, to hand over: (description, descriptor) per socket."""
        return handover_sockets(self._served)

    def served_ports(self) -> dict[ClaimKey, int]:
        """The proxy port of each served (service port, protocol, path), for the state file."""
        return {
            (str(name), str(name.protocol), str(path)): listener.port
            for name, served in self._served.items()
            for path, listener in served.listeners.items()
        }

    ports_of = staticmethod(ports_of)
    """`served_ports` from rule targets (`proxied_ports()`): safe in another thread."""

    # ---- reconcile -----------------------------------------------------------------------

    async def sync(
        self, snapshot: Snapshot | Change, *, full: bool = True, rules: bool = True
    ) -> None:
        """Make listeners, pools and rules match `snapshot`; per-port failures are contained.

        Without `full` (a sync for a change), work follows the change: a `Change` names the
        service ports to look at (`Change.changed`), and in a complete `Snapshot` a
        service port whose info and endpoints are the objects last applied is skipped after
        two identity checks. `full` (the first and the periodic syncs) reconciles every service
        port, retrying what failed, and hands the rules to the portals, which check them for
        tampering. With `rules` the rules follow (`commit_rules`); without, a changed rule
        target is only recorded (`rules_pending`): an endpoint-only change never needs one.
        """
        async with self._reconcile_lock:
            change = isinstance(snapshot, Change)
            if rules and self._commits.first_commit_due(complete=not change):
                self._budget.start()
                await self._commits.commit_early(snapshot.services.values(), snapshot.node_ips)
            await self._reconcile(snapshot, full=full and not change)
        if rules:
            await self.commit_rules(force=full)

    async def _reconcile(self, snapshot: Snapshot | Change, *, full: bool) -> None:
        # A new zone or node IPs choose endpoints (hints) and NodePort addresses again; a new
        # source policy (--preserve-source-ip) reaches every pool, as a new node does.
        node_moved = (snapshot.node_zone, snapshot.node_ips) != (self._node_zone, self.node_ips)
        same_node = (
            snapshot.node_name == self.node_name
            and not node_moved
            and snapshot.source == self.source
        )
        self.node_name = snapshot.node_name
        self.source = snapshot.source
        self._commits.node_ips = snapshot.node_ips
        self._node_zone = snapshot.node_zone
        self._node_port_now = self._node_ports.addresses_now() if node_moved else None
        self._budget.start()
        if not self._book.loaded:
            await self._book.load(self._commits.portals)
        changed = snapshot.changed if isinstance(snapshot, Change) else None
        services = snapshot.services
        if changed is None:
            gone = [n for n in self._served if n not in services]
            self._over_budget.clear()
        else:
            gone = [n for n in changed if n in self._served and n not in services]
            self._over_budget.difference_update(changed)
        for name in gone:
            self._remove(name)
        for name in [n for n in (changed or self._errors) if n not in services]:
            self._errors.pop(name, None)
        endpoints = snapshot.endpoints
        yielded = time.perf_counter()
        for name, info in services.items():
            served = self._served.get(name)
            if (
                not full
                and served is not None
                and served.info is info
                and served.endpoints is endpoints.get(name, ())
                and same_node
                and name not in self._errors
            ):
                continue
            if time.perf_counter() - yielded > SLICE_SECONDS:
                # Connections and events wait while this loop runs: let them in now and then.
                await asyncio.sleep(0)
                yielded = time.perf_counter()
            try:
                await self._reconcile_port(name, info, snapshot)
            except DescriptorBudgetError as exc:
                self._over_budget.add(name)
                self._report(name, str(exc))
            except (PortExhaustedError, PortInUseError, OSError) as exc:
                self._report(name, str(exc))
            except Exception as exc:
                # A bug must cost one service port, not every Service's sync.
                if self._errors.get(name) != repr(exc):
                    log.exception("%s: unexpected error while syncing", name)
                self._errors[name] = repr(exc)
        # Listeners serve their endpoints before any rule points at them (but for the first
        # commit, `CommitScheduler.commit_early`).
        await self._dataplane.publish()
        self._announce_opened()

    def _announce_opened(self) -> None:
        opened, self._opened = self._opened, []
        # One line per new service port, unless a sync opens thousands (a start at scale):
        # then one line in all, and the ports at DEBUG (/debug/state lists them).
        each = log.info if len(opened) <= LOG_EACH_OPENED else log.debug
        if len(opened) > LOG_EACH_OPENED:
            log.info("serving %d new service ports (each one at -v 4)", len(opened))
        for served in opened:
            each(
                "%s -> %s:%d (%d endpoints)",
                served.info.name,
                self._book.host,
                served.port_of(Path.CLUSTER),
                len(served.pools[Path.CLUSTER]),
            )

    @property
    def rules_generation(self) -> int:
        """Grows with every change of a rule target."""
        return self._commits.generation

    @property
    def committed_generation(self) -> int:
        """The rule generation the last successful commit carried."""
        return self._commits.applied_generation

    @property
    def served_count(self) -> int:
        """How many service ports are served."""
        return len(self._served)

    @property
    def rules_pending(self) -> bool:
        """True when a rule target changed (or a port waits for release) since the last commit."""
        return self._commits.pending

    async def commit_rules(self, *, force: bool = False) -> None:
        """Hand the rule targets to the portals when one changed (or `force`: a periodic
        check); then the deferred deletes, then the release of retired ports (`commits`)."""
        await self._commits.commit(force=force)

    async def _reconcile_port(
        self, name: ServicePortName, info: ServicePortInfo, snapshot: Snapshot | Change
    ) -> None:
        served = self._served.get(name)
        new = served is None
        if served is None:
            served = Served(info=info, stats=ConnStats())
            self._commits.target_changed()
        elif served.info is not info:
            self._commits.target_changed()  # the rules are rendered from the info
            served.target = None
        served.info = info
        fresh: list[tuple[Path, Listener[PoolT]]] = []
        try:
            if Path.CLUSTER not in served.listeners:
                fresh.append((Path.CLUSTER, self._open(served, Path.CLUSTER)))
            # A separate external listener exists exactly while the two paths need different
            # endpoint sets (one of the traffic policies is Local, the other not).
            if info.paths_differ and Path.EXTERNAL not in served.listeners:
                fresh.append((Path.EXTERNAL, self._open(served, Path.EXTERNAL)))
            elif not info.paths_differ and Path.EXTERNAL in served.listeners:
                self._retire(served, Path.EXTERNAL)
            served.take_endpoints(snapshot, self.balancing)
            # Started once their pools are filled, so a port listens when it is announced.
            for _, listener in fresh:
                await listener.start()
        except BaseException:
            # Undo what this call opened; no rule has pointed at those ports yet.
            served.target = None
            for path, listener in fresh:
                served.listeners.pop(path, None)
                served.pools.pop(path, None)
                self._book.release(info.protocol, listener.port)
                await listener.close()
            if not new:
                served.take_endpoints(snapshot, self.balancing)  # the paths left still follow
            raise
        if fresh:
            served.target = None
            self._commits.target_changed()  # a new proxy port: its rules, the state file's ports
        if new:
            self._served[name] = served
        self._node_ports.point(served)
        if served.node_port and self._node_port_now is not None:
            await self._node_ports.follow(served, self._node_port_now)
        if served.node_port != info.node_port:
            self._node_ports.close(served)
            if info.node_port:
                await self._node_ports.open(served)
        if self._errors.pop(name, None) is not None:
            log.info("%s: recovered", name)
        if new:
            self._opened.append(served)

    def _open(self, served: Served[PoolT], path: Path) -> Listener[PoolT]:
        """Take a proxy port for `path` and make its listener; the caller starts it."""
        info = served.info
        pool = self._dataplane.new_pool(info.name)
        sock, adopt = self._book.take(info, path)
        listener = self._dataplane.listener(sock, pool, served.stats, str(info.name), adopt=adopt)
        served.pools[path] = pool
        served.listeners[path] = listener
        return listener

    # ---- removal and shutdown --------------------------------------------------------------

    def _remove(self, name: ServicePortName) -> None:
        served = self._served.pop(name)
        for path in list(served.listeners):
            self._retire(served, path)
        self._node_ports.close(served)
        log.info("%s: removed (proxy port closed; open connections finish)", name)

    def _retire(self, served: Served[PoolT], path: Path) -> None:
        """Close the listener of `path`; its port stays out of use until no rule names it."""
        listener = served.listeners.pop(path)
        served.pools.pop(path, None)
        self._commits.target_changed()
        served.target = None
        self._retired.close_later(listener)
        # Rules still send this port's traffic here until the next commit: handing the port
        # to another service port before then would deliver one Service's clients to another.
        self._book.quarantine(served.info.protocol, listener.port)

    def _report(self, name: ServicePortName, message: str) -> None:
        if self._errors.get(name) != message:
            log.error("%s: %s", name, message)
        self._errors[name] = message

    async def shutdown(self, grace: float, *, release: bool = False) -> None:
        """Stop accepting everywhere, then give open connections `grace` seconds to finish.

        `release`: the sockets were handed over to a new process: close only this process's
        descriptors, leaving them as they are for it (`Listener.release`).
        """
        await self._commits.settle()  # a first commit still running: let it end
        listeners = [lst for served in self._served.values() for lst in served.every_listener()]
        await asyncio.gather(
            *(lst.release() if release else lst.close() for lst in listeners),
            return_exceptions=True,
        )
        listeners.extend(await self._retired.closed())
        await asyncio.gather(*(lst.drain(grace) for lst in listeners), return_exceptions=True)
        self._book.close()
        self._node_ports.close_unused()
        self._served.clear()
        self._retired.clear()

    # ---- views for rules, metrics and /debug/state ------------------------------------------

    def proxied_ports(self) -> list[ProxiedPort]:
        """The desired rule targets: each service port with the proxy port of each path."""
        return [served.rule_target() for served in self._served.values()]

    def port_stats(self) -> list[tuple[ServicePortName, ConnStats]]:
        """(service port, its counters) for every served port; read by metrics at scrape time."""
        native.count_bytes()  # open native connections' bytes, counted when they are read
        return [(name, served.stats) for name, served in self._served.items()]

    def open_ports(self) -> int:
        """How many proxy ports (incl. NodePort sockets) are open."""
        return sum(
            len(served.listeners) + len(served.node_port_listeners)
            for served in self._served.values()
        )

    def port_of(self, name: ServicePortName, path: Path = Path.CLUSTER) -> int:
        """The proxy port serving `name` on `path` (0 when it is not served)."""
        served = self._served.get(name)
        return served.port_of(path) if served is not None else 0

    def over_budget(self) -> int:
        """How many service ports the last sync refused for want of descriptors."""
        return len(self._over_budget)

    def errors(self) -> dict[ServicePortName, str]:
        """Service ports that could not be served, with the reason."""
        return dict(self._errors)

    def debug_state(self) -> dict[str, Any]:
        """JSON-able view: service port -> proxy ports -> endpoints, affinity, counters."""
        return dict(self.debug_entries(sorted(self.debug_names(), key=debugview.by_name)))

    async def debug_items(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """`debug_state` one service port at a time, so a caller can yield to the loop between.

        The names are sorted a run at a time, yielding to the loop between runs: one sort of
        10,000 names held the loop for 25-45 ms. Service ports removed while it is consumed
        are left out; ClientIP pins are summarized.
        """
        for item in self.debug_entries(await debugview.sorted_in_runs(self.debug_names())):
            yield item

    def debug_names(self) -> list[ServicePortName]:
        """The service ports the view shows, unsorted: those served and those that failed."""
        return debugview.names_shown(self._served, self._errors)

    def debug_entries(
        self, names: Iterable[ServicePortName]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """The view of each of `names` in turn, as it is when reached (gone ones are skipped)."""
        return debugview.entries(self._served, self._errors, self._dataplane, names)
