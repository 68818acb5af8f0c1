"""The event loop that waits in the native core (`dataplane/coreloop.py`, what `--event-loop
auto` runs where the native data plane serves): asyncio's loop over `CoreSelector`.

The data-plane suites (test_tcp.py, test_udp.py, test_handover_paths.py) run on this loop
too; these tests check the loop itself through real descriptors: timers, Python's own
descriptors, signals and wake-ups from other threads while the core waits, the selector's
bookkeeping, and `Core.select`/`watch_fd`'s argument checks.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from kube_userspace_proxy.dataplane import ConnStats, TcpListener, coreloop, native
from tests import polling

pytestmark = pytest.mark.skipif(
    native.unavailable().startswith("the C extension"), reason="the C extension is not built"
)

T = TypeVar("T")


def run(main: Callable[[], Awaitable[T]]) -> T:
    with asyncio.Runner(loop_factory=coreloop.new_event_loop) as runner:
        return runner.run(main())  # type: ignore[arg-type]


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def test_native_loop_runs_timers_in_order_and_never_early() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, coreloop.CoreLoop)
        fired: list[tuple[str, float]] = []
        done = loop.create_future()
        start = loop.time()
        loop.call_later(0.12, lambda: fired.append(("late", loop.time() - start)))
        loop.call_later(0.03, lambda: fired.append(("early", loop.time() - start)))
        loop.call_later(0.2, done.set_result, None)
        await asyncio.wait_for(done, polling.bound(30))
        return fired

    fired = run(main)
    assert [name for name, _ in fired] == ["early", "late"]
    # asyncio fires a timer within its clock resolution of the due time, never before.
    assert fired[0][1] >= 0.03 - 0.001
    assert fired[1][1] >= 0.12 - 0.001


def test_native_loop_watches_python_descriptors(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair

    async def main() -> None:
        loop = asyncio.get_running_loop()
        got: list[bytes] = []
        arrived = asyncio.Event()

        def readable() -> None:
            got.append(b.recv(100))
            arrived.set()

        loop.add_reader(b.fileno(), readable)
        a.send(b"one")
        await asyncio.wait_for(arrived.wait(), polling.bound(30))
        assert got == [b"one"]
        # Level-triggered, as the stdlib's selectors: unread bytes keep calling.
        calls = 0

        def count() -> None:
            nonlocal calls
            calls += 1

        loop.remove_reader(b.fileno())
        loop.add_reader(b.fileno(), count)
        a.send(b"two")
        await polling.eventually(lambda: calls >= 3, "a reader called again for unread bytes")
        # Removed: no more calls, though the bytes are still there.
        loop.remove_reader(b.fileno())
        seen = calls
        await asyncio.sleep(0.2)
        assert calls == seen
        assert b.recv(100) == b"two"
        writable = loop.create_future()
        loop.add_writer(a.fileno(), lambda: writable.done() or writable.set_result(True))
        assert await asyncio.wait_for(writable, polling.bound(30))
        loop.remove_writer(a.fileno())

    run(main)


async def _fires_before_the_wait_times_out(fired: asyncio.Future[float]) -> None:
    """`fired` gets the loop time its timer (due 0.05 s after it was set, inside the wait)
    ran at; the only other timer is wait_for's, so the wait's timeout is that one's. A timer
    kept waiting fires with it, `wait` seconds on; one on time, long before."""
    loop = asyncio.get_running_loop()
    wait = polling.bound(30)
    start = loop.time()
    ran_at = await asyncio.wait_for(fired, 2 * wait)
    assert ran_at - start < wait / 2, f"the timer ran {ran_at - start:.1f} s after the wait began"


def test_a_timer_set_from_inside_the_wait_is_not_kept_waiting(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A reader callback runs inside the core's wait, which was given the timeout of the
    earliest timer then (here the 60 s bound below): a sooner timer it sets must end the wait,
    not fire when that timeout passes (then wait_for would fail first)."""
    a, b = pair

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fired: asyncio.Future[float] = loop.create_future()

        def readable() -> None:
            b.recv(100)
            loop.remove_reader(b.fileno())
            loop.call_later(0.05, lambda: fired.set_result(loop.time()))

        loop.add_reader(b.fileno(), readable)
        threading.Timer(0.1, a.send, (b"x",)).start()
        await _fires_before_the_wait_times_out(fired)

    run(main)


def test_native_loop_wakes_for_a_signal_while_the_core_waits() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        got = loop.create_future()
        loop.add_signal_handler(signal.SIGUSR1, lambda: got.done() or got.set_result(True))
        try:
            # Nothing else is due: the core waits with no timeout but the bound below.
            timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1))
            timer.start()
            assert await asyncio.wait_for(got, polling.bound(60))
            timer.join()
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)

    run(main)


def test_native_loop_wakes_for_another_threads_callback_and_executor() -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        got = loop.create_future()
        timer = threading.Timer(0.1, loop.call_soon_threadsafe, (got.set_result, 7))
        timer.start()
        value: int = await asyncio.wait_for(got, polling.bound(60))
        timer.join()
        return value + await loop.run_in_executor(None, sum, [1, 2])

    assert run(main) == 10


def test_a_native_listener_on_this_loop_uses_the_loops_core_unnested() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, coreloop.CoreLoop)
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        picker = _Picker(server.sockets[0].getsockname()[:2])
        listener = TcpListener(sock, picker, ConnStats(), dataplane="native")
        await listener.start()
        try:
            plane = native.for_loop(loop)
            core = loop.core_selector.core
            assert plane.owned and plane.core is core
            # The core's epoll descriptor is not watched by the loop: there is one wait.
            assert core.fileno() not in {key.fd for key in loop.core_selector.get_map().values()}
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(b"ping")
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(4), polling.bound(30)) == b"ping"
            writer.close()
            await writer.wait_closed()
            await polling.eventually(
                lambda: listener.stats.completed == 1, "the proxied connection counted"
            )
            await polling.eventually(lambda: not _echoing, "the echo server's connection ended")
        finally:
            await listener.close()
            server.close()
            await server.wait_closed()

    run(main)


def test_a_timer_set_by_the_native_planes_handler_is_not_kept_waiting() -> None:
    """The same from the native plane's handler, which runs inside the wait too (a pick that
    sets a timer, as the pause after EMFILE does). Nothing else on this loop wakes it: the
    client connects from another thread, the endpoint is a listening socket nobody accepts
    from (the kernel completes the handshake)."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with socket.create_server(("127.0.0.1", 0)) as endpoint, socket.socket() as client:
            fired: asyncio.Future[float] = loop.create_future()
            picker = _Picker(endpoint.getsockname()[:2])
            picker.on_pick = lambda: loop.call_later(0.05, lambda: fired.set_result(loop.time()))
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            listener = TcpListener(sock, picker, ConnStats(), dataplane="native")
            await listener.start()
            try:
                connect = threading.Timer(0.1, client.connect, (("127.0.0.1", listener.port),))
                connect.start()
                await _fires_before_the_wait_times_out(fired)
                connect.join()
            finally:
                await listener.close()
                await listener.drain(0)

    run(main)


_echoing: set[asyncio.StreamWriter] = set()


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    _echoing.add(writer)
    try:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()
        await writer.wait_closed()
        _echoing.discard(writer)


class _Picker:
    """One endpoint, always; records nothing (the balancer is tested elsewhere)."""

    proxy_protocol = 0
    source = None

    def __init__(self, address: tuple[str, int]) -> None:
        from kube_userspace_proxy.balancer import EndpointTally

        self.address = address
        self.picked = EndpointTally()
        self.on_pick: Callable[[], object] = lambda: None

    def pick(self, client_ip: str, *, retry: bool = False) -> tuple[str, int] | None:
        self.on_pick()
        return self.address

    def dial_failed(self, address: tuple[str, int], outcome: int = 1) -> None:
        pass

    def dial_succeeded(self, address: tuple[str, int]) -> None:
        pass


def test_core_selector_keeps_the_selectors_contract(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    sel = coreloop.CoreSelector(native.new_core())
    try:
        key = sel.register(a, selectors.EVENT_READ, "data")
        assert (key.fileobj, key.fd, key.events, key.data) == (a, a.fileno(), 1, "data")
        assert sel.get_key(a) is key and sel.get_map()[a.fileno()] is key
        assert list(sel.get_map()) == [a] and len(sel.get_map()) == 1
        with pytest.raises(KeyError):
            sel.register(a.fileno(), selectors.EVENT_WRITE)
        with pytest.raises(ValueError, match="Invalid events"):
            sel.register(b, 0)
        with pytest.raises(KeyError):
            sel.unregister(b)
        assert sel.select(0) == []
        b.send(b"x")
        assert sel.select(polling.bound(30)) == [(key, selectors.EVENT_READ)]
        key = sel.modify(a, selectors.EVENT_READ | selectors.EVENT_WRITE, "more")
        assert key.data == "more"
        events = dict(sel.select(polling.bound(30)))
        assert events == {key: selectors.EVENT_READ | selectors.EVENT_WRITE}
        assert sel.unregister(a) is key
        assert sel.select(0) == []
        # A descriptor closed before it was unregistered: epoll forgot it, and so does this.
        c, d = socket.socketpair()
        with d:
            fd = c.fileno()
            sel.register(fd, selectors.EVENT_READ)
            c.close()
            assert sel.unregister(fd).fd == fd
            assert len(sel.get_map()) == 0
    finally:
        sel.close()


def test_core_select_and_watch_fd_check_their_arguments() -> None:
    core: Any = native.new_core()
    try:
        with pytest.raises(TypeError):
            core.select("1", lambda events: False)
        with pytest.raises(TypeError):
            core.select(0, 5)
        with pytest.raises(TypeError):
            core.select(0)
        with pytest.raises(ValueError, match="watch_fd"):
            core.watch_fd(-1, 1, True)
        with pytest.raises(ValueError, match="watch_fd"):
            core.watch_fd(core.fileno(), 1, True)
        with socket.socket() as s:
            with pytest.raises(ValueError, match="watch_fd"):
                core.watch_fd(s.fileno(), 4, True)
            core.watch_fd(s.fileno(), 1, True)
            with pytest.raises(FileExistsError):
                core.watch_fd(s.fileno(), 1, True)
            core.watch_fd(s.fileno(), 0, False)
            with pytest.raises(FileNotFoundError):
                core.watch_fd(s.fileno(), 0, False)
        assert core.select(0, lambda events: False) == []
    finally:
        core.close()
    with pytest.raises(RuntimeError, match="closed"):
        core.select(0, lambda events: False)


@pytest.mark.parametrize(
    ("event_loop", "serves_native", "control", "runs"),
    [
        ("auto", True, False, "native"),  # a worker serving the native data plane
        ("auto", True, True, "uvloop"),  # the control process, serving too (--workers 1)
        ("auto", False, False, "uvloop"),  # a worker serving the Python data plane
        ("auto", False, True, "uvloop"),
        ("native", True, True, "native"),  # asked for: the one process waits in the core too
        ("native", True, False, "native"),
        ("native", False, True, "uvloop"),  # nothing native serves here
        ("uvloop", True, False, "uvloop"),  # the core nested in uvloop, as before
        ("asyncio", True, False, "asyncio"),
    ],
)
def test_which_loop_each_process_runs(
    event_loop: str, serves_native: bool, control: bool, runs: str
) -> None:
    chosen = coreloop.choose(event_loop, serves_native=serves_native, control=control)
    assert chosen == runs
    factory = coreloop.factory(chosen)
    loop = factory() if factory is not None else asyncio.new_event_loop()
    try:
        assert isinstance(loop, coreloop.CoreLoop) == (runs == "native")
    finally:
        loop.close()


def test_an_unknown_event_loop_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--event-loop 'tokio': not one of auto, native"):
        coreloop.choose("tokio", serves_native=True, control=False)
