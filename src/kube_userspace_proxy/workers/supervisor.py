"""Keeping N worker processes running: fork, read, ping, restart, reap.

Each worker is forked by the fork server (`forkserver`), an interpreter that imported the data
plane only, with one end of a socketpair (its channel): a worker shares that interpreter's pages
and is ready in milliseconds. When a worker dies, a new one is forked for its slot and the owner
gives it the current table (with `spare`, one more forked worker waits to take a slot at once).
A worker that dies again soon after its start is restarted after a growing delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import time
from collections.abc import Awaitable, Callable

from kube_userspace_proxy import logs
from kube_userspace_proxy.errors import ProxyError
from kube_userspace_proxy.workers import protocol
from kube_userspace_proxy.workers.forking import ForkServer
from kube_userspace_proxy.workers.link import SPARE, Replies, WorkerLink, WorkerProcess
from kube_userspace_proxy.workers.protocol import (
    Adopted,
    Adopting,
    Applied,
    Become,
    Collected,
    Drain,
    Drained,
    Exported,
    Hello,
    Penalty,
    Ping,
    Pong,
    Recovered,
)

log = logs.get(__name__)

START_TIMEOUT = 10.0
"""Seconds a new worker has to say `Hello`."""
CHANNEL_BUFFER = 4 * 1024 * 1024
"""Socket buffer of each channel end (a table of 10,000 ports is 1.5 MB)."""
RESTART_DELAYS = (0.0, 0.25, 1.0, 2.0, 5.0)
"""Waits before restarting a worker that failed again soon after its start."""
RECENT = 10.0
"""Seconds after its start within which a worker's exit counts as failing again."""
KEEP_SPARE = True
"""Whether a forked spare waits to take the slot of a worker that dies (else one is forked when
needed). Forked, it costs 21 MiB RSS, 9 MiB PSS; at 10,000 ports beside CPU hogs it took the
slot in 1.0 s (median) where a worker forked then took 1.6 s, over the issue's 1 s
(benchmarks/replacement.py, docs/workers.md)."""


class Supervisor:
    """The worker processes of every slot, and the spare; restarts the ones that exit.

    `on_part` takes each `Collected` part; `on_exit` hears of a slot's worker that exited
    (or was killed); `on_slot` gives a worker that took a slot the current table.
    """

    def __init__(
        self,
        count: int,
        argv: list[str],
        replies: Replies,
        *,
        on_part: Callable[[WorkerLink, Collected], None],
        on_exit: Callable[[int], None],
        on_slot: Callable[[WorkerLink], Awaitable[None]],
        on_dial: Callable[[Penalty | Recovered], None] = lambda _: None,
        pass_fds: tuple[int, ...] = (),
        spare: bool | None = None,
    ) -> None:
        self.count = count
        self.forks = ForkServer(argv, pass_fds)
        """The fork server every worker is forked from."""
        self._keeps_spare = KEEP_SPARE if spare is None else spare
        self._replies = replies
        self._on_part = on_part
        self._on_exit = on_exit
        self._on_slot = on_slot
        self._on_dial = on_dial
        self._workers: list[WorkerLink | None] = [None] * count
        self._spare: WorkerLink | None = None
        self._spare_task: asyncio.Task[None] | None = None
        self._replacing: set[asyncio.Task[None]] = set()  # watchers replacing a dead worker
        self._failures = [0] * count
        self.stopping = False
        """Shutting down (or abandoning the workers): no restarts, no steering."""
        self.restarts = 0
        """Workers replaced after an unexpected exit."""

    # ---- what the others read ------------------------------------------------------------------

    def broadcast(self, message: protocol.ToWorker) -> None:
        """Send `message` to every live worker."""
        body = protocol.encode(message)
        for worker in self.live():
            worker.send(body)

    def live(self) -> list[WorkerLink]:
        """The workers serving now, in slot order (the spare not counted)."""
        return [w for w in self._workers if w is not None and w.ready]

    def pids(self) -> list[int]:
        """The process IDs of the workers, in slot order (0 for a slot being replaced)."""
        return [w.process.pid if w is not None and w.ready else 0 for w in self._workers]

    def spare_pid(self) -> int:
        """The process ID of the warm spare (0 if none is ready)."""
        return self._spare.process.pid if self._spare is not None else 0

    def stalest_answer(self) -> float:
        """Seconds since the worker whose event loop answered longest ago last answered."""
        now = time.monotonic()
        return max((now - w.answered for w in self.live()), default=0.0)

    async def heartbeat(self, interval: float = 1.0) -> None:
        """Ping every worker's event loop each `interval` seconds (a root task)."""
        for seq in itertools.count():
            for worker in self.live():
                worker.send(Ping(seq))
            await asyncio.sleep(interval)

    # ---- starting ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker (and the spare); raises ProxyError when one cannot start."""
        try:
            await self.forks.start()
        except OSError as exc:
            raise ProxyError(f"the workers could not start: {exc}") from None
        started = await asyncio.gather(
            *(self._spawn(index) for index in range(self.count)), return_exceptions=True
        )
        failed = [r for r in started if isinstance(r, BaseException)]
        for index, result in enumerate(started):
            if isinstance(result, WorkerLink):
                self._workers[index] = result
        if failed:
            for worker in self._workers:
                if worker is not None:
                    await self._end(worker)
            raise failed[0]
        self._keep_spare()  # in the background: the workers serve without waiting for it

    async def _spawn(self, index: int) -> WorkerLink:
        """A started worker process (ready: it said hello); ProxyError when it cannot start."""
        what = "the spare worker" if index == SPARE else f"worker {index}"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (ours, theirs):  # a table of 10,000 ports is 1.5 MB: fewer round trips
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHANNEL_BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CHANNEL_BUFFER)
        try:
            process = await self.forks.fork(index, theirs)
        except BaseException as exc:
            ours.close()
            if isinstance(exc, OSError):
                raise ProxyError(f"{what} could not start: {exc}") from None
            raise
        finally:
            theirs.close()
        try:
            reader, writer = await asyncio.open_unix_connection(sock=ours)
        except BaseException:
            ours.close()
            await reap(process)
            raise
        worker = WorkerLink(index, process, writer, ready=False)
        try:
            hello = await asyncio.wait_for(_hello(reader), START_TIMEOUT)
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
        log.info("%s started (pid %d)", what, hello.pid)
        worker.reader_task = asyncio.create_task(self._read(worker, reader), name=f"{what} channel")
        worker.watcher = asyncio.create_task(self._watch(worker), name=f"{what} watch")
        return worker

    async def _read(self, worker: WorkerLink, reader: asyncio.StreamReader) -> None:
        """Take what `worker` sends until its channel closes."""
        while True:
            try:
                message = await protocol.receive(reader)
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                return
            match message:
                case Collected():
                    self._on_part(worker, message)
                    await asyncio.sleep(0)  # one part per turn, however many came in at once
                case Pong():
                    worker.answered = time.monotonic()
                case Penalty():
                    # One worker saw a dial fail: the others skip that endpoint too.
                    body = protocol.encode(message)
                    for other in self.live():
                        if other is not worker:
                            other.send(body)
                    self._on_dial(message)
                case Recovered():
                    self._on_dial(message)
                case Applied() | Adopting() | Adopted() | Exported() | Drained():
                    self._replies.take(worker, message)
                case _:
                    log.error("worker %d sent an unexpected %s", worker.index, message)

    # ---- restarting --------------------------------------------------------------------------

    async def _watch(self, worker: WorkerLink) -> None:
        assert worker.reader_task is not None
        await asyncio.wait(
            [asyncio.ensure_future(worker.process.wait()), worker.reader_task],
            return_when=asyncio.FIRST_COMPLETED,
        )
        if self.stopping:
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
        recent = time.monotonic() - worker.started < RECENT
        self._failures[index] = self._failures[index] + 1 if recent else 1
        if self._failures[index] > 1:  # crashing again: do not burn through processes
            await asyncio.sleep(RESTART_DELAYS[min(self._failures[index], len(RESTART_DELAYS)) - 1])
        while not self.stopping:
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

    async def _take_slot(self, worker: WorkerLink, index: int) -> None:
        """Make `worker` serve slot `index` with the current table."""
        if worker.index == SPARE:
            worker.send(Become(index))
        worker.index = index
        worker.started = time.monotonic()
        self._workers[index] = worker
        log.info("worker %d is pid %d now", index, worker.process.pid)
        await self._on_slot(worker)

    def _keep_spare(self) -> None:
        if not self._keeps_spare or self.stopping or self._spare is not None:
            return
        if self._spare_task is not None and not self._spare_task.done():
            return
        self._spare_task = asyncio.create_task(self._start_spare(), name="spare worker")

    async def _start_spare(self) -> None:
        for delay in RESTART_DELAYS:
            if self.stopping:
                return
            try:
                spare = await self._spawn(SPARE)
            except ProxyError as exc:
                log.error("%s", exc)
                await asyncio.sleep(delay)
                continue
            if self.stopping:
                await self._end(spare)
            else:
                self._spare = spare
            return

    # ---- stopping ----------------------------------------------------------------------------

    async def _end(self, worker: WorkerLink) -> int | None:
        """Forget a worker that exited (or kill it): its sockets left every group."""
        worker.ready = False
        code = await reap(worker.process)
        worker.writer.close()
        for task in (worker.reader_task, worker.watcher):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        self._replies.fail(worker)
        if worker.index >= 0:
            self._on_exit(worker.index)
        return code

    async def shutdown(
        self, grace: float, *, release: bool, tasks: tuple[asyncio.Task[None] | None, ...] = ()
    ) -> None:
        """Tell every worker to stop accepting and drain within `grace`; then reap them.

        `release`: the sockets were handed over; the workers close their descriptors only.
        `tasks`: the owner's, to cancel with the starts and restarts under way.
        """
        self.stopping = True
        starting = [t for t in (self._spare_task, *tasks, *self._replacing) if t is not None]
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        waiting = []
        for worker in self.live():
            seq = self._replies.next_seq()
            waiting.append(self._replies.expect(worker, Drained, seq))
            worker.send(Drain(seq, grace, release))
        await asyncio.gather(
            *(asyncio.wait_for(w, grace + 2.0) for w in waiting), return_exceptions=True
        )
        for process in [*self._workers, self._spare]:
            if process is not None:
                await self._end(process)
        await self.forks.close()

    def abandon(self) -> None:
        """Kill every worker at once, leaving the sockets they hold untouched (a handover
        that failed: the process that handed them over still serves them)."""
        self.stopping = True
        for worker in [*self._workers, self._spare]:
            if worker is not None and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
        self.forks.abandon()


async def _hello(reader: asyncio.StreamReader) -> Hello:
    """A new worker's first message; ValueError when it is not `Hello`."""
    message = await protocol.receive(reader)
    if not isinstance(message, Hello):
        raise ValueError(f"a worker's first message is {type(message).__name__}, not Hello")
    return message


async def reap(process: WorkerProcess) -> int | None:
    """Kill `process` if it still runs, and wait for its exit code (None: unknown)."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    return await process.wait()
