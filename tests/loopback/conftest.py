"""Real loopback backends for the data-plane tests, a test picker, and loop selection.

Every data-plane test runs on uvloop and, unless it runs the Python TCP data plane (which no
`--event-loop` puts there), on the loop that waits in the native core (`coreloop`: what
`--event-loop auto` gives a worker serving the native data plane; UDP runs there too); tests
marked
`pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])` run on plain asyncio too
(all of them with KUP_BOTH_LOOPS=1 in the environment).
tests/loopback is not a package, so helpers reach the tests as fixtures.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import uvloop

from kube_userspace_proxy.balancer import EndpointTally
from kube_userspace_proxy.dataplane import ConnStats, TcpListener, UdpListener, coreloop
from tests import polling

DATAPLANE_FILES = {"test_tcp.py", "test_udp.py", "test_handover_paths.py"}
LOOPS: Mapping[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop,
    "asyncio": asyncio.new_event_loop,
}
SERVING_LOOPS: Mapping[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop,
    "coreloop": coreloop.new_event_loop,
}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Any]:
    """uvloop for the data-plane tests (plus asyncio where a test asks); the default elsewhere."""
    if item.path.name not in DATAPLANE_FILES:
        return {"asyncio": asyncio.new_event_loop}
    marker = item.get_closest_marker("asyncio")
    loops = dict(SERVING_LOOPS)
    if os.environ.get("KUP_BOTH_LOOPS") or (
        marker is not None and marker.kwargs.get("loop_factories")
    ):
        loops["asyncio"] = asyncio.new_event_loop
    return loops


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """No Python-TCP-data-plane test runs on the core's loop: no `--event-loop` runs that loop
    where the Python data plane serves (auto and native choose it only where the native one
    does), so that pairing is left out as never generated, not skipped."""
    kept: list[pytest.Item] = []
    left_out: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec is not None else {}
        on_core = params.get("_asyncio_loop_factory") is coreloop.new_event_loop
        (left_out if on_core and params.get("dataplane") == "python" else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


async def _eventually(
    check: Callable[[], bool], *, timeout: float = 30.0, what: str = "condition"
) -> None:
    """Poll `check` until it is true; fail after `timeout` seconds (never less than the
    suite's floor: tests/polling.py)."""
    await polling.eventually(check, what, timeout, interval=0.005)


@pytest.fixture
def eventually() -> Callable[..., Awaitable[None]]:
    """`await eventually(check, timeout=30, what="...")`: poll until true or fail."""
    return _eventually


@pytest.fixture
def round_robin() -> type[RoundRobin]:
    """The test picker class: `round_robin(("127.0.0.1", port), ...)`."""
    return RoundRobin


class RoundRobin:
    """A test picker: round robin over a list the test controls; records failed dials."""

    def __init__(self, *endpoints: tuple[str, int]) -> None:
        self.endpoints = list(endpoints)
        self.failed: list[tuple[str, int]] = []
        # Every dial's outcome as the data plane reported it: (address, DialOutcome value).
        self.outcomes: list[tuple[tuple[str, int], int]] = []
        self.retries = 0
        self._next = 0
        self.proxy_protocol = 0
        self.source = None
        self.picked = EndpointTally()

    def pick(self, client_ip: str, *, retry: bool = False) -> tuple[str, int] | None:
        if retry:
            self.retries += 1
        if not self.endpoints:
            return None
        endpoint = self.endpoints[self._next % len(self.endpoints)]
        self._next += 1
        return endpoint

    def dial_failed(self, address: tuple[str, int], outcome: int = 1) -> None:
        self.failed.append(address)
        self.outcomes.append((address, outcome))

    def dial_succeeded(self, address: tuple[str, int]) -> None:
        self.outcomes.append((address, 0))

    def __bool__(self) -> bool:
        return bool(self.endpoints)

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        return tuple(self.endpoints)


# --- TCP backends


@dataclass
class TcpBackend:
    """A real TCP server on 127.0.0.1: `name` (answers its name), `echo`, or `bulk`.

    bulk: sends `bulk_size` bytes of `pattern` then EOF, and records the sha256 of everything
    it received once the client half-closes.
    """

    mode: str
    name: str
    bulk_size: int = 0
    pattern: bytes = b""
    server: asyncio.Server | None = None
    connections: int = 0
    open_connections: int = 0
    received_digests: list[str] = field(default_factory=list)
    received_bytes: int = 0

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return host, port

    async def start(self, port: int = 0) -> None:
        self.server = await asyncio.start_server(
            self._serve, "127.0.0.1", port, backlog=4096, reuse_address=True
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_connections += 1
        try:
            if self.mode == "name":
                await reader.readline()
                writer.write(self.name.encode() + b"\n")
                await writer.drain()
                await reader.read()  # until the client closes
            elif self.mode == "echo":
                while data := await reader.read(65536):
                    self.received_bytes += len(data)
                    writer.write(data)
                    await writer.drain()
                writer.write(b"<eof seen by " + self.name.encode() + b">")
                writer.write_eof()
                await writer.drain()
            elif self.mode == "bulk":
                await asyncio.gather(self._send_bulk(writer), self._hash_input(reader))
        except (ConnectionError, OSError):
            pass
        finally:
            self.open_connections -= 1
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _send_bulk(self, writer: asyncio.StreamWriter) -> None:
        view = memoryview(self.pattern)
        left = self.bulk_size
        while left > 0:
            chunk = view[: min(left, len(view))]
            writer.write(chunk)
            left -= len(chunk)
            await writer.drain()
        writer.write_eof()

    async def _hash_input(self, reader: asyncio.StreamReader) -> None:
        digest = hashlib.sha256()
        while data := await reader.read(1 << 20):
            self.received_bytes += len(data)
            digest.update(data)
        self.received_digests.append(digest.hexdigest())

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def tcp_backends() -> AsyncIterator[Callable[..., Awaitable[TcpBackend]]]:
    """Factory: `await tcp_backends("name", "a")` starts a backend; all stop at teardown."""
    started: list[TcpBackend] = []

    async def start(mode: str, name: str = "", **kwargs: Any) -> TcpBackend:
        backend = TcpBackend(mode, name or f"{mode}{len(started)}", **kwargs)
        await backend.start()
        started.append(backend)
        return backend

    yield start
    for backend in started:
        if backend.server is not None:
            backend.server.close()


@pytest.fixture
def refusing_endpoint() -> Iterator[tuple[str, int]]:
    """An address whose port is bound but not listening: connecting gets ECONNREFUSED."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()
    sock.close()


@pytest.fixture
def blackhole_endpoint() -> Iterator[tuple[str, int]]:
    """An address whose SYNs are dropped (full accept queue): dialing it times out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    address = listener.getsockname()
    fillers = []
    for _ in range(3):  # fills the backlog; the kernel then drops further SYNs
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(address)
        fillers.append(filler)
    time.sleep(0.05)
    yield address
    for filler in fillers:
        filler.close()
    listener.close()


# --- UDP backends


class UdpEcho(asyncio.DatagramProtocol):
    """Echoes each datagram prefixed with its name and `|`; counts what it saw."""

    def __init__(self, name: str) -> None:
        self.name = name.encode()
        self.transport: asyncio.DatagramTransport | None = None
        self.datagrams = 0
        self.peers: set[tuple[str, int]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's UDPTransport does not subclass asyncio.DatagramTransport.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.datagrams += 1
        self.peers.add(addr)
        assert self.transport is not None
        self.transport.sendto(self.name + b"|" + data, addr)

    @property
    def address(self) -> tuple[str, int]:
        assert self.transport is not None
        host, port = self.transport.get_extra_info("sockname")[:2]
        return host, port


def big_udp_socket(family: socket.AddressFamily = socket.AF_INET) -> socket.socket:
    """A UDP socket with buffers for 64 KiB datagrams."""
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    return sock


@pytest.fixture
async def udp_backends() -> AsyncIterator[Callable[[str], Awaitable[UdpEcho]]]:
    """Factory: `await udp_backends("a")` starts a UDP echo backend on 127.0.0.1."""
    started: list[UdpEcho] = []
    loop = asyncio.get_running_loop()

    async def start(name: str) -> UdpEcho:
        sock = big_udp_socket()
        sock.bind(("127.0.0.1", 0))
        _, proto = await loop.create_datagram_endpoint(lambda: UdpEcho(name), sock=sock)
        started.append(proto)
        return proto

    yield start
    for proto in started:
        if proto.transport is not None:
            proto.transport.close()


# --- listeners under test


def bound_socket(kind: int, host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """What PortAllocator hands out: bound, non-blocking, SO_REUSEADDR for TCP, not listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, kind)
    if kind == socket.SOCK_STREAM:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


@pytest.fixture
async def tcp_listener() -> AsyncIterator[Callable[..., Awaitable[TcpListener]]]:
    """Factory: a started TcpListener on 127.0.0.1 (kernel-chosen port); closed, drained after."""
    made: list[TcpListener] = []

    async def make(picker: Any, *, host: str = "127.0.0.1", **kwargs: Any) -> TcpListener:
        kwargs.setdefault("stats", ConnStats())
        listener = TcpListener(bound_socket(socket.SOCK_STREAM, host), picker, **kwargs)
        await listener.start()
        made.append(listener)
        return listener

    yield make
    for listener in made:
        await listener.close()
        await listener.drain(1.0)


@pytest.fixture
async def udp_listener() -> AsyncIterator[Callable[..., Awaitable[UdpListener]]]:
    """Factory: a started UdpListener on 127.0.0.1; closed after."""
    made: list[UdpListener] = []

    async def make(picker: Any, *, host: str = "127.0.0.1", **kwargs: Any) -> UdpListener:
        kwargs.setdefault("stats", ConnStats())
        listener = UdpListener(bound_socket(socket.SOCK_DGRAM, host), picker, **kwargs)
        await listener.start()
        made.append(listener)
        return listener

    yield make
    for listener in made:
        await listener.close()


@pytest.fixture
def open_fds() -> Callable[[], int]:
    """Counts the descriptors open in this process (leak checks)."""
    return lambda: len(os.listdir("/proc/self/fd"))
