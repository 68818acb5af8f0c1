"""UdpListener on 127.0.0.1 with real UDP echo backends: sessions, expiry, big datagrams."""

from __future__ import annotations

import asyncio
import resource
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest

from kube_userspace_proxy.dataplane import ConnStats, UdpListener

BOTH_LOOPS = pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])
Backends = Callable[[str], Awaitable[Any]]  # conftest.udp_backends -> UdpEcho
Listeners = Callable[..., Awaitable[UdpListener]]
Eventually = Callable[..., Awaitable[None]]


class Client(asyncio.DatagramProtocol):
    """A UDP client that queues what it receives, with the sender's address."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[tuple[bytes, tuple[str, int]]] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's UDPTransport does not subclass asyncio.DatagramTransport.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.inbox.put_nowait((data, addr))

    def send(self, data: bytes, port: int, host: str = "127.0.0.1") -> None:
        assert self.transport is not None
        self.transport.sendto(data, (host, port))

    async def receive(self, timeout: float = 30.0) -> tuple[bytes, tuple[str, int]]:
        return await asyncio.wait_for(self.inbox.get(), timeout)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


@pytest.fixture
async def clients() -> Any:
    """Factory: `await clients()` opens a UDP client socket (64 KiB-ready) on 127.0.0.1."""
    loop = asyncio.get_running_loop()
    made: list[Client] = []

    async def make(host: str = "127.0.0.1") -> Client:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        sock.bind((host, 0))
        _, client = await loop.create_datagram_endpoint(Client, sock=sock)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@BOTH_LOOPS
async def test_echo_round_trip_replies_from_the_service_port(
    udp_backends: Backends, udp_listener: Listeners, clients: Any, round_robin: Any
) -> None:
    backend = await udp_backends("a")
    stats = ConnStats()
    listener = await udp_listener(round_robin(backend.address), stats=stats)
    client = await clients()
    client.send(b"hello", listener.port)
    data, sender = await client.receive()
    assert data == b"a|hello"
    assert sender[:2] == ("127.0.0.1", listener.port)
    assert (stats.udp_datagrams_in, stats.udp_datagrams_out) == (1, 1)
    assert (stats.bytes_in, stats.bytes_out) == (5, 7)


@BOTH_LOOPS
async def test_60_kib_datagram_round_trip(
    udp_backends: Backends, udp_listener: Listeners, clients: Any, round_robin: Any
) -> None:
    backend = await udp_backends("a")
    listener = await udp_listener(round_robin(backend.address))
    client = await clients()
    payload = bytes(range(256)) * 240  # 60 KiB
    client.send(payload, listener.port)
    data, _ = await client.receive()
    assert data == b"a|" + payload


@BOTH_LOOPS
async def test_session_expires_after_idle_timeout(
    udp_backends: Backends,
    udp_listener: Listeners,
    clients: Any,
    round_robin: Any,
    eventually: Eventually,
) -> None:
    backend = await udp_backends("a")
    stats = ConnStats()
    listener = await udp_listener(round_robin(backend.address), stats=stats)
    client = await clients()
    client.send(b"x", listener.port)
    await client.receive()
    last_packet = time.monotonic()
    assert listener.active_connections == stats.udp_sessions_active == 1
    await eventually(lambda: listener.active_connections == 0, timeout=30, what="expiry")
    assert time.monotonic() - last_packet >= 0.2  # default idle timeout 0.25 s
    assert (stats.udp_sessions_active, stats.udp_sessions_total) == (0, 1)


async def test_traffic_keeps_a_session_alive_past_the_idle_timeout(
    udp_backends: Backends,
    udp_listener: Listeners,
    clients: Any,
    round_robin: Any,
) -> None:
    backend = await udp_backends("a")
    stats = ConnStats()
    listener = await udp_listener(round_robin(backend.address), stats=stats, idle_timeout=0.5)
    client = await clients()
    for _ in range(10):  # 10 x 0.1 s > 0.5 s, one session throughout
        client.send(b"x", listener.port)
        await client.receive()
        await asyncio.sleep(0.1)
    assert stats.udp_sessions_total == 1
    assert len(backend.peers) == 1


async def test_each_client_address_gets_its_own_session(
    udp_backends: Backends, udp_listener: Listeners, clients: Any, round_robin: Any
) -> None:
    a = await udp_backends("a")
    b = await udp_backends("b")
    listener = await udp_listener(round_robin(a.address, b.address))
    first, second = await clients(), await clients()
    first.send(b"1", listener.port)
    assert (await first.receive())[0] == b"a|1"
    second.send(b"2", listener.port)
    assert (await second.receive())[0] == b"b|2"
    first.send(b"3", listener.port)  # sticks to its session's endpoint
    assert (await first.receive())[0] == b"a|3"
    assert listener.active_connections == 2


@BOTH_LOOPS
async def test_busy_client_moves_off_a_removed_endpoint_after_refresh(
    udp_backends: Backends,
    udp_listener: Listeners,
    clients: Any,
    round_robin: Any,
) -> None:
    a = await udp_backends("a")
    b = await udp_backends("b")
    picker = round_robin(a.address)
    listener = await udp_listener(picker, idle_timeout=0.25)
    client = await clients()
    client.send(b"1", listener.port)
    assert (await client.receive())[0] == b"a|1"
    picker.endpoints[:] = [b.address]  # endpoint a removed
    listener.refresh()
    seen_by_a = a.datagrams
    # The client sends every 50 ms, well inside the idle timeout: only refresh() can move it.
    replies = []
    for i in range(20):
        client.send(b"%d" % i, listener.port)
        replies.append((await client.receive())[0])
        await asyncio.sleep(0.05)
    assert replies == [b"b|%d" % i for i in range(20)]
    assert a.datagrams == seen_by_a


@BOTH_LOOPS
async def test_no_endpoints_drops_and_counts(
    udp_listener: Listeners, clients: Any, round_robin: Any, eventually: Eventually
) -> None:
    stats = ConnStats()
    listener = await udp_listener(round_robin(), stats=stats)
    client = await clients()
    client.send(b"x", listener.port)
    await eventually(lambda: stats.udp_datagrams_in == 1, what="datagram seen")
    # Counted once, under its own reason (udp_refused_total), not again as a drop.
    assert (stats.udp_dropped, stats.refused_no_endpoints) == (0, 1)
    assert listener.active_connections == 0
    assert client.inbox.empty()


async def test_full_client_table_drops_new_clients(
    udp_backends: Backends,
    udp_listener: Listeners,
    clients: Any,
    round_robin: Any,
    eventually: Eventually,
) -> None:
    backend = await udp_backends("a")
    stats = ConnStats()
    # Sessions idle less than a fifth of the idle timeout (6 s here) keep their places.
    listener = await udp_listener(
        round_robin(backend.address), stats=stats, max_sessions=2, idle_timeout=30
    )
    admitted = [await clients(), await clients()]
    for client in admitted:
        client.send(b"x", listener.port)
        await client.receive()
    late = await clients()
    late.send(b"x", listener.port)
    await eventually(lambda: stats.udp_dropped == 1, what="drop counted")
    assert stats.udp_dropped_table_full == 1
    assert listener.active_connections == 2
    assert late.inbox.empty()


async def test_full_table_gives_the_longest_idle_session_to_a_new_client(
    udp_backends: Backends,
    udp_listener: Listeners,
    clients: Any,
    round_robin: Any,
    eventually: Eventually,
) -> None:
    backend = await udp_backends("a")
    stats = ConnStats()
    # Idle timeout 1 s: a session idle 0.2 s may give its place away when the table is full.
    listener = await udp_listener(
        round_robin(backend.address), stats=stats, max_sessions=2, idle_timeout=1.0
    )
    quiet, busy = await clients(), await clients()
    for client in (quiet, busy):
        client.send(b"x", listener.port)
        await client.receive()
    for _ in range(4):  # quiet goes quiet, busy keeps talking
        await asyncio.sleep(0.1)
        busy.send(b"y", listener.port)
        await busy.receive()
    late = await clients()
    late.send(b"z", listener.port)
    assert (await late.receive())[0] == b"a|z"
    assert (stats.udp_sessions_evicted, stats.udp_dropped) == (1, 0)
    assert listener.active_connections == 2
    busy.send(b"w", listener.port)  # the busy client kept its session
    assert (await busy.receive())[0] == b"a|w"
    assert stats.udp_sessions_total == 3


async def test_a_flood_of_new_clients_on_one_port_does_not_starve_another(
    udp_backends: Backends,
    udp_listener: Listeners,
    clients: Any,
    round_robin: Any,
) -> None:
    backend = await udp_backends("a")
    flooded_stats, quiet_stats = ConnStats(), ConnStats()
    flooded = await udp_listener(round_robin(backend.address), stats=flooded_stats, max_sessions=64)
    quiet = await udp_listener(round_robin(backend.address), stats=quiet_stats)
    regular = await clients()
    answered = 0
    # DNS-like: 2,000 queries, each from a new source port, interleaved with a regular
    # client's queries on the other port (bounded: 40 rounds of 50).
    for round_ in range(40):
        for _ in range(50):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as one_shot:
                one_shot.sendto(b"q", ("127.0.0.1", flooded.port))
        regular.send(f"r{round_}".encode(), quiet.port)
        data, _ = await regular.receive()
        answered += data == f"a|r{round_}".encode()
        await asyncio.sleep(0.02)  # about 2,500 new clients a second
    assert answered == 40
    assert flooded.active_connections <= 64
    # Sessions idle 50 ms (a fifth of the idle timeout) made room for new clients.
    assert flooded_stats.udp_sessions_evicted > 0
    assert flooded_stats.udp_sessions_total > 64
    assert quiet_stats.udp_dropped == 0


def test_one_port_holds_at_most_an_eighth_of_the_descriptor_limit(round_robin: Any) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (800, hard))
        listener = UdpListener(sock, round_robin(), ConnStats())
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        sock.close()
    # 800 descriptors: a flooded port may hold 100 sessions, the rest stay for other ports.
    assert listener.max_sessions == 100


async def test_endpoint_without_a_server_is_replaced_on_the_next_datagram(
    udp_backends: Backends,
    udp_listener: Listeners,
    clients: Any,
    round_robin: Any,
    eventually: Eventually,
) -> None:
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    dead = closed.getsockname()
    closed.close()  # nothing listens there: the kernel answers ICMP port unreachable
    good = await udp_backends("good")
    picker = round_robin(dead, good.address)
    listener = await udp_listener(picker)
    client = await clients()
    reply = None
    deadline = time.monotonic() + 5
    while reply is None and time.monotonic() < deadline:
        client.send(b"x", listener.port)
        try:
            reply = await client.receive(timeout=0.1)
        except TimeoutError:
            continue
    assert reply is not None
    assert reply[0] == b"good|x"
    assert dead in picker.failed


async def test_ipv6_service_port_forwards(
    udp_backends: Backends, udp_listener: Listeners, clients: Any, round_robin: Any
) -> None:
    backend = await udp_backends("v6")
    try:
        listener = await udp_listener(round_robin(backend.address), host="::1")
    except OSError as exc:  # pragma: no cover - a host without IPv6 loopback
        pytest.skip(f"no IPv6 loopback: {exc}")
    client = await clients("::1")
    client.send(b"hi", listener.port, "::1")
    data, sender = await client.receive()
    assert data == b"v6|hi"
    assert sender[1] == listener.port


async def test_close_ends_sessions_and_releases_the_port(
    udp_backends: Backends, udp_listener: Listeners, clients: Any, round_robin: Any
) -> None:
    backend = await udp_backends("a")
    stats = ConnStats()
    listener = await udp_listener(round_robin(backend.address), stats=stats)
    client = await clients()
    client.send(b"x", listener.port)
    await client.receive()
    await listener.close()
    assert listener.active_connections == stats.udp_sessions_active == 0
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", listener.port))
    probe.close()
