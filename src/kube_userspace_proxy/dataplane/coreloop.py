"""The event loop of a process that serves the native data plane: asyncio's, waiting in the core.

On uvloop the core's epoll set is one descriptor in uvloop's own: each wakeup is two waits
(uvloop's, then the core's) and a turn of uvloop's loop before any byte moves. Here the core
is the loop's selector (`CoreSelector`): one `epoll_wait` watches the connections, the
listeners and the descriptors asyncio registers, with the GIL released. While only bytes move,
the core stays in C from one wait to the next, as HAProxy's loop does. It calls the native
plane's handler for a batch of events that needs a decision, and runs the callbacks of the
descriptors asyncio watches when they are ready; it gives the turn back to asyncio's
`_run_once` only when callbacks are queued, an earlier timer was set, a signal arrived, or the
next timer's time came.

Everything else runs as on asyncio's own loop (`asyncio.SelectorEventLoop`): timers, signals
(through its self-pipe), the Python data plane and UDP, the worker's channel.

`--event-loop auto` (the default) runs this loop in each worker process that serves the native
data plane and uvloop in the control process, even when it serves (`--workers 1`: its control
work runs faster on uvloop); `--event-loop native` runs it there too; `uvloop` keeps the core
nested in uvloop's wait everywhere, `asyncio` in asyncio's.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import selectors
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from kube_userspace_proxy.dataplane import native

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

Handler = Callable[[list[tuple[Any, ...]]], object]

EVENT_LOOPS = ("auto", "native", "uvloop", "asyncio")
"""--event-loop's choices. `auto`: this module's loop in a worker process that serves the native
data plane, uvloop in the control process (which also serves with --workers 1: its control
work, 10,000 Services' worth, starts 1.25x slower on asyncio's loop than on uvloop) and
wherever the Python data plane serves. `native`: this module's loop in every process that
serves the native data plane, the control process with --workers 1 included."""
Loop = Literal["native", "uvloop", "asyncio"]


def _no_handler(events: list[tuple[Any, ...]]) -> object:
    raise RuntimeError(f"native core: {len(events)} events and no plane to handle them")


def _fd_of(fileobj: FileDescriptorLike) -> int:
    fd = fileobj if isinstance(fileobj, int) else int(fileobj.fileno())
    if fd < 0:
        raise ValueError(f"invalid file descriptor: {fd}")
    return fd


class _Keys(Mapping[Any, selectors.SelectorKey]):
    """`get_map()`: the registered keys by file object (or descriptor), as selectors has it."""

    def __init__(self, by_fd: dict[int, selectors.SelectorKey]) -> None:
        self._by_fd = by_fd

    def __len__(self) -> int:
        return len(self._by_fd)

    def __getitem__(self, fileobj: FileDescriptorLike) -> selectors.SelectorKey:
        try:
            return self._by_fd[_fd_of(fileobj)]
        except (KeyError, ValueError, AttributeError):
            raise KeyError(f"{fileobj!r} is not registered") from None

    def __iter__(self) -> Iterator[FileDescriptorLike]:
        return iter([key.fileobj for key in self._by_fd.values()])


class CoreSelector(selectors.BaseSelector):
    """A `selectors` selector that waits in the native core (`Core.select`)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self._by_fd: dict[int, selectors.SelectorKey] = {}
        self._map = _Keys(self._by_fd)
        # The native plane's (`NativePlane._handle`): each batch of the core's events that
        # needs Python.
        self.handler: Handler = _no_handler
        # Set by the loop: what the wait calls instead (the batch, then whether the loop needs
        # a turn), and what runs the callbacks of ready descriptors from inside the wait
        # (same return). Without them select() returns the ready ones, as any selector.
        self.events_handler: Callable[[list[tuple[Any, ...]]], bool] | None = None
        self.io_handler: Callable[[list[tuple[int, int]]], bool] | None = None

    def register(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        if not events or events & ~(selectors.EVENT_READ | selectors.EVENT_WRITE):
            raise ValueError(f"Invalid events: {events!r}")
        fd = _fd_of(fileobj)
        if fd in self._by_fd:
            raise KeyError(f"{fileobj!r} (FD {fd}) is already registered")
        self.core.watch_fd(fd, events, True)
        key = self._by_fd[fd] = selectors.SelectorKey(fileobj, fd, events, data)
        return key

    def unregister(self, fileobj: FileDescriptorLike) -> selectors.SelectorKey:
        key = self._map[fileobj]
        del self._by_fd[key.fd]
        # Closed already: epoll forgot it then (EpollSelector ignores this too).
        with contextlib.suppress(OSError):
            self.core.watch_fd(key.fd, 0, False)
        return key

    def modify(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        key = self._map[fileobj]
        if not events or events & ~(selectors.EVENT_READ | selectors.EVENT_WRITE):
            raise ValueError(f"Invalid events: {events!r}")
        if events != key.events:
            self.core.watch_fd(key.fd, events, False)
        if events != key.events or data != key.data:
            key = self._by_fd[key.fd] = key._replace(events=events, data=data)
        return key

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            ms = -1
        elif timeout <= 0:
            ms = 0
        else:  # rounded up, as EpollSelector does: never wake before the timer is due
            ms = math.ceil(timeout * 1e3)
        ready = []
        by_fd = self._by_fd
        handler = self.events_handler or self.handler
        for fd, mask in self.core.select(ms, handler, self.io_handler):
            key = by_fd.get(fd)
            if key is not None:
                ready.append((key, mask & key.events))
        return ready

    def get_map(self) -> Mapping[FileDescriptorLike, selectors.SelectorKey]:
        return self._map

    def close(self) -> None:
        self._by_fd.clear()
        self.core.close()


class CoreLoop(asyncio.SelectorEventLoop):
    """asyncio's loop over a `CoreSelector`; its native plane uses the selector's core.

    The callbacks of ready descriptors (`add_reader`/`add_writer`, so every transport's) run
    from inside the core's wait (`_run_io`), as `_process_events` would queue them, without a
    turn of `_run_once` each: a loop turn is taken only when callbacks are queued (`call_soon`,
    a future's result), a timer is due or an earlier one was set, or a signal came. UDP and
    the Python data plane cost about what they cost on uvloop this way.
    """

    def __init__(self) -> None:
        # Built is enough: KUP_NO_EXTENSIONS makes auto the Python data plane and uvloop, but
        # this loop serves either data plane.
        self.core_selector = CoreSelector(native.new_core())
        super().__init__(self.core_selector)
        self.core_selector.events_handler = self._on_core_events
        self.core_selector.io_handler = self._run_io

    def _first_timer(self) -> object:
        scheduled = self._scheduled  # type: ignore[attr-defined]
        return scheduled[0] if scheduled else None

    def _needs_turn(self, first_timer: object) -> bool:
        """Whether the wait must return to `_run_once`: callbacks are queued, or the earliest
        timer changed (one due sooner than the wait's timeout may have been set)."""
        return bool(self._ready) or self._first_timer() is not first_timer  # type: ignore[attr-defined]

    def _on_core_events(self, events: list[tuple[Any, ...]]) -> bool:
        """The native plane's handler, called from inside the wait."""
        first_timer = self._first_timer()
        try:
            self.core_selector.handler(events)
        except Exception as exc:
            self.call_exception_handler(
                {
                    "message": "native data plane: handling a batch of events failed",
                    "exception": exc,
                }
            )
        return self._needs_turn(first_timer)

    def _run_io(self, ready: list[tuple[int, int]]) -> bool:
        """Run the reader and writer callbacks of the ready descriptors now (asyncio's
        `_process_events`, then the handles' own `_run`, which reports what they raise to the
        loop's exception handler); whether the loop needs a turn."""
        first_timer = self._first_timer()
        keys = self.core_selector._by_fd  # the loop and its own selector
        for fd, mask in ready:
            key = keys.get(fd)
            if key is None:
                continue
            reader, writer = key.data
            if mask & selectors.EVENT_READ and reader is not None:
                if reader._cancelled:  # asyncio's own check
                    self._remove_reader(fd)  # type: ignore[attr-defined]
                else:
                    reader._run()
            if mask & selectors.EVENT_WRITE and writer is not None:
                key = keys.get(fd)  # the reader may have changed or closed it
                if key is None or key.data[1] is not writer:
                    continue
                if writer._cancelled:
                    self._remove_writer(fd)  # type: ignore[attr-defined]
                else:
                    writer._run()
        return self._needs_turn(first_timer)


def new_event_loop() -> CoreLoop:
    return CoreLoop()


def choose(event_loop: str, *, serves_native: bool, control: bool) -> Loop:
    """The loop a process runs for --event-loop `event_loop` (`serves_native`: this process
    serves the native data plane; `control`: it is the control process)."""
    if event_loop in ("auto", "native"):
        core = serves_native and not native.unavailable()
        if event_loop == "auto" and control:
            core = False
        return "native" if core else "uvloop"
    if event_loop not in ("uvloop", "asyncio"):
        raise ValueError(f"--event-loop {event_loop!r}: not one of {', '.join(EVENT_LOOPS)}")
    return "uvloop" if event_loop == "uvloop" else "asyncio"


def factory(loop: Loop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop factory for `asyncio.Runner` (None: asyncio's own)."""
    if loop == "native":
        return new_event_loop
    if loop == "uvloop":
        import uvloop  # noqa: PLC0415 - only the chosen loop is imported

        return uvloop.new_event_loop
    return None


DESCRIPTIONS: dict[str, str] = {
    "native": "asyncio waiting in the native core",
    "uvloop": "uvloop",
    "asyncio": "asyncio",
}
