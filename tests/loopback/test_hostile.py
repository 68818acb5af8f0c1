"""Hostile traffic against one listener, over both TCP data planes: RST storms, floods of
connections that are held open or half-closed and never read, and 1-byte writes. Through all
of it a well-behaved client is served, and afterwards every connection, buffer and descriptor
is given back. (Slow readers, resets one at a time and descriptor exhaustion have their own
tests in test_tcp.py and test_descriptors.py; a worker killed under load in test_workers.py.)

These also run against the native data plane built with ASan and UBSan (scripts/dev sanitize).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kube_userspace_proxy.dataplane import ConnStats, TcpListener

# Every test here runs over both TCP data planes (tests/conftest.py `dataplane`).
pytestmark = pytest.mark.usefixtures("dataplane")

Backends = Callable[..., Awaitable[Any]]
Listeners = Callable[..., Awaitable[TcpListener]]
Eventually = Callable[..., Awaitable[None]]

STORM = 300
FLOOD = 300
BATCH = 50


async def _connect(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


async def _ask_name(port: int) -> str:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
    try:
        writer.write(b"who\n")
        return (await asyncio.wait_for(reader.readline(), 30)).decode().strip()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0) instead of a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def _storm_one(port: int, payload: bytes) -> None:
    loop = asyncio.get_running_loop()
    try:
        sock = await _connect(port)
    except OSError:
        return  # the backlog overflowed: the kernel's answer, not the proxy's
    with contextlib.suppress(OSError):
        await loop.sock_sendall(sock, payload)
    _reset(sock)


async def _settled(listener: TcpListener, eventually: Eventually) -> None:
    await eventually(lambda: listener.active_connections == 0, what="every connection ended")
    await eventually(lambda: listener.buffered_bytes == 0, what="every buffer given back")


async def test_an_rst_storm_leaves_nothing_behind_and_others_are_served(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
    eventually: Eventually,
    open_fds: Callable[[], int],
) -> None:
    backend = await tcp_backends("name", "a")
    stats = ConnStats()
    listener = await tcp_listener(round_robin(backend.address), stats=stats)
    assert await _ask_name(listener.port) == "a"  # warm up: the data plane's own descriptors
    before = open_fds()
    # Clients that reset at once, some with nothing sent, some mid-request, some after more
    # than one read's worth: before, during and after the proxy's dial.
    payloads = [b"", b"wh", b"x" * 100_000]
    for start in range(0, STORM, BATCH):
        await asyncio.gather(
            *(_storm_one(listener.port, payloads[i % 3]) for i in range(start, start + BATCH))
        )
        assert await _ask_name(listener.port) == "a"  # served in the middle of the storm
    await _settled(listener, eventually)
    await eventually(lambda: backend.open_connections == 0, what="the backend's side closed")
    await eventually(lambda: open_fds() <= before, what="every descriptor given back")
    assert stats.accepted >= BATCH  # the storm did reach the proxy


@pytest.mark.parametrize("how", ["held", "half-closed"])
async def test_a_flood_of_silent_connections_is_served_and_then_freed(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
    eventually: Eventually,
    *,
    open_fds: Callable[[], int],
    how: str,
) -> None:
    # Clients that connect and then say nothing and read nothing (held), or send their FIN at
    # once and never read what comes back (half-closed).
    backend = await tcp_backends("name", "a")
    listener = await tcp_listener(round_robin(backend.address))
    assert await _ask_name(listener.port) == "a"
    before = open_fds()
    flood: list[socket.socket] = []
    try:
        for _ in range(0, FLOOD, BATCH):
            flood += await asyncio.gather(*(_connect(listener.port) for _ in range(BATCH)))
        if how == "half-closed":
            for sock in flood:
                sock.shutdown(socket.SHUT_WR)
        else:
            await eventually(
                lambda: backend.open_connections >= FLOOD, what="the flood to reach the backend"
            )
        # Every one of them holds a connection, and the proxy still answers a good client.
        for _ in range(5):
            assert await _ask_name(listener.port) == "a"
    finally:
        for sock in flood:
            _reset(sock) if how == "half-closed" else sock.close()
    await _settled(listener, eventually)
    await eventually(lambda: backend.open_connections == 0, what="the backend's side closed")
    await eventually(lambda: open_fds() <= before, what="every descriptor given back")


async def test_one_byte_writes_arrive_whole_and_in_order(
    tcp_backends: Backends,
    tcp_listener: Listeners,
    round_robin: Any,
    eventually: Eventually,
) -> None:
    backend = await tcp_backends("echo", "e")
    listener = await tcp_listener(round_robin(backend.address))
    loop = asyncio.get_running_loop()
    sock = await _connect(listener.port)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sent = bytes(range(256)) * 16  # 4 KiB, one byte per segment

    async def send() -> None:
        for i in range(len(sent)):
            await loop.sock_sendall(sock, sent[i : i + 1])
            if i % 64 == 0:
                await asyncio.sleep(0)  # let the proxy see them one or a few at a time
        sock.shutdown(socket.SHUT_WR)

    async def receive() -> bytes:
        chunks = []
        while chunk := await loop.sock_recv(sock, 65536):
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        _, got = await asyncio.wait_for(asyncio.gather(send(), receive()), 120)
    finally:
        sock.close()
    assert got == sent + b"<eof seen by e>"
    assert backend.received_bytes == len(sent)
    await _settled(listener, eventually)
