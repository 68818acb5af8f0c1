"""The control process's end of a worker: its handle, and the answers awaited from workers.

A request to a worker carries a `seq`; its answer names the same `seq`. `Replies` keeps one
future per request (reply type, worker, seq) until the answer comes or the worker exits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Any, Protocol, TypeVar

from kube_userspace_proxy.workers import protocol

SPARE = -2
"""The index of the warm spare: a started worker that takes over the slot of one that dies."""

_Answer = TypeVar("_Answer")


class WorkerProcess(Protocol):
    """A worker's process as the control process handles it (`forkserver.ForkedProcess`)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def kill(self) -> None: ...

    async def wait(self) -> int | None: ...


@dataclasses.dataclass(slots=True, eq=False)
class WorkerLink:
    """One worker process; `index` is its slot, SPARE while it waits to take one over."""

    index: int
    process: WorkerProcess
    writer: asyncio.StreamWriter
    reader_task: asyncio.Task[None] | None = None
    watcher: asyncio.Task[None] | None = None
    ready: bool = True
    started: float = 0.0
    answered: float = 0.0  # when its loop last answered a ping (monotonic)

    def send(self, message: protocol.Message | bytes) -> None:
        """Queue `message` (or one `protocol.encode`d already) to this worker; never blocks."""
        protocol.send(self.writer, message)


class Replies:
    """The requests sent to workers whose answers are awaited, by (answer type, worker, seq)."""

    def __init__(self) -> None:
        self._seq = itertools.count(1)
        self._waiting: dict[tuple[type[Any], WorkerLink, int], asyncio.Future[Any]] = {}

    def next_seq(self) -> int:
        """A number no request has used yet."""
        return next(self._seq)

    def expect(self, worker: WorkerLink, kind: type[_Answer], seq: int) -> asyncio.Future[_Answer]:
        """A future for `worker`'s `kind` answer to request `seq`."""
        future: asyncio.Future[_Answer] = asyncio.get_running_loop().create_future()
        self._waiting[(kind, worker, seq)] = future
        return future

    def waiting(self, worker: WorkerLink, kind: type[_Answer], seq: int) -> bool:
        """Whether an answer to request `seq` is still awaited (not given up on)."""
        future = self._waiting.get((kind, worker, seq))
        return future is not None and not future.done()

    def answer(self, worker: WorkerLink, kind: type[_Answer], seq: int, value: _Answer) -> None:
        """Complete the request `seq` of `worker` (nothing if it was given up on)."""
        future = self._waiting.pop((kind, worker, seq), None)
        if future is not None and not future.done():
            future.set_result(value)

    def take(self, worker: WorkerLink, reply: protocol.Reply) -> None:
        """`worker`'s answer to one of its requests."""
        self.answer(worker, type(reply), reply.seq, reply)

    def forget(self, worker: WorkerLink, kind: type[Any], seq: int) -> None:
        """Give up on an answer (timed out)."""
        self._waiting.pop((kind, worker, seq), None)

    def fail(self, worker: WorkerLink) -> None:
        """`worker` exited: every request still waiting for it fails with ConnectionError."""
        for key in [key for key in self._waiting if key[1] is worker]:
            future = self._waiting.pop(key)
            if not future.done():
                future.set_exception(ConnectionError(f"worker {worker.index} exited"))
