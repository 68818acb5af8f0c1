"""The workers as the proxier's data plane: `WorkerPool` and the `SharedPort`s it hands out.

The control process keeps the reserved socket of every proxy port (and NodePort) and hands
the proxier `SharedPort`s in place of listeners, and `EndpointSet`s in place of the
`balancer.EndpointPool`s the workers pick from: the control process never picks, so it keeps
the endpoints and nothing of a balancer's state (cursor, tallies, pins, penalties).
`WorkerPool` is the one object the rest of the program holds; it wires the parts that do the
work:

- `supervisor.Supervisor` keeps the worker processes running (spare, restarts);
- `publisher.Publisher` sends them the table and deltas after each reconcile;
- `groups.Groups` tracks each port's reuseport group, from which the steering routes come;
- `counters.Counters` sums their counters into the proxier's ConnStats;
- `handover.Handover` passes their sockets to the next process's workers.
"""

from __future__ import annotations

import dataclasses
import socket
import weakref
from collections.abc import Sequence

from kube_userspace_proxy.balancer import BalancerView, PoolView, Transparency
from kube_userspace_proxy.dataplane import ConnStats
from kube_userspace_proxy.model import (
    SCHEDULERS,
    Address,
    Balancing,
    Endpoint,
    ServicePortName,
    SocketKey,
    SourcePolicy,
)
from kube_userspace_proxy.nodecounts import NodeCounts, SlotBook
from kube_userspace_proxy.outliers import Outliers
from kube_userspace_proxy.schedulers import LC, NO_SLOTS, RR, scheduler_code
from kube_userspace_proxy.workers.counters import Counters
from kube_userspace_proxy.workers.groups import Groups
from kube_userspace_proxy.workers.handover import Handover
from kube_userspace_proxy.workers.link import Replies, WorkerLink
from kube_userspace_proxy.workers.protocol import (
    Collected,
    Eject,
    Penalty,
    Pin,
    Recovered,
    Scheduled,
    Settings,
)
from kube_userspace_proxy.workers.publisher import Publisher
from kube_userspace_proxy.workers.supervisor import Supervisor

_OPAQUE: Transparency = (None, ())
"""No transparent dialing, no endpoint on this node."""


class EndpointSet:
    """A pool as the control process keeps it while the workers serve: what they are sent.

    The `PoolView` the publisher describes to the workers and the `Pool` the proxier fills,
    as `EndpointPool.update` would (the same addresses, timeout and local endpoints), with
    slots: 10,000 of them are held, one per service port and path.
    """

    __slots__ = (
        "__weakref__",  # the publisher ids pools weakly
        "_book",
        "_ejecting",
        "_local",
        "_scheduler",
        "_slots",
        "addresses",
        "affinity_timeout",
        "name",
        "outliers",
        "proxy_protocol",
        "source",
    )

    def __init__(self, name: ServicePortName, book: SlotBook | None = None) -> None:
        self.name = name
        self._book = book
        self._scheduler = RR
        self._slots: dict[Address, int] = {}  # lc: each endpoint's slot in the shared counts
        self.outliers: Outliers | None = None
        """Passive ejection, decided here for every worker; made at the first failed dial
        (None: none yet, or off)."""
        self._ejecting: Balancing | None = None  # the settings of ejection (None: off)
        self.addresses: tuple[Address, ...] = ()
        """The usable endpoint addresses, in round-robin order."""
        self.affinity_timeout: float | None = None
        """The ClientIP affinity timeout in seconds now in force; None without affinity."""
        self.proxy_protocol = 0
        """PROXY protocol version the workers send these endpoints first (0: none)."""
        self.source: SourcePolicy | None = None
        """Transparent dialing (--preserve-source-ip) and the node's local clients; None: off."""
        self._local: tuple[Address, ...] = ()  # the usable endpoints on this node, in order

    def __len__(self) -> int:
        return len(self.addresses)

    def update(
        self,
        endpoints: Sequence[Endpoint],
        *,
        affinity_timeout: float | None,
        local: frozenset[Address] = frozenset(),
    ) -> None:
        """Take a new endpoint list, the affinity timeout and which endpoints run on this node."""
        addresses = tuple(dict.fromkeys(e.address for e in endpoints))
        if addresses != self.addresses:  # unchanged: keep the tuple the entries already share
            self.addresses = addresses
            self._take_slots()
            if self.outliers is not None:
                self.outliers.keep(addresses)
        self.affinity_timeout = (
            affinity_timeout if affinity_timeout is not None and affinity_timeout > 0 else None
        )
        self._local = tuple(a for a in self.addresses if a in local) if local else ()

    @property
    def scheduler(self) -> str:
        """The scheduler the workers pick with (one of `model.SCHEDULERS`)."""
        return SCHEDULERS[self._scheduler]

    def balance(self, balancing: Balancing) -> None:
        """Have the workers pick with `balancing.scheduler` (lc: each endpoint gets a slot of
        the node's shared counts); eject outliers as `balancing` says."""
        self._scheduler = scheduler_code(balancing.scheduler)
        self._take_slots()
        self._ejecting = balancing if balancing.outlier_failures > 0 else None
        if self._ejecting is None:
            self.outliers = None
        elif self.outliers is not None:
            self.outliers.failures = balancing.outlier_failures
            self.outliers.base = balancing.outlier_base_ejection

    def dial_failed(self, address: Address) -> float:
        """A worker's dial to `address` failed: the seconds it is ejected for now (0: not)."""
        ejecting = self._ejecting
        if ejecting is None:
            return 0.0
        if self.outliers is None:  # made at the first failure: most pools never see one
            self.outliers = Outliers(
                self.name,
                failures=ejecting.outlier_failures,
                base=ejecting.outlier_base_ejection,
            )
        return self.outliers.failed(address, len(self.addresses))

    @property
    def scheduled(self) -> Scheduled:
        """How the workers pick: (scheduler code, lc's slot per endpoint, in order)."""
        if self._scheduler != LC or not self._slots:
            return (self._scheduler, NO_SLOTS)
        return (self._scheduler, tuple(self._slots[a] for a in self.addresses))

    def _take_slots(self) -> None:
        """Slots for lc's endpoints (kept while the endpoint stays), given back otherwise."""
        book = self._book
        if book is None:
            return
        wanted = self.addresses if self._scheduler == LC else ()
        held = self._slots
        keep = set(wanted)
        gone = [a for a in held if a not in keep]
        if gone:
            book.give_back(tuple(held.pop(a) for a in gone))
        if wanted and not held:  # the first: give them back when this set is dropped
            weakref.finalize(self, _give_back, book, held)
        for address in wanted:
            if address not in held:
                held[address] = book.take()

    @property
    def transparency(self) -> Transparency:
        """The source policy's CIDRs (None: off) and the local endpoints, for the workers."""
        source = self.source
        if source is None and not self._local:
            return _OPAQUE  # the publisher keeps one per pool: share the common one
        return (None if source is None else source.client_cidrs, self._local)

    def source_choices(self) -> dict[Address, str]:
        """Per usable endpoint, the source address its dials get under --preserve-source-ip
        (as `EndpointPool.source_choices`); {} while off."""
        if self.source is None:
            return {}
        local = set(self._local)
        return {a: "client" if a in local else "client-if-pod" for a in self.addresses}


def _give_back(book: SlotBook, held: dict[Address, int]) -> None:
    book.give_back(tuple(held.values()))
    held.clear()


class SharedPort:
    """A proxy port (or NodePort) served by the workers; this process holds its reservation."""

    __slots__ = ("_pool", "_sock", "key", "name", "picker", "stats", "v6only")

    def __init__(
        self, pool: WorkerPool, sock: socket.socket, picker: PoolView, stats: ConnStats, name: str
    ) -> None:
        if sock.type == socket.SOCK_STREAM:
            # Workers' listeners join this reservation: it must allow that, and nobody else.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        sock.setblocking(False)
        self._pool = pool
        self._sock: socket.socket | None = sock
        address = sock.getsockname()
        protocol = "TCP" if sock.type == socket.SOCK_STREAM else "UDP"
        self.key: SocketKey = (protocol, address[0], address[1])
        self.v6only = (
            sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
            if sock.family == socket.AF_INET6
            else 0
        )
        self.picker = picker
        self.stats = stats
        self.name = name
        pool.add(self)

    async def start(self) -> None:
        """Served once `publish()` has sent the table (before any rule points here)."""

    def refresh(self) -> None:
        """The next `publish()` carries the pool's endpoints to the workers."""
        self._pool.touch(self)

    def set_picker(self, picker: PoolView) -> None:
        self.picker = picker
        self._pool.touch(self)

    async def close(self) -> None:
        if self._sock is not None:
            self._pool.remove(self)
            self._sock.close()
            self._sock = None

    async def release(self) -> None:
        """Close this process's descriptor only (handed over: the reservation, and for UDP
        the group member, stay with the new owner)."""
        if self._sock is not None:
            self._pool.remove(self)
            self._sock.close()
            self._sock = None

    def fileno(self) -> int:
        return self._sock.fileno() if self._sock is not None else -1

    async def drain(self, timeout: float) -> None:  # noqa: ASYNC109 - the contract's shape
        """The workers drain their connections (`WorkerPool.shutdown`)."""

    @property
    def port(self) -> int:
        return self.key[2]

    @property
    def address(self) -> tuple[str, int]:
        return (self.key[1], self.key[2])

    @property
    def active_connections(self) -> int:
        return 0  # connections live in the workers; they keep their listeners until drained


class WorkerPool:
    """N worker processes serving every proxy port; the proxier's data plane with workers."""

    shares_ports = True

    def __init__(
        self,
        count: int,
        *,
        udp_idle_timeout: float = 0.25,
        tcp_keepalive: float = 15.0,
        verbosity: int = 0,
        log_format: str = "text",
        event_loop: str = "auto",
        dataplane: str = "auto",
    ) -> None:
        self.count = count
        # lc's active connections, shared by the workers (inherited through the fork server).
        self.counts = NodeCounts.create(count)
        self._book = SlotBook(self.counts.slots)
        argv = ["--workers", str(count), "-v", str(verbosity), "--log-format", log_format]
        argv += ["--event-loop", event_loop, "--dataplane", dataplane]
        argv += ["--counts-fd", str(self.counts.fd)]
        replies = Replies()
        self._supervisor = Supervisor(
            count,
            argv,
            replies,
            on_part=self._take_part,
            on_exit=self._worker_exited,
            on_slot=self._slot_taken,
            on_dial=self._dial_reported,
            pass_fds=(self.counts.fd,),
        )
        self._groups = Groups(count)
        self._publisher = Publisher(
            Settings(udp_idle_timeout, tcp_keepalive), self._groups, replies, self._supervisor.live
        )
        self._counters = Counters(replies)
        self._handover = Handover(replies, self._supervisor.live)

    # ---- the proxier's data plane ------------------------------------------------------------

    def new_pool(self, name: ServicePortName) -> EndpointSet:
        """The workers pick; this process only describes each pool to them."""
        return EndpointSet(name, self._book)

    def listener(
        self,
        sock: socket.socket,
        pool: PoolView,
        stats: ConnStats,
        name: str,
        *,
        adopt: bool = False,
    ) -> SharedPort:
        # A handed-over reservation is in its group already (`adopt_groups`).
        return SharedPort(self, sock, pool, stats, name)

    def add(self, port: SharedPort) -> None:
        """Serve `port` from the next `publish()` on."""
        self._publisher.add(port)

    def touch(self, port: SharedPort) -> None:
        """`port`'s pool or picker changed: the next `publish()` sends it."""
        self._publisher.touch(port)

    def remove(self, port: SharedPort) -> None:
        """Stop serving `port` from the next `publish()` on."""
        self._publisher.remove(port)

    async def publish(self) -> None:
        """Send every worker the ports changed since the last publish, then steer the
        changed groups (`Publisher.publish`)."""
        await self._publisher.publish()

    async def collect(self, *, debug: bool = False) -> None:
        """Ask every worker for its counters and sum them into the proxier's ConnStats."""
        stats = {port.name: port.stats for port in self._publisher.ports.values()}
        await self._counters.collect(self._supervisor.live(), stats, debug=debug)

    def affinity_summary(self, pool: PoolView) -> tuple[int, list[Pin]]:
        """The pin count and the pins shown, as the workers reported them at the last
        `collect(debug=True)`."""
        return self._counters.affinity_summary(self._publisher.pool_id(pool))

    def balancer_view(self, pool: PoolView) -> BalancerView:
        """What each worker's copy of `pool` reported at the last `collect(debug=True)`, with
        its scheduler and the endpoints ejected now (decided here)."""
        view = self._counters.balancer_view(self._publisher.pool_id(pool), pool.addresses)
        if not isinstance(pool, EndpointSet):
            return view
        ejected = pool.outliers.ejected() if pool.outliers is not None else []
        return dataclasses.replace(view, scheduler=pool.scheduler, ejected=ejected)

    # ---- what the parts tell each other ------------------------------------------------------

    def _take_part(self, worker: WorkerLink, part: Collected) -> None:
        self._counters.take_part(worker, part)

    def _dial_reported(self, message: Penalty | Recovered) -> None:
        """A worker's dial failed (`Penalty`), or connected after a failure (`Recovered`):
        count it node-wide; an ejection is sent to every worker."""
        pool = self._publisher.pool(message.pool_id)
        if not isinstance(pool, EndpointSet):
            return
        if isinstance(message, Recovered):
            if pool.outliers is not None:
                pool.outliers.succeeded(message.address)
            return
        seconds = pool.dial_failed(message.address)
        if seconds > 0:
            self._supervisor.broadcast(Eject(message.pool_id, message.address, seconds))

    def _worker_exited(self, index: int) -> None:
        """The worker of slot `index` exited (or was killed): its sockets left every group."""
        self._counters.bury(index)
        self._publisher.forget_worker(index)  # its replacement reports its own
        changed = self._groups.leave_all(index)
        if changed and not self._supervisor.stopping:
            self._publisher.steer(changed)

    async def _slot_taken(self, worker: WorkerLink) -> None:
        await self._publisher.send_table(worker)
        # A worker new in its slot skips what the others skip: the endpoints ejected now.
        for port in list(self._publisher.ports.values()):
            pool = port.picker
            pool_id = self._publisher.pool_id(pool)
            if isinstance(pool, EndpointSet) and pool.outliers is not None and pool_id:
                for address, left in pool.outliers.ejected():
                    worker.send(Eject(pool_id, address, left))

    # ---- what the others read ----------------------------------------------------------------

    @property
    def alive(self) -> int:
        """Workers serving now (the spare not counted)."""
        return len(self._supervisor.live())

    def pids(self) -> list[int]:
        """The process IDs of the workers, in slot order (0 for a slot being replaced)."""
        return self._supervisor.pids()

    def spare_pid(self) -> int:
        """The process ID of the warm spare (0 if none is ready)."""
        return self._supervisor.spare_pid()

    @property
    def fork_server_pid(self) -> int:
        """The process ID of the fork server the workers are forked from (0 if none runs)."""
        return self._supervisor.forks.pid

    def stalest_answer(self) -> float:
        """Seconds since the worker whose event loop answered longest ago last answered."""
        return self._supervisor.stalest_answer()

    @property
    def restarts(self) -> int:
        """Workers replaced after an unexpected exit."""
        return self._supervisor.restarts

    @property
    def deltas(self) -> int:
        """Deltas published (each carries only the ports changed since the previous)."""
        return self._publisher.deltas

    @property
    def ports_sent(self) -> int:
        """Port entries the deltas carried, in all (each delta's, counted once)."""
        return self._publisher.ports_sent

    @property
    def tables(self) -> int:
        """Full tables sent (to a worker taking a slot)."""
        return self._publisher.tables

    @property
    def programs_sent(self) -> int:
        """Steering programs the workers were told to attach (each costs a kernel compile)."""
        return self._publisher.programs_sent

    @property
    def unserved(self) -> int:
        """Ports some worker could not open at its last answer, summed over the workers."""
        return self._publisher.unserved

    def unserved_ports(self, index: int) -> frozenset[SocketKey]:
        """The ports worker `index` reported it could not open."""
        return self._publisher.unserved_ports(index)

    def members(self, key: SocketKey) -> tuple[int, ...]:
        """The reuseport group of `key` as tracked: worker numbers in the kernel's order."""
        return self._groups.members(key)

    def groups(self) -> dict[SocketKey, list[int]]:
        """Every reuseport group as tracked: worker numbers in the kernel's order."""
        return self._groups.snapshot()

    # ---- starting, handing over, stopping ----------------------------------------------------

    async def start(self) -> None:
        """Start every worker and the spare; raises ProxyError when one cannot start."""
        await self._supervisor.start()

    async def heartbeat(self, interval: float = 1.0) -> None:
        """Ping every worker's event loop each `interval` seconds (a root task)."""
        await self._supervisor.heartbeat(interval)

    def adopt_groups(self, groups: dict[SocketKey, list[int]]) -> None:
        """Before the first table: the groups of the sockets handed over, in the order the
        process that made them tracked (same sockets: the same order, so steering holds)."""
        self._groups.adopt(groups)

    async def prepare_adoption(self, directory: str) -> dict[int, str]:
        """Have every worker listen for its predecessor's sockets; slot -> unix socket path."""
        return await self._handover.prepare_adoption(directory)

    async def finish_adoption(self, timeout: float) -> dict[int, int]:  # noqa: ASYNC109
        """Wait until every worker has its predecessor's sockets; slot -> how many."""
        return await self._handover.finish_adoption(timeout)

    async def export(self, paths: dict[int, str], timeout: float) -> dict[int, int]:  # noqa: ASYNC109
        """Each worker sends its sockets to the path of its slot; slot -> how many."""
        return await self._handover.export(paths, timeout)

    def abandon(self) -> None:
        """Kill every worker at once, leaving the sockets they hold untouched (a handover
        that failed: the process that handed them over still serves them)."""
        self._publisher.stop()
        self._supervisor.abandon()

    async def shutdown(self, grace: float, *, release: bool = False) -> None:
        """Tell every worker to stop accepting and drain within `grace`; then reap them.

        `release`: the sockets were handed over; the workers close their descriptors only.
        """
        retry = self._publisher.stop()
        await self._supervisor.shutdown(grace, release=release, tasks=(retry,))
        self.counts.close()  # the workers are gone; their own mappings went with them
