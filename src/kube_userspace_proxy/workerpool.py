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
import socket
import sys
import time
import weakref
from typing import Any

from kube_userspace_proxy import channel, logs
from kube_userspace_proxy.balancer import EndpointPool
from kube_userspace_proxy.dataplane import ConnStats, Picker, steering
from kube_userspace_proxy.errors import ProxyError

log = logs.get(__name__)

Key = tuple[str, str, int]
Address = tuple[str, int]
Pins = list[tuple[str, Address, float]]
CONTROL = -1
"""The member id of the control process's own (UDP) socket in a reuseport group."""
COUNTERS = tuple(f.name for f in dataclasses.fields(ConnStats))
GAUGES = frozenset({"active", "udp_sessions_active"})
START_TIMEOUT = 10.0
APPLY_TIMEOUT = 10.0
COLLECT_TIMEOUT = 2.0
RESTART_DELAYS = (0.05, 0.25, 1.0, 2.0, 5.0)


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
        self.key: Key = (protocol, address[0], address[1])
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

    def set_picker(self, picker: Picker) -> None:
        self.picker = picker

    async def close(self) -> None:
        if self._sock is not None:
            self._pool.remove(self)
            self._sock.close()
            self._sock = None

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


@dataclasses.dataclass(slots=True)
class _Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    reader_task: asyncio.Task[None] | None = None
    ready: bool = False
    started: float = 0.0


class WorkerPool:
    """N worker processes serving every proxy port; the proxier's data plane with workers."""

    shares_ports = True

    def __init__(
        self,
        count: int,
        *,
        udp_idle_timeout: float = 0.25,
        verbosity: int = 0,
        log_format: str = "text",
        event_loop: str = "uvloop",
    ) -> None:
        self.count = count
        self._settings = {"udp_idle_timeout": udp_idle_timeout}
        self._argv = ["-v", str(verbosity), "--log-format", log_format, "--event-loop", event_loop]
        self._workers = [_Worker(i) for i in range(count)]
        self._ports: dict[Key, SharedPort] = {}
        self._groups: dict[Key, list[int]] = {}
        self._pool_ids: weakref.WeakKeyDictionary[Picker, int] = weakref.WeakKeyDictionary()
        self._next_pool_id = itertools.count(1)
        self._seq = itertools.count(1)
        self._lock = asyncio.Lock()
        self._waiting: dict[tuple[str, int, int], asyncio.Future[Any]] = {}
        self._reports: dict[int, dict[str, tuple[int, ...]]] = {}
        self._dead_totals: dict[str, list[int]] = {}
        self._affinity: dict[int, Pins] = {}
        self._supervisors: list[asyncio.Task[None]] = []
        self._stopping = False
        self._table: tuple[list[Any], dict[int, Any]] | None = None
        self.restarts = 0
        """Workers restarted after an unexpected exit."""

    # ---- the proxier's data plane ------------------------------------------------------------

    def listener(
        self, sock: socket.socket, pool: EndpointPool, stats: ConnStats, name: str
    ) -> SharedPort:
        return SharedPort(self, sock, pool, stats, name)

    def add(self, port: SharedPort) -> None:
        self._ports[port.key] = port
        if port.key[0] == "UDP":  # a bound UDP socket is in the group from its bind on
            self._groups.setdefault(port.key, []).append(CONTROL)

    def remove(self, port: SharedPort) -> None:
        if self._ports.get(port.key) is port:
            del self._ports[port.key]
        if port.key[0] == "UDP":
            self._leave(port.key, CONTROL)

    async def publish(self) -> None:
        """Send the complete table to every worker in turn, then steer the changed groups."""
        self._table = self._build_table()
        async with self._lock:
            changed: set[Key] = set()
            for worker in self._workers:
                if worker.ready:
                    changed |= await self._apply(worker)
            self._steer(changed)

    def affinity_entries(self, pool: EndpointPool) -> Pins:
        """The pins the workers reported at the last `collect(debug=True)`."""
        pool_id = self._pool_ids.get(pool)
        return self._affinity.get(pool_id, []) if pool_id is not None else []

    # ---- starting and supervising ------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker; raises ProxyError when one cannot start."""
        for worker in self._workers:
            await self._spawn(worker)
        for worker in self._workers:
            self._supervisors.append(
                asyncio.create_task(self._supervise(worker), name=f"worker-{worker.index}")
            )

    async def _spawn(self, worker: _Worker) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            worker.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kube_userspace_proxy.worker",
                "--fd",
                str(theirs.fileno()),
                "--index",
                str(worker.index),
                *self._argv,
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        worker.writer = writer
        try:
            hello = await asyncio.wait_for(channel.receive(reader), START_TIMEOUT)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            code = await self._end(worker)
            raise ProxyError(
                f"worker {worker.index} could not start (exit code {code}): {exc!r}; see its"
                " log lines above"
            ) from None
        worker.started = time.monotonic()
        log.info("worker %d started (pid %d)", worker.index, hello[2])
        worker.reader_task = asyncio.create_task(
            self._read(worker, reader), name=f"worker-{worker.index}-channel"
        )
        worker.ready = True
        if self._table is not None:  # a restart: serve the current table at once
            async with self._lock:
                changed = await self._apply(worker)
                self._steer(changed)

    async def _supervise(self, worker: _Worker) -> None:
        failures = 0
        while not self._stopping:
            assert worker.process is not None and worker.reader_task is not None
            await asyncio.wait(
                [asyncio.ensure_future(worker.process.wait()), worker.reader_task],
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self._stopping:
                return
            code = await self._end(worker)
            log.error("worker %d exited unexpectedly (code %s); restarting it", worker.index, code)
            self.restarts += 1
            failures = failures + 1 if time.monotonic() - worker.started < 10 else 1
            await asyncio.sleep(RESTART_DELAYS[min(failures, len(RESTART_DELAYS)) - 1])
            try:
                await self._spawn(worker)
            except ProxyError as exc:
                log.error("%s", exc)

    async def _end(self, worker: _Worker) -> int | None:
        """Forget a worker that exited (or kill it): its sockets left every group."""
        worker.ready = False
        process = worker.process
        code = None
        if process is not None:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            code = await process.wait()
        if worker.writer is not None:
            worker.writer.close()
            worker.writer = None
        if worker.reader_task is not None:
            worker.reader_task.cancel()
            worker.reader_task = None
        for waiting in [k for k in self._waiting if k[1] == worker.index]:
            future = self._waiting.pop(waiting)
            if not future.done():
                future.set_exception(ConnectionError(f"worker {worker.index} exited"))
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
            if kind == "penalty":
                # One worker saw a dial fail: the others skip that endpoint too.
                for other in self._workers:
                    if other is not worker and other.ready and other.writer is not None:
                        channel.send(other.writer, message)
                continue
            future = self._waiting.pop((kind, worker.index, message[1]), None)
            if future is not None and not future.done():
                future.set_result(message)

    # ---- tables and steering -----------------------------------------------------------------

    def _pool_id(self, picker: Picker) -> int:
        pool_id = self._pool_ids.get(picker)
        if pool_id is None:
            pool_id = self._pool_ids[picker] = next(self._next_pool_id)
        return pool_id

    def _build_table(self) -> tuple[list[Any], dict[int, Any]]:
        listeners = []
        pools: dict[int, Any] = {}
        for port in self._ports.values():
            picker = port.picker
            pool_id = self._pool_id(picker)
            if pool_id not in pools:
                assert isinstance(picker, EndpointPool)
                pools[pool_id] = (
                    picker.name,
                    picker.addresses,
                    picker.affinity_timeout,
                    picker.proxy_protocol,
                )
            listeners.append((port.key, port.name, pool_id, port.v6only))
        return listeners, pools

    def _request(self, worker: _Worker, kind: str, seq: int) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[(kind, worker.index, seq)] = future
        return future

    async def _apply(self, worker: _Worker) -> set[Key]:
        """Send `worker` the table; returns the groups whose members changed."""
        if self._table is None or worker.writer is None:
            return set()
        listeners, pools = self._table
        routes = {}
        for key, _, pool_id, _ in listeners:
            members = self._groups.get(key, [])
            joins = key[0] == "UDP" or bool(pools[pool_id][1])
            if joins and worker.index not in members:
                routes[key] = steering.route_for([*members, worker.index], self.count)
        seq = next(self._seq)
        done = self._request(worker, "applied", seq)
        channel.send(worker.writer, ("table", seq, self._settings, listeners, pools, routes))
        try:
            reply = await asyncio.wait_for(done, APPLY_TIMEOUT)
        except (TimeoutError, ConnectionError) as exc:
            self._waiting.pop(("applied", worker.index, seq), None)
            if worker.ready:
                log.error(
                    "worker %d did not apply the table (%r); restarting it", worker.index, exc
                )
                process = worker.process
                if process is not None and process.returncode is None:
                    process.kill()
            return set()
        changed: set[Key] = set()
        for event, key in reply[3]:
            changed.add(key)
            if event == "join":
                self._groups.setdefault(key, []).append(worker.index)
            else:
                self._leave(key, worker.index)
        return changed

    def _leave(self, key: Key, member: int) -> None:
        """As the kernel does: the group's last socket takes the leaver's place."""
        members = self._groups.get(key)
        if members is None or member not in members:
            return
        where = members.index(member)
        members[where] = members[-1]
        members.pop()
        if not members:
            del self._groups[key]

    def _steer(self, keys: set[Key]) -> None:
        routes = {
            key: steering.route_for(self._groups[key], self.count)
            for key in keys
            if key in self._groups
        }
        if not routes:
            return
        for worker in self._workers:
            if worker.ready and worker.writer is not None:
                channel.send(worker.writer, ("steer", routes))

    # ---- counters ----------------------------------------------------------------------------

    async def collect(self, *, debug: bool = False) -> None:
        """Ask every worker for its counters and sum them into the proxier's ConnStats."""
        request = next(self._seq)
        waiting = []
        for worker in self._workers:
            if worker.ready and worker.writer is not None:
                waiting.append(self._request(worker, "collected", request))
                channel.send(worker.writer, ("collect", request, debug))
        replies = await asyncio.gather(
            *(asyncio.wait_for(w, COLLECT_TIMEOUT) for w in waiting), return_exceptions=True
        )
        affinity: dict[int, Pins] = {}
        for reply in replies:
            if isinstance(reply, BaseException):
                continue
            self._reports[reply[2]] = reply[3]
            for pool_id, pins in (reply[4] or {}).items():
                affinity.setdefault(pool_id, []).extend(pins)
        if debug:
            self._affinity = affinity
        self._sum()

    def _sum(self) -> None:
        names = {port.name: port.stats for port in self._ports.values()}
        self._dead_totals = {n: t for n, t in self._dead_totals.items() if n in names}
        for name, stats in names.items():
            total = list(self._dead_totals.get(name, [0] * len(COUNTERS)))
            for report in self._reports.values():
                values = report.get(name)
                if values is not None:
                    for i in range(len(COUNTERS)):
                        total[i] += values[i]
            for field, value in zip(COUNTERS, total, strict=True):
                setattr(stats, field, value)

    # ---- shutdown ----------------------------------------------------------------------------

    async def shutdown(self, grace: float) -> None:
        """Tell every worker to stop accepting and drain within `grace`; then reap them."""
        self._stopping = True
        for task in self._supervisors:
            task.cancel()
        waiting = []
        for worker in self._workers:
            if worker.ready and worker.writer is not None:
                waiting.append(self._request(worker, "drained", worker.index))
                channel.send(worker.writer, ("drain", grace))
        await asyncio.gather(
            *(asyncio.wait_for(w, grace + 2.0) for w in waiting), return_exceptions=True
        )
        for worker in self._workers:
            await self._end(worker)

    @property
    def alive(self) -> int:
        """Workers running now."""
        return sum(1 for w in self._workers if w.ready)

    def pids(self) -> list[int]:
        """The process IDs of the running workers (in worker order; 0 when not running)."""
        return [w.process.pid if w.process is not None and w.ready else 0 for w in self._workers]
