"""One proxied TCP connection: two small Protocols, a dial ladder, flow control, splice.

Per connection there are two Protocol objects (client side, backend side) and one task (the
dial: `loop.create_connection` is a coroutine). Bytes are copied by `data_received` ->
`write` with high-water marks pausing the other side; a direction whose reads keep coming back
large switches to zero-copy `os.splice` (see splice.py). EOF is passed on with `write_eof`
(half-close); an error or reset on one side resets the other (RST, not FIN).

A connection gets its listener's `Settings` (frozen) and `Shared` state (picker, counters,
the set of open connections), as uvicorn's protocols get a config and a server state; it
never sees the listener itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections import deque
from dataclasses import dataclass
from typing import Any

from kube_userspace_proxy import logs
from kube_userspace_proxy.dataplane import proxyproto
from kube_userspace_proxy.dataplane import splice as splicing
from kube_userspace_proxy.dataplane.sockets import (
    SocketOptions,
    abort_with_reset,
    keepalive,
    shutdown_write,
)
from kube_userspace_proxy.dataplane.stats import NO_DESCRIPTORS, ConnStats, Picker, Tally, notices
from kube_userspace_proxy.dataplane.transparent import chooser_for, dial_from
from kube_userspace_proxy.model import DialOutcome

log = logs.get(__name__)

# A direction switches to splice after this many consecutive reads of at least this size.
SPLICE_MIN_READ = 64 * 1024
SPLICE_AFTER_READS = 4


class _NoTally:
    """Counters of a connection not yet dialed: bumped by nobody, read by nobody."""

    __slots__ = ("active", "bytes_in", "bytes_out", "local", "total")

    def __init__(self) -> None:
        self.active = self.total = self.bytes_in = self.bytes_out = 0
        self.local = False


_NO_TALLY: Tally = _NoTally()


@dataclass(frozen=True, slots=True)
class Settings:
    """What every connection of a listener is configured with (fixed for its lifetime): a
    value, shared by the listeners configured alike (the listener's name is in `Shared`)."""

    dial_timeouts: tuple[float, ...]
    high_water: int
    low_water: int
    keepalive: SocketOptions = ()
    """setsockopt triples for keepalive on dialed sockets; () = keepalive off."""
    log_connections: bool = False
    """Per-connection DEBUG lines: decided once per listener, not per connection."""


class Shared:
    """A listener's state that its connections read and update (uvicorn's ServerState)."""

    __slots__ = (
        "conns",
        "idle",
        "loop",
        "name",
        "picker",
        "splice",
        "stats",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        picker: Picker,
        stats: ConnStats,
        splice: bool,
        name: str = "",
    ) -> None:
        self.loop = loop
        self.name = name  # the listener's, for log lines
        self.picker = picker
        self.stats = stats
        self.splice = splice  # cleared for good once splice(2) proves unusable here
        # The open connections, as an ordered set: a dict, emptied by clear() as its last
        # connection closes (64 B; a set keeps its 0.2 KiB: a port used once held it for good).
        self.conns: dict[Connection, None] = {}
        self.idle: asyncio.Future[None] | None = None  # set while drain() waits


class BackendSide(asyncio.Protocol):
    """The backend side of a connection: forwards to the client side it belongs to.

    It is its own protocol factory (`__call__` returns itself): a dial allocates no closure.
    """

    __slots__ = ("client", "transport", "write_paused")

    transport: asyncio.Transport

    def __init__(self, client: Connection) -> None:
        self.client = client
        self.write_paused = False

    def __call__(self) -> BackendSide:
        return self

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        settings = self.client.settings
        transport.set_write_buffer_limits(settings.high_water, settings.low_water)

    def data_received(self, data: bytes) -> None:
        c = self.client
        c.stats.bytes_out += len(data)
        c.ep.bytes_out += len(data)
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
        "ep",
        "fds",
        "in_done",
        "out_done",
        "peer",
        "pending",
        "pending_size",
        "pump_in",
        "pump_out",
        "settings",
        "shared",
        "splicing",
        "stats",
        "timed_out",
        "transport",
    )

    transport: asyncio.Transport

    def __init__(self, settings: Settings, shared: Shared) -> None:
        self.settings = settings
        self.shared = shared
        self.stats = shared.stats  # read on every chunk: one attribute hop, not two
        self.backend: BackendSide | None = None
        self.pending: deque[bytes] | None = deque()
        self.pending_size = 0
        self.in_done = False  # client -> backend finished (EOF passed on)
        self.out_done = False  # backend -> client finished
        self.dial: asyncio.Task[None] | None = None
        self.timed_out = False
        self.splicing = shared.splice
        self.big_in = 0
        self.big_out = 0
        self.pump_in: splicing.SplicePump | None = None
        self.pump_out: splicing.SplicePump | None = None
        self.fds: tuple[int, int] | None = None
        self.ep: Tally = _NO_TALLY  # the endpoint's counters, once dialed
        self.peer: tuple[Any, ...] = ("", 0)  # the client, as accept() returned it

    def start(self, sock: socket.socket, peer: tuple[Any, ...]) -> None:
        """Serve an accepted client socket from `peer` (accept()'s address): wrap it, then dial."""
        self.peer = peer
        self.dial = self.shared.loop.create_task(self._serve(sock, peer[0]))

    def __call__(self) -> Connection:
        return self  # its own protocol factory, as BackendSide

    async def _serve(self, sock: socket.socket, client_ip: str) -> None:
        try:
            await self.shared.loop.connect_accepted_socket(self, sock)
        except OSError as exc:  # e.g. the loop could not register the socket
            sock.close()
            self.dial = None
            log.debug("%s: cannot serve an accepted connection: %r", self.shared.name, exc)
            return
        await self._dial(client_ip)

    # --- client transport callbacks

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        stats = self.stats
        stats.accepted += 1
        stats.active += 1
        self.shared.conns[self] = None
        settings = self.settings
        transport.set_write_buffer_limits(settings.high_water, settings.low_water)

    def data_received(self, data: bytes) -> None:
        b = self.backend
        if b is None:
            pending = self.pending
            if pending is None:  # dialing failed; the connection is being torn down
                return
            pending.append(data)
            self.pending_size += len(data)
            if self.pending_size >= self.settings.high_water:
                self.transport.pause_reading()
            return
        self.stats.bytes_in += len(data)
        self.ep.bytes_in += len(data)
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
        shared = self.shared
        self.stats.active -= 1
        conns = shared.conns
        conns.pop(self, None)
        if self.dial is not None:
            self.dial.cancel()
            self.dial = None
        b = self.backend
        if b is not None:
            self.stats.completed += 1
            self.ep.active -= 1
            keepalive.conns.pop(self, None)  # freed now, not at the sweep (see KeepAlive)
            if self.settings.log_connections:
                log.debug(
                    "%s: %s closed (%s)", self.shared.name, _peer(self.transport), exc or "normal"
                )
            if not b.transport.is_closing():
                if exc is None and self.in_done and self.out_done:
                    b.transport.close()
                else:
                    abort_with_reset(b.transport)
        if self.pump_in is not None or self.fds is not None:
            self._stop_pumps()
        # The two sides refer to each other: let go of the backend side, so a finished
        # connection is freed by reference counting, not left (with both transports) for
        # the cyclic collector, whose passes over thousands of them stall the loop.
        self.backend = None
        if not conns:
            conns.clear()  # its table goes (see Shared.conns)
            if shared.idle is not None and not shared.idle.done():
                shared.idle.set_result(None)

    # --- dialing

    async def _dial(self, client_ip: str) -> None:
        shared = self.shared
        picker = shared.picker
        stats = self.stats
        address = picker.pick(client_ip)
        ep = picker.picked  # before the next await: other connections pick meanwhile
        if address is None:
            stats.refused_no_endpoints += 1
            self._give_up()
            return
        loop = shared.loop
        settings = self.settings
        chooser = chooser_for(picker.source) if picker.source is not None else None
        for timeout in settings.dial_timeouts:
            b = BackendSide(self)
            # call_later + cancel costs less per connection than asyncio.timeout().
            timer = loop.call_later(timeout, self._dial_timed_out)
            try:
                if chooser is None:
                    await loop.create_connection(b, address[0], address[1])
                else:  # --preserve-source-ip
                    await dial_from(loop, b, address, chooser, client_ip, ep.local, stats)
            except (Exception, asyncio.CancelledError) as exc:
                refused = isinstance(exc, ConnectionRefusedError)
                outcome = DialOutcome.REFUSED if refused else DialOutcome.UNREACHABLE
                if isinstance(exc, asyncio.CancelledError):
                    if not self.timed_out:
                        raise
                    self.timed_out = False
                    assert self.dial is not None
                    self.dial.uncancel()
                    outcome = DialOutcome.TIMED_OUT
                elif isinstance(exc, OSError) and exc.errno in NO_DESCRIPTORS:
                    # This process is out of descriptors: the endpoint is not at fault.
                    stats.no_descriptors += 1
                    notices.no_descriptors(self.shared.name, "dial", exc)
                    break
                elif not isinstance(exc, OSError):  # e.g. a malformed address from the picker
                    log.warning("%s: cannot dial %r: %r", self.shared.name, address, exc)
                stats.dial_failures += 1
                picker.dial_failed(address, outcome)
                log.debug("%s: dial %s failed: %r", self.shared.name, address, exc)
                if self.transport.is_closing():
                    return
                next_address = picker.pick(client_ip, retry=True)
                if next_address is None:
                    break
                address = next_address
                ep = picker.picked
                continue
            finally:
                timer.cancel()
            self.dial = None
            if self.transport.is_closing():
                abort_with_reset(b.transport)
            else:
                self.backend = b
                self.ep = ep
                picker.dial_succeeded(address)
                ep.active += 1
                ep.total += 1
                if settings.keepalive:
                    keepalive.add(self)
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
        abort_with_reset(self.transport)

    def backend_connected(self) -> None:
        """Flush what the client sent while dialing, then forward directly."""
        b = self.backend
        assert b is not None
        if self.settings.log_connections:
            log.debug(
                "%s: %s -> %s",
                self.shared.name,
                _peer(self.transport),
                _peer(b.transport),
            )
        if self.shared.picker.proxy_protocol:
            b.transport.write(_proxy_header(self))
        pending = self.pending
        self.pending = None
        if pending:
            self.stats.bytes_in += self.pending_size
            self.ep.bytes_in += self.pending_size
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

    def abort(self, *, reset: bool = True) -> None:
        """An error on either side: reset both (`reset=False`: close both, dropping buffers)."""
        self._stop_pumps()
        end = abort_with_reset if reset else _drop
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
        self.stats.spliced += 1
        self.pump_in = splicing.SplicePump(
            self.shared.loop,
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
        self.stats.spliced += 1
        self.pump_out = splicing.SplicePump(
            self.shared.loop,
            fds[1],
            fds[0],
            on_bytes=self._count_out,
            on_eof=self._spliced_eof_out,
            on_error=self._splice_out_failed,
        )

    def _count_in(self, n: int) -> None:
        self.stats.bytes_in += n
        self.ep.bytes_in += n

    def _count_out(self, n: int) -> None:
        self.stats.bytes_out += n
        self.ep.bytes_out += n

    def _spliced_eof_in(self) -> None:
        assert self.fds is not None
        self.in_done = True
        with contextlib.suppress(OSError):
            shutdown_write(self.fds[1])
        if self.out_done:
            self.finish()

    def _spliced_eof_out(self) -> None:
        assert self.fds is not None
        self.out_done = True
        with contextlib.suppress(OSError):
            shutdown_write(self.fds[0])
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
        if self.shared.splice:
            self.shared.splice = False
            log.info(
                "%s: os.splice is not usable here (%s); copying instead", self.shared.name, exc
            )
        return True

    def _splice_error(self, exc: OSError) -> None:
        log.debug("%s: splice failed: %r", self.shared.name, exc)
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


def _proxy_header(conn: Connection) -> bytes:
    """The PROXY protocol header, which goes first, always: the backend learns who the client is.

    The client is named by the address accept() returned: a client that reset meanwhile has no
    peer address any more, and its bytes must never reach the backend unheaded. A transparent
    dial (--preserve-source-ip) names the same address.
    """
    sock = conn.transport.get_extra_info("socket")
    version = conn.shared.picker.proxy_protocol
    return proxyproto.for_connection(version, sock, (conn.peer[0], conn.peer[1]))


def _drop(transport: Any) -> None:
    transport.abort()


def _peer(transport: Any) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return f"{peer[0]}:{peer[1]}" if peer else "?"
