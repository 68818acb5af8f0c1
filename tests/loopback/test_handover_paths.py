"""The pieces of a handover on 127.0.0.1: passing sockets (`fdpass`), adopting a listening
socket (`TcpListener(adopt=True)`) and releasing one (`release()`) without disturbing it.

A descriptor duplicated in the same process stands for one received from another: both name
the same socket, as SCM_RIGHTS makes them.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kube_userspace_proxy import fdpass
from kube_userspace_proxy.dataplane import ConnStats, TcpListener, UdpListener
from kube_userspace_proxy.dataplane.tcp import is_listening

# Every test here runs over both TCP data planes (tests/conftest.py `dataplane`).
pytestmark = pytest.mark.usefixtures("dataplane")

BOTH_LOOPS = pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])


def _twin(fd: int) -> socket.socket:
    """The socket behind `fd`, through a descriptor of its own (as if handed over)."""
    return socket.socket(fileno=os.dup(fd))


async def _name_through(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"who?\n")
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()


@BOTH_LOOPS
async def test_more_sockets_than_one_message_carries_arrive_in_batches() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sent = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(300)]
    try:
        for sock in sent:
            sock.bind(("127.0.0.1", 0))
        for end in (ours, theirs):
            end.setblocking(False)
        names = [s.getsockname() for s in sent]
        long_text = "x" * (3 * fdpass.CHUNK)  # a message longer than one packet

        async def give() -> None:
            for batch in fdpass.batches(sent):
                await fdpass.send(
                    ours, {"n": len(batch), "pad": long_text}, [s.fileno() for s in batch]
                )
            await fdpass.send(ours, {"done": True})

        async def take() -> list[socket.socket]:
            got: list[socket.socket] = []
            while True:
                message, socks = await fdpass.receive(theirs)
                if "done" in message:
                    return got
                assert message["n"] == len(socks) <= fdpass.MAX_FDS
                assert message["pad"] == long_text
                got.extend(socks)

        _, received = await asyncio.gather(give(), take())
        assert [s.getsockname() for s in received] == names
        assert fdpass.check_peer(theirs) == os.getpid()
        for sock in received:
            sock.close()
    finally:
        ours.close()
        theirs.close()
        for sock in sent:
            sock.close()


@BOTH_LOOPS
async def test_an_adopted_listening_socket_keeps_its_backlog_and_the_old_owner_releases_it(
    tcp_backends: Any, round_robin: Any
) -> None:
    backend = await tcp_backends("name", "a")
    picker = round_robin(backend.address)
    old = TcpListener(_bound(), picker, ConnStats(), name="old")
    await old.start()
    port = old.port
    assert await _name_through(port) == b"a\n"
    held_reader, held_writer = await asyncio.open_connection("127.0.0.1", port)
    twin = _twin(old.fileno())
    await old.release()  # nobody accepts now: new connections wait in the backlog
    assert is_listening(twin), "release() must not stop the socket listening"
    waiting = [asyncio.create_task(_name_through(port)) for _ in range(5)]
    await asyncio.sleep(0.2)
    assert not any(task.done() for task in waiting)
    new = TcpListener(twin, picker, ConnStats(), name="new", adopt=True)
    await new.start()
    assert new.accepting and new.port == port
    assert await asyncio.gather(*waiting) == [b"a\n"] * 5  # none refused, none reset
    # The connection the old owner accepted goes on (it drains it).
    held_writer.write(b"still there?\n")
    assert await asyncio.wait_for(held_reader.readline(), 10) == b"a\n"
    held_writer.close()
    await old.drain(5)
    assert old.active_connections == 0
    await new.close()


@BOTH_LOOPS
async def test_an_adopted_listener_without_endpoints_refuses(
    tcp_backends: Any, round_robin: Any
) -> None:
    backend = await tcp_backends("name", "a")
    old = TcpListener(_bound(), round_robin(backend.address), ConnStats())
    await old.start()
    twin = _twin(old.fileno())
    await old.release()
    new = TcpListener(twin, round_robin(), ConnStats(), adopt=True)
    await new.start()
    assert not new.accepting
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", new.port)
    await new.close()


@BOTH_LOOPS
async def test_a_released_udp_port_hands_new_clients_over_and_old_sessions_still_get_replies(
    udp_backends: Callable[[str], Awaitable[Any]], round_robin: Any
) -> None:
    backend = await udp_backends("a")
    old_stats, new_stats = ConnStats(), ConnStats()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    old = UdpListener(sock, round_robin(backend.address), old_stats, idle_timeout=5.0)
    await old.start()
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.settimeout(5)
    try:
        client.sendto(b"one", ("127.0.0.1", old.port))
        assert await asyncio.to_thread(client.recv, 100) == b"a|one"
        session = next(iter(old.sessions.values()))
        twin = _twin(old.fileno())
        await old.release()
        new = UdpListener(twin, round_robin(backend.address), new_stats, idle_timeout=5.0)
        await new.start()
        # A reply on the old process's session still leaves from the service port.
        session.sock.send(b"late")
        data, source = await asyncio.to_thread(client.recvfrom, 100)
        assert (data, source[1]) == (b"a|late", old.port)
        # The client's next datagram reaches the new owner.
        client.sendto(b"two", ("127.0.0.1", old.port))
        assert await asyncio.to_thread(client.recv, 100) == b"a|two"
        assert new_stats.udp_datagrams_in == 1 and old_stats.udp_datagrams_in == 1
        await old.drain(0.1)
        assert not old.sessions
        await new.close()
    finally:
        client.close()


@BOTH_LOOPS
async def test_a_reply_read_while_the_udp_port_is_released_still_leaves(round_robin: Any) -> None:
    # The transport drops what it is given from close() on, before its connection_lost: a
    # reply read in that window was lost (one datagram in a few hundred across restarts).
    backend = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    backend.bind(("127.0.0.1", 0))
    backend.settimeout(5)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    twin = _twin(sock.fileno())  # the new owner's descriptor keeps the port open
    old = UdpListener(sock, round_robin(backend.getsockname()), ConnStats(), idle_timeout=5.0)
    await old.start()
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.settimeout(5)
    try:
        client.sendto(b"q", ("127.0.0.1", old.port))
        query, session = await asyncio.to_thread(backend.recvfrom, 100)
        # The answer waits in the session's socket as the release begins: no turn of the
        # loop between the two, so the session reads it while the port's transport closes.
        backend.sendto(b"answer:" + query, session)
        await old.release()
        assert await asyncio.to_thread(client.recv, 100) == b"answer:q"
        await old.drain(0.1)
    finally:
        for end in (client, backend, twin):
            end.close()


def _bound() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock
