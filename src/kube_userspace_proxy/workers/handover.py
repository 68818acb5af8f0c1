"""The workers' part of a handover: each slot's sockets go to the same slot of the next process.

The new process's workers listen on a unix socket each (`prepare_adoption`); the old
process's workers send their sockets there (`export`), each to the worker of its own slot;
the new ones report how many arrived (`finish_adoption`). Same sockets, same reuseport groups,
same order: steering holds across the restart.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from kube_userspace_proxy import fdpass
from kube_userspace_proxy.errors import ProxyError
from kube_userspace_proxy.workers.link import Replies, WorkerLink
from kube_userspace_proxy.workers.protocol import Adopt, Adopted, Adopting, Export, Exported

STEP_TIMEOUT = 10.0
"""Seconds each worker has to start listening for its predecessor's sockets."""


class Handover:
    """The control process's side of passing the workers' sockets between two processes."""

    def __init__(self, replies: Replies, live: Callable[[], list[WorkerLink]]) -> None:
        self._replies = replies
        self._live = live
        self._adopting: dict[int, asyncio.Future[Adopted]] = {}

    async def prepare_adoption(self, directory: str) -> dict[int, str]:
        """Have every worker listen for its predecessor's sockets; slot -> unix socket path."""
        paths: dict[int, str] = {}
        ready = []
        self._adopting = {}
        for worker in self._live():
            seq = self._replies.next_seq()
            path = os.path.join(directory, f".handover-{os.getpid()}-{worker.index}.sock")
            ready.append(self._replies.expect(worker, Adopting, seq))
            self._adopting[worker.index] = self._replies.expect(worker, Adopted, seq)
            worker.send(Adopt(seq, path))
            paths[worker.index] = path
        for reply in await asyncio.gather(*(asyncio.wait_for(r, STEP_TIMEOUT) for r in ready)):
            if reply.error:
                raise ProxyError(f"worker {reply.worker} cannot receive sockets: {reply.error}")
        return paths

    async def finish_adoption(self, timeout: float) -> dict[int, int]:  # noqa: ASYNC109
        """Wait until every worker has its predecessor's sockets; slot -> how many."""
        counts = {}
        for index, done in self._adopting.items():
            reply = await asyncio.wait_for(done, timeout)
            if reply.error:
                raise ProxyError(f"worker {index} did not receive its sockets: {reply.error}")
            counts[index] = reply.sockets
        return counts

    async def export(self, paths: dict[int, str], timeout: float) -> dict[int, int]:  # noqa: ASYNC109
        """Each worker sends its sockets to the path of its slot; slot -> how many.

        A slot without a worker now (being replaced) sends none: its successor binds anew.
        """
        waiting = {}
        for worker in self._live():
            if worker.index in paths:
                seq = self._replies.next_seq()
                waiting[worker.index] = self._replies.expect(worker, Exported, seq)
                worker.send(Export(seq, paths[worker.index]))
        counts = {}
        for index, path in paths.items():
            future = waiting.get(index)
            if future is None:
                with await asyncio.to_thread(fdpass.connect, path, timeout) as conn:
                    await fdpass.send(conn, {"done": 0})
                counts[index] = 0
                continue
            reply = await asyncio.wait_for(future, timeout)
            if reply.error:
                raise ProxyError(f"worker {index} could not send its sockets: {reply.error}")
            counts[index] = reply.sockets
        return counts
