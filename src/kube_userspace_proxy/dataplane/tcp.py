"""TCP listener: accept, dial with a timeout ladder, splice both ways with flow control.

Per connection there are two small Protocol objects (client side, backend side) and one task
(the dial: `loop.create_connection` is a coroutine). Bytes are copied by `data_received` ->
`write` with high-water marks pausing the other side; a direction whose reads keep coming back
large switches to zero-copy `os.splice` (see splice.py).

Refusing: while the picker has no endpoints there is no listening socket. The socket handed
in stays bound, not listening, with SO_REUSEPORT, so it keeps the port reserved; when
endpoints exist a second SO_REUSEPORT socket bound to the same address listens. A SYN to a
port whose reuseport group has no listener gets a RST: the client sees ECONNREFUSED.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections import deque
from typing import Any

from kube_userspace_proxy import logs
from kube_userspace_proxy.dataplane import splice as splicing
from kube_userspace_proxy.dataplane.stats import ConnStats, Picker

log = logs.get(__name__)

DIAL_TIMEOUTS = (0.25, 0.5, 1.0, 2.0)
# A direction switches to splice after this many consecutive reads of at least this size.
SPLICE_MIN_READ = 64 * 1024
SPLICE_AFTER_READS = 4


class _Backend(asyncio.Protocol):
    """The backend side of a connection: forwards to the client side it belongs to."""

    __slots__ = ("client", "transport", "write_paused")

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.transport: Any = None
        self.write_paused = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(self.client.lst.high_water, self.client.lst.low_water)

    def data_received(self, data: bytes) -> None:
        c = self.client
        c.lst.stats.bytes_out += len(data)
        c.transport.write(data)
        if c.splicing and len(data) >= SPLICE_MIN_READ:
            c.big_out += 1
            if c.big_out >= SPLICE_AFTER_READS and not c.transport.get_write_buffer_size():
                c.splice_out()
        else:
            c.big_out = 0

    def eof_received(self) -> bool:
        c = self.client
        c.out_done = True
        if c.in_done:
            c.finish()  # close() sends the FIN after the buffered bytes: no shutdown() needed
        elif c.transport.can_write_eof():
            c.transport.write_eof()
        return True

    def pause_writing(self) -> None:
        self.write_paused = True
        self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        c = self.client
        if c.pump_in is None and not c.transport.is_closing():
            c.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        c = self.client
        if c.backend is self and not c.transport.is_closing():
            if exc is None and c.out_done and c.in_done:
                c.transport.close()
            else:
                c.abort()


class _Client(asyncio.Protocol):
    """The client side of a connection; owns the connection's state."""

    __slots__ = (
        "backend",
        "big_in",
        "big_out",
        "dial",
        "fds",
        "in_done",
        "lst",
        "out_done",
        "pending",
        "pending_size",
        "pump_in",
        "pump_out",
        "splicing",
        "timed_out",
        "transport",
    )

    def __init__(self, lst: TcpListener) -> None:
        self.lst = lst
        self.transport: Any = None
        self.backend: _Backend | None = None
        self.pending: deque[bytes] | None = deque()
        self.pending_size = 0
        self.in_done = False  # client -> backend finished (EOF passed on)
        self.out_done = False  # backend -> client finished
        self.dial: asyncio.Task[None] | None = None
        self.timed_out = False
        self.splicing = lst.splice
        self.big_in = 0
        self.big_out = 0
        self.pump_in: splicing.SplicePump | None = None
        self.pump_out: splicing.SplicePump | None = None
        self.fds: tuple[int, int] | None = None

    # --- client transport callbacks

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        lst = self.lst
        lst.stats.accepted += 1
        lst.stats.active += 1
        lst.conns.add(self)
        transport.set_write_buffer_limits(lst.high_water, lst.low_water)
        self.dial = lst.loop.create_task(self._dial(transport.get_extra_info("peername")[0]))

    def data_received(self, data: bytes) -> None:
        b = self.backend
        if b is None:
            pending = self.pending
            if pending is None:  # dialing failed; the connection is being torn down
                return
            pending.append(data)
            self.pending_size += len(data)
            if self.pending_size >= self.lst.high_water:
                self.transport.pause_reading()
            return
        self.lst.stats.bytes_in += len(data)
        b.transport.write(data)
        if self.splicing and len(data) >= SPLICE_MIN_READ:
            self.big_in += 1
            if self.big_in >= SPLICE_AFTER_READS and not b.transport.get_write_buffer_size():
                self.splice_in()
        else:
            self.big_in = 0

    def eof_received(self) -> bool:
        self.in_done = True
        b = self.backend
        if b is not None:
            if self.out_done:
                self.finish()
            elif b.transport.can_write_eof():
                b.transport.write_eof()
        return True

    def pause_writing(self) -> None:
        b = self.backend
        if b is not None:
            b.transport.pause_reading()

    def resume_writing(self) -> None:
        b = self.backend
        if b is not None and self.pump_out is None and not b.transport.is_closing():
            b.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        lst = self.lst
        lst.stats.active -= 1
        lst.conns.discard(self)
        if self.dial is not None:
            self.dial.cancel()
            self.dial = None
        b = self.backend
        if b is not None:
            lst.stats.completed += 1
            if not b.transport.is_closing():
                if exc is None and self.in_done and self.out_done:
                    b.transport.close()
                else:
                    b.transport.abort()
        self._stop_pumps()
        if not lst.conns and lst.idle is not None and not lst.idle.done():
            lst.idle.set_result(None)

    # --- dialing

    async def _dial(self, client_ip: str) -> None:
        lst = self.lst
        picker = lst.picker
        stats = lst.stats
        address = picker.pick(client_ip)
        if address is None:
            stats.refused_no_endpoints += 1
            self._give_up()
            return
        loop = lst.loop
        for timeout in lst.dial_timeouts:
            b = _Backend(self)
            # call_later + cancel costs less per connection than asyncio.timeout().
            timer = loop.call_later(timeout, self._dial_timed_out)
            try:
                await loop.create_connection(lambda: b, address[0], address[1])  # noqa: B023
            except (OSError, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError):
                    if not self.timed_out:
                        raise
                    self.timed_out = False
                    assert self.dial is not None
                    self.dial.uncancel()
                stats.dial_failures += 1
                picker.dial_failed(address)
                log.debug("%s: dial %s failed: %r", lst.name, address, exc)
                if self.transport.is_closing():
                    return
                next_address = picker.pick(client_ip, retry=True)
                if next_address is None:
                    break
                address = next_address
                continue
            finally:
                timer.cancel()
            self.dial = None
            if self.transport.is_closing():
                b.transport.abort()
            else:
                self.backend = b
                self.backend_connected()
            return
        stats.failed += 1
        self._give_up()

    def _dial_timed_out(self) -> None:
        if self.dial is not None:
            self.timed_out = True
            self.dial.cancel()

    def _give_up(self) -> None:
        self.dial = None
        self.pending = None
        self.transport.abort()

    def backend_connected(self) -> None:
        """Flush what the client sent while dialing, then forward directly."""
        b = self.backend
        assert b is not None
        pending = self.pending
        self.pending = None
        if pending:
            self.lst.stats.bytes_in += self.pending_size
            b.transport.writelines(pending)
        self.pending_size = 0
        if self.in_done and b.transport.can_write_eof():
            b.transport.write_eof()
            if self.out_done:
                self.finish()
                return
        if not b.write_paused and not self.transport.is_closing():
            self.transport.resume_reading()

    # --- ending

    def finish(self) -> None:
        """Both directions saw EOF: close both sockets once their buffers are written."""
        self._stop_pumps()
        self.transport.close()
        b = self.backend
        if b is not None:
            b.transport.close()

    def abort(self) -> None:
        """An error on either side: reset both."""
        self._stop_pumps()
        self.transport.abort()
        b = self.backend
        if b is not None and not b.transport.is_closing():
            b.transport.abort()

    # --- zero-copy

    def _dup_fds(self) -> tuple[int, int] | None:
        fds = self.fds
        if fds is None:
            b = self.backend
            assert b is not None
            try:
                cfd = os.dup(self.transport.get_extra_info("socket").fileno())
            except (OSError, AttributeError):
                return None
            try:
                bfd = os.dup(b.transport.get_extra_info("socket").fileno())
            except (OSError, AttributeError):
                os.close(cfd)
                return None
            fds = self.fds = (cfd, bfd)
        return fds

    def splice_in(self) -> None:
        """Client -> backend goes zero-copy from now on."""
        self.big_in = 0
        fds = self._dup_fds()
        if fds is None or self.in_done:
            self.splicing = False
            return
        self.transport.pause_reading()
        self.lst.stats.spliced += 1
        self.pump_in = splicing.SplicePump(
            self.lst.loop,
            fds[0],
            fds[1],
            on_bytes=self._count_in,
            on_eof=self._spliced_eof_in,
            on_error=self._splice_in_failed,
        )

    def splice_out(self) -> None:
        """Backend -> client goes zero-copy from now on."""
        self.big_out = 0
        fds = self._dup_fds()
        b = self.backend
        if fds is None or b is None or self.out_done:
            self.splicing = False
            return
        b.transport.pause_reading()
        self.lst.stats.spliced += 1
        self.pump_out = splicing.SplicePump(
            self.lst.loop,
            fds[1],
            fds[0],
            on_bytes=self._count_out,
            on_eof=self._spliced_eof_out,
            on_error=self._splice_out_failed,
        )

    def _count_in(self, n: int) -> None:
        self.lst.stats.bytes_in += n

    def _count_out(self, n: int) -> None:
        self.lst.stats.bytes_out += n

    def _spliced_eof_in(self) -> None:
        assert self.fds is not None
        self.in_done = True
        with contextlib.suppress(OSError):
            os_shutdown_write(self.fds[1])
        if self.out_done:
            self.finish()

    def _spliced_eof_out(self) -> None:
        assert self.fds is not None
        self.out_done = True
        with contextlib.suppress(OSError):
            os_shutdown_write(self.fds[0])
        if self.in_done:
            self.finish()

    def _splice_in_failed(self, exc: OSError) -> None:
        pump = self.pump_in
        if pump is not None and self._can_fall_back(pump, exc):
            self.pump_in = None
            self.transport.resume_reading()
        else:
            self._splice_error(exc)

    def _splice_out_failed(self, exc: OSError) -> None:
        pump = self.pump_out
        b = self.backend
        if pump is not None and b is not None and self._can_fall_back(pump, exc):
            self.pump_out = None
            b.transport.resume_reading()
        else:
            self._splice_error(exc)

    def _can_fall_back(self, pump: splicing.SplicePump, exc: OSError) -> bool:
        """splice(2) refused these sockets before moving a byte: copy instead, from now on."""
        if exc.errno not in splicing.UNSUPPORTED or pump.moved:
            return False
        self.splicing = False
        if self.lst.splice:
            self.lst.splice = False
            log.info("%s: os.splice is not usable here (%s); copying instead", self.lst.name, exc)
        return True

    def _splice_error(self, exc: OSError) -> None:
        log.debug("%s: splice failed: %r", self.lst.name, exc)
        self.abort()

    def _stop_pumps(self) -> None:
        if self.pump_in is not None:
            self.pump_in.stop()
        if self.pump_out is not None:
            self.pump_out.stop()
        fds = self.fds
        if fds is not None:
            self.fds = None
            os.close(fds[0])
            os.close(fds[1])


def os_shutdown_write(fd: int) -> None:
    """shutdown(fd, SHUT_WR) on a raw descriptor without taking ownership of it."""
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_WR)
    finally:
        sock.detach()


def _reserve(sock: socket.socket) -> None:
    """Make a bound socket a port reservation that listening sockets can join.

    SO_REUSEPORT set after bind lets our listener bind the same address (the kernel checks
    the current flags of the sockets already bound); clearing SO_REUSEADDR stops a stranger
    with only SO_REUSEADDR from binding the port while nothing listens.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    sock.setblocking(False)


class TcpListener:
    """Serves one proxy port; refuses connections (RST) while the picker has no endpoints.

    `sock` is a bound TCP socket (IPv4 or IPv6) that is not listening; the listener owns it
    from now on and closes it in `close()`.
    """

    def __init__(
        self,
        sock: socket.socket,
        picker: Picker,
        stats: ConnStats,
        *,
        name: str = "",
        dial_timeouts: tuple[float, ...] = DIAL_TIMEOUTS,
        splice: bool = True,
        high_water: int = 256 * 1024,
        backlog: int = 4096,
    ) -> None:
        if sock.type != socket.SOCK_STREAM:
            raise ValueError(f"TcpListener needs a TCP socket, got {sock!r}")
        _reserve(sock)
        self._sock: socket.socket | None = sock
        self._address = sock.getsockname()
        self.picker = picker
        self.stats = stats
        self.name = name or f"tcp:{self._address[1]}"
        self.dial_timeouts = dial_timeouts
        self.splice = splice
        self.high_water = high_water
        self.low_water = high_water // 4
        self._backlog = backlog
        self.conns: set[_Client] = set()
        self.idle: asyncio.Future[None] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._opening: asyncio.Task[None] | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "TcpListener.start() was not called"
        return self._loop

    async def start(self) -> None:
        """Begin serving: listen now if the picker has endpoints, else refuse."""
        self._loop = asyncio.get_running_loop()
        if self.picker and not self._closed:
            await self._open()

    def set_picker(self, picker: Picker) -> None:
        """Use another picker for new connections, then `refresh()`."""
        self.picker = picker
        self.refresh()

    def refresh(self) -> None:
        """Listen while the picker has endpoints; refuse (port kept) while it has none."""
        if self._closed or self._loop is None:
            return
        if self.picker:
            if self._server is None and self._opening is None:
                self._opening = self._loop.create_task(self._reopen(), name=f"listen {self.name}")
        else:
            self._stop_listening()

    async def _open(self) -> None:
        """Listen on the port; raises OSError when that is impossible (see `refresh`)."""
        try:
            listen_sock = self._listening_socket()
            server = await self.loop.create_server(
                self._protocol, sock=listen_sock, backlog=self._backlog
            )
        finally:
            self._opening = None
        self._server = server
        log.debug("%s: listening on %s", self.name, self._address)
        if self._closed or not self.picker:  # changed while we were opening
            self._stop_listening()

    async def _reopen(self) -> None:
        try:
            await self._open()
        except OSError as exc:  # the next refresh() tries again
            log.error("%s: cannot listen on %s: %s", self.name, self._address, exc)

    def _listening_socket(self) -> socket.socket:
        assert self._sock is not None
        sock = socket.socket(self._sock.family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if sock.family == socket.AF_INET6:
                v6only = self._sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
            sock.bind(self._address)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    def _protocol(self) -> _Client:
        return _Client(self)

    def _stop_listening(self) -> None:
        server = self._server
        if server is not None:
            self._server = None
            server.close()  # closes the listening socket now; pending SYNs get RST
            log.debug("%s: refusing on %s", self.name, self._address)

    async def close(self) -> None:
        """Stop accepting and release the port; connections in flight go on to finish."""
        self._closed = True
        opening = self._opening
        if opening is not None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await opening
        self._stop_listening()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def drain(self, timeout: float) -> None:  # noqa: ASYNC109 - the contract's shape
        """Wait up to `timeout` seconds for connections in flight, then abort the rest."""
        if self.conns:
            self.idle = self.loop.create_future()
            try:
                async with asyncio.timeout(timeout):
                    await self.idle
            except TimeoutError:
                log.info(
                    "%s: aborting %d connections after %.1fs", self.name, len(self.conns), timeout
                )
                for conn in list(self.conns):
                    conn.abort()
            finally:
                self.idle = None

    @property
    def address(self) -> tuple[Any, ...]:
        """The bound address (host, port[, flowinfo, scope_id])."""
        return tuple(self._address)

    @property
    def port(self) -> int:
        return int(self._address[1])

    @property
    def active_connections(self) -> int:
        return len(self.conns)

    @property
    def accepting(self) -> bool:
        """True while a socket listens on the port (the picker has endpoints)."""
        return self._server is not None

    @property
    def buffered_bytes(self) -> int:
        """Bytes the proxy holds for its connections: write and dial buffers, splice pipes."""
        total = 0
        for conn in self.conns:
            total += conn.pending_size + conn.transport.get_write_buffer_size()
            if conn.backend is not None:
                total += conn.backend.transport.get_write_buffer_size()
            if conn.pump_in is not None:
                total += conn.pump_in.pending
            if conn.pump_out is not None:
                total += conn.pump_out.pending
        return total
