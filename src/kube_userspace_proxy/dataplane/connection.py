"""One proxied TCP connection: two small Protocols, a dial ladder, flow control, splice.

Per connection there are two Protocol objects (client side, backend side) and one task (the
dial: `loop.create_connection` is a coroutine). Bytes are copied by `data_received` ->
`write` with high-water marks pausing the other side; a direction whose reads keep coming back
large switches to zero-copy `os.splice` (see splice.py). EOF is passed on with `write_eof`
(half-close); an error or reset on one side resets the other (RST, not FIN).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections import deque
from typing import TYPE_CHECKING, Any

from kube_userspace_proxy import logs
from kube_userspace_proxy.dataplane import proxyproto
from kube_userspace_proxy.dataplane import splice as splicing

if TYPE_CHECKING:
    from kube_userspace_proxy.dataplane.tcp import TcpListener

log = logs.get(__name__)

# A direction switches to splice after this many consecutive reads of at least this size.
SPLICE_MIN_READ = 64 * 1024
SPLICE_AFTER_READS = 4
# SO_LINGER on, 0 s: close() sends a RST (struct linger).
_LINGER_RESET = struct.pack("ii", 1, 0)


class BackendSide(asyncio.Protocol):
    """The backend side of a connection: forwards to the client side it belongs to."""

    __slots__ = ("client", "transport", "write_paused")

    def __init__(self, client: Connection) -> None:
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


class Connection(asyncio.Protocol):
    """A proxied connection: the protocol of its client side, which owns its state."""

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
        self.lst = lst  # the listener's settings, picker, stats and connection set
        self.transport: Any = None
        self.backend: BackendSide | None = None
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
        peer = transport.get_extra_info("peername")  # None if the client is already gone
        self.dial = lst.loop.create_task(self._dial(peer[0] if peer else ""))

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
            if lst.log_connections:
                log.debug("%s: %s closed (%s)", lst.name, _peer(self.transport), exc or "normal")
            if not b.transport.is_closing():
                if exc is None and self.in_done and self.out_done:
                    b.transport.close()
                else:
                    _reset(b.transport)
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
            b = BackendSide(self)
            # call_later + cancel costs less per connection than asyncio.timeout().
            timer = loop.call_later(timeout, self._dial_timed_out)
            try:
                await loop.create_connection(lambda: b, address[0], address[1])  # noqa: B023
            except (Exception, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError):
                    if not self.timed_out:
                        raise
                    self.timed_out = False
                    assert self.dial is not None
                    self.dial.uncancel()
                elif not isinstance(exc, OSError):  # e.g. a malformed address from the picker
                    log.warning("%s: cannot dial %r: %r", lst.name, address, exc)
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
                _reset(b.transport)
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
        _reset(self.transport)

    def backend_connected(self) -> None:
        """Flush what the client sent while dialing, then forward directly."""
        b = self.backend
        assert b is not None
        if self.lst.log_connections:
            log.debug(
                "%s: %s -> %s",
                self.lst.name,
                _peer(self.transport),
                _peer(b.transport),
            )
        if self.lst.picker.proxy_protocol:
            self._send_proxy_header(b)
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

    def _send_proxy_header(self, b: BackendSide) -> None:
        """The PROXY protocol header goes first: the backend learns who the client is."""
        sock = self.transport.get_extra_info("socket")
        try:
            head = proxyproto.for_connection(self.lst.picker.proxy_protocol, sock)
        except (OSError, AttributeError, ValueError) as exc:  # the client is already gone
            log.debug("%s: no PROXY header: %r", self.lst.name, exc)
            return
        b.transport.write(head)

    # --- ending

    def finish(self) -> None:
        """Both directions saw EOF: close both sockets once their buffers are written."""
        self._stop_pumps()
        self.transport.close()
        b = self.backend
        if b is not None:
            b.transport.close()

    def abort(self, *, reset: bool = True) -> None:
        """An error on either side: reset both (`reset=False`: close both, dropping buffers)."""
        self._stop_pumps()
        end = _reset if reset else _drop
        end(self.transport)
        b = self.backend
        if b is not None and not b.transport.is_closing():
            end(b.transport)

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
            _shutdown_write(self.fds[1])
        if self.out_done:
            self.finish()

    def _spliced_eof_out(self) -> None:
        assert self.fds is not None
        self.out_done = True
        with contextlib.suppress(OSError):
            _shutdown_write(self.fds[0])
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


def _reset(transport: Any) -> None:
    """Abort `transport` so that its peer gets a RST (a plain abort() closes with a FIN)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    transport.abort()


def _drop(transport: Any) -> None:
    transport.abort()


def _peer(transport: Any) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return f"{peer[0]}:{peer[1]}" if peer else "?"


def _shutdown_write(fd: int) -> None:
    """shutdown(fd, SHUT_WR) on a raw descriptor without taking ownership of it."""
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_WR)
    finally:
        sock.detach()
