"""The cyclic garbage collector, held off while a large state is first built.

Listing 10,000 Services and their EndpointSlices and serving them builds about 1.5 million
objects, and they all live on. The collector's passes over them while they pile up (each
full pass walks everything built so far) took 0.9 s of a 2.0 s build in-process (list and
parse, snapshot, listeners). Nothing built then is cyclic garbage worth looking for, so the
collector is held off while it is built; what was built is then frozen (`gc.freeze()`: later
full passes skip it) and the collector runs as before. Garbage without cycles is freed by
reference counting all along; a hold is bounded in time, so a start that waits long (an API
server away) is not left without a collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator

FIRST_BUILD_LIMIT = 30.0
"""Seconds the collector is held off at most while the first state is built."""


class Hold:
    """Holds off the cyclic collector from `begin()` until `end()`, at most `limit` seconds.

    `end()` freezes what was built, then lets the collector run; at the time limit the
    collector runs again without a freeze (a start that waited that long built little and
    may have made cyclic garbage meanwhile: failed connections, their tracebacks).
    """

    def __init__(self, limit: float = FIRST_BUILD_LIMIT) -> None:
        self._limit = limit
        self._timer: asyncio.TimerHandle | None = None
        self.held = False

    def begin(self) -> None:
        """Hold the collector off (nothing when it is disabled already: not ours to undo)."""
        if self.held or not gc.isenabled():
            return
        gc.disable()
        self.held = True
        self._timer = asyncio.get_running_loop().call_later(self._limit, self._expire)

    def end(self) -> None:
        """The build is done: freeze it and let the collector run again."""
        if not self.held:
            return
        gc.freeze()
        self._release()

    def abandon(self) -> None:
        """Let the collector run again without a freeze (the build did not finish)."""
        if self.held:
            self._release()

    def _expire(self) -> None:
        self._timer = None
        self.abandon()

    def _release(self) -> None:
        self.held = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        gc.enable()


@contextlib.contextmanager
def held_off() -> Iterator[None]:
    """Hold the collector off for one bounded step (e.g. applying a whole table); the
    caller freezes what should not be walked again."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
