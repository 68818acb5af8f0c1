"""Active connections per endpoint shared by the node's worker processes (for `lc`).

One memfd, made by the control process before the fork server starts and inherited by every
worker: int64 cells, a column of `SLOTS` per worker (`worker * SLOTS + slot`). The control
process gives each endpoint of a least-connection pool a slot (`SlotBook`, in the table);
each worker writes only its own column (its count of open connections to that endpoint), and
a pick sums the slot's cells over the columns. One writer per cell: no lost updates and no
atomic instructions needed (an aligned 8-byte store and load are single-copy atomic on the
machines this runs on). A read may see another worker's count a connection late: the cost of
a shared count is a few hundred nanoseconds per pick, not a lock.
"""

from __future__ import annotations

import mmap
import os
from collections import deque

SLOTS = 32768
"""Endpoint slots (of least-connection pools) the node can count: 256 KiB per worker column,
resident only once a worker counts in it. Past it a pool counts its own worker's only."""
_CELL = 8


class NodeCounts:
    """The shared cells, mapped in this process (`fd` is the memfd every worker inherits)."""

    def __init__(self, fd: int, workers: int, slots: int = SLOTS) -> None:
        self.fd = fd
        self.workers = workers
        self.slots = slots
        self._map = mmap.mmap(fd, workers * slots * _CELL, mmap.MAP_SHARED)
        self.cells: memoryview = memoryview(self._map).cast("q")
        """The cells as int64s (`worker * slots + slot`)."""

    @classmethod
    def create(cls, workers: int, slots: int = SLOTS) -> NodeCounts:
        """A fresh memfd of zeros for `workers` columns (inheritable: the workers map it)."""
        fd = os.memfd_create("kube-userspace-proxy-counts", 0)  # no MFD_CLOEXEC: inherited
        os.ftruncate(fd, workers * slots * _CELL)
        return cls(fd, workers, slots)

    def clear_column(self, worker: int) -> None:
        """Zero `worker`'s column: a worker taking a slot starts with no connections (the one
        before it may have died holding some)."""
        start = worker * self.slots
        self.cells[start : start + self.slots] = memoryview(bytes(self.slots * _CELL)).cast("q")

    def load(self, slot: int) -> int:
        """Open connections to the endpoint in `slot`, summed over every worker."""
        return sum(self.cells[slot :: self.slots])  # one cell per column: a strided view

    def close(self) -> None:
        """Unmap the cells and close the memfd (once no worker will be forked again)."""
        if self.fd < 0:
            return
        self.cells.release()
        self._map.close()
        os.close(self.fd)
        self.fd = -1


class SlotBook:
    """The control process's assignment of slots to (pool, endpoint): a freed slot is reused
    last (oldest first), so a worker that still counts in it under its old owner has applied
    the change long before the slot serves another endpoint."""

    def __init__(self, slots: int = SLOTS) -> None:
        self._next = 0
        self._slots = slots
        self._free: deque[int] = deque()

    def take(self) -> int:
        """A free slot; -1 when every slot is taken (that endpoint is counted per worker)."""
        if self._next < self._slots:
            self._next += 1
            return self._next - 1
        return self._free.popleft() if self._free else -1

    def give_back(self, slots: tuple[int, ...]) -> None:
        self._free.extend(s for s in slots if s >= 0)

    @property
    def used(self) -> int:
        return self._next - len(self._free)
