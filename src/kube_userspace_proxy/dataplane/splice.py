"""Zero-copy forwarding of one TCP direction with os.splice through a pooled pipe.

The event loop's transports own the sockets; a pump works on duplicated descriptors (os.dup)
so it can register its own readiness callbacks with `loop.add_reader`/`add_writer` on uvloop
and on plain asyncio alike, while the transport of the source socket stays paused.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
from collections.abc import Callable

from kube_userspace_proxy import logs

log = logs.get(__name__)

# A larger pipe moves more bytes per splice call; 1 MiB is the unprivileged maximum by default.
PIPE_SIZE = 1024 * 1024
# Splice calls per readiness callback before yielding to the loop (fairness between connections).
_BURST = 4
_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
# Errors meaning "splice cannot be used on these descriptors": fall back to copying.
UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})


class PipePool:
    """Reusable pipes (read end, write end, capacity); only empty pipes are given back."""

    def __init__(self, *, size: int = PIPE_SIZE, keep: int = 64) -> None:
        self._size = size
        self._keep = keep
        self._idle: list[tuple[int, int, int]] = []

    def get(self) -> tuple[int, int, int]:
        """An empty pipe, from the pool or new."""
        if self._idle:
            return self._idle.pop()
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            capacity = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, self._size)
        except OSError:  # pipe-max-size is lower here: keep the default capacity
            capacity = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)
        return r, w, capacity

    def put(self, pipe: tuple[int, int, int]) -> None:
        """Return an empty pipe; closed instead when the pool is full."""
        if len(self._idle) < self._keep:
            self._idle.append(pipe)
        else:
            os.close(pipe[0])
            os.close(pipe[1])

    def discard(self, pipe: tuple[int, int, int]) -> None:
        """Close a pipe that may still hold data."""
        os.close(pipe[0])
        os.close(pipe[1])

    def close(self) -> None:
        """Close every idle pipe."""
        for r, w, _ in self._idle:
            os.close(r)
            os.close(w)
        self._idle.clear()

    @property
    def idle(self) -> int:
        return len(self._idle)


POOL = PipePool()


class SplicePump:
    """Moves bytes src -> pipe -> dst until EOF or an error; back-pressure is the pipe's size.

    While the pipe holds bytes the pump waits for `dst` to be writable and stops reading `src`,
    so a slow receiver never makes the proxy hold more than one pipe per direction.
    `on_bytes(n)` counts, `on_eof()` fires after the last byte was written (the caller
    half-closes `dst`), `on_error(exc)` after a failure; `stop()` releases the pipe.
    """

    __slots__ = (
        "_cap",
        "_dst",
        "_loop",
        "_on_bytes",
        "_on_eof",
        "_on_error",
        "_pipe",
        "_reading",
        "_src",
        "_stopped",
        "moved",
        "pending",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        src: int,
        dst: int,
        *,
        on_bytes: Callable[[int], None],
        on_eof: Callable[[], None],
        on_error: Callable[[OSError], None],
    ) -> None:
        self._loop = loop
        self._src = src
        self._dst = dst
        self._on_bytes = on_bytes
        self._on_eof = on_eof
        self._on_error = on_error
        self._pipe = POOL.get()
        self._cap = self._pipe[2]
        self.pending = 0  # bytes sitting in the pipe
        self.moved = 0
        self._reading = True
        self._stopped = False
        loop.add_reader(src, self._readable)

    def _readable(self) -> None:
        pipe_w = self._pipe[1]
        for _ in range(_BURST):
            try:
                n = os.splice(self._src, pipe_w, self._cap - self.pending, flags=_FLAGS)
            except BlockingIOError:
                return
            except OSError as exc:
                self._fail(exc)
                return
            if n == 0:
                self._eof()
                return
            self.pending += n
            self.moved += n
            self._on_bytes(n)
            if not self._flush():
                return

    def _flush(self) -> bool:
        """Write the pipe out; False when dst is full (now waiting for it) or the pump stopped."""
        pipe_r = self._pipe[0]
        while self.pending:
            try:
                n = os.splice(pipe_r, self._dst, self.pending, flags=_FLAGS)
            except BlockingIOError:
                if self._reading:
                    self._reading = False
                    self._loop.remove_reader(self._src)
                    self._loop.add_writer(self._dst, self._writable)
                return False
            except OSError as exc:
                self._fail(exc)
                return False
            self.pending -= n
        return not self._stopped

    def _writable(self) -> None:
        if self._flush() and not self._reading:
            self._reading = True
            self._loop.remove_writer(self._dst)
            self._loop.add_reader(self._src, self._readable)

    def _eof(self) -> None:
        # EOF can only be seen while reading, i.e. with an empty pipe.
        self.stop()
        self._on_eof()

    def _fail(self, exc: OSError) -> None:
        self.stop()
        self._on_error(exc)

    def stop(self) -> None:
        """Unregister and release the pipe (back to the pool only if empty). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._reading:
            self._loop.remove_reader(self._src)
        else:
            self._loop.remove_writer(self._dst)
        if self.pending:
            POOL.discard(self._pipe)
        else:
            POOL.put(self._pipe)
