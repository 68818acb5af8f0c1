"""Worker processes, seen from the control process: start, feed, steer, sum, supervise.

The control process keeps the reserved socket of every proxy port (and NodePort) and hands
the proxier `SharedPort`s in place of listeners. After each reconcile `publish()` sends every
worker the complete table (ports, pools, endpoints), one worker after the other, and learns
from each the order in which its sockets joined and left each port's reuseport group. From
that order it computes, per port, where the kernel must send each worker's clients
(`steering.route_for`), so that a client IP always lands on the same worker. A dead worker is
restarted and given the current table; the others keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import socket
import sys
import time
import weakref
from collections.abc import Iterable
from typing import Any

from kube_userspace_proxy import fdpass, logs
from kube_userspace_proxy.balancer import PINS_SHOWN, BalancerView, EndpointPool
from kube_userspace_proxy.dataplane import ConnStats, Picker, steering
from kube_userspace_proxy.dataplane.stats import COUNTERS
from kube_userspace_proxy.errors import ProxyError
from kube_userspace_proxy.model import Address, SocketKey
from kube_userspace_proxy.workers import channel

log = logs.get(__name__)

Pins = list[tuple[str, Address, float]]
CONTROL = -1
"""The member id of the control process's own (UDP) socket in a reuseport group."""
GAUGES = frozenset({"active", "udp_sessions_active"})
START_TIMEOUT = 10.0
CHANNEL_BUFFER = 4 * 1024 * 1024
APPLY_TIMEOUT = 10.0
COLLECT_TIMEOUT = 2.0
SUM_PART = 200
PART = 1000
"""Ports per message of a delta that goes to the workers one after the other."""
"""Ports whose counters `collect` sums between two yields to the event loop."""
RESTART_DELAYS = (0.0, 0.25, 1.0, 2.0, 5.0)
RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Waits before sending a worker again the ports it could not open (EMFILE, say)."""


class SharedPort:
    """A proxy port (or NodePort) served by the workers; this process holds its reservation."""

    def __init__(
        self, pool: WorkerPool, sock: socket.socket, picker: Picker, stats: ConnStats, name: str
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

    def set_picker(self, picker: Picker) -> None:
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


@dataclasses.dataclass(slots=True, eq=False)
class _Worker:
    """One worker process; `index` is its slot, SPARE while it waits to take one over."""

    index: int
    process: asyncio.subprocess.Process
    writer: asyncio.StreamWriter
    reader_task: asyncio.Task[None] | None = None
    watcher: asyncio.Task[None] | None = None
    ready: bool = True
    started: float = 0.0
    answered: float = 0.0  # when its loop last answered a ping (monotonic)


SPARE = -2
"""The index of the warm spare: a started worker that takes over the slot of one that dies."""


class WorkerPool:
    """N worker processes serving every proxy port; the proxier's data plane with workers.

    One more process waits as a warm spare: when a worker dies, the spare takes its slot at
    once (a fresh interpreter takes a few hundred milliseconds to start on a busy node), gets
    the current table, and a new spare is started in the background.
    """

    shares_ports = True

    def __init__(
        self,
        count: int,
        *,
        udp_idle_timeout: float = 0.25,
        tcp_keepalive: float = 15.0,
        verbosity: int = 0,
        log_format: str = "text",
        event_loop: str = "uvloop",
    ) -> None:
        self.count = count
        self._settings = {"udp_idle_timeout": udp_idle_timeout, "tcp_keepalive": tcp_keepalive}
        self._argv = ["-v", str(verbosity), "--log-format", log_format, "--event-loop", event_loop]
        self._workers: list[_Worker | None] = [None] * count
        self._spare: _Worker | None = None
        self._spare_task: asyncio.Task[None] | None = None
        self._replacing: set[asyncio.Task[None]] = set()  # watchers replacing a dead worker
        self._failures = [0] * count
        self._ports: dict[SocketKey, SharedPort] = {}
        self._groups: dict[SocketKey, list[int]] = {}
        # The route whose program each group holds now, as last given to a worker (a group
        # of one socket needs none: it gets every connection). Attaching one costs the kernel
        # a compile (~20-80 us): not again for the same route, 10,000 times per start.
        self._programs: dict[SocketKey, tuple[int, ...]] = {}
        self._pool_ids: weakref.WeakKeyDictionary[Picker, int] = weakref.WeakKeyDictionary()
        self._next_pool_id = itertools.count(1)
        self._seq = itertools.count(1)
        self._lock = asyncio.Lock()
        self._waiting: dict[tuple[str, _Worker, int], asyncio.Future[Any]] = {}
        self._reports: dict[int, dict[str, tuple[int, ...]]] = {}
        self._dead_totals: dict[str, list[int]] = {}
        # The last debug report of each worker (by index): pool id -> its pins and balancer,
        # `channel.pack`ed (see worker.Worker._collect); read a pool at a time by the views.
        self._views: dict[int, dict[int, bytes]] = {}
        # Reports being received, part by part: (kind, worker, request) -> what came so far.
        self._parts: dict[tuple[str, _Worker, int], tuple[dict[str, Any], ...]] = {}
        self._stopping = False
        self._adopting: dict[int, asyncio.Future[Any]] = {}
        self._published = False  # a table (or delta) went out: restarted workers need one
        # Ports to send at the next publish (added or changed) and ports removed since.
        self._dirty: dict[SocketKey, SharedPort] = {}
        self._removed: set[SocketKey] = set()
        # Per published port: whether the workers' sockets are in its reuseport group.
        self._joined: dict[SocketKey, bool] = {}
        # What the last deltas carried, per port and per pool.
        self._sent_ports: dict[SocketKey, Any] = {}
        self._sent_pools: dict[int, Any] = {}
        self.deltas = 0
        """Deltas published (each carries only the ports changed since the previous)."""
        self.ports_sent = 0
        """Port entries the deltas carried, in all (each delta's, counted once)."""
        self.tables = 0
        """Full tables sent (to a worker taking a slot)."""
        self.programs_sent = 0
        """Steering programs the workers were told to attach (each costs a kernel compile)."""
        self.restarts = 0
        """Workers replaced after an unexpected exit."""
        # Ports each worker (by index) reported it could not open, and the retry of them.
        self._unserved: dict[int, frozenset[SocketKey]] = {}
        self._retries = 0
        self._retry_handle: asyncio.TimerHandle | None = None
        self._retry_task: asyncio.Task[None] | None = None

    # ---- the proxier's data plane ------------------------------------------------------------

    def listener(
        self,
        sock: socket.socket,
        pool: EndpointPool,
        stats: ConnStats,
        name: str,
        *,
        adopt: bool = False,
    ) -> SharedPort:
        # A handed-over reservation is in its group already (`adopt_groups`).
        return SharedPort(self, sock, pool, stats, name)

    def add(self, port: SharedPort) -> None:
        self._ports[port.key] = port
        self._dirty[port.key] = port
        self._removed.discard(port.key)
        members = self._groups.setdefault(port.key, [])
        # A bound UDP socket is in the group from its bind on (a handed-over one already is).
        if port.key[0] == "UDP" and CONTROL not in members:
            members.append(CONTROL)
        if not members:
            del self._groups[port.key]
            self._programs.pop(port.key, None)

    def touch(self, port: SharedPort) -> None:
        """`port`'s pool or picker changed: the next `publish()` sends it."""
        if self._ports.get(port.key) is port:
            self._dirty[port.key] = port

    def remove(self, port: SharedPort) -> None:
        if self._ports.get(port.key) is port:
            del self._ports[port.key]
            self._dirty.pop(port.key, None)
            self._removed.add(port.key)
        if port.key[0] == "UDP":
            self._leave(port.key, CONTROL)

    async def publish(self) -> None:
        """Send every worker the ports changed since the last publish (a delta), then steer
        the changed groups.

        Only the changed ports and their pools go out, so an endpoint move costs one entry,
        not the table. A delta that can change a reuseport group (a new or removed port, a
        TCP port gaining or losing all its endpoints) goes to one worker after the other, so
        that the order of joins and leaves is known; any other delta goes to all at once.
        A worker that takes a slot gets the full table instead (`_take_slot`).
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
            for key, _, pool_id, _ in listeners:
                joins = key[0] == "UDP" or bool(pools[pool_id][1])
                if self._joined.get(key) != joins:
                    self._joined[key] = joins
                    regrouped = True
            for key in removed:
                self._joined.pop(key, None)
                entry = self._sent_ports.pop(key, None)
                if entry is not None:
                    self._sent_pools.pop(entry[2], None)
            self._published = True
            self.deltas += 1
            self.ports_sent += len(listeners)
            delta = (listeners, sorted(removed), pools)
            changed: set[SocketKey] = set()
            live = self._live()
            if not regrouped:
                seq = next(self._seq)
                body = channel.encode(("delta", seq, self._settings, *delta, {}))
                replies = await asyncio.gather(*(self._apply(w, body, seq) for w in live))
                for reply in replies:
                    changed |= reply
            else:
                changed = await self._send_in_order(live, delta)
            self._steer(changed)

    async def _send_in_order(self, live: list[_Worker], delta: tuple[Any, ...]) -> set[SocketKey]:
        """Send a delta that changes reuseport groups to one worker after the other, in parts
        of PART ports: a worker gets a part once the worker before it has applied that part.
        Each port's joins still come in a known order (the routes depend on it), while the
        workers apply different parts at once: at a start with 10,000 ports the second
        worker no longer waits for the first one's whole table. Returns the changed groups.
        """
        listeners, removed, pools = delta
        parts = [listeners[i : i + PART] for i in range(0, len(listeners), PART)] or [[]]
        applied = [[asyncio.Event() for _ in parts] for _ in live]
        changed: set[SocketKey] = set()

        async def feed(k: int, worker: _Worker) -> None:
            for i, part in enumerate(parts):
                if k:
                    await applied[k - 1][i].wait()
                part_pools = {entry[2]: pools[entry[2]] for entry in part}
                content = (part, removed if i == 0 else [], part_pools)
                changed.update(await self._send(worker, "delta", content))
                applied[k][i].set()

        await asyncio.gather(*(feed(k, worker) for k, worker in enumerate(live)))
        return changed

    @property
    def unserved(self) -> int:
        """Ports some worker could not open at its last answer, summed over the workers."""
        return sum(len(keys) for keys in self._unserved.values())

    def unserved_ports(self, index: int) -> frozenset[SocketKey]:
        """The ports worker `index` reported it could not open."""
        return self._unserved.get(index, frozenset())

    def _mark_unserved(self) -> bool:
        """Put the ports a worker could not open back in the next publish; True if any."""
        keys = {key for keys in self._unserved.values() for key in keys if key in self._ports}
        for key in keys:
            self._dirty[key] = self._ports[key]
            self._sent_ports.pop(key, None)  # send it though its entry has not changed
        return bool(keys)

    def _note_unserved(self, worker: _Worker, keys: frozenset[SocketKey]) -> None:
        """Take a worker's list of the ports it could not open; retry them with a backoff."""
        if keys:
            self._unserved[worker.index] = keys
        else:
            self._unserved.pop(worker.index, None)
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

    def affinity_summary(self, pool: EndpointPool) -> tuple[int, Pins]:
        """The pin count and the pins shown, as the workers reported them at the last
        `collect(debug=True)`."""
        count = 0
        shown: Pins = []
        for _, view in self._reported_views(pool):
            count += view[0]
            shown += view[1][: PINS_SHOWN - len(shown)]
        return count, shown

    def _reported_views(self, pool: EndpointPool) -> list[tuple[int, tuple[Any, ...]]]:
        """(worker, (pins, pins shown, tallies, recent picks, penalized)) of `pool`, as each
        worker reported it at the last `collect(debug=True)`, in worker order."""
        pool_id = self._pool_ids.get(pool)
        if pool_id is None:
            return []
        return [
            (worker, channel.unpack(reported[pool_id]))
            for worker, reported in sorted(self._views.items())
            if pool_id in reported
        ]

    async def heartbeat(self, interval: float = 1.0) -> None:
        """Ping every worker's event loop each `interval` seconds (a root task)."""
        for seq in itertools.count():
            for worker in self._live():
                channel.send(worker.writer, ("ping", seq))
            await asyncio.sleep(interval)

    def stalest_answer(self) -> float:
        """Seconds since the worker whose event loop answered longest ago last answered."""
        now = time.monotonic()
        return max((now - w.answered for w in self._live()), default=0.0)

    def members(self, key: SocketKey) -> tuple[int, ...]:
        """The reuseport group of `key` as tracked: worker numbers in the kernel's order."""
        return tuple(self._groups.get(key, ()))

    def _live(self) -> list[_Worker]:
        return [w for w in self._workers if w is not None and w.ready]

    def balancer_view(self, pool: EndpointPool) -> BalancerView:
        """What each worker's copy of `pool` reported at the last `collect(debug=True)`.

        Endpoint counters are summed over the running workers (a dead worker's are lost);
        each worker balances on its own, so picks are listed per worker.
        """
        sums: dict[Address, list[int]] = {a: [0] * 5 for a in pool.addresses}
        penalized: dict[Address, float] = {}
        picks: list[tuple[int | None, list[tuple[Address, str]]]] = []
        for worker, (_, _, tallies, recent, penalties) in self._reported_views(pool):
            for address, values in tallies:
                total = sums.get(address)
                if total is not None:
                    for i, value in enumerate(values):
                        total[i] += value
            picks.append((worker, list(recent)))
            for address, left in penalties:
                penalized[address] = max(left, penalized.get(address, 0.0))
        endpoints = [(a, (v[0], v[1], v[2], v[3], v[4])) for a, v in sums.items()]
        return BalancerView(endpoints, picks, sorted(penalized.items()))

    # ---- starting and supervising ------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker and the spare; raises ProxyError when one cannot start."""
        started = await asyncio.gather(
            *(self._spawn(index) for index in range(self.count)), return_exceptions=True
        )
        failed = [r for r in started if isinstance(r, BaseException)]
        for index, result in enumerate(started):
            if isinstance(result, _Worker):
                self._workers[index] = result
        if failed:
            for worker in self._workers:
                if worker is not None:
                    await self._end(worker)
            raise failed[0]
        self._keep_spare()  # in the background: the workers serve without waiting for it

    async def _spawn(self, index: int) -> _Worker:
        """A started worker process (ready: it said hello); ProxyError when it cannot start."""
        what = "the spare worker" if index == SPARE else f"worker {index}"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (ours, theirs):  # a table of 10,000 ports is 1.5 MB: fewer round trips
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHANNEL_BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CHANNEL_BUFFER)
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kube_userspace_proxy.workers.process",
                "--fd",
                str(theirs.fileno()),
                "--index",
                str(index),
                *self._argv,
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        try:
            reader, writer = await asyncio.open_unix_connection(sock=ours)
        except BaseException:
            ours.close()
            await _reap(process)
            raise
        worker = _Worker(index, process, writer, ready=False)
        try:
            hello = await asyncio.wait_for(channel.receive(reader), START_TIMEOUT)
        except asyncio.CancelledError:  # shutting down while it starts
            await asyncio.shield(self._end(worker))
            raise
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            code = await self._end(worker)
            why = (
                f"not ready within {START_TIMEOUT:.0f}s"
                if isinstance(exc, TimeoutError)
                else "it exited before it was ready"
                if isinstance(exc, asyncio.IncompleteReadError)
                else repr(exc)
            )
            raise ProxyError(
                f"{what} could not start (exit code {code}): {why}; see its log lines above"
            ) from None
        worker.started = worker.answered = time.monotonic()
        worker.ready = True
        log.info("%s started (pid %d)", what, hello[2])
        worker.reader_task = asyncio.create_task(self._read(worker, reader), name=f"{what} channel")
        worker.watcher = asyncio.create_task(self._watch(worker), name=f"{what} watch")
        return worker

    async def _watch(self, worker: _Worker) -> None:
        assert worker.reader_task is not None
        await asyncio.wait(
            [asyncio.ensure_future(worker.process.wait()), worker.reader_task],
            return_when=asyncio.FIRST_COMPLETED,
        )
        if self._stopping:
            return
        index = worker.index
        worker.watcher = None  # this task ends here; _end must not cancel it
        current = asyncio.current_task()
        assert current is not None
        self._replacing.add(current)
        current.add_done_callback(self._replacing.discard)
        code = await self._end(worker)
        if index == SPARE:
            log.warning("the spare worker exited (code %s); starting another", code)
            self._spare = None
            self._keep_spare()
            return
        log.error("worker %d exited unexpectedly (code %s); replacing it", index, code)
        self.restarts += 1
        self._workers[index] = None
        self._unserved.pop(index, None)  # its replacement reports its own
        recent = time.monotonic() - worker.started < 10
        self._failures[index] = self._failures[index] + 1 if recent else 1
        if self._failures[index] > 1:  # crashing again: do not burn through processes
            await asyncio.sleep(RESTART_DELAYS[min(self._failures[index], len(RESTART_DELAYS)) - 1])
        while not self._stopping:
            spare, self._spare = self._spare, None
            try:
                replacement = spare if spare is not None else await self._spawn(index)
            except ProxyError as exc:
                log.error("%s", exc)
                await asyncio.sleep(RESTART_DELAYS[-1])
                continue
            await self._take_slot(replacement, index)
            break
        self._keep_spare()

    async def _take_slot(self, worker: _Worker, index: int) -> None:
        """Make `worker` serve slot `index` with the current table."""
        if worker.index == SPARE:
            channel.send(worker.writer, ("become", index))
        worker.index = index
        worker.started = time.monotonic()
        self._workers[index] = worker
        log.info("worker %d is pid %d now", index, worker.process.pid)
        if self._published:
            async with self._lock:
                # The whole table: the slot's earlier deltas died with the worker.
                table = self._entries(self._ports.values())
                self.tables += 1
                self._steer(await self._send(worker, "table", table))

    def _keep_spare(self) -> None:
        if self._stopping or self._spare is not None:
            return
        if self._spare_task is not None and not self._spare_task.done():
            return
        self._spare_task = asyncio.create_task(self._start_spare(), name="spare worker")

    async def _start_spare(self) -> None:
        for delay in RESTART_DELAYS:
            if self._stopping:
                return
            try:
                spare = await self._spawn(SPARE)
            except ProxyError as exc:
                log.error("%s", exc)
                await asyncio.sleep(delay)
                continue
            if self._stopping:
                await self._end(spare)
            else:
                self._spare = spare
            return

    async def _end(self, worker: _Worker) -> int | None:
        """Forget a worker that exited (or kill it): its sockets left every group."""
        worker.ready = False
        code = await _reap(worker.process)
        worker.writer.close()
        for task in (worker.reader_task, worker.watcher):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        for waiting in [k for k in self._waiting if k[1] is worker]:
            future = self._waiting.pop(waiting)
            if not future.done():
                future.set_exception(ConnectionError(f"worker {worker.index} exited"))
        if worker.index < 0:
            return code
        report = self._reports.pop(worker.index, {})
        for name, values in report.items():
            base = self._dead_totals.setdefault(name, [0] * len(COUNTERS))
            for i, field in enumerate(COUNTERS):
                if field not in GAUGES:
                    base[i] += values[i]
        changed = {key for key, members in self._groups.items() if worker.index in members}
        for key in changed:
            self._leave(key, worker.index)
        if changed and not self._stopping:
            self._steer(changed)
        return code

    async def _read(self, worker: _Worker, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                message = await channel.receive(reader)
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                return
            kind = message[0]
            if kind == "collected":
                self._take_part(worker, message)
                await asyncio.sleep(0)  # one part per turn, however many came in at once
                continue
            if kind == "pong":
                worker.answered = time.monotonic()
                continue
            if kind == "penalty":
                # One worker saw a dial fail: the others skip that endpoint too.
                for other in self._live():
                    if other is not worker:
                        channel.send(other.writer, message)
                continue
            future = self._waiting.pop((kind, worker, message[1]), None)
            if future is not None and not future.done():
                future.set_result(message)

    # ---- tables and steering -----------------------------------------------------------------

    def _pool_id(self, picker: Picker) -> int:
        pool_id = self._pool_ids.get(picker)
        if pool_id is None:
            pool_id = self._pool_ids[picker] = next(self._next_pool_id)
        return pool_id

    def _unsent(
        self, listeners: list[Any], pools: dict[int, Any]
    ) -> tuple[list[Any], dict[int, Any]]:
        """Leave out what the workers have already (a periodic resync refreshes every port)."""
        fresh = {pid for pid, entry in pools.items() if self._sent_pools.get(pid) != entry}
        listeners = [
            entry
            for entry in listeners
            if entry[2] in fresh or self._sent_ports.get(entry[0]) != entry
        ]
        pools = {entry[2]: pools[entry[2]] for entry in listeners}
        self._sent_pools.update(pools)
        for entry in listeners:
            self._sent_ports[entry[0]] = entry
        return listeners, pools

    def _entries(self, ports: Iterable[SharedPort]) -> tuple[list[Any], dict[int, Any]]:
        """The table entries of `ports` and of their pools (plain tuples: cheap to decode)."""
        listeners = []
        pools: dict[int, Any] = {}
        for port in ports:
            picker = port.picker
            pool_id = self._pool_id(picker)
            if pool_id not in pools:
                assert isinstance(picker, EndpointPool)
                name = picker.name
                pools[pool_id] = (
                    # Plain strings: unpickling 10,000 dataclasses costs a worker 0.1 s.
                    (name.namespace, name.name, name.port, str(name.protocol)),
                    picker.addresses,
                    picker.affinity_timeout,
                    picker.proxy_protocol,
                    picker.transparency,  # --preserve-source-ip
                )
            listeners.append((port.key, port.name, pool_id, port.v6only))
        return listeners, pools

    def _request(self, worker: _Worker, kind: str, seq: int) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[(kind, worker, seq)] = future
        return future

    async def _send(self, worker: _Worker, kind: str, content: tuple[Any, ...]) -> set[SocketKey]:
        """Send `worker` a table or delta of its own, with the routes for the groups its
        sockets will join; returns the groups whose members changed."""
        listeners, pools = content[0], content[-1]
        routes = {}
        for key, _, pool_id, _ in listeners:
            members = self._groups.get(key, [])
            joins = key[0] == "UDP" or bool(pools[pool_id][1])
            if joins and worker.index not in members:
                if not members:  # the first socket of a new group: no program yet
                    self._programs.pop(key, None)
                    continue
                routes[key] = self._programs[key] = steering.route_for(
                    [*members, worker.index], self.count
                )
        seq = next(self._seq)
        body = channel.encode((kind, seq, self._settings, *content, routes))
        self.programs_sent += len(routes)
        return await self._apply(worker, body, seq)

    async def _apply(self, worker: _Worker, body: bytes, seq: int) -> set[SocketKey]:
        """Send `worker` an encoded table or delta and wait for its answer; returns the
        groups whose members changed."""
        done = self._request(worker, "applied", seq)
        channel.send(worker.writer, body)
        try:
            reply = await asyncio.wait_for(done, APPLY_TIMEOUT)
        except (TimeoutError, ConnectionError) as exc:
            self._waiting.pop(("applied", worker, seq), None)
            if worker.ready:
                log.error("worker %d did not apply the table (%r); replacing it", worker.index, exc)
                if worker.process.returncode is None:
                    worker.process.kill()
            return set()
        if len(reply) > 4:
            self._note_unserved(worker, frozenset(tuple(key) for key in reply[4]))
        changed: set[SocketKey] = set()
        for event, key in reply[3]:
            changed.add(key)
            if event == "join":
                self._groups.setdefault(key, []).append(worker.index)
            else:
                self._leave(key, worker.index)
        return changed

    def _leave(self, key: SocketKey, member: int) -> None:
        """As the kernel does: the group's last socket takes the leaver's place."""
        members = self._groups.get(key)
        if members is None or member not in members:
            return
        where = members.index(member)
        members[where] = members[-1]
        members.pop()
        if not members:  # the kernel frees the group, and its program with it
            del self._groups[key]
            self._programs.pop(key, None)

    def _steer(self, keys: set[SocketKey]) -> None:
        """Send the workers the routes of the groups in `keys` whose program must change."""
        routes = {}
        for key in keys:
            members = self._groups.get(key)
            if members is None:
                continue
            route = steering.route_for(members, self.count)
            if len(members) == 1 and members[0] >= 0 and key not in self._programs:
                continue  # one worker's socket alone, without a program: it gets everything
            if self._programs.get(key) != route:
                routes[key] = self._programs[key] = route
        if not routes:
            return
        for worker in self._live():
            channel.send(worker.writer, ("steer", routes))
            self.programs_sent += len(routes)

    # ---- counters ----------------------------------------------------------------------------

    async def collect(self, *, debug: bool = False) -> None:
        """Ask every worker for its counters and sum them into the proxier's ConnStats.

        Reports come in parts (worker.REPORT_PART service ports each), taken in one per turn of
        the loop; pins and balancers are kept per worker, packed, and merged for one pool at a
        time when a view asks: no step walks all 10,000 service ports at once.
        """
        request = next(self._seq)
        live = self._live()
        waiting = []
        for worker in live:
            waiting.append(self._request(worker, "collected", request))
            channel.send(worker.writer, ("collect", request, debug))
        replies = await asyncio.gather(
            *(asyncio.wait_for(w, COLLECT_TIMEOUT) for w in waiting), return_exceptions=True
        )
        for worker in live:  # what is left of a worker that timed out or died
            self._waiting.pop(("collected", worker, request), None)
            self._parts.pop(("collected", worker, request), None)
        views: dict[int, dict[int, bytes]] = {}
        for reply in replies:
            if isinstance(reply, BaseException):
                continue
            index, (stats, reported) = reply
            self._reports[index] = stats
            views[index] = reported
        if debug:
            self._views = views
        await self._sum()

    def _take_part(self, worker: _Worker, message: tuple[Any, ...]) -> None:
        """Add one part of a "collected" report; the last one completes the request."""
        key = ("collected", worker, message[1])
        future = self._waiting.get(key)
        if future is None or future.done():
            return  # the collect gave up on this worker
        stats, views = self._parts.setdefault(key, ({}, {}))
        stats.update(message[3])
        views.update(message[4] or {})
        if message[5]:
            del self._waiting[key]
            future.set_result((message[2], self._parts.pop(key)))

    async def _sum(self) -> None:
        """Each port's counters: the workers' reports and the dead workers' totals, summed
        SUM_PART ports per turn of the loop (10,000 at once took ~50 ms)."""
        names = {port.name: port.stats for port in self._ports.values()}
        self._dead_totals = {n: t for n, t in self._dead_totals.items() if n in names}
        reports = list(self._reports.values())
        zeros = [0] * len(COUNTERS)
        for done, (name, stats) in enumerate(names.items()):
            if done and done % SUM_PART == 0:
                await asyncio.sleep(0)
            total = list(self._dead_totals.get(name, zeros))
            for report in reports:
                values = report.get(name)
                if values is not None:
                    for i in range(len(COUNTERS)):
                        total[i] += values[i]
            for field, value in zip(COUNTERS, total, strict=True):
                setattr(stats, field, value)

    # ---- handing the workers' sockets over to the next process --------------------------------

    def groups(self) -> dict[SocketKey, list[int]]:
        """Every reuseport group as tracked: worker numbers in the kernel's order."""
        return {key: list(members) for key, members in self._groups.items()}

    def adopt_groups(self, groups: dict[SocketKey, list[int]]) -> None:
        """Before the first table: the groups of the sockets handed over, in the order the
        process that made them tracked (same sockets: the same order, so steering holds)."""
        self._groups = {key: list(members) for key, members in groups.items()}

    async def prepare_adoption(self, directory: str) -> dict[int, str]:
        """Have every worker listen for its predecessor's sockets; slot -> unix socket path."""
        paths: dict[int, str] = {}
        ready = []
        self._adopting = {}
        for worker in self._live():
            seq = next(self._seq)
            path = os.path.join(directory, f".handover-{os.getpid()}-{worker.index}.sock")
            ready.append(self._request(worker, "adopting", seq))
            self._adopting[worker.index] = self._request(worker, "adopted", seq)
            channel.send(worker.writer, ("adopt", seq, path))
            paths[worker.index] = path
        for reply in await asyncio.gather(*(asyncio.wait_for(r, APPLY_TIMEOUT) for r in ready)):
            if reply[3]:
                raise ProxyError(f"worker {reply[2]} cannot receive sockets: {reply[3]}")
        return paths

    async def finish_adoption(self, timeout: float) -> dict[int, int]:  # noqa: ASYNC109
        """Wait until every worker has its predecessor's sockets; slot -> how many."""
        counts = {}
        for index, done in self._adopting.items():
            reply = await asyncio.wait_for(done, timeout)
            if reply[4]:
                raise ProxyError(f"worker {index} did not receive its sockets: {reply[4]}")
            counts[index] = reply[3]
        return counts

    async def export(self, paths: dict[int, str], timeout: float) -> dict[int, int]:  # noqa: ASYNC109
        """Each worker sends its sockets to the path of its slot; slot -> how many.

        A slot without a worker now (being replaced) sends none: its successor binds anew.
        """
        waiting = {}
        for worker in self._live():
            if worker.index in paths:
                seq = next(self._seq)
                waiting[worker.index] = self._request(worker, "exported", seq)
                channel.send(worker.writer, ("export", seq, paths[worker.index]))
        counts = {}
        for index, path in paths.items():
            future = waiting.get(index)
            if future is None:
                with await asyncio.to_thread(fdpass.connect, path, timeout) as conn:
                    await fdpass.send(conn, {"done": 0})
                counts[index] = 0
                continue
            reply = await asyncio.wait_for(future, timeout)
            if reply[4]:
                raise ProxyError(f"worker {index} could not send its sockets: {reply[4]}")
            counts[index] = reply[3]
        return counts

    def abandon(self) -> None:
        """Kill every worker at once, leaving the sockets they hold untouched (a handover
        that failed: the process that handed them over still serves them)."""
        self._stopping = True
        for worker in [*self._workers, self._spare]:
            if worker is not None and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()

    # ---- shutdown ----------------------------------------------------------------------------

    async def shutdown(self, grace: float, *, release: bool = False) -> None:
        """Tell every worker to stop accepting and drain within `grace`; then reap them.

        `release`: the sockets were handed over; the workers close their descriptors only.
        """
        self._stopping = True
        if self._retry_handle is not None:
            self._retry_handle.cancel()
        starting = [
            t for t in (self._spare_task, self._retry_task, *self._replacing) if t is not None
        ]
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        waiting = []
        for worker in self._live():
            waiting.append(self._request(worker, "drained", worker.index))
            channel.send(worker.writer, ("release" if release else "drain", grace))
        await asyncio.gather(
            *(asyncio.wait_for(w, grace + 2.0) for w in waiting), return_exceptions=True
        )
        for process in [*self._workers, self._spare]:
            if process is not None:
                await self._end(process)

    @property
    def alive(self) -> int:
        """Workers serving now (the spare not counted)."""
        return len(self._live())

    def pids(self) -> list[int]:
        """The process IDs of the workers, in slot order (0 for a slot being replaced)."""
        return [w.process.pid if w is not None and w.ready else 0 for w in self._workers]


async def _reap(process: asyncio.subprocess.Process) -> int:
    """Kill `process` if it still runs, and wait for its exit code."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    return await process.wait()
