"""TCP listener: serves one proxy port, and refuses connections while there are no endpoints.

One descriptor per port: the socket handed in is both the reservation and the listener.
While the picker has endpoints it listens; while it has none, shutdown(SHUT_RD) takes it back
to a bound, non-listening socket (Linux: the backlog is reset, the port stays bound because it
was bound explicitly), and a SYN to it gets a RST: the client sees ECONNREFUSED. It keeps
SO_REUSEPORT, so that other processes' listeners may join the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from kube_userspace_proxy import logs
from kube_userspace_proxy.dataplane.connection import Connection
from kube_userspace_proxy.dataplane.stats import ConnStats, Picker

log = logs.get(__name__)

DIAL_TIMEOUTS = (0.25, 0.5, 1.0, 2.0)


def _reserve(sock: socket.socket) -> socket.socket:
    """The port reservation for a bound socket: a socket bound explicitly to its address.

    Linux forgets a kernel-chosen port when its socket stops listening, but keeps a port that
    was asked for: so a second socket binds the address explicitly, joining through
    SO_REUSEPORT (set on the first after its bind; the kernel checks the flags of the sockets
    already bound), and the first is closed. The reservation keeps SO_REUSEPORT so that
    listeners of other processes may join it, and has SO_REUSEADDR cleared, so that a
    stranger with only SO_REUSEADDR cannot bind the port.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    pinned = socket.socket(sock.family, socket.SOCK_STREAM)
    try:
        pinned.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if sock.family == socket.AF_INET6:
            v6only = sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
            pinned.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
        pinned.bind(sock.getsockname())
        pinned.setblocking(False)
    except BaseException:
        pinned.close()
        raise
    sock.close()
    return pinned


def _unlisten(sock: socket.socket) -> None:
    """A listening socket back to bound and not listening; its backlog is reset."""
    with contextlib.suppress(OSError):  # ENOTCONN: it was not listening
        sock.shutdown(socket.SHUT_RD)


class TcpListener:
    """Serves one proxy port; refuses connections (RST) while the picker has no endpoints.

    `sock` is a bound TCP socket (IPv4 or IPv6) that is not listening; the listener owns it
    from now on (replaced by its reservation, see `_reserve`) and closes it in `close()`.
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
        sock = _reserve(sock)
        self._sock: socket.socket | None = sock
        self._address = sock.getsockname()
        self.picker = picker
        self.stats = stats
        self.name = name or f"tcp:{self._address[1]}"
        # Per-connection lines only at -v 4 and above; decided once, not per connection.
        self.log_connections = log.isEnabledFor(logging.DEBUG)
        self.dial_timeouts = dial_timeouts
        self.splice = splice
        self.high_water = high_water
        self.low_water = high_water // 4
        self._backlog = backlog
        self.conns: set[Connection] = set()
        self.idle: asyncio.Future[None] | None = None
        self._server: asyncio.AbstractServer | None = None
        # Listening, not yet served by the loop: set by refresh(), cleared by _serve().
        self._pending = False
        self._handing_over = False  # _serve() is inside create_server()
        self._opening: asyncio.Task[None] | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        # Told each time a listening socket joins the port (the socket) or leaves it (None):
        # worker processes track the order of their port's reuseport group with it.
        self.on_listen: Callable[[socket.socket | None], None] | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "TcpListener.start() was not called"
        return self._loop

    async def start(self) -> None:
        """Begin serving: listen now if the picker has endpoints, else refuse.

        Raises OSError when the port cannot listen.
        """
        self._loop = asyncio.get_running_loop()
        if self.picker and not self._closed:
            self._listen()
            await self._serve()

    def set_picker(self, picker: Picker) -> None:
        """Use another picker for new connections, then `refresh()`."""
        self.picker = picker
        self.refresh()

    def refresh(self) -> None:
        """Listen while the picker has endpoints; refuse (port kept) while it has none.

        The port listens when this returns: connections made right after it wait in the
        backlog until the loop serves the socket. A failure to listen is logged; the next
        refresh() tries again.
        """
        if self._closed or self._loop is None:
            return
        if not self.picker:
            self._stop_listening()
        elif self._server is None and not self._pending and not self._handing_over:
            try:
                self._listen()
            except OSError as exc:
                log.error("%s: cannot listen on %s: %s", self.name, self._address, exc)
                return
            if self._opening is None:
                self._opening = self._loop.create_task(
                    self._serve_later(), name=f"listen {self.name}"
                )

    async def _serve(self) -> None:
        """Hand the listening socket (if still wanted) to the loop; raises OSError on failure."""
        sock = self._sock
        if not self._pending or sock is None:  # refused again before this ran
            return
        self._pending = False
        self._handing_over = True
        try:
            server = await self.loop.create_server(self._protocol, sock=sock, backlog=self._backlog)
        except Exception:
            _unlisten(sock)
            if self.on_listen is not None:
                self.on_listen(None)
            raise
        finally:
            self._handing_over = False
        self._server = server
        log.debug("%s: listening on %s", self.name, self._address)
        if self._closed or not self.picker:  # changed while create_server() yielded
            self._stop_listening()

    async def _serve_later(self) -> None:
        try:
            await self._serve()
        except OSError as exc:  # the next refresh() tries again
            log.error("%s: cannot listen on %s: %s", self.name, self._address, exc)
        finally:
            self._opening = None

    def _listen(self) -> None:
        """Listen on the reserved socket now (connections wait in the backlog until served)."""
        assert self._sock is not None
        self._sock.listen(self._backlog)
        self._pending = True
        if self.on_listen is not None:
            self.on_listen(self._sock)

    def _protocol(self) -> Connection:
        return Connection(self)

    def _stop_listening(self, *, release: bool = False) -> None:
        """Refuse from now on, keeping the port (or giving it up too, with `release`)."""
        # Unlistening resets the connections still in the backlog, as closing would.
        pending = self._pending
        if pending:  # not yet handed to the loop: _serve() will skip it
            self._pending = False
            assert self._sock is not None
            _unlisten(self._sock)
        server = self._server
        if server is not None and self._sock is not None:
            kept = None
            if not release:
                # The loop closes the descriptor it serves: keep the socket (and the port)
                # through a duplicate, the only descriptor once the server has closed.
                try:
                    kept = self._sock.dup()
                except OSError as exc:
                    # Still listening: connections are reset for want of endpoints.
                    log.error("%s: cannot stop listening on %s: %s", self.name, self._address, exc)
                    return
            self._server = None
            server.close()
            self._sock = kept
            if kept is not None:
                _unlisten(kept)
        if pending or server is not None:
            log.debug("%s: refusing on %s", self.name, self._address)
            if self.on_listen is not None:
                self.on_listen(None)

    async def close(self) -> None:
        """Stop accepting and release the port; connections in flight go on to finish."""
        self._closed = True
        self._stop_listening(release=True)
        opening = self._opening
        if opening is not None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await opening
        self._stop_listening(release=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def drain(self, timeout: float) -> None:  # noqa: ASYNC109 - the contract's shape
        """Wait up to `timeout` seconds for connections in flight, then close the rest (FIN)."""
        if self.conns:
            self.idle = self.loop.create_future()
            try:
                async with asyncio.timeout(timeout):
                    await self.idle
            except TimeoutError:
                log.info(
                    "%s: closing %d connections still open after %.1fs",
                    self.name,
                    len(self.conns),
                    timeout,
                )
                for conn in list(self.conns):
                    # A FIN, as a process exit would send: shutting down is not an error.
                    conn.abort(reset=False)
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
        return self._server is not None or self._pending or self._handing_over

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
