"""What a proxied connection does to its sockets besides reading and writing them: keepalive
options on dialed sockets (one batch a second after the dial), a reset instead of a FIN, and a
half-close on a raw descriptor (the splice path holds duplicates of the sockets' fds)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import TYPE_CHECKING, Any

from kube_userspace_proxy import logs

if TYPE_CHECKING:
    from kube_userspace_proxy.dataplane.connection import Connection

log = logs.get(__name__)

SocketOptions = tuple[tuple[int, int, int], ...]
"""(level, option, value) triples for setsockopt."""

# SO_LINGER on, 0 s: close() sends a RST (struct linger).
_LINGER_RESET = struct.pack("ii", 1, 0)


# Dialed sockets get their keepalive options this long after the dial, in one batch per
# event loop: a connection that ends sooner (most short requests) costs no setsockopt at all.
# The bound that matters (keepalive, 15 s by default) is much longer than this delay.
KEEPALIVE_DELAY = 1.0


class KeepAlive:
    """Connections dialed in the last KEEPALIVE_DELAY seconds, their dialed sockets waiting
    for keepalive: one batch and one timer for the process (per listener, a dict and a timer
    for each port just used, 10,000 in a worker, were made and freed among what the ports keep
    for good: its memory was left in pieces). A connection leaves as it closes: freed then."""

    __slots__ = ("conns", "loop", "timer")

    def __init__(self) -> None:
        self.conns: dict[Connection, None] = {}  # an ordered set
        self.timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the timer's

    def add(self, conn: Connection) -> None:
        """Set keepalive on `conn`'s dialed socket within KEEPALIVE_DELAY, if it lives."""
        loop = conn.shared.loop
        if self.timer is None or loop is not self.loop:
            # A batch of another loop (one that closed: tests run many) is not swept: dropped.
            self.conns = {}
            self.loop = loop
            self.timer = loop.call_later(KEEPALIVE_DELAY, self._sweep)
        self.conns[conn] = None

    def _sweep(self) -> None:
        conns, self.conns, self.timer = self.conns, {}, None
        for conn in conns:
            b = conn.backend
            if b is not None and not b.transport.is_closing():
                set_options(b.transport, conn.settings.keepalive)


keepalive = KeepAlive()  # the process's batch


def set_options(transport: asyncio.BaseTransport, options: SocketOptions) -> None:
    """setsockopt each (level, option, value) on a transport's socket; failures are ignored."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            for level, option, value in options:
                sock.setsockopt(level, option, value)
        except OSError as exc:  # the socket is already closing: nothing to keep alive
            log.debug("cannot set socket options: %r", exc)


def abort_with_reset(transport: Any) -> None:
    """Abort `transport` so that its peer gets a RST (a plain abort() closes with a FIN)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    transport.abort()


def shutdown_write(fd: int) -> None:
    """shutdown(fd, SHUT_WR) on a raw descriptor without taking ownership of it."""
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_WR)
    finally:
        sock.detach()
