"""Proxier: reconcile a full Snapshot against the open proxy ports, the balancer and the rules.

The only module that knows the listeners, the endpoint pools, the port allocator and the
portals at once; none of those know each other. Every sync receives the complete desired state
(as kpng's full-state sinks do) and changes only what differs.
"""

from __future__ import annotations

import asyncio
import heapq
import ipaddress
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from typing import Protocol as TypingProtocol

from kube_userspace_proxy import logs
from kube_userspace_proxy.balancer import (
    PINS_SHOWN,
    BalancerView,
    EndpointPool,
    on_node,
    usable_endpoints,
)
from kube_userspace_proxy.dataplane import ConnStats, Picker, TcpListener, UdpListener
from kube_userspace_proxy.errors import DescriptorBudgetError, PortExhaustedError, PortInUseError
from kube_userspace_proxy.model import (
    Address,
    ClaimKey,
    Endpoint,
    Path,
    Protocol,
    ProxiedPort,
    ServicePortInfo,
    ServicePortName,
    Snapshot,
    SocketKey,
    SourcePolicy,
)
from kube_userspace_proxy.ports import DescriptorBudget, PortAllocator

log = logs.get(__name__)

LOG_EACH_OPENED = 100
"""New service ports in one sync up to which each gets an INFO line."""
SLICE_SECONDS = 0.004
"""Longest run of reconciling service ports between two turns of the event loop."""


class Listener(TypingProtocol):
    """One served socket of a service port (TCP or UDP; in this process or in the workers)."""

    picker: Picker

    async def start(self) -> None:
        """Begin serving (TCP: listen while the picker has endpoints)."""
        ...

    def refresh(self) -> None:
        """The picker's endpoints changed: listen or refuse, end sessions to removed ones."""
        ...

    def set_picker(self, picker: Picker) -> None:
        """Serve new connections from `picker`, then `refresh()`."""
        ...

    async def close(self) -> None:
        """Stop accepting and release the port; open connections go on."""
        ...

    async def release(self) -> None:
        """Stop serving and close this process's descriptor only, leaving the socket as it
        is to the process it was handed over to; open connections go on."""
        ...

    def fileno(self) -> int:
        """The descriptor of the served socket, to hand it over; -1 once closed."""
        ...

    async def drain(self, timeout: float) -> None:  # noqa: ASYNC109 - the contract's shape
        """Give open connections `timeout` seconds, then close them."""
        ...

    @property
    def port(self) -> int: ...

    @property
    def active_connections(self) -> int: ...


class DataPlane(TypingProtocol):
    """Where the listeners run: in this process (`LocalDataPlane`) or in worker processes."""

    shares_ports: bool
    """True when other processes join the proxy ports with SO_REUSEPORT (UDP binds with it)."""

    def listener(
        self,
        sock: socket.socket,
        pool: EndpointPool,
        stats: ConnStats,
        name: str,
        *,
        adopt: bool = False,
    ) -> Listener:
        """A listener for the bound socket `sock` (the data plane owns it from now on);
        `adopt`: a socket handed over by an earlier process, used as it is."""
        ...

    async def publish(self) -> None:
        """Make every listener serve its pool's current endpoints (before rules point at it)."""
        ...

    def affinity_summary(
        self, pool: EndpointPool
    ) -> tuple[int, list[tuple[str, tuple[str, int], float]]]:
        """How many ClientIP pins `pool` holds, and up to PINS_SHOWN live ones:
        (client, endpoint, seconds left)."""
        ...

    def balancer_view(self, pool: EndpointPool) -> BalancerView:
        """`pool`'s per-endpoint counters, recent picks (per process) and penalized endpoints."""
        ...


class LocalDataPlane:
    """Listeners on this process's event loop (`--workers 1`)."""

    shares_ports = False

    def __init__(self, *, udp_idle_timeout: float = 0.25, tcp_keepalive: float = 15.0) -> None:
        self.udp_idle_timeout = udp_idle_timeout
        self.tcp_keepalive = tcp_keepalive

    def listener(
        self,
        sock: socket.socket,
        pool: EndpointPool,
        stats: ConnStats,
        name: str,
        *,
        adopt: bool = False,
    ) -> Listener:
        if sock.type == socket.SOCK_STREAM:
            return TcpListener(
                sock, pool, stats, name=name, keepalive=self.tcp_keepalive, adopt=adopt
            )
        return UdpListener(sock, pool, stats, name=name, idle_timeout=self.udp_idle_timeout)

    async def publish(self) -> None:
        """Nothing to send: the listeners read their pools directly."""

    def affinity_summary(
        self, pool: EndpointPool
    ) -> tuple[int, list[tuple[str, tuple[str, int], float]]]:
        return pool.affinity_count(), pool.affinity_entries(PINS_SHOWN)

    def balancer_view(self, pool: EndpointPool) -> BalancerView:
        return BalancerView(pool.tallies(), [(None, pool.recent_picks())], pool.penalized())


_local: DataPlane = LocalDataPlane()  # conformance: LocalDataPlane is a DataPlane


class RuleSink(TypingProtocol):
    """What the proxier needs of the portals: take the full desired set, apply the difference."""

    def apply(self, ports: Sequence[ProxiedPort], node_ips: Sequence[str]) -> None:
        """Install the rules for `ports`; the node's own traffic is DNATed to `node_ips`.

        Once it returns the rules are live; rules that no longer take packets may remain
        until `commit_deferred`."""
        ...

    def commit_deferred(self) -> None:
        """Delete what the last `apply` left behind (off the latency path); a no-op if none."""
        ...

    def claimed_ports(self) -> dict[ClaimKey, int]:
        """The proxy ports the rules installed now (perhaps by an earlier run) point at."""
        ...


@dataclass(slots=True)
class _Served:
    """One service port as it is served now. Mutable; private to the proxier."""

    info: ServicePortInfo
    stats: ConnStats
    pools: dict[Path, EndpointPool]
    listeners: dict[Path, Listener] = field(default_factory=dict)
    node_port_listeners: list[tuple[str, Listener]] = field(default_factory=list)
    node_port: int = 0
    all_endpoints: int = 0
    endpoints: tuple[Endpoint, ...] | None = None
    """The snapshot's endpoint tuple last applied (the state keeps it while it is unchanged)."""
    target: ProxiedPort | None = None
    """The rule target last built for it; None once its info or listeners changed."""

    def port_of(self, path: Path) -> int:
        listener = self.listeners.get(path) or self.listeners.get(Path.CLUSTER)
        return listener.port if listener is not None else 0

    def every_listener(self) -> Iterable[Listener]:
        yield from self.listeners.values()
        for _, listener in self.node_port_listeners:
            yield listener


class Proxier:
    """Owns the proxy ports: opens, updates and closes listeners to match each Snapshot."""

    def __init__(
        self,
        allocator: PortAllocator,
        *,
        portals: RuleSink | None = None,
        udp_idle_timeout: float = 0.25,
        node_port_addresses: Callable[[], Sequence[str]] | None = None,
        dataplane: DataPlane | None = None,
        budget: DescriptorBudget | None = None,
    ) -> None:
        self._allocator = allocator
        self._budget = budget or DescriptorBudget()
        # Service ports refused because the descriptor budget is spent.
        self._over_budget: set[ServicePortName] = set()
        # Rule targets change generation by generation (a service port came, went, or its info
        # changed); the generation and the node IPs the last successful commit used.
        self._rules_gen = 0
        self._applied_gen = -1
        self._node_ips: tuple[str, ...] = ()
        self._applied_node_ips: tuple[str, ...] | None = None
        self._reconcile_lock = asyncio.Lock()
        self._commit_lock = asyncio.Lock()
        self.rule_applies = 0
        """Rule sets handed to the portals (a sync that changes no rule target hands none)."""
        self.rules_live_at = 0.0
        """When (time.time) the last rule commit made its rules live: before the deletes it
        deferred (`RuleSink.commit_deferred`), which the same `commit_rules` makes after."""
        self._portals = portals
        self._dataplane = dataplane or LocalDataPlane(udp_idle_timeout=udp_idle_timeout)
        self._node_port_addresses = node_port_addresses or (lambda: (allocator.host,))
        self._served: dict[ServicePortName, _Served] = {}
        self._errors: dict[ServicePortName, str] = {}
        self._opened: list[_Served] = []  # announced once they serve
        self._closing: set[asyncio.Task[None]] = set()
        # Closed listeners whose connections may still be open; drained at shutdown.
        self._retired: list[Listener] = []
        # Ports of retired listeners, released once a rule commit no longer names them.
        self._quarantine: list[tuple[Protocol, int]] = []
        # Sockets on the ports an earlier run's rules point at, kept for the same service
        # ports until the first commit; None until they have been read.
        self._claims: dict[ClaimKey, socket.socket] | None = None
        # The first commit, started before the listeners are made: (its task, its targets,
        # its node IPs), until `commit_rules` takes it.
        self._early: tuple[asyncio.Task[bool], list[ProxiedPort], tuple[str, ...]] | None = None
        self._preferred: dict[ClaimKey, int] = {}
        # Sockets an earlier process handed over (`adopt`), used instead of binding anew.
        self._adopted_claims: dict[ClaimKey, socket.socket] = {}
        self._adopted_node_ports: dict[SocketKey, socket.socket] = {}
        self._adopted: set[int] = set()  # their descriptors, until a listener takes them
        self.node_name: str | None = None
        self.source: SourcePolicy | None = None

    def prefer_ports(self, ports: dict[ClaimKey, int]) -> None:
        """Before the first sync: serve these service ports on these proxy ports if free
        (an earlier run's, from the state file; the installed rules' win over them)."""
        self._preferred = dict(ports)

    def adopt(
        self,
        claims: dict[ClaimKey, socket.socket],
        node_ports: dict[SocketKey, socket.socket],
    ) -> None:
        """Before the first sync: serve on these sockets, handed over by the process this one
        replaces, instead of binding new ones (same sockets: same backlogs, same groups)."""
        self._adopted_claims = dict(claims)
        self._adopted_node_ports = dict(node_ports)
        self._adopted = {s.fileno() for s in (*claims.values(), *node_ports.values())}

    def handover_sockets(self) -> list[tuple[list[Any], int]]:
        """What this process serves, to hand over: (description, descriptor) per socket.

        ["port", "ns/name:port", protocol, path] for a proxy port;
        ["nodeport", protocol, address, port] for a NodePort socket.
        """
        out: list[tuple[list[Any], int]] = []
        for name, served in self._served.items():
            protocol = str(name.protocol)
            for path, listener in served.listeners.items():
                if listener.fileno() >= 0:
                    out.append((["port", str(name), protocol, str(path)], listener.fileno()))
            for address, listener in served.node_port_listeners:
                if listener.fileno() >= 0:
                    entry = ["nodeport", protocol, address, served.node_port]
                    out.append((entry, listener.fileno()))
        return out

    def served_ports(self) -> dict[ClaimKey, int]:
        """The proxy port of each served (service port, protocol, path), for the state file."""
        return {
            (str(name), str(name.protocol), str(path)): listener.port
            for name, served in self._served.items()
            for path, listener in served.listeners.items()
        }

    @staticmethod
    def ports_of(targets: Iterable[ProxiedPort]) -> dict[ClaimKey, int]:
        """`served_ports` from rule targets (`proxied_ports()`): safe in another thread."""
        ports: dict[ClaimKey, int] = {}
        for target in targets:
            name = target.info.name
            if target.cluster_port:
                ports[(str(name), str(name.protocol), str(Path.CLUSTER))] = target.cluster_port
            if target.external_port != target.cluster_port:
                ports[(str(name), str(name.protocol), str(Path.EXTERNAL))] = target.external_port
        return ports

    def set_rule_sink(self, portals: RuleSink | None) -> None:
        """Send each sync's rule targets to `portals` (None: serve proxy ports only)."""
        self._portals = portals

    # ---- reconcile -----------------------------------------------------------------------

    async def sync(self, snapshot: Snapshot, *, full: bool = True, rules: bool = True) -> None:
        """Make listeners, pools and rules match `snapshot`; per-port failures are contained.

        Without `full` (a sync for a change), work follows the change: a partial snapshot
        (`Snapshot.changed`) names the service ports to look at, and in a complete one a
        service port whose info and endpoints are the objects last applied is skipped after
        two identity checks. `full` (the first and the periodic syncs) reconciles every service
        port, retrying what failed, and hands the rules to the portals, which check them for
        tampering. With `rules` the rules follow (`commit_rules`); without, a changed rule
        target is only recorded (`rules_pending`): an endpoint-only change never needs one.
        """
        async with self._reconcile_lock:
            if rules and self._first_commit_due(snapshot):
                await self._commit_first_early(snapshot)
            await self._reconcile(snapshot, full=full and not snapshot.partial)
        if rules:
            await self.commit_rules(force=full)

    def _first_commit_due(self, snapshot: Snapshot) -> bool:
        return (
            self._portals is not None
            and self._applied_gen == -1
            and self._early is None
            and not snapshot.partial
            and not self._quarantine
        )

    async def _commit_first_early(self, snapshot: Snapshot) -> None:
        """Start the first rule commit before the listeners are made, not after them.

        At 10,000 service ports making the listeners takes about as long as the commit (half
        a second each), and the commit is mostly iptables-restore's own work, off this loop.
        So each new service port's proxy port is reserved first, held as a claim (as an
        earlier run's ports are, `_claim_previous_ports`) for the reconcile that follows to
        serve on, and the rules naming those ports are committed meanwhile. Until its
        listener starts, a connection to such a port is refused (TCP) or waits in the
        socket (UDP), as on a Service without endpoints: on a first start there were no rules
        at all. `commit_rules` then waits for this commit and skips its own when the targets
        came out the same. A service port that cannot be reserved here is left to the
        reconcile (and to that commit), which reports why.
        """
        self._budget.start()
        if self._claims is None:
            await self._claim_previous_ports()
        claims = self._claims
        assert claims is not None
        targets: list[ProxiedPort] = []
        yielded = time.perf_counter()
        for info in snapshot.services.values():
            if time.perf_counter() - yielded > SLICE_SECONDS:
                await asyncio.sleep(0)
                yielded = time.perf_counter()
            try:
                cluster = self._reserve_early(info, Path.CLUSTER)
                external = self._reserve_early(info, Path.EXTERNAL) if info.paths_differ else 0
            except DescriptorBudgetError:
                break  # the reconcile refuses the rest, each with the reason
            except (PortExhaustedError, OSError):
                continue
            targets.append(ProxiedPort(info, cluster, external or cluster))
        node_ips = snapshot.node_ips
        portals = self._portals
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

    def _reserve_early(self, info: ServicePortInfo, path: Path) -> int:
        """The proxy port `_open` will serve `path` of `info` on: a claim held, or one
        reserved now and held as a claim."""
        assert self._claims is not None
        key = (str(info.name), str(info.protocol))
        claimed = self._claims.get((*key, str(path)))
        if claimed is None and path is Path.CLUSTER and not info.paths_differ:
            claimed = self._claims.get((*key, str(Path.EXTERNAL)))
        if claimed is None:
            self._budget.take(f"its {path} proxy port")
            claimed = self._allocator.reserve(info.protocol, name=str(info.name))
            self._claims[(*key, str(path))] = claimed
        return int(claimed.getsockname()[1])

    async def _reconcile(self, snapshot: Snapshot, *, full: bool) -> None:
        # A new source policy (--preserve-source-ip) reaches every pool, as a new node does.
        same_node = snapshot.node_name == self.node_name and snapshot.source == self.source
        self.node_name = snapshot.node_name
        self.source = snapshot.source
        self._node_ips = snapshot.node_ips
        self._budget.start()
        if self._claims is None:
            await self._claim_previous_ports()
        changed = snapshot.changed
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
        # commit, `_commit_first_early`).
        await self._dataplane.publish()
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
                self._allocator.host,
                served.port_of(Path.CLUSTER),
                len(served.pools[Path.CLUSTER]),
            )

    @property
    def rules_generation(self) -> int:
        """Grows with every change of a rule target."""
        return self._rules_gen

    @property
    def committed_generation(self) -> int:
        """The rule generation the last successful commit carried."""
        return self._applied_gen

    @property
    def served_count(self) -> int:
        """How many service ports are served."""
        return len(self._served)

    @property
    def rules_pending(self) -> bool:
        """True when a rule target changed (or a port waits for release) since the last commit."""
        if self._portals is None:
            return bool(self._quarantine or self._claims)
        return (
            self._rules_gen != self._applied_gen
            or bool(self._quarantine)
            or self._node_ips != self._applied_node_ips
        )

    async def commit_rules(self, *, force: bool = False) -> None:
        """Hand the rule targets to the portals when one changed (or `force`: a periodic check).

        The targets are taken between reconciles, so a rule never names a port before its
        listener serves; reconciles go on while the commit runs (in a thread). Once the commit
        is live (`rules_live_at`) the deletes it deferred follow, and only then are retired
        ports released: until that second commit, a stale rule may still name them.
        """
        async with self._commit_lock:
            early_done = False
            if self._early is not None:
                task, early_targets, early_ips = self._early
                self._early = None
                early_done = await task
                self.rule_applies += early_done
            async with self._reconcile_lock:
                releasable, self._quarantine = self._quarantine, []
                generation = self._rules_gen
                node_ips = self._node_ips
                wanted = self._portals is not None and (
                    force
                    or releasable
                    or generation != self._applied_gen
                    or node_ips != self._applied_node_ips
                )
                targets = self.proxied_ports() if wanted else []
            if early_done:
                self.rules_live_at = time.time()
            if early_done and not releasable and (targets, node_ips) == (early_targets, early_ips):
                wanted = False  # the first commit, made early, named exactly these
                self._applied_gen = generation
                self._applied_node_ips = node_ips
            if wanted and self._portals is not None:
                try:
                    await asyncio.to_thread(self._portals.apply, targets, node_ips)
                except BaseException:
                    self._quarantine = releasable + self._quarantine
                    raise
                # Live now: the network-programming latency ends here, not after the deletes.
                self.rules_live_at = time.time()
                self._applied_gen = generation
                self._applied_node_ips = node_ips
                self.rule_applies += 1
                # A retired port is released only once no rule names it, stale ones included.
                if not await self._commit_deferred():
                    self._quarantine = releasable + self._quarantine
                    releasable = []
            for protocol, port in releasable:
                self._allocator.release(protocol, port)
            if self._claims:
                # The commit replaced the earlier run's rules: unclaimed ports name nothing now.
                self._drop_claims()

    async def _commit_deferred(self) -> bool:
        """The deletes the last apply deferred (in a thread); False if they failed (logged:
        the next commit deletes those rules, the periodic one at the latest)."""
        assert self._portals is not None
        try:
            await asyncio.to_thread(self._portals.commit_deferred)
        except Exception as exc:
            log.warning("deleting stale rules failed (%s): their proxy ports stay held", exc)
            return False
        return True

    async def _reconcile_port(
        self, name: ServicePortName, info: ServicePortInfo, snapshot: Snapshot
    ) -> None:
        served = self._served.get(name)
        new = served is None
        if served is None:
            served = _Served(info=info, stats=ConnStats(), pools={})
            self._rules_gen += 1
        elif served.info is not info:
            self._rules_gen += 1  # the rules are rendered from the info
            served.target = None
        served.info = info
        fresh: list[tuple[Path, Listener]] = []
        try:
            if Path.CLUSTER not in served.listeners:
                fresh.append((Path.CLUSTER, self._open(served, Path.CLUSTER)))
            # A separate external listener exists exactly while the two paths need different
            # endpoint sets (one of the traffic policies is Local, the other not).
            if info.paths_differ and Path.EXTERNAL not in served.listeners:
                fresh.append((Path.EXTERNAL, self._open(served, Path.EXTERNAL)))
            elif not info.paths_differ and Path.EXTERNAL in served.listeners:
                self._retire(served, Path.EXTERNAL)
            self._update_endpoints(served, snapshot)
            # Started once their pools are filled, so a port listens when it is announced.
            for _, listener in fresh:
                await listener.start()
        except BaseException:
            # Undo what this call opened; no rule has pointed at those ports yet.
            served.target = None
            for path, listener in fresh:
                served.listeners.pop(path, None)
                served.pools.pop(path, None)
                self._allocator.release(info.protocol, listener.port)
                await listener.close()
            if not new:
                self._update_endpoints(served, snapshot)  # the paths left still follow
            raise
        if fresh:
            served.target = None
            self._rules_gen += 1  # a new proxy port: its rules, and the state file's ports
        if new:
            self._served[name] = served
        self._point_node_ports(served)
        if served.node_port != info.node_port:
            self._close_node_ports(served)
            if info.node_port:
                await self._open_node_ports(served)
        if self._errors.pop(name, None) is not None:
            log.info("%s: recovered", name)
        if new:
            self._opened.append(served)

    async def _claim_previous_ports(self) -> None:
        """Hold the ports that installed rules point at, to give each back to its service port.

        After a restart the earlier run's rules stay in place until the first commit; serving
        each service port on the port its rules already name keeps its clients working
        throughout, and no other service port can receive its traffic meanwhile.
        """
        self._claims = {}
        for key, sock in self._adopted_claims.items():
            self._claims[key] = self._allocator.adopt(Protocol(key[1]), sock)
        self._adopted_claims = {}
        # The state file's ports first, the installed rules' over them: rules carry traffic.
        claimed = dict(self._preferred)
        if self._portals is not None:
            try:
                claimed.update(await asyncio.to_thread(self._portals.claimed_ports))
            except Exception as exc:
                log.warning("cannot read the installed rules' proxy ports: %s", exc)
        for key, port in sorted(claimed.items()):
            if key in self._claims:
                continue  # handed over
            protocol = Protocol(key[1])
            try:
                sock = self._allocator.reserve(protocol, name=key[0], prefer=port)
            except (PortExhaustedError, OSError):
                continue
            if sock.getsockname()[1] != port:  # taken, or outside the range now
                log.debug("cannot hold proxy port %s/%d for %s %s", protocol, port, key[0], key[2])
                self._allocator.release(protocol, sock.getsockname()[1])
                sock.close()
                continue
            log.debug("holding proxy port %s/%d for %s %s", protocol, port, key[0], key[2])
            self._claims[key] = sock
        if self._claims:
            log.info("holding %d proxy port(s) an earlier run served", len(self._claims))

    def _drop_claims(self) -> None:
        assert self._claims is not None
        for (_, protocol, _), sock in self._claims.items():
            self._allocator.release(Protocol(protocol), sock.getsockname()[1])
            sock.close()
        self._claims.clear()

    def _open(self, served: _Served, path: Path) -> Listener:
        """Reserve a proxy port for `path` and make its listener; the caller starts it."""
        info = served.info
        pool = EndpointPool(info.name)
        claimed = None
        if self._claims:
            key = (str(info.name), str(info.protocol))
            claimed = self._claims.pop((*key, str(path)), None)
            if claimed is None and path is Path.CLUSTER and not info.paths_differ:
                # One port for both paths: the rules may name it only as the external one.
                claimed = self._claims.pop((*key, str(Path.EXTERNAL)), None)
        if claimed is None:
            self._budget.take(f"its {path} proxy port")
        sock = claimed or self._allocator.reserve(info.protocol, name=str(info.name))
        listener = self._make_listener(sock, pool, served.stats, str(info.name))
        served.pools[path] = pool
        served.listeners[path] = listener
        return listener

    def _make_listener(
        self, sock: socket.socket, pool: EndpointPool, stats: ConnStats, name: str
    ) -> Listener:
        adopt = sock.fileno() in self._adopted
        self._adopted.discard(sock.fileno())
        return self._dataplane.listener(sock, pool, stats, name, adopt=adopt)

    def _update_endpoints(self, served: _Served, snapshot: Snapshot) -> None:
        info = served.info
        endpoints = snapshot.endpoints_of(info.name)
        served.endpoints = endpoints
        served.all_endpoints = len(endpoints)
        timeout = float(info.affinity_timeout_seconds) if info.client_ip_affinity else None
        for path, pool in served.pools.items():
            local = (
                info.external_traffic_local
                if path is Path.EXTERNAL
                else info.internal_traffic_local
            )
            usable = usable_endpoints(endpoints, local_only=local, node_name=snapshot.node_name)
            pool.source = snapshot.source  # --preserve-source-ip
            pool.update(usable, affinity_timeout=timeout, local=on_node(usable, snapshot.node_name))
            pool.proxy_protocol = info.proxy_protocol
        for listener in served.every_listener():
            listener.refresh()

    # ---- NodePorts: a real socket per NodePort so nothing else can take it ------------------

    async def _open_node_ports(self, served: _Served) -> None:
        info = served.info
        pool = served.pools.get(Path.EXTERNAL) or served.pools[Path.CLUSTER]
        kind = socket.SOCK_STREAM if info.protocol is Protocol.TCP else socket.SOCK_DGRAM
        failures = []
        addresses = self._node_port_addresses()
        self._budget.take(f"its NodePort {info.protocol}/{info.node_port}", len(addresses))
        for address in addresses:
            adopted = self._adopted_node_ports.pop(
                (str(info.protocol), address, info.node_port), None
            )
            if adopted is not None:
                listener = self._make_listener(adopted, pool, served.stats, str(info.name))
                served.node_port_listeners.append((address, listener))
                await listener.start()
                continue
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, kind)
            try:
                if kind == socket.SOCK_STREAM:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                elif self._dataplane.shares_ports:  # workers join it (UDP: set before bind)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                sock.bind((address, info.node_port))
                sock.setblocking(False)
            except OSError as exc:
                sock.close()
                failures.append(f"{address}:{info.node_port}: {exc.strerror}")
                continue
            except BaseException:
                sock.close()
                self._close_node_ports(served)
                raise
            listener = self._make_listener(sock, pool, served.stats, str(info.name))
            served.node_port_listeners.append((address, listener))
            await listener.start()
        served.node_port = info.node_port
        if failures:
            # Hold all or none, so that the next sync tries the whole NodePort again.
            self._close_node_ports(served)
            raise PortInUseError(
                f"can't hold NodePort {info.protocol}/{info.node_port} ({'; '.join(failures)});"
                " traffic captured by the NodePort rules is still served"
            )

    def _point_node_ports(self, served: _Served) -> None:
        """NodePort sockets serve external traffic: give them that path's pool."""
        pool = served.pools.get(Path.EXTERNAL) or served.pools[Path.CLUSTER]
        for _, listener in served.node_port_listeners:
            if listener.picker is not pool:
                listener.set_picker(pool)

    def _close_node_ports(self, served: _Served) -> None:
        for _, listener in served.node_port_listeners:
            self._close_later(listener)
        served.node_port_listeners.clear()
        served.node_port = 0

    # ---- removal and shutdown --------------------------------------------------------------

    def _remove(self, name: ServicePortName) -> None:
        served = self._served.pop(name)
        for path in list(served.listeners):
            self._retire(served, path)
        self._close_node_ports(served)
        log.info("%s: removed (proxy port closed; open connections finish)", name)

    def _retire(self, served: _Served, path: Path) -> None:
        """Close the listener of `path`; its port stays out of use until no rule names it."""
        listener = served.listeners.pop(path)
        served.pools.pop(path, None)
        self._rules_gen += 1
        served.target = None
        self._close_later(listener)
        # Rules still send this port's traffic here until the next commit: handing the port
        # to another service port before then would deliver one Service's clients to another.
        self._quarantine.append((served.info.protocol, listener.port))

    def _close_later(self, listener: Listener) -> None:
        # Stop accepting now; the connections already open finish on their own.
        task = asyncio.get_running_loop().create_task(listener.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        self._retired = [old for old in self._retired if old.active_connections]
        self._retired.append(listener)

    def _report(self, name: ServicePortName, message: str) -> None:
        if self._errors.get(name) != message:
            log.error("%s: %s", name, message)
        self._errors[name] = message

    async def shutdown(self, grace: float, *, release: bool = False) -> None:
        """Stop accepting everywhere, then give open connections `grace` seconds to finish.

        `release`: the sockets were handed over to a new process: close only this process's
        descriptors, leaving them as they are for it (`Listener.release`).
        """
        if self._early is not None:  # a first commit still running: let it end
            await asyncio.gather(self._early[0], return_exceptions=True)
            self._early = None
        listeners = [lst for served in self._served.values() for lst in served.every_listener()]
        await asyncio.gather(
            *(lst.release() if release else lst.close() for lst in listeners),
            return_exceptions=True,
        )
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        listeners.extend(self._retired)
        await asyncio.gather(*(lst.drain(grace) for lst in listeners), return_exceptions=True)
        if self._claims:
            self._drop_claims()
        for sock in (*self._adopted_claims.values(), *self._adopted_node_ports.values()):
            sock.close()  # handed over and never used: this descriptor only
        self._served.clear()
        self._retired.clear()

    # ---- views for rules, metrics and /debug/state ------------------------------------------

    def proxied_ports(self) -> list[ProxiedPort]:
        """The desired rule targets: each service port with the proxy port of each path."""
        return [served.target or self._target(served) for served in self._served.values()]

    @staticmethod
    def _target(served: _Served) -> ProxiedPort:
        served.target = ProxiedPort(
            info=served.info,
            cluster_port=served.port_of(Path.CLUSTER),
            external_port=served.port_of(Path.EXTERNAL),
        )
        return served.target

    def port_stats(self) -> list[tuple[ServicePortName, ConnStats]]:
        """(service port, its counters) for every served port; read by metrics at scrape time."""
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
        return dict(self.debug_entries(sorted(self.debug_names(), key=by_name)))

    async def debug_items(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """`debug_state` one service port at a time, so a caller can yield to the loop between.

        The names are sorted a run at a time, yielding to the loop between runs: one sort of
        10,000 names held the loop for 25-45 ms. Service ports removed while it is consumed
        are left out; ClientIP pins are summarized.
        """
        for item in self.debug_entries(await sorted_in_runs(self.debug_names())):
            yield item

    def debug_names(self) -> list[ServicePortName]:
        """The service ports the view shows, unsorted: those served and those that failed."""
        names = list(self._served)
        names += [name for name in self._errors if name not in self._served]
        return names

    def debug_entries(
        self, names: Iterable[ServicePortName]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """The view of each of `names` in turn, as it is when reached (gone ones are skipped)."""
        for name in names:
            served = self._served.get(name)
            error = self._errors.get(name)
            if served is None:
                if error is not None:
                    yield str(name), {"error": error}
                continue
            info = served.info
            stats = served.stats
            pins, shown = self._dataplane.affinity_summary(served.pools[Path.CLUSTER])
            entry: dict[str, Any] = {
                "protocol": str(info.protocol),
                "clusterIPs": list(info.cluster_ips),
                "port": info.port,
                "nodePort": info.node_port or None,
                "externalIPs": list(info.external_ips),
                "loadBalancerIPs": list(info.load_balancer_ips),
                "sessionAffinity": "ClientIP" if info.client_ip_affinity else "None",
                "proxyPorts": {
                    str(path): listener.port for path, listener in served.listeners.items()
                },
                "nodePortListeners": [
                    f"{address}:{listener.port}" for address, listener in served.node_port_listeners
                ],
                "endpoints": {
                    str(path): [f"{ip}:{port}" for ip, port in pool.addresses]
                    for path, pool in served.pools.items()
                },
                "knownEndpoints": served.all_endpoints,
                "sourceAddress": {  # --preserve-source-ip: the dial's source, per endpoint
                    str(path): {_show(a): why for a, why in pool.source_choices().items()}
                    for path, pool in served.pools.items()
                    if pool.source is not None
                },
                "balancer": {
                    str(path): _balancer_json(self._dataplane.balancer_view(pool))
                    for path, pool in served.pools.items()
                },
                "affinity": {
                    "pins": pins,
                    "shown": [
                        {
                            "clientIP": client,
                            "endpoint": f"{ep[0]}:{ep[1]}",
                            "expiresIn": round(left, 1),
                        }
                        for client, ep, left in shown
                    ],
                },
                "connections": {
                    "active": stats.active,
                    "accepted": stats.accepted,
                    "completed": stats.completed,
                    "refusedNoEndpoints": stats.refused_no_endpoints,
                    "dialFailures": stats.dial_failures,
                    "failed": stats.failed,
                },
                "bytes": {"in": stats.bytes_in, "out": stats.bytes_out},
                "udp": {
                    "sessionsActive": stats.udp_sessions_active,
                    "datagramsIn": stats.udp_datagrams_in,
                    "datagramsOut": stats.udp_datagrams_out,
                    "dropped": stats.udp_dropped,
                },
            }
            if error is not None:
                entry["error"] = error
            yield str(name), entry


SORT_RUN = 256
"""Names `sorted_in_runs` sorts between two yields to the event loop (~0.3 ms of work)."""


def by_name(name: ServicePortName) -> tuple[str, str, str, str]:
    """The sort key of a service port name: a plain tuple sorts in C; the dataclass's
    generated __lt__ does not."""
    return (name.namespace, name.name, name.port, name.protocol)


async def sorted_in_runs(names: list[ServicePortName]) -> Iterator[ServicePortName]:
    """`names` in `by_name` order, sorted SORT_RUN at a time with a yield to the event loop
    after each run, then merged lazily: no step costs more than a run or one merge step."""
    runs = []
    for start in range(0, len(names), SORT_RUN):
        runs.append(sorted([(by_name(n), n) for n in names[start : start + SORT_RUN]]))
        await asyncio.sleep(0)
    # Keys are unique (equal keys are equal names), so the names themselves are never compared.
    return (name for _, name in heapq.merge(*runs))


def _show(address: Address) -> str:
    ip, port = address
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _balancer_json(view: BalancerView) -> dict[str, Any]:
    return {
        "endpoints": [
            {
                "endpoint": _show(address),
                "active": values[0],
                "total": values[1],
                "bytesIn": values[2],
                "bytesOut": values[3],
                "dialFailures": values[4],
            }
            for address, values in view.endpoints
        ],
        "recentPicks": [
            {"worker": worker, "picks": [[_show(a), why] for a, why in picks]}
            for worker, picks in view.picks
        ],
        "penalized": [
            {"endpoint": _show(a), "secondsLeft": round(left, 1)} for a, left in view.penalized
        ],
    }


def local_addresses_in(cidrs: Sequence[str], addresses: Iterable[str]) -> list[str]:
    """The addresses that fall inside any of `cidrs` (for `--nodeport-addresses`)."""
    networks = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    return [a for a in addresses if any(ipaddress.ip_address(a) in n for n in networks)]
