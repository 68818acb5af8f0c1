"""TcpListener on 127.0.0.1 with real backends: forwarding, dialing, refusing, flow control."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
import resource
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kube_userspace_proxy.dataplane import ConnStats, TcpListener, proxyproto, sockets
from kube_userspace_proxy.dataplane.splice import PIPE_SIZE

# Every test here runs over both TCP data planes (tests/conftest.py `dataplane`).
pytestmark = pytest.mark.usefixtures("dataplane")

MiB = 1 << 20
BOTH_LOOPS = pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])
Backends = Callable[..., Awaitable[Any]]  # conftest.tcp_backends
Listeners = Callable[..., Awaitable[TcpListener]]
Eventually = Callable[..., Awaitable[None]]


def connections_alive() -> int:
    """The proxied connections' protocol objects still alive (with gc off: freed by
    reference counting, as the data plane means them to be)."""
    names = {"Connection", "BackendSide"}
    return sum(1 for o in gc.get_objects() if type(o).__name__ in names)


async def ask_name(port: int, host: str = "127.0.0.1") -> str:
    """One request through the proxy to a `name` backend: returns the backend's name."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"who?\n")
        await writer.drain()
        # Generous: under load 1,000 concurrent requests share two CPUs with everything else.
        line = await asyncio.wait_for(reader.readline(), 15)
        return line.decode().strip()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def exchange(port: int, payload: bytes, *, read_delay: float = 0.0) -> tuple[str, int]:
    """Send `payload` then half-close, while reading until EOF: (sha256 received, bytes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        view = memoryview(payload)
        for i in range(0, len(view), MiB):
            writer.write(view[i : i + MiB])
            await writer.drain()
        writer.write_eof()

    async def receive() -> tuple[str, int]:
        digest = hashlib.sha256()
        total = 0
        while data := await reader.read(256 * 1024):
            digest.update(data)
            total += len(data)
            if read_delay:
                await asyncio.sleep(read_delay)
        return digest.hexdigest(), total

    try:
        _, received = await asyncio.gather(send(), receive())
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return received


def connect_blocking(port: int, host: str = "127.0.0.1") -> None:
    with socket.create_connection((host, port), timeout=2):
        pass


# --- forwarding


@BOTH_LOOPS
@pytest.mark.parametrize("splice", [True, False], ids=["splice", "copy"])
async def test_16_mib_each_way_arrives_intact(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    splice: bool,
    round_robin: Any,
    eventually: Eventually,
) -> None:
    pattern = os.urandom(MiB)
    backend = await tcp_backends("bulk", bulk_size=16 * MiB, pattern=pattern)
    stats = ConnStats()
    listener = await tcp_listener(round_robin(backend.address), stats=stats, splice=splice)
    upload = os.urandom(16 * MiB)

    got_digest, got_size = await exchange(listener.port, upload)

    assert got_size == 16 * MiB
    assert got_digest == hashlib.sha256(pattern * 16).hexdigest()
    await eventually(lambda: len(backend.received_digests) == 1, what="backend digest")
    assert backend.received_digests == [hashlib.sha256(upload).hexdigest()]
    await eventually(lambda: stats.active == 0, what="connection closed")
    assert (stats.bytes_in, stats.bytes_out) == (16 * MiB, 16 * MiB)
    assert (stats.accepted, stats.completed) == (1, 1)
    if splice:
        assert stats.spliced >= 1
    else:
        assert stats.spliced == 0


@BOTH_LOOPS
async def test_half_close_reaches_backend_and_reply_still_arrives(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
) -> None:
    backend = await tcp_backends("echo", "echo-a")
    listener = await tcp_listener(round_robin(backend.address))
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    writer.write(b"hello")
    writer.write_eof()  # shutdown(SHUT_WR)
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    # The backend writes its trailer only after it saw EOF, so both halves worked.
    assert reply == b"hello<eof seen by echo-a>"


@BOTH_LOOPS
async def test_client_data_sent_before_the_backend_answers_is_forwarded(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
) -> None:
    backend = await tcp_backends("echo", "echo-a")
    listener = await tcp_listener(round_robin(backend.address))
    sock = socket.create_connection(("127.0.0.1", listener.port))
    sock.sendall(b"x" * 100_000)  # sent at once, while the proxy is still dialing
    sock.shutdown(socket.SHUT_WR)
    loop = asyncio.get_running_loop()
    received = await asyncio.wait_for(loop.run_in_executor(None, _read_all, sock), 5)
    sock.close()
    assert received == b"x" * 100_000 + b"<eof seen by echo-a>"


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    chunks = []
    while data := sock.recv(65536):
        chunks.append(data)
    return b"".join(chunks)


async def test_requests_are_spread_round_robin(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
) -> None:
    a = await tcp_backends("name", "a")
    b = await tcp_backends("name", "b")
    listener = await tcp_listener(round_robin(a.address, b.address))
    names = [await ask_name(listener.port) for _ in range(4)]
    assert sorted(names) == ["a", "a", "b", "b"]


async def test_ipv6_listener_forwards(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
) -> None:
    backend = await tcp_backends("name", "v6")
    try:
        listener = await tcp_listener(round_robin(backend.address), host="::1")
    except OSError as exc:  # pragma: no cover - a host without IPv6 loopback
        pytest.skip(f"no IPv6 loopback: {exc}")
    assert await ask_name(listener.port, "::1") == "v6"


async def test_transfer_falls_back_to_copying_when_splice_is_refused(
    tcp_backends: Backends,
) -> None:
    # The proxy runs in a child whose kernel refuses splice(2) (a seccomp filter answers
    # EINVAL, as a kernel or socket type without it would): tests/splice_refused.py.
    pattern = os.urandom(MiB)
    backend = await tcp_backends("bulk", bulk_size=8 * MiB, pattern=pattern)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.splice_refused",
        str(backend.address[1]),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        port = int(await asyncio.wait_for(child.stdout.readline(), 60))
        upload = os.urandom(8 * MiB)
        assert await exchange(port, upload) == (hashlib.sha256(pattern * 8).hexdigest(), 8 * MiB)
        child.stdin.close()
        counters = json.loads(await asyncio.wait_for(child.stdout.readline(), 60))
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
    assert counters["spliced"] >= 1  # it tried
    assert counters["splice"] is False  # and stopped trying


# --- dialing


@BOTH_LOOPS
async def test_refusing_endpoint_is_skipped_without_client_visible_error(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    refusing_endpoint: tuple[str, int],
    round_robin: Any,
) -> None:
    good = await tcp_backends("name", "good")
    picker = round_robin(refusing_endpoint, good.address)
    stats = ConnStats()
    listener = await tcp_listener(picker, stats=stats)
    names = [await ask_name(listener.port) for _ in range(4)]
    assert names == ["good"] * 4
    assert refusing_endpoint in picker.failed
    assert stats.dial_failures >= 1
    assert stats.failed == 0


@BOTH_LOOPS
async def test_all_endpoints_refusing_resets_the_client_quickly(
    tcp_listener: Listeners,
    refusing_endpoint: tuple[str, int],
    round_robin: Any,
) -> None:
    stats = ConnStats()
    listener = await tcp_listener(round_robin(refusing_endpoint), stats=stats)
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    started = time.monotonic()
    try:
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), 2)
    finally:
        writer.close()
    assert time.monotonic() - started < 1.0
    assert stats.failed == 1
    assert stats.dial_failures == 4  # every rung of the ladder was tried


async def test_all_endpoints_timing_out_fail_within_the_dial_ladder(
    tcp_listener: Listeners,
    blackhole_endpoint: tuple[str, int],
    round_robin: Any,
) -> None:
    stats = ConnStats()
    listener = await tcp_listener(round_robin(blackhole_endpoint), stats=stats)
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    started = time.monotonic()
    try:
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    elapsed = time.monotonic() - started
    assert 3.5 < elapsed < 5.0  # 0.25 + 0.5 + 1 + 2 s, plus slack
    assert (stats.dial_failures, stats.failed) == (4, 1)


async def test_a_slow_dial_does_not_block_other_accepts(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    blackhole_endpoint: tuple[str, int],
    round_robin: Any,
) -> None:
    good = await tcp_backends("name", "good")
    picker = round_robin(blackhole_endpoint, good.address)
    listener = await tcp_listener(picker, dial_timeouts=(10.0,))
    _stuck_reader, stuck_writer = await asyncio.open_connection("127.0.0.1", listener.port)
    started = time.monotonic()
    # The first connection's dial hangs for up to 10 s; this one goes straight to `good`.
    assert await ask_name(listener.port) == "good"
    assert time.monotonic() - started < 5
    assert listener.active_connections == 2  # the stuck one is still dialing
    stuck_writer.close()


# --- refusing while there are no endpoints


@BOTH_LOOPS
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
async def test_no_endpoints_refuses_connections_and_keeps_the_port(
    tcp_listener: Listeners,
    round_robin: Any,
    host: str,
) -> None:
    stats = ConnStats()
    try:
        listener = await tcp_listener(round_robin(), stats=stats, host=host)
    except OSError as exc:  # pragma: no cover - a host without IPv6 loopback
        pytest.skip(f"cannot bind {host}: {exc}")
    with pytest.raises(ConnectionRefusedError):
        connect_blocking(listener.port, host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for reuse in (False, True):
        intruder = socket.socket(family)
        if reuse:
            intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError, match="in use"):
            intruder.bind((host, listener.port))
        intruder.close()
    assert stats.accepted == 0
    assert not listener.accepting


@BOTH_LOOPS
async def test_endpoints_appearing_make_the_port_accept_again(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
    eventually: Eventually,
) -> None:
    backend = await tcp_backends("name", "late")
    picker = round_robin()
    listener = await tcp_listener(picker)
    with pytest.raises(ConnectionRefusedError):
        connect_blocking(listener.port)
    picker.endpoints.append(backend.address)
    listener.refresh()
    await eventually(lambda: listener.accepting, what="listening")
    assert await ask_name(listener.port) == "late"


@BOTH_LOOPS
async def test_port_listens_as_soon_as_refresh_returns(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
) -> None:
    backend = await tcp_backends("name", "late")
    picker = round_robin()
    listener = await tcp_listener(picker)
    picker.endpoints.append(backend.address)
    listener.refresh()
    # No await between refresh() and connect(): the loop has not run a single task since.
    sock = socket.create_connection(("127.0.0.1", listener.port), timeout=2)
    assert listener.accepting
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(b"who?\n")
    assert await asyncio.wait_for(reader.readline(), 5) == b"late\n"
    writer.close()


@BOTH_LOOPS
async def test_endpoints_flapping_within_one_iteration_end_in_the_last_state(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
    eventually: Eventually,
) -> None:
    backend = await tcp_backends("name", "a")
    picker = round_robin()
    listener = await tcp_listener(picker)
    picker.endpoints.append(backend.address)
    listener.refresh()
    picker.endpoints.clear()
    listener.refresh()
    with pytest.raises(ConnectionRefusedError):
        connect_blocking(listener.port)
    picker.endpoints.append(backend.address)
    listener.refresh()
    await asyncio.sleep(0)  # the task that hands the socket to the loop may run now
    picker.endpoints.clear()
    listener.refresh()
    picker.endpoints.append(backend.address)
    listener.refresh()
    names = [await ask_name(listener.port) for _ in range(3)]
    assert names == ["a"] * 3
    picker.endpoints.clear()
    listener.refresh()
    await eventually(lambda: not listener.accepting, what="refusing")
    with pytest.raises(ConnectionRefusedError):
        connect_blocking(listener.port)


class _Records(logging.Handler):
    """Keeps the records of one logger (the package logger may not propagate to the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_listener_holds_one_descriptor_whether_refusing_or_listening(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
    open_fds: Callable[[], int],
    eventually: Eventually,
) -> None:
    backend = await tcp_backends("name", "a")
    # A port served throughout: the data plane's own descriptors (the native one's epoll,
    # timer and wake-up, held while any listener of the loop is served) are not counted.
    keeper = await tcp_listener(round_robin(backend.address))
    assert await ask_name(keeper.port) == "a"
    before = open_fds()
    pickers = [round_robin() for _ in range(20)]
    listeners = [await tcp_listener(picker) for picker in pickers]
    assert open_fds() - before == 20  # refusing: the reservation only
    for picker, listener in zip(pickers, listeners, strict=True):
        picker.endpoints.append(backend.address)
        listener.refresh()
    await eventually(lambda: all(lst.accepting for lst in listeners), what="served")
    assert open_fds() - before == 20  # listening: the reservation is the listener
    assert await ask_name(listeners[0].port) == "a"
    for picker, listener in zip(pickers, listeners, strict=True):
        picker.endpoints.clear()
        listener.refresh()
    # Refusing again, every port still held (once the proxied connection has closed).
    await eventually(lambda: open_fds() - before == 20, what="one descriptor per port")
    with pytest.raises(ConnectionRefusedError):
        connect_blocking(listeners[0].port)
    with socket.socket() as stranger, pytest.raises(OSError):
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        stranger.bind(("127.0.0.1", listeners[1].port))


async def test_stopping_listening_needs_no_descriptor(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
) -> None:
    # The listener accepts from its own socket: refusing again is a shutdown(SHUT_RD) of it,
    # with no duplicate descriptor to keep the port, so it works out of descriptors too.
    backend = await tcp_backends("name", "a")
    picker = round_robin(backend.address)
    listener = await tcp_listener(picker)
    assert await ask_name(listener.port) == "a"
    picker.endpoints.clear()
    tcp_log = logging.getLogger(TcpListener.__module__)
    captured = _Records()
    tcp_log.addHandler(captured)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (0, hard))  # any new descriptor: EMFILE
        try:
            listener.refresh()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    finally:
        tcp_log.removeHandler(captured)
    assert not [r for r in captured.records if r.levelno >= logging.WARNING]
    assert not listener.accepting
    with pytest.raises(ConnectionRefusedError):
        connect_blocking(listener.port)


async def test_endpoints_disappearing_refuses_at_once(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
) -> None:
    backend = await tcp_backends("name", "a")
    picker = round_robin(backend.address)
    listener = await tcp_listener(picker)
    assert await ask_name(listener.port) == "a"
    picker.endpoints.clear()
    listener.refresh()
    with pytest.raises(ConnectionRefusedError):
        connect_blocking(listener.port)


async def test_endpoint_removed_mid_transfer_lets_that_transfer_complete(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
    eventually: Eventually,
) -> None:
    pattern = os.urandom(MiB)
    backend = await tcp_backends("bulk", bulk_size=8 * MiB, pattern=pattern)
    picker = round_robin(backend.address)
    listener = await tcp_listener(picker)
    transfer = asyncio.create_task(exchange(listener.port, b"u" * MiB, read_delay=0.01))
    await eventually(lambda: backend.connections == 1, what="backend connected")
    picker.endpoints.clear()
    listener.refresh()
    with pytest.raises(ConnectionRefusedError):
        connect_blocking(listener.port)
    digest, size = await asyncio.wait_for(transfer, 30)
    assert (digest, size) == (hashlib.sha256(pattern * 8).hexdigest(), 8 * MiB)


# --- flow control


@pytest.mark.parametrize("splice", [True, False], ids=["splice", "copy"])
async def test_slow_reader_keeps_proxy_buffers_bounded(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    splice: bool,
    round_robin: Any,
) -> None:
    pattern = os.urandom(MiB)
    backend = await tcp_backends("bulk", bulk_size=32 * MiB, pattern=pattern)
    high_water = 128 * 1024
    listener = await tcp_listener(
        round_robin(backend.address), high_water=high_water, splice=splice
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port, limit=16 * 1024)
    writer.write_eof()
    peak = 0
    received = 0
    digest = hashlib.sha256()
    while data := await reader.read(16 * 1024):
        received += len(data)
        digest.update(data)
        peak = max(peak, listener.buffered_bytes)
        if received < 4 * MiB:
            await asyncio.sleep(0.002)  # slow for the first MiBs: the backend must be paused
    writer.close()
    assert received == 32 * MiB
    assert digest.hexdigest() == hashlib.sha256(pattern * 32).hexdigest()
    if splice:  # at most one pipe of bytes in flight
        assert 0 < peak <= PIPE_SIZE
    else:  # one write buffer up to the high-water mark plus one read of at most 256 KiB
        assert 0 < peak <= high_water + 256 * 1024 + 64 * 1024


@BOTH_LOOPS
async def test_reset_by_the_backend_resets_the_client(
    tcp_listener: Listeners,
    round_robin: Any,
    eventually: Eventually,
) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    listener = await tcp_listener(round_robin(server.getsockname()))
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    loop = asyncio.get_running_loop()
    conn, _ = await asyncio.wait_for(loop.sock_accept(server), 5)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    conn.close()  # RST
    server.close()
    try:
        with pytest.raises(ConnectionResetError):  # a clean close would read b"" instead
            await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    await eventually(lambda: listener.active_connections == 0, what="connection gone")


@BOTH_LOOPS
async def test_reset_by_the_client_resets_the_backend_connection(
    tcp_listener: Listeners, round_robin: Any, eventually: Eventually
) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    listener = await tcp_listener(round_robin(server.getsockname()))
    _reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    loop = asyncio.get_running_loop()
    conn, _ = await asyncio.wait_for(loop.sock_accept(server), 5)
    server.close()
    try:
        writer.write(b"ping")
        assert await asyncio.wait_for(loop.sock_recv(conn, 16), 5) == b"ping"
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()  # close with linger 0: RST
        with pytest.raises(ConnectionResetError):  # a clean close would read b"" instead
            await asyncio.wait_for(loop.sock_recv(conn, 16), 5)
    finally:
        conn.close()
    await eventually(lambda: listener.active_connections == 0, what="proxy side closed")


# --- scale


async def test_1000_concurrent_connections_all_complete(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
    eventually: Eventually,
) -> None:
    a = await tcp_backends("name", "a")
    b = await tcp_backends("name", "b")
    stats = ConnStats()
    picker = round_robin(a.address, b.address)
    listener = await tcp_listener(picker, stats=stats)
    names = await asyncio.gather(*(ask_name(listener.port) for _ in range(1000)))
    assert names.count("a") + names.count("b") == 1000
    # Exactly even, except that a dial timing out on a loaded machine retries (another pick).
    assert abs(names.count("a") - names.count("b")) <= 2 * picker.retries
    await eventually(lambda: stats.active == 0, what="all connections closed")
    assert (stats.accepted, stats.completed, stats.failed) == (1000, 1000, 0)


# --- shutdown


@BOTH_LOOPS
async def test_close_lets_an_in_flight_transfer_finish(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
    eventually: Eventually,
) -> None:
    pattern = os.urandom(MiB)
    backend = await tcp_backends("bulk", bulk_size=8 * MiB, pattern=pattern)
    listener = await tcp_listener(round_robin(backend.address))
    port = listener.port
    transfer = asyncio.create_task(exchange(port, b"u" * MiB, read_delay=0.01))
    await eventually(lambda: backend.connections == 1, what="backend connected")
    await listener.close()
    with pytest.raises(ConnectionRefusedError):
        connect_blocking(port)
    assert await asyncio.wait_for(transfer, 30) == (
        hashlib.sha256(pattern * 8).hexdigest(),
        8 * MiB,
    )
    await asyncio.wait_for(listener.drain(5), 1)  # nothing left: returns at once
    probe = socket.socket()
    probe.bind(("127.0.0.1", port))  # the port is released
    probe.close()


async def test_drain_aborts_connections_still_open_after_the_timeout(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
) -> None:
    backend = await tcp_backends("echo")
    stats = ConnStats()
    listener = await tcp_listener(round_robin(backend.address), stats=stats)
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
    await listener.close()
    started = time.monotonic()
    await listener.drain(0.3)
    assert 0.25 < time.monotonic() - started < 1.0
    try:  # shutting down is not an error: a clean EOF, not a reset
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        writer.close()
    assert stats.active == 0


async def test_no_descriptors_leak_after_connections_close(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
    eventually: Eventually,
    open_fds: Callable[[], int],
) -> None:
    pattern = os.urandom(MiB)
    backend = await tcp_backends("bulk", bulk_size=4 * MiB, pattern=pattern)
    listener = await tcp_listener(round_robin(backend.address))
    await exchange(listener.port, os.urandom(4 * MiB))  # warm up: pipe pool, loop internals
    before = open_fds()
    for _ in range(5):
        await exchange(listener.port, os.urandom(4 * MiB))
    await eventually(lambda: listener.active_connections == 0, what="connections closed")
    await eventually(lambda: backend.open_connections == 0, what="backend side closed")
    assert open_fds() <= before


@BOTH_LOOPS
@pytest.mark.parametrize("version", [1, 2])
async def test_proxy_protocol_header_comes_before_the_first_byte(
    tcp_backends: Backends, tcp_listener: Listeners, round_robin: Any, version: int
) -> None:
    backend = await tcp_backends("echo", "echo-a")
    picker = round_robin(backend.address)
    picker.proxy_protocol = version
    stats = ConnStats()
    listener = await tcp_listener(picker, stats=stats)
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    client = writer.get_extra_info("sockname")[:2]
    writer.write(b"hello")
    writer.write_eof()
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    # Not NATed: the destination is the proxy port itself.
    head = proxyproto.header(version, client, ("127.0.0.1", listener.port))
    assert reply == head + b"hello<eof seen by echo-a>"
    assert stats.bytes_in == len(b"hello")  # the header is not the client's payload


async def test_a_pinned_reservation_is_served_as_it_is_and_keeps_its_port(
    tcp_backends: Backends, round_robin: Any, eventually: Eventually
) -> None:
    backend = await tcp_backends("name", "pod")
    # A worker's socket: the port asked for explicitly, SO_REUSEPORT from the start.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    picker = round_robin(backend.address)
    listener = TcpListener(sock, picker, ConnStats(), pinned=True)
    try:
        await listener.start()
        assert listener.fileno() == sock.fileno()  # no second socket made
        assert await ask_name(port) == "pod"
        picker.endpoints.clear()
        listener.refresh()  # no endpoints: refused, and the port stays this listener's
        with pytest.raises(ConnectionRefusedError):
            connect_blocking(port)
        with socket.socket() as intruder, pytest.raises(OSError, match="in use"):
            intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            intruder.bind(("127.0.0.1", port))
        picker.endpoints.append(backend.address)
        listener.refresh()
        await eventually(lambda: listener.accepting, what="listening")
        assert await ask_name(port) == "pod"
    finally:
        await listener.close()
        await listener.drain(1.0)


@BOTH_LOOPS
async def test_finished_connections_are_freed_without_the_cyclic_collector(
    tcp_backends: Backends, tcp_listener: Listeners, round_robin: Any, eventually: Eventually
) -> None:
    """Each side of a proxied connection refers to the other; once both are closed nothing
    may be left for the cyclic collector (whose passes over thousands of dead connections
    stall the loop): every ending (client closes, backend resets, client resets) frees both
    sides by reference counting alone."""
    backend = await tcp_backends("name", "a")
    listener = await tcp_listener(round_robin(backend.address), keepalive=0)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    resetting = await tcp_listener(round_robin(server.getsockname()), keepalive=0)
    loop = asyncio.get_running_loop()
    linger = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # SO_LINGER on, 0 s: close() sends RST

    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            assert await ask_name(listener.port) == "a"
        for by_client in (False, True) * 5:
            reader, writer = await asyncio.open_connection("127.0.0.1", resetting.port)
            conn, _ = await asyncio.wait_for(loop.sock_accept(server), 5)
            if by_client:
                writer.transport.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, linger
                )
                writer.transport.abort()
            else:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            conn.close()
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(reader.read(), 5)
            writer.close()
        await eventually(
            lambda: listener.active_connections == resetting.active_connections == 0,
            what="connections gone",
        )
        await asyncio.sleep(0.05)  # the transports' last callbacks
        assert connections_alive() == 0
    finally:
        gc.enable()
        server.close()


@BOTH_LOOPS
async def test_finished_connections_are_freed_before_their_keepalive_batch_is_due(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
    eventually: Eventually,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dialed sockets get keepalive in a batch, KEEPALIVE_DELAY after their dial; a connection
    that ends before that is freed as it ends, not held by the batch until it is due (the
    memory of thousands of such connections a second stayed in pieces)."""
    monkeypatch.setattr(sockets, "KEEPALIVE_DELAY", 60.0)  # due after the test
    backend = await tcp_backends("name", "a")
    listener = await tcp_listener(round_robin(backend.address))

    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            assert await ask_name(listener.port) == "a"
        await eventually(lambda: listener.active_connections == 0, what="connections gone")
        await asyncio.sleep(0.05)  # the transports' last callbacks
        assert connections_alive() == 0
    finally:
        gc.enable()


async def test_counters_given_by_a_function_are_made_at_the_first_connection(
    tcp_backends: Backends, round_robin: Any, eventually: Eventually
) -> None:
    backend = await tcp_backends("name", "pod")
    made: list[str] = []
    counters = ConnStats()

    def counters_of(name: str) -> ConnStats:
        made.append(name)
        return counters

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    listener = TcpListener(sock, round_robin(backend.address), counters_of, name="ns/web:http")
    try:
        await listener.start()
        assert listener.accepting and made == []  # listening: no counters yet
        assert await ask_name(listener.port) == "pod"
        assert await ask_name(listener.port) == "pod"
        assert made == ["ns/web:http"]
        assert listener.stats is counters
        await eventually(lambda: counters.completed == 2, what="both connections counted")
        assert counters.accepted == 2
    finally:
        await listener.close()
        await listener.drain(1.0)
