"""UDP listener: one connected backend socket per client address, expired when idle.

The service port is a datagram transport; each client address gets a raw non-blocking
socket connected to its endpoint, read with `loop.add_reader` (no task, no transport per
session). Replies leave from the service port with `transport.sendto(data, client)`.

Sized for DNS-like load (many clients, each query from a new source port): a port holds up
to `max_sessions` (16,384) sessions, but never more than an eighth of this process's
descriptor limit, so that a flood on one port leaves descriptors to every other port. When
the table is full, a new client takes the place of the session that has been idle longest,
if it has been idle for a fifth of the idle timeout (50 ms by default: a DNS answer came
back long before); only when every session is busier than that is the new client dropped
(counted as `udp_dropped_table_full`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
from typing import Any, Protocol

from kube_userspace_proxy import logs
from kube_userspace_proxy.dataplane.stats import NO_DESCRIPTORS, ConnStats, Picker, Tally, notices
from kube_userspace_proxy.dataplane.transparent import (
    chooser_for,
    count_source,
    transparent_socket,
)
from kube_userspace_proxy.model import DialOutcome

log = logs.get(__name__)

IDLE_TIMEOUT = 0.25
MAX_SESSIONS = 16384
# A full table looks at this many of its oldest sessions for one idle enough to replace.
_EVICT_LOOK = 4
# Room for a few 64 KiB datagrams per socket (the kernel caps it at net.core.[rw]mem_max).
SOCKET_BUFFER = 4 * 1024 * 1024
_MAX_DATAGRAM = 65536
# Datagrams read per readiness callback before yielding to other sessions.
_BURST = 16


def session_cap(max_sessions: int) -> int:
    """`max_sessions`, but at most an eighth of this process's descriptor limit (at least 64).

    Each session is a descriptor: one flooded port must not take them all from the others.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_sessions
    return max(1, min(max_sessions, max(64, soft // 8)))


def _size_buffers(sock: socket.socket) -> None:
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError as exc:  # pragma: no cover - only a hardened kernel refuses this
            log.debug("cannot size UDP socket buffers: %s", exc)


class _Session:
    """One client address and its connected backend socket."""

    __slots__ = ("backend", "client", "ep", "fd", "last", "lst", "sock", "timer")

    def __init__(
        self,
        lst: UdpListener,
        client: Any,
        backend: tuple[str, int],
        sock: socket.socket,
        ep: Tally,
    ) -> None:
        self.lst = lst
        self.ep = ep  # the endpoint's counters
        ep.active += 1
        ep.total += 1
        self.client = client
        self.backend = backend
        self.sock = sock
        self.fd = sock.fileno()
        self.last = lst.loop.time()
        self.timer = lst.loop.call_at(self.last + lst.idle_timeout, self._check_idle)
        lst.loop.add_reader(self.fd, self._readable)

    def send(self, data: bytes) -> None:
        self.last = self.lst.loop.time()
        stats = self.lst.stats
        try:
            self.sock.send(data)
        except BlockingIOError:  # backend socket buffer full: UDP may drop
            stats.udp_dropped_send_failed += 1
            return
        except OSError as exc:  # e.g. ECONNREFUSED reported by an earlier ICMP error
            stats.udp_dropped_send_failed += 1
            self._failed(exc)
            return
        stats.bytes_in += len(data)
        self.ep.bytes_in += len(data)

    def _readable(self) -> None:
        lst = self.lst
        transport = lst.transport
        stats = lst.stats
        recv = self.sock.recv
        for _ in range(_BURST):
            try:
                data = recv(_MAX_DATAGRAM)
            except BlockingIOError:
                return
            except OSError as exc:
                self._failed(exc)
                return
            self.last = lst.loop.time()
            if transport is None:
                continue
            transport.sendto(data, self.client)
            stats.udp_datagrams_out += 1
            stats.bytes_out += len(data)
            self.ep.bytes_out += len(data)

    def _failed(self, exc: OSError) -> None:
        # The endpoint rejected us (ICMP port unreachable): let the next datagram pick anew.
        log.debug("%s: session %s -> %s failed: %r", self.lst.name, self.client, self.backend, exc)
        self.lst.stats.dial_failures += 1
        self.lst.picker.dial_failed(self.backend, DialOutcome.REFUSED)
        self.close()

    def _check_idle(self) -> None:
        deadline = self.last + self.lst.idle_timeout
        if self.lst.loop.time() >= deadline:
            self.close()
        else:
            self.timer = self.lst.loop.call_at(deadline, self._check_idle)

    def close(self) -> None:
        lst = self.lst
        if lst.sessions.pop(self.client, None) is None:
            return
        self.timer.cancel()
        lst.loop.remove_reader(self.fd)
        self.sock.close()
        lst.stats.udp_sessions_active -= 1
        self.ep.active -= 1


class _Sender(Protocol):
    """Where sessions' replies leave: the service port's transport, or `_Replies`."""

    def sendto(self, data: bytes, addr: Any, /) -> None: ...


class _Replies:
    """Replies of the sessions still open after the service port was handed over.

    Sent from a duplicate of the port's descriptor, so that the new owner alone reads the
    port while replies already on their way still reach their clients.
    """

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def sendto(self, data: bytes, addr: Any, /) -> None:
        with contextlib.suppress(OSError):  # a full buffer: UDP may drop
            self.sock.sendto(data, addr)


class _ServicePort(asyncio.DatagramProtocol):
    def __init__(self, lst: UdpListener) -> None:
        self.lst = lst
        self.closed: asyncio.Future[None] = lst.loop.create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.lst.received(data, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("%s: %r", self.lst.name, exc)


class UdpListener:
    """Serves one UDP proxy port; replies leave from the service port.

    `sock` is a bound UDP socket (IPv4 or IPv6); the listener owns it. A datagram from a new
    client address opens a session while there is room (`max_sessions`); sessions expire
    `idle_timeout` seconds after their last datagram in either direction.
    """

    def __init__(
        self,
        sock: socket.socket,
        picker: Picker,
        stats: ConnStats,
        *,
        name: str = "",
        idle_timeout: float = IDLE_TIMEOUT,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        if sock.type != socket.SOCK_DGRAM:
            raise ValueError(f"UdpListener needs a UDP socket, got {sock!r}")
        sock.setblocking(False)
        _size_buffers(sock)
        self._sock: socket.socket | None = sock
        self._address = sock.getsockname()
        self.picker = picker
        self.stats = stats
        self.name = name or f"udp:{self._address[1]}"
        self.idle_timeout = idle_timeout
        self.max_sessions = session_cap(max_sessions)
        # A session idle this long may give its place to a new client when the table is full.
        self.evict_after = idle_timeout / 5
        self.sessions: dict[Any, _Session] = {}
        self.transport: _Sender | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self._replies: _Replies | None = None
        self._protocol: _ServicePort | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "UdpListener.start() was not called"
        return self._loop

    async def start(self) -> None:
        """Begin receiving on the service port."""
        self._loop = asyncio.get_running_loop()
        assert self._sock is not None
        protocol = self._protocol = _ServicePort(self)
        self.transport = self._transport = (
            await self._loop.create_datagram_endpoint(lambda: protocol, sock=self._sock)
        )[0]
        if hasattr(self._transport, "max_size"):
            # asyncio's transport reads into a new 256 KiB object per datagram (past malloc's
            # mmap threshold: an mmap and munmap each); no UDP datagram is larger than this.
            self._transport.max_size = _MAX_DATAGRAM

    def set_picker(self, picker: Picker) -> None:
        """Use another picker for new sessions, then `refresh()`."""
        self.picker = picker
        self.refresh()

    def refresh(self) -> None:
        """After an endpoint update: end the sessions whose endpoint is no longer usable.

        A client that sends more often than the idle timeout would otherwise keep its
        session, and the removed endpoint, forever; its next datagram picks a live endpoint.
        Without endpoints datagrams are dropped (and counted).
        """
        if not self.sessions:
            return
        usable = set(self.picker.addresses)
        for session in [s for s in self.sessions.values() if s.backend not in usable]:
            session.close()

    def received(self, data: bytes, client: Any) -> None:
        """A datagram from `client` on the service port."""
        stats = self.stats
        stats.udp_datagrams_in += 1
        session = self.sessions.get(client)
        if session is None:
            session = self._open(client)
            if session is None:
                return
        session.send(data)

    def _open(self, client: Any) -> _Session | None:
        """A session for a new client, or None (the datagram is dropped and counted)."""
        stats = self.stats
        if len(self.sessions) >= self.max_sessions and not self._evict():
            stats.udp_dropped_table_full += 1
            return None
        backend = self.picker.pick(client[0])
        ep = self.picker.picked
        if backend is None:
            stats.refused_no_endpoints += 1
            return None
        family = socket.AF_INET6 if ":" in backend[0] else socket.AF_INET
        source = self.picker.source
        reason, bind_ip = 0, ""
        if source is not None:
            reason, bind_ip = chooser_for(source).choose(client[0], backend[0], ep.local)
        try:
            if reason:
                sock = transparent_socket(socket.SOCK_DGRAM, bind_ip)
            else:
                sock = socket.socket(family, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        except OSError as exc:
            if exc.errno not in NO_DESCRIPTORS:
                if not reason:
                    raise
                # EPERM (no CAP_NET_ADMIN) or an address the kernel refuses: the endpoint
                # is not at fault, and the proxy says so at start (prerequisites).
                stats.udp_dropped_send_failed += 1
                log.debug("%s: cannot open a transparent socket: %r", self.name, exc)
                return None
            # Out of descriptors: this process's fault, not the endpoint's.
            stats.no_descriptors += 1
            stats.udp_dropped_no_descriptors += 1
            notices.no_descriptors(self.name, "UDP session", exc)
            return None
        try:
            _size_buffers(sock)
            sock.connect(backend)
        except OSError as exc:
            sock.close()
            stats.udp_dropped_send_failed += 1
            stats.dial_failures += 1
            self.picker.dial_failed(backend, DialOutcome.UNREACHABLE)
            log.debug("%s: cannot open a socket to %s: %r", self.name, backend, exc)
            return None
        session = _Session(self, client, backend, sock, ep)
        self.sessions[client] = session
        self.stats.udp_sessions_active += 1
        self.stats.udp_sessions_total += 1
        if source is not None:
            count_source(stats, reason)
        return session

    def _evict(self) -> bool:
        """End the longest-idle of the oldest sessions if it is idle enough; True if one went.

        Sessions are in the order they were opened; a busy one among the oldest moves to the
        end, so the next look starts from sessions that may have gone quiet.
        """
        sessions = self.sessions
        oldest_ok = self.loop.time() - self.evict_after
        for _ in range(min(_EVICT_LOOK, len(sessions))):
            client = next(iter(sessions))
            session = sessions[client]
            if session.last <= oldest_ok:
                session.close()
                self.stats.udp_sessions_evicted += 1
                return True
            sessions[client] = sessions.pop(client)  # busy: to the back of the line
        return False

    async def close(self) -> None:
        """Stop receiving, end every session and release the port."""
        for session in list(self.sessions.values()):
            session.close()
        await self._close_port()
        self._close_replies()

    async def _close_port(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()
            assert self._protocol is not None
            await self._protocol.closed  # this descriptor is closed
        elif self._sock is not None:
            self._sock.close()
        self._sock = None

    def _close_replies(self) -> None:
        self.transport = None
        if self._replies is not None:
            self._replies.sock.close()
            self._replies = None

    async def release(self) -> None:
        """Stop reading the port and close this process's descriptor only (the process it
        was handed over to reads it now). Open sessions go on until idle: replies from their
        endpoints still leave from the port; a client's next datagram reaches the new owner."""
        if self._transport is not None and self.sessions:
            # The transport closes its descriptor: replies leave through a duplicate.
            self._replies = _Replies(socket.socket(fileno=os.dup(self.fileno())))
            self._replies.sock.setblocking(False)
        # Before the transport closes: from close() on it drops what it is given (uvloop and
        # asyncio alike), and a reply read before its connection_lost was lost.
        self.transport = self._replies
        await self._close_port()

    def fileno(self) -> int:
        """The descriptor of the service port (to hand it over); -1 once closed."""
        return self._sock.fileno() if self._sock is not None else -1

    async def drain(self, timeout: float) -> None:  # noqa: ASYNC109 - the contract's shape
        """Closed: returns at once. Released: gives open sessions up to `timeout` seconds to
        go idle, then ends the rest."""
        if self._replies is not None:
            deadline = self.loop.time() + timeout
            while self.sessions and self.loop.time() < deadline:  # noqa: ASYNC110 - idle expiry
                await asyncio.sleep(min(self.idle_timeout, 0.1))
        for session in list(self.sessions.values()):
            session.close()
        self._close_replies()

    @property
    def address(self) -> tuple[Any, ...]:
        """The bound address (host, port[, flowinfo, scope_id])."""
        return tuple(self._address)

    @property
    def port(self) -> int:
        return int(self._address[1])

    @property
    def active_connections(self) -> int:
        """Open sessions (client addresses with a backend socket)."""
        return len(self.sessions)
