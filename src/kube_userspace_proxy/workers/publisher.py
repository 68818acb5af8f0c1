"""What the workers serve: the full table to a worker taking a slot, deltas after that.

After each reconcile `publish()` sends the live workers the ports changed since the last
publish (a `Delta`), and learns from each the order in which its sockets joined and left each
port's reuseport group (`Applied`); `Groups` turns that order into steering routes, sent with
`Steer`. A worker that takes a slot gets the whole `Table` instead. Ports a worker could not
open (EMFILE, say) are sent to it again, after a growing delay, until it serves them.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

from kube_userspace_proxy import logs
from kube_userspace_proxy.balancer import PoolView, Transparency
from kube_userspace_proxy.dataplane import ConnStats
from kube_userspace_proxy.model import Address, SocketKey
from kube_userspace_proxy.workers import protocol
from kube_userspace_proxy.workers.groups import CONTROL, Groups
from kube_userspace_proxy.workers.link import Replies, WorkerLink
from kube_userspace_proxy.workers.protocol import (
    Applied,
    Delta,
    ListenerEntry,
    PoolEntry,
    Scheduled,
    Settings,
    Steer,
    Table,
)

log = logs.get(__name__)

APPLY_TIMEOUT = 10.0
"""Seconds a worker may spend on a table or delta without using any CPU before it is replaced
(a worker still working on a big table on a busy node is waited for, up to APPLY_LIMIT)."""
APPLY_LIMIT = 300.0
"""Seconds after which a worker that has not applied a table is replaced, however busy."""
PART = 1000
"""Ports per message of a delta that goes to the workers one after the other."""
RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Waits before sending a worker again the ports it could not open (EMFILE, say)."""


class Port(Protocol):
    """A port the workers serve, as the publisher reads it (`pool.SharedPort`)."""

    key: SocketKey
    name: str
    picker: PoolView
    v6only: int
    stats: ConnStats


class Publisher:
    """Sends the live workers the table, then deltas, in an order that keeps steering right."""

    def __init__(
        self,
        settings: Settings,
        groups: Groups,
        replies: Replies,
        live: Callable[[], list[WorkerLink]],
    ) -> None:
        self._settings = settings
        self._groups = groups
        self._replies = replies
        self._live = live
        self.ports: dict[SocketKey, Port] = {}
        """Every port served now."""
        self._pool_ids: weakref.WeakKeyDictionary[PoolView, int] = weakref.WeakKeyDictionary()
        self._pools: weakref.WeakValueDictionary[int, PoolView] = weakref.WeakValueDictionary()
        self._next_pool_id = itertools.count(1)
        self._lock = asyncio.Lock()
        self._published = False  # a table (or delta) went out: restarted workers need one
        # Ports to send at the next publish (added or changed) and ports removed since.
        self._dirty: dict[SocketKey, Port] = {}
        self._removed: set[SocketKey] = set()
        # Per published port: whether the workers' sockets are in its reuseport group.
        self._joined: dict[SocketKey, bool] = {}
        # What the last deltas carried: per port, its pool's id (the rest of a port's entry,
        # its name and IPV6_V6ONLY, is its object's for good: `add` sends a new object anew);
        # per pool, its entry less its name (a pool's for good). Each entry whole, with a
        # name tuple and a protocol string per pool, was ~4 MiB at 10,000 ports.
        self._sent_ports: dict[SocketKey, int] = {}
        self._sent_pools: dict[int, _PoolState] = {}
        # Ports each worker (by index) reported it could not open, and the retry of them.
        self._unserved: dict[int, frozenset[SocketKey]] = {}
        self._retries = 0
        self._retry_handle: asyncio.TimerHandle | None = None
        self._retry_task: asyncio.Task[None] | None = None
        self._stopping = False
        self.deltas = 0
        """Deltas published (each carries only the ports changed since the previous)."""
        self.ports_sent = 0
        """Port entries the deltas carried, in all (each delta's, counted once)."""
        self.tables = 0
        """Full tables sent (to a worker taking a slot)."""
        self.programs_sent = 0
        """Steering programs the workers were told to attach (each costs a kernel compile)."""

    # ---- the ports -----------------------------------------------------------------------------

    def add(self, port: Port) -> None:
        """Serve `port` from the next publish on."""
        self.ports[port.key] = port
        self._dirty[port.key] = port
        self._removed.discard(port.key)
        self._sent_ports.pop(port.key, None)  # a new port object: sent whole
        self._groups.add_port(port.key)

    def touch(self, port: Port) -> None:
        """`port`'s pool or picker changed: the next `publish()` sends it."""
        if self.ports.get(port.key) is port:
            self._dirty[port.key] = port

    def remove(self, port: Port) -> None:
        """Stop serving `port` from the next publish on."""
        if self.ports.get(port.key) is port:
            del self.ports[port.key]
            self._dirty.pop(port.key, None)
            self._removed.add(port.key)
        if port.key[0] == "UDP":
            self._groups.leave(port.key, CONTROL)

    def pool_id(self, picker: PoolView) -> int | None:
        """The id the workers know `picker`'s pool by (None: never published)."""
        return self._pool_ids.get(picker)

    def pool(self, pool_id: int) -> PoolView | None:
        """The pool the workers know by `pool_id` (None: gone, or never published)."""
        return self._pools.get(pool_id)

    def forget_sent(self) -> None:
        """Send every port at the next publish though the workers have it (benchmarks)."""
        self._sent_ports.clear()
        self._sent_pools.clear()

    # ---- publishing ----------------------------------------------------------------------------

    async def publish(self) -> None:
        """Send every worker the ports changed since the last publish (a delta), then steer
        the changed groups.

        Only the changed ports and their pools go out, so an endpoint move costs one entry,
        not the table. A delta that can change a reuseport group (a new or removed port, a
        TCP port gaining or losing all its endpoints) goes to one worker after the other, so
        that the order of joins and leaves is known; any other delta goes to all at once.
        A worker that takes a slot gets the full table instead (`send_table`).
        """
        async with self._lock:
            retried = self._mark_unserved()
            if not self._dirty and not self._removed:
                return
            dirty, self._dirty = self._dirty, {}
            removed, self._removed = self._removed, set()
            listeners, pools = self._unsent(*self._entries(dirty.values()))
            if not listeners and not removed:
                return
            # A port sent again to a worker that could not open it will join its group.
            regrouped = bool(removed) or retried
            for key, _, pool_id, _ in listeners:  # inline `_joins`: 10,000 calls cost ~1 ms
                _, addresses, _, _, _, _ = pools[pool_id]
                joins = key[0] == "UDP" or bool(addresses)
                if self._joined.get(key) != joins:
                    self._joined[key] = joins
                    regrouped = True
            for key in removed:
                self._joined.pop(key, None)
                sent = self._sent_ports.pop(key, None)
                if sent is not None:
                    self._sent_pools.pop(sent, None)
            self._published = True
            self.deltas += 1
            self.ports_sent += len(listeners)
            changed: set[SocketKey] = set()
            live = self._live()
            if not regrouped:
                seq = self._replies.next_seq()
                body = protocol.encode(
                    Delta(seq, self._settings, listeners, sorted(removed), pools, {})
                )
                replies = await asyncio.gather(*(self._apply(w, body, seq) for w in live))
                for reply in replies:
                    changed |= reply
            else:
                changed = await self._send_in_order(live, listeners, sorted(removed), pools)
            self.steer(changed)

    async def _send_in_order(
        self,
        live: list[WorkerLink],
        listeners: list[ListenerEntry],
        removed: list[SocketKey],
        pools: dict[int, PoolEntry],
    ) -> set[SocketKey]:
        """Send a delta that changes reuseport groups to one worker after the other, in parts
        of PART ports: a worker gets a part once the worker before it has applied that part.
        Each port's joins still come in a known order (the routes depend on it), while the
        workers apply different parts at once: at a start with 10,000 ports the second
        worker no longer waits for the first one's whole table. Returns the changed groups.
        """
        parts = [listeners[i : i + PART] for i in range(0, len(listeners), PART)] or [[]]
        applied = [[asyncio.Event() for _ in parts] for _ in live]
        changed: set[SocketKey] = set()

        async def feed(k: int, worker: WorkerLink) -> None:
            for i, part in enumerate(parts):
                if k:
                    await applied[k - 1][i].wait()
                part_pools = {pool_id: pools[pool_id] for _, _, pool_id, _ in part}
                changed.update(
                    await self._send(worker, part, part_pools, removed=removed if i == 0 else [])
                )
                applied[k][i].set()

        await asyncio.gather(*(feed(k, worker) for k, worker in enumerate(live)))
        return changed

    async def send_table(self, worker: WorkerLink) -> None:
        """Give `worker`, which took a slot, the whole table (the slot's earlier deltas died
        with the worker that had it); nothing before the first publish."""
        if self._published:
            async with self._lock:
                listeners, pools = self._entries(self.ports.values())
                self.tables += 1
                self.steer(await self._send(worker, listeners, pools))

    async def _send(
        self,
        worker: WorkerLink,
        listeners: list[ListenerEntry],
        pools: dict[int, PoolEntry],
        *,
        removed: list[SocketKey] | None = None,
    ) -> set[SocketKey]:
        """Send `worker` a table (`removed` None) or a delta of its own, with the routes for
        the groups its sockets will join; returns the groups whose members changed."""
        routes = {}
        for key, _, pool_id, _ in listeners:
            if _joins(key, pools[pool_id]):
                route = self._groups.route_for_joining(key, worker.index)
                if route is not None:
                    routes[key] = route
        seq = self._replies.next_seq()
        message: Table | Delta
        if removed is None:
            message = Table(seq, self._settings, listeners, pools, routes)
        else:
            message = Delta(seq, self._settings, listeners, removed, pools, routes)
        self.programs_sent += len(routes)
        return await self._apply(worker, protocol.encode(message), seq)

    async def _apply(self, worker: WorkerLink, body: bytes, seq: int) -> set[SocketKey]:
        """Send `worker` an encoded table or delta and wait for its answer; returns the
        groups whose members changed."""
        done = self._replies.expect(worker, Applied, seq)
        worker.send(body)
        try:
            reply = await _while_working(worker, done)
        except (TimeoutError, ConnectionError) as exc:
            self._replies.forget(worker, Applied, seq)
            if worker.ready:
                log.error("worker %d did not apply the table (%r); replacing it", worker.index, exc)
                if worker.process.returncode is None:
                    worker.process.kill()
            return set()
        self._note_unserved(worker.index, frozenset(reply.unserved))
        changed: set[SocketKey] = set()
        ports = self.ports
        for joined, sent in reply.changes:
            # The port's own key, not the message's copy (three objects), goes into the
            # groups for good: ~1.5 MiB at 10,000 ports.
            port = ports.get(sent)
            key = sent if port is None else port.key
            changed.add(key)
            if joined:
                self._groups.join(key, worker.index)
            else:
                self._groups.leave(key, worker.index)
        return changed

    def steer(self, keys: set[SocketKey]) -> None:
        """Send the workers the routes of the groups in `keys` whose program must change."""
        routes = self._groups.routes_to_change(keys)
        if not routes:
            return
        for worker in self._live():
            worker.send(Steer(routes))
            self.programs_sent += len(routes)

    # ---- the table's entries -------------------------------------------------------------------

    def _pool_id(self, picker: PoolView) -> int:
        pool_id = self._pool_ids.get(picker)
        if pool_id is None:
            pool_id = self._pool_ids[picker] = next(self._next_pool_id)
            self._pools[pool_id] = picker
        return pool_id

    def _entries(self, ports: Iterable[Port]) -> tuple[list[ListenerEntry], dict[int, PoolEntry]]:
        """The table entries of `ports` and of their pools (plain tuples: see `protocol`)."""
        listeners: list[ListenerEntry] = []
        pools: dict[int, PoolEntry] = {}
        for port in ports:
            picker = port.picker
            pool_id = self._pool_id(picker)
            if pool_id not in pools:
                name = picker.name
                pools[pool_id] = (
                    # The enum's own string, not a copy per pool (`str()` makes one).
                    (name.namespace, name.name, name.port, name.protocol.value),
                    picker.addresses,
                    picker.affinity_timeout,
                    picker.proxy_protocol,
                    picker.transparency,  # --preserve-source-ip
                    picker.scheduled,
                )
            listeners.append((port.key, port.name, pool_id, port.v6only))
        return listeners, pools

    def _unsent(
        self, listeners: list[ListenerEntry], pools: dict[int, PoolEntry]
    ) -> tuple[list[ListenerEntry], dict[int, PoolEntry]]:
        """Leave out what the workers have already (a periodic resync refreshes every port)."""
        sent_pools = self._sent_pools
        fresh = {pid for pid, pool in pools.items() if sent_pools.get(pid) != pool[1:]}
        unsent = []
        for entry in listeners:
            key, _, pool_id, _ = entry
            if pool_id in fresh or self._sent_ports.get(key) != pool_id:
                unsent.append(entry)
                self._sent_ports[key] = pool_id  # keys are unique: the test above is unchanged
        pools = {pool_id: pools[pool_id] for _, _, pool_id, _ in unsent}
        for pool_id, pool in pools.items():
            sent_pools[pool_id] = pool[1:]
        return unsent, pools

    # ---- ports a worker could not open ---------------------------------------------------------

    @property
    def unserved(self) -> int:
        """Ports some worker could not open at its last answer, summed over the workers."""
        return sum(len(keys) for keys in self._unserved.values())

    def unserved_ports(self, index: int) -> frozenset[SocketKey]:
        """The ports worker `index` reported it could not open."""
        return self._unserved.get(index, frozenset())

    def forget_worker(self, index: int) -> None:
        """The worker of slot `index` exited: its replacement reports its own."""
        self._unserved.pop(index, None)

    def _mark_unserved(self) -> bool:
        """Put the ports a worker could not open back in the next publish; True if any."""
        keys = {key for keys in self._unserved.values() for key in keys if key in self.ports}
        for key in keys:
            self._dirty[key] = self.ports[key]
            self._sent_ports.pop(key, None)  # send it though its entry has not changed
        return bool(keys)

    def _note_unserved(self, index: int, keys: frozenset[SocketKey]) -> None:
        """Take a worker's list of the ports it could not open; retry them with a backoff."""
        if keys:
            self._unserved[index] = keys
        else:
            self._unserved.pop(index, None)
        if not self._unserved:
            self._retries = 0
            return
        if self._stopping or self._retry_handle is not None:
            return
        delay = RETRY_DELAYS[min(self._retries, len(RETRY_DELAYS) - 1)]
        self._retries += 1
        self._retry_handle = asyncio.get_running_loop().call_later(delay, self._retry)

    def _retry(self) -> None:
        self._retry_handle = None
        if self._stopping or (self._retry_task is not None and not self._retry_task.done()):
            return
        self._retry_task = asyncio.create_task(self._publish_retry(), name="worker port retry")

    async def _publish_retry(self) -> None:
        try:
            await self.publish()
        except Exception:  # the next change or retry sends them again
            log.exception("sending the workers the ports they could not open failed")

    def stop(self) -> asyncio.Task[None] | None:
        """No more retries; the retry under way, if any (to cancel and await)."""
        self._stopping = True
        if self._retry_handle is not None:
            self._retry_handle.cancel()
        return self._retry_task


_PoolState = tuple[tuple[Address, ...], float | None, int, Transparency, Scheduled]
"""A pool's entry less its name (`PoolEntry[1:]`): what may change of a pool."""


def _joins(key: SocketKey, pool: PoolEntry) -> bool:
    """Whether the workers' sockets of port `key` are in its reuseport group: UDP always, TCP
    while its pool has endpoints (without, the workers do not listen)."""
    _, addresses, _, _, _, _ = pool
    return key[0] == "UDP" or bool(addresses)


async def _while_working(worker: WorkerLink, done: asyncio.Future[Applied]) -> Applied:
    """`worker`'s answer, waited for as long as it keeps working on the request: TimeoutError
    once it spent APPLY_TIMEOUT seconds without using CPU (stuck), or after APPLY_LIMIT.

    A fixed deadline replaced a worker that was merely slow (10,000 ports beside CPU hogs), and
    its replacement with it, again and again; a stuck one uses no CPU."""
    used = _cpu_ticks(worker.process.pid)
    waited = 0.0
    while True:
        try:
            return await asyncio.wait_for(asyncio.shield(done), APPLY_TIMEOUT)
        except TimeoutError:
            waited += APPLY_TIMEOUT
            now = _cpu_ticks(worker.process.pid)
            if now is None or now == used or waited >= APPLY_LIMIT:
                done.cancel()
                raise
            log.warning(
                "worker %d is still applying its table after %.0fs (busy: waiting)",
                worker.index,
                waited,
            )
            used = now


def _cpu_ticks(pid: int) -> int | None:
    """User + system clock ticks `pid` has used (/proc/PID/stat), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
