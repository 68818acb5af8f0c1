"""A data-plane worker process: serves every proxy port the control process sends it.

Forked by the fork server (`forkserver`), which runs `main` with one end of a socketpair from
the control process (`python -m kube_userspace_proxy.workers.process --fd N` runs one alone).
It holds the data plane only (listeners, endpoint pools, connections) and never
imports the control plane's libraries (kubernetes_asyncio, aiohttp, pydantic, iptc), so it
starts small. Each table it receives is the complete set of served ports; it reconciles its
listeners to it, like the proxier does, and answers with the order in which its sockets joined
and left each port's reuseport group (the control process steers clients with that).

Every message it reads or writes is a `protocol` type; `Worker.run` hands each to its handler
through a table keyed by the message's type.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from sys import intern
from typing import Any

from kube_userspace_proxy import collector, fdpass, logs
from kube_userspace_proxy.balancer import (
    NO_LOCAL,
    PINS_SHOWN,
    EndpointPool,
    Transparency,
    source_policy,
)
from kube_userspace_proxy.dataplane import (
    ConnStats,
    TcpListener,
    UdpListener,
    coreloop,
    native,
    steering,
)
from kube_userspace_proxy.dataplane.stats import COUNTERS
from kube_userspace_proxy.dataplane.tcp import DATAPLANES, is_listening, set_default
from kube_userspace_proxy.model import (
    Address,
    DialOutcome,
    Protocol,
    ServicePortName,
    SocketKey,
)
from kube_userspace_proxy.nodecounts import NodeCounts
from kube_userspace_proxy.workers import channel, protocol
from kube_userspace_proxy.workers.nodewide import NodeWide
from kube_userspace_proxy.workers.protocol import (
    Adopt,
    Adopted,
    Adopting,
    Applied,
    Become,
    Collect,
    Collected,
    Delta,
    Drain,
    Drained,
    Eject,
    Export,
    Exported,
    Hello,
    ListenerEntry,
    Membership,
    Penalty,
    Ping,
    Pong,
    PoolEntry,
    PoolView,
    Routes,
    Scheduled,
    Settings,
    Steer,
    Table,
)

log = logs.get(__name__)

HANDOVER_TIMEOUT = 60.0
"""Seconds a worker waits for its predecessor's sockets (the old process may be busy)."""
REPORT_PART = 250
"""Service ports per part of a "collected" report: a part is built here, and read and taken in
by the control process, in one turn of a loop (at 10,000 ports a report in one piece held
the control process's loop for 70-235 ms of CPU)."""


class Addresses:
    """One object per endpoint address, and per list of them, among a worker's pools.

    The table carries an address (a tuple, its IP string, its port number) per endpoint per
    pool, and pools share endpoints: a Service's ports, its cluster and external paths, pods
    behind several Services. Kept for as long as a pool holds them: `prune` forgets the rest
    once there are twice as many as after the last prune.
    """

    def __init__(self) -> None:
        self._known: dict[Any, Any] = {}
        self._floor = 1024

    def one(self, addresses: tuple[Address, ...]) -> tuple[Address, ...]:
        """The object equal to `addresses` that the worker holds already (made so if none)."""
        known = self._known
        shared: tuple[Address, ...] | None = known.get(addresses)
        if shared is None:
            items = []
            for address in addresses:
                one = known.get(address)
                if one is None:
                    ip, port = address
                    one = (intern(ip), port)
                    known[one] = one
                items.append(one)
            shared = tuple(items)
            known[shared] = shared
        return shared

    def prune(self, pools: Iterable[EndpointPool]) -> None:
        """Forget what no pool holds, if the count doubled since the last prune."""
        if len(self._known) > 2 * self._floor:
            self._known = {a: a for pool in pools for a in (pool.addresses, *pool.addresses)}
            self._floor = max(1024, len(self._known))


class _Pool(EndpointPool):
    """An endpoint pool whose dial failures are also reported to the other workers; the
    worker's copy of its slot (`EndpointPool.take_slot`)."""

    __slots__ = ("fresh", "pool_id", "sched", "worker")

    def __init__(self, pool_id: int, name: ServicePortName, worker: Worker) -> None:
        super().__init__(name, slot=worker.index, slots=worker.slots)
        self.pool_id = pool_id
        self.worker = worker
        self.fresh = True
        self.sched: Scheduled = (0, ())
        """How the table says to pick (kept: a spare shares its counts once it has a slot)."""

    def dial_failed(self, address: Address, outcome: int = DialOutcome.REFUSED) -> None:
        super().dial_failed(address, outcome)
        self.worker.report_penalty(self.pool_id, address)

    def _recovered(self, address: Address) -> None:
        super()._recovered(address)
        self.worker.nodewide.report_recovered(self.pool_id, address)

    def take(
        self,
        addresses: tuple[Address, ...],
        timeout: float | None,
        proxy_protocol: int,
        transparency: Transparency,
        scheduled: Scheduled,
    ) -> bool:
        """Take this pool's entry of a table or delta; whether its endpoints changed."""
        self.proxy_protocol = proxy_protocol
        self.source = source_policy(transparency[0])
        # Compared with what the pool holds: a copy of the table's entries kept to compare
        # with was the table a second time in every worker (0.4 KiB a pool).
        if not self.fresh and (addresses, timeout, transparency, scheduled) == (
            self.addresses,
            self.affinity_timeout,
            self.transparency,
            self.sched,
        ):
            return False
        self.fresh = False
        self.take_addresses(
            self.worker.addresses.one(addresses),
            affinity_timeout=timeout,
            local=frozenset(transparency[1]) if transparency[1] else NO_LOCAL,
        )
        self.worker.nodewide.take(self, scheduled)
        return True


@dataclasses.dataclass(slots=True)
class _Served:
    listener: TcpListener | UdpListener
    name: str
    pool_id: int


class Worker:
    """The worker's state: listeners by (protocol, host, port), pools, counters per name."""

    def __init__(
        self,
        index: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        slots: int = 1,
    ) -> None:
        self.index = index
        self.slots = slots
        """How many workers serve (this one included): each starts its round robins at its
        own place, so that their first picks spread over the endpoints."""
        self._reader = reader
        self._writer = writer
        self._served: dict[SocketKey, _Served] = {}
        self._pools: dict[int, _Pool] = {}
        self.nodewide = NodeWide(None, index, writer, self._pools)  # counts: set by `_main`
        self.addresses = Addresses()
        self._stats: dict[str, ConnStats] = {}
        self._events: list[Membership] = []
        self._programs: dict[tuple[int, ...], bytes] = {}
        self._routes: dict[SocketKey, tuple[int, ...]] = {}
        self._group_socks: dict[SocketKey, socket.socket] = {}
        self._retired: list[TcpListener | UdpListener] = []
        # Sockets the same slot's worker of the process this one replaces handed over.
        self._adopted: dict[SocketKey, socket.socket] = {}
        # Ports of the table it failed to open (EMFILE, say): reported with every answer.
        self._unserved: set[SocketKey] = set()
        self.udp_idle_timeout = 0.25
        self.tcp_keepalive = 15.0
        self._stopped = False
        # Every TCP listener's `on_listen` and maker of counters: one bound method each.
        self._on_listen = self._membership
        self._counters_of = self._stats_of
        # Each message the control process sends, by its type: the method that takes it.
        self._handlers: dict[type[Any], Callable[[Any], Awaitable[None]]] = {
            Table: self._on_table,
            Delta: self._on_delta,
            Ping: self._on_ping,
            Become: self._on_become,
            Steer: self._on_steer,
            Penalty: self._on_penalty,
            Eject: self.nodewide.on_eject,
            Collect: self._collect,
            Adopt: self._adopt,
            Export: self._export,
            Drain: self._on_drain,
        }

    # ---- the channel -----------------------------------------------------------------------

    async def run(self) -> int:
        """Serve tables until told to drain (exit 0) or the control process goes away (1)."""
        protocol.send(self._writer, Hello(self.index, os.getpid()))
        while not self._stopped:
            try:
                frame = await channel.receive(self._reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                log.error("worker %d: the control process is gone; stopping", self.index)
                await self.drain(1.0)
                return 1
            try:
                message = protocol.decode(frame)
                handler = self._handlers[type(message)]
            except (ValueError, KeyError) as exc:
                log.error("worker %d: unknown message %r: %s", self.index, frame[0], exc)
                continue
            await handler(message)
            del frame, message  # a table is freed now, not once the next message has arrived
        return 0

    async def _on_table(self, table: Table) -> None:
        with collector.held_off():  # what a whole table builds lives on (frozen)
            await self.apply(table)

    async def _on_delta(self, delta: Delta) -> None:
        with collector.held_off():  # the first one carries the whole table
            await self.apply_delta(delta)

    async def _on_ping(self, ping: Ping) -> None:
        """The control process checks that this loop runs."""
        protocol.send(self._writer, Pong(ping.seq, self.index))

    async def _on_become(self, become: Become) -> None:
        """This spare takes the slot of a worker that died; its pools start at the slot's
        place if they have not picked yet."""
        self.index = become.worker
        self.nodewide.become(self.index, self.slots)

    async def _on_steer(self, steer: Steer) -> None:
        self.steer(steer.routes)

    async def _on_penalty(self, penalty: Penalty) -> None:
        """Another worker's dial to this endpoint failed: skip it here too."""
        pool = self._pools.get(penalty.pool_id)
        if pool is not None:
            EndpointPool.dial_failed(pool, penalty.address)

    async def _on_drain(self, drain: Drain) -> None:
        await self.drain(drain.grace, release=drain.release)
        protocol.send(self._writer, Drained(drain.seq, self.index))
        await self._writer.drain()
        self._stopped = True

    def report_penalty(self, pool_id: int, address: Address) -> None:
        protocol.send(self._writer, Penalty(pool_id, address))

    # ---- the table ---------------------------------------------------------------------------

    async def apply(self, table: Table) -> None:
        """Make the listeners and pools match the whole table; report group joins and leaves."""
        changed = self._take(table.settings, table.pools, table.routes)
        wanted = {key for key, _, _, _ in table.listeners}
        self._unserved &= wanted
        await self._drop([k for k in self._served if k not in wanted])
        await self._upsert(table.listeners, changed)
        for pool_id in [p for p in self._pools if p not in table.pools]:
            del self._pools[pool_id]
        self._forget_unserved()
        self._answer(table.seq)

    async def apply_delta(self, delta: Delta) -> None:
        """Take the ports changed since the last table or delta (`removed`: gone); the rest
        stays as it is. Costs time in proportion to the change."""
        changed = self._take(delta.settings, delta.pools, delta.routes)
        await self._drop(delta.removed)
        await self._upsert(delta.listeners, changed)
        if delta.removed:
            used = {s.pool_id for s in self._served.values()}
            for pool_id in [p for p in self._pools if p not in used]:
                del self._pools[pool_id]
            self._forget_unserved()
        self._answer(delta.seq)

    def _take(self, settings: Settings, pools: dict[int, PoolEntry], routes: Routes) -> set[int]:
        """Take the settings, routes and pools of a table or delta; the pools that changed."""
        self.udp_idle_timeout = float(settings.udp_idle_timeout)
        self.tcp_keepalive = float(settings.tcp_keepalive)
        self._routes.update(routes)
        changed: set[int] = set()
        for pool_id, (pool_name, addresses, timeout, proxy_protocol, tp, sched) in pools.items():
            pool = self._pools.get(pool_id)
            if pool is None:
                namespace, name, port, kind = pool_name
                spn = ServicePortName(namespace, name, port, Protocol(kind))
                pool = self._pools[pool_id] = _Pool(pool_id, spn, self)
            if pool.take(addresses, timeout, proxy_protocol, tp, sched):
                changed.add(pool_id)
        self.addresses.prune(self._pools.values())
        return changed

    async def _drop(self, keys: Sequence[SocketKey]) -> None:
        for key in keys:
            self._unserved.discard(key)
            served = self._served.pop(key, None)
            if served is not None:
                await self._retire(key, served.listener)

    async def _upsert(self, listeners: Sequence[ListenerEntry], changed: set[int]) -> None:
        for key, name, pool_id, v6only in listeners:
            pool = self._pools[pool_id]
            served_now = self._served.get(key)
            if served_now is None:
                try:
                    listener = await self._open(key, name, pool, v6only)
                except OSError as exc:
                    log.error("worker %d: cannot serve %s %s:%d: %s", self.index, *key, exc)
                    self._unserved.add(key)
                    continue
                self._unserved.discard(key)
                self._served[key] = _Served(listener, name, pool_id)
            elif served_now.pool_id != pool_id:
                served_now.pool_id = pool_id
                served_now.listener.set_picker(pool)
            elif pool_id in changed:
                served_now.listener.refresh()

    def _forget_unserved(self) -> None:
        """Drop the counters and routes of ports no longer served."""
        names = {s.name for s in self._served.values()}
        for gone in [n for n in self._stats if n not in names]:
            del self._stats[gone]
        self._routes = {k: r for k, r in self._routes.items() if k in self._served}

    def _answer(self, seq: int) -> None:
        # The first table or delta after a handover names every port this process serves:
        # a socket handed over that it did not use is no longer served.
        for sock in self._adopted.values():
            sock.close()
        self._adopted.clear()
        events, self._events = self._events, []
        protocol.send(self._writer, Applied(seq, self.index, events, sorted(self._unserved)))
        # The table's objects live until the next one: keep the cyclic collector from walking
        # them again and again (at 10,000 ports a full collection stalls the loop ~0.1 s).
        gc.freeze()

    async def _open(
        self, key: SocketKey, name: str, pool: _Pool, v6only: int
    ) -> TcpListener | UdpListener:
        adopted = self._adopted.pop(key, None)
        if adopted is not None:
            return await self._open_adopted(key, name, pool, adopted)
        protocol, host, port = key
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        kind = socket.SOCK_STREAM if protocol == "TCP" else socket.SOCK_DGRAM
        sock = socket.socket(family, kind)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
            sock.bind((host, port))  # UDP: joins the port's group now
        except BaseException:
            sock.close()
            raise
        listener: TcpListener | UdpListener
        if kind == socket.SOCK_STREAM:  # its counters are made at its first connection
            listener = TcpListener(
                sock, pool, self._counters_of, name=name, keepalive=self.tcp_keepalive, pinned=True
            )
            listener.key = key
            listener.on_listen = self._on_listen
            await listener.start()
        else:
            self._membership(key, sock)
            stats = self._stats_of(name)
            listener = UdpListener(sock, pool, stats, name=name, idle_timeout=self.udp_idle_timeout)
            await listener.start()
        return listener

    def _stats_of(self, name: str) -> ConnStats:
        """The counters of the ports named `name`, made at the first ask."""
        return self._stats.get(name) or self._stats.setdefault(name, ConnStats())

    async def _open_adopted(
        self, key: SocketKey, name: str, pool: _Pool, sock: socket.socket
    ) -> TcpListener | UdpListener:
        """Serve a handed-over socket: it keeps its place in the group (no join to report)."""
        listener: TcpListener | UdpListener
        if sock.type == socket.SOCK_STREAM:
            if is_listening(sock):
                self._group_socks[key] = sock
            listener = TcpListener(
                sock, pool, self._counters_of, name=name, keepalive=self.tcp_keepalive, adopt=True
            )
            listener.key = key
            listener.on_listen = self._on_listen
        else:
            self._group_socks[key] = sock
            stats = self._stats_of(name)
            listener = UdpListener(sock, pool, stats, name=name, idle_timeout=self.udp_idle_timeout)
        await listener.start()
        return listener

    # ---- handing sockets over between the workers of one slot -----------------------------

    async def _adopt(self, adopt: Adopt) -> None:
        """Listen at `adopt.path` for the sockets of the worker this one replaces; report how
        many arrived. They are served as the next table names them."""
        seq, path = adopt
        try:
            server = fdpass.listen(path)
        except OSError as exc:
            protocol.send(self._writer, Adopting(seq, self.index, str(exc)))
            return
        protocol.send(self._writer, Adopting(seq, self.index, ""))
        error = ""
        try:
            async with asyncio.timeout(HANDOVER_TIMEOUT):
                conn = await fdpass.accept(server)
                with conn:
                    while True:
                        message, socks = await fdpass.receive(conn)
                        if "done" in message:
                            break
                        for (kind, host, port), sock in zip(message["keys"], socks, strict=True):
                            self._adopted[(str(kind), str(host), int(port))] = sock
        except (OSError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            error = repr(exc)
            for sock in self._adopted.values():
                sock.close()
            self._adopted.clear()
        finally:
            server.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
        protocol.send(self._writer, Adopted(seq, self.index, len(self._adopted), error))

    async def _export(self, export: Export) -> None:
        """Send every served socket to the worker listening at `export.path` (this one goes
        on serving until told to release)."""
        seq, path = export
        items = [
            (list(key), served.listener.fileno())
            for key, served in self._served.items()
            if served.listener.fileno() >= 0
        ]
        error = ""
        try:
            async with asyncio.timeout(HANDOVER_TIMEOUT):
                conn = await asyncio.to_thread(fdpass.connect, path, HANDOVER_TIMEOUT)
                with conn:
                    for batch in fdpass.batches(items):
                        await fdpass.send(
                            conn, {"keys": [k for k, _ in batch]}, [f for _, f in batch]
                        )
                    await fdpass.send(conn, {"done": len(items)})
        except (OSError, TimeoutError) as exc:
            error = repr(exc)
        protocol.send(self._writer, Exported(seq, self.index, len(items), error))

    async def _retire(self, key: SocketKey, listener: TcpListener | UdpListener) -> None:
        await listener.close()
        if isinstance(listener, UdpListener):
            self._membership(key, None)
        self._retired = [old for old in self._retired if old.active_connections]
        if listener.active_connections:
            self._retired.append(listener)

    def _membership(self, key: SocketKey, sock: socket.socket | None) -> None:
        """A socket of ours joined (`sock`) or left (None) the group of `key`."""
        self._events.append(Membership(sock is not None, key))
        if sock is None:
            self._group_socks.pop(key, None)
            return
        self._group_socks[key] = sock
        route = self._routes.get(key)
        if route is not None:
            self._attach(key, sock, route)

    def _attach(self, key: SocketKey, sock: socket.socket, route: tuple[int, ...]) -> None:
        code = self._programs.get(route)
        if code is None:
            code = self._programs[route] = steering.program(route)
        try:
            steering.attach(sock, code)
        except OSError as exc:
            log.error("worker %d: cannot steer %s %s:%d: %s", self.index, *key, exc)

    def steer(self, routes: Routes) -> None:
        """Attach the programs for changed groups (to the sockets this worker has in them)."""
        for key, route in routes.items():
            if key not in self._served:
                continue
            self._routes[key] = route
            sock = self._group_socks.get(key)
            if sock is not None:
                self._attach(key, sock, route)

    # ---- counters and shutdown ------------------------------------------------------------

    async def _collect(self, collect: Collect) -> None:
        """Report the counters (with `debug`, each pool's pins and balancer too) in parts of
        REPORT_PART service ports, yielding to this loop between parts; the last part says so.

        A pool's debug data travels `protocol.pack_view`ed, and the control process keeps it so
        until a view reads it: 10,000 pools as nested tuples were ~140,000 objects for its
        garbage collector to walk, and its full passes took 10-25 ms of CPU.
        """
        native.count_bytes()  # open native connections' bytes so far
        stats = list(self._stats.items())
        pools = list(self._pools.items()) if collect.debug else []
        parts = max(1, -(-max(len(stats), len(pools)) // REPORT_PART))
        for part in range(parts):
            window = slice(part * REPORT_PART, (part + 1) * REPORT_PART)
            counters = {
                name: tuple(getattr(s, field) for field in COUNTERS) for name, s in stats[window]
            }
            views = {
                pid: protocol.pack_view(
                    PoolView(
                        pool.affinity_count(),
                        tuple(pool.affinity_entries(PINS_SHOWN)),
                        tuple(pool.tallies()),
                        tuple(pool.recent_picks()),
                        tuple(pool.penalized()),
                    )
                )
                for pid, pool in pools[window]
            }
            last = part == parts - 1
            protocol.send(self._writer, Collected(collect.seq, self.index, counters, views, last))
            if not last:
                await asyncio.sleep(0)

    async def drain(self, grace: float, *, release: bool = False) -> None:
        """Stop accepting everywhere, then give open connections `grace` seconds.

        `release`: the sockets were handed over; close this process's descriptors only.
        """
        listeners = [s.listener for s in self._served.values()] + self._retired
        await asyncio.gather(
            *(lst.release() if release else lst.close() for lst in listeners),
            return_exceptions=True,
        )
        await asyncio.gather(*(lst.drain(grace) for lst in listeners), return_exceptions=True)
        self._served.clear()
        self._retired.clear()


async def _main(args: argparse.Namespace) -> int:
    sock = socket.socket(fileno=args.fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    loop = asyncio.get_running_loop()
    # The control process decides when to stop: it drains the workers on SIGTERM/SIGINT.
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, lambda: None)
    counts = None
    if args.counts_fd >= 0:
        try:
            counts = NodeCounts(args.counts_fd, args.workers)
        except (OSError, ValueError) as exc:
            log.error("worker %d: no shared counts (lc counts per worker): %s", args.index, exc)
    worker = Worker(args.index, reader, writer, slots=args.workers)
    worker.nodewide.counts = counts
    return await worker.run()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kube-userspace-proxy worker")
    parser.add_argument("--fd", type=int, required=True, help="the channel's descriptor")
    parser.add_argument("--index", type=int, required=True, help="this worker's number")
    parser.add_argument("--workers", type=int, default=1, help="how many workers serve (default 1)")
    parser.add_argument(
        "--counts-fd", type=int, default=-1, help="the shared counts' memfd (-1: none)"
    )
    parser.add_argument("-v", dest="verbosity", type=int, default=0)
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--event-loop", choices=coreloop.EVENT_LOOPS, default="auto")
    parser.add_argument("--dataplane", choices=DATAPLANES, default="auto")
    args = parser.parse_args(argv)
    logs.setup(args.verbosity, args.log_format)
    # The control process checked that it is available.
    serves_native = set_default(args.dataplane) == "native"
    loop = coreloop.choose(args.event_loop, serves_native=serves_native, control=False)
    with asyncio.Runner(loop_factory=coreloop.factory(loop)) as runner:
        return runner.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
