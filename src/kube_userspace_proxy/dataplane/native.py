"""The native TCP data plane: C moves the bytes, this module decides.

`_native.Core` (the C extension, `_native.c`) owns an epoll set of the listening sockets and
connections of one event loop. The loop watches that set's descriptor (`add_reader`) and calls
`Core.run()`, which accepts, dials, copies or splices, half-closes and resets in C, and hands
back one batch of what needs a decision or a count:

- a new connection: this module asks the listener's picker (the balancer) for an endpoint and
  tells the core to dial it, with the PROXY protocol header and the source address
  (--preserve-source-ip) decided here, and the dial ladder's timeout for this attempt;
- a dial's outcome: reported to the picker (`dial_succeeded` / `dial_failed(address,
  outcome)`), counted, and on a failure the next endpoint is picked and dialed, or the client
  is reset once the ladder is done;
- an ended connection: its bytes, counted on the port and the endpoint.

A pool in plain round robin (no affinity, penalty, PROXY header or transparent source) gets
a `PoolTable`: its endpoints and cursor copied into the core (`balancer.Mirror`). While the
table is enabled, the core picks and dials an accepted connection itself and reports it once,
with the dial's outcome (EV_FAST): the pick is recorded in the pool and counted here as a
Python-dialed one, and a failed dial goes on down the ladder here. Every change to what a pick
depends on takes the cursor back first (`schedulers.mirrored`), and
tests/loopback/test_native_table.py drives a mirrored and a plain pool through the same
events and compares every pick.

So Python runs once per new connection (with a table: once per dial's outcome), per failed
dial and per closed connection, never per read or write; which endpoint, whether to retry and
what to count stay here and in `balancer.py`.
The Python data plane (`connection.py`) is the reference implementation; both pass one test
suite (tests/loopback, parametrized over `dataplane`).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import socket
from typing import TYPE_CHECKING, Any

from kube_userspace_proxy import logs
from kube_userspace_proxy.dataplane import proxyproto
from kube_userspace_proxy.dataplane.stats import NO_DESCRIPTORS, notices
from kube_userspace_proxy.dataplane.transparent import chooser_for, count_source
from kube_userspace_proxy.model import DialOutcome

if TYPE_CHECKING:
    from kube_userspace_proxy.dataplane.tcp import TcpListener

log = logs.get(__name__)

try:
    from kube_userspace_proxy.dataplane import _native  # type: ignore[attr-defined]
except ImportError as exc:  # not built (no compiler or headers at install time)
    _native = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = ""

NO_EXTENSIONS = "KUP_NO_EXTENSIONS"
"""Set (to anything but "") in the environment, `--dataplane auto` is the Python data plane
even where the extension is built (aiohttp's AIOHTTP_NO_EXTENSIONS); workers inherit it."""


def unavailable() -> str:
    """Why the native data plane cannot serve here; "" when it can."""
    if _native is None:
        return f"the C extension is not built ({_IMPORT_ERROR})"
    if os.environ.get(NO_EXTENSIONS):
        return f"{NO_EXTENSIONS} is set"
    return ""


_ACCEPTED, _DIALED, _CLOSED, _ACCEPT_ERROR, _FAST = 1, 2, 3, 4, 5
_NO_DESCRIPTORS = 4  # a dial outcome of the core: this process is out of descriptors
_CONNECTED = int(DialOutcome.CONNECTED)
_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})


class NativePlane:
    """The core of one event loop and the decisions its events need.

    One per loop (`for_loop`): every native listener of the loop registers its listening
    socket here. Per listener it keeps how many connections are open (accepted and not
    ended), which is what `TcpListener.active_connections` and `drain` read.
    """

    __slots__ = ("_closing", "core", "idle", "ids", "listeners", "loop", "open", "owned", "tabled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        if _native is None:
            raise RuntimeError(f"the native data plane is not available: {unavailable()}")
        self.loop = loop
        # On the core's loop (coreloop.py) the loop waits in its selector's core: this plane's.
        selector = getattr(loop, "core_selector", None)
        self.owned = selector is not None
        self.core: Any = selector.core if selector is not None else new_core()
        # Connections accepted and not ended, per listener.
        self.open: dict[TcpListener, int] = {}
        # The listeners that use this plane (started, not closed): the plane closes, with its
        # three descriptors, once none is left and no connection is open.
        self.listeners: set[TcpListener] = set()
        # drain(): per listener, resolved when its last connection ends.
        self.idle: dict[TcpListener, asyncio.Future[None]] = {}
        # Per listener accepting here: its id in the core, and the table its accepts dial
        # from (None: it never will, e.g. it logs each connection), once decided.
        self.ids: dict[TcpListener, int] = {}
        self.tabled: dict[TcpListener, PoolTable | None] = {}
        self._closing = False
        if selector is not None:
            selector.handler = self._handle  # called from inside the loop's wait
            return
        # A wakeup that only moved bytes calls no Python: the core runs, and calls _handle
        # only with a batch of events that need a decision or a count.
        loop.add_reader(self.core.fileno(), self.core.dispatch, self._handle)

    def attach(self, listener: TcpListener) -> None:
        """`listener` uses this plane until `detach`."""
        self.listeners.add(listener)

    def detach(self, listener: TcpListener) -> None:
        """`listener` is closed; its open connections go on to finish."""
        self.listeners.discard(listener)
        self._close_if_unused()

    def _close_if_unused(self) -> None:
        # A core the loop waits in lives as long as the loop.
        if not self.listeners and not self.open and not self.owned:
            self.close()

    # ---- listeners ----------------------------------------------------------------------

    def watch(self, listener: TcpListener, sock: socket.socket) -> int:
        """Accept from `sock` (listening) for `listener`; the id to `unwatch` with."""
        ka = listener.keepalive_options
        idle = intvl = user = 0
        for level, option, value in ka:
            if (level, option) == (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE):
                idle = value
            elif (level, option) == (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL):
                intvl = value
            elif (level, option) == (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT):
                user = value
        lid: int = self.core.add_listener(
            sock.fileno(), listener, idle, intvl, user, listener.splice
        )
        self.ids[listener] = lid
        self.tabled.pop(listener, None)
        return lid

    def unwatch(self, listener: TcpListener, lid: int) -> None:
        """No more accepts for `listener` (id `lid`); its open connections go on."""
        self.core.remove_listener(lid)
        self.ids.pop(listener, None)
        self.tabled.pop(listener, None)

    def untable(self, listener: TcpListener) -> None:
        """`listener` has another picker: its accepts stop dialing from the old one's table
        (the next accept Python handles decides again)."""
        if self.tabled.pop(listener, None) is not None:
            self.core.use_table(self.ids[listener], None)

    def _use_table(self, listener: TcpListener) -> None:
        """After Python picked for `listener`: let its accepts dial from its pool's table."""
        table: PoolTable | None = None
        lid = self.ids.get(listener)
        pool = listener.picker
        settings = listener.settings
        timeout_ms = max(1, round(settings.dial_timeouts[0] * 1000))
        attach = getattr(pool, "attach_mirror", None)
        if lid is not None and attach is not None and not settings.log_connections:
            mirror = getattr(pool, "mirror", None)
            if mirror is None:
                table = PoolTable(timeout_ms)
                attach(table)
            elif isinstance(mirror, PoolTable) and mirror.timeout_ms == timeout_ms:
                table = mirror
        self.tabled[listener] = table
        if table is not None and lid is not None:
            self.core.use_table(lid, table.table)

    def active(self, listener: TcpListener) -> int:
        return self.open.get(listener, 0)

    def buffered(self, listener: TcpListener) -> int:
        return int(self.core.buffered(listener))

    @property
    def splice(self) -> bool:
        """False once splice(2) proved unusable here (the core copies from then on)."""
        return bool(self.core.stats()["splice"])

    async def drain(self, listener: TcpListener, timeout: float) -> None:  # noqa: ASYNC109
        """`TcpListener.drain` for this plane: wait, then close what is left (FIN)."""
        from kube_userspace_proxy.dataplane.tcp import wait_idle  # noqa: PLC0415 - tcp imports us

        if not self.active(listener):
            return
        self.idle[listener] = idle = self.loop.create_future()
        try:
            close = functools.partial(self.close_connections, listener)
            await wait_idle(listener.name, idle, timeout, lambda: self.active(listener), close)
        finally:
            self.idle.pop(listener, None)

    def close_connections(self, listener: TcpListener, *, reset: bool = False) -> None:
        """End every connection of `listener` now (a FIN each, or a reset)."""
        self._handle(self.core.close_connections(listener, reset))

    def count_bytes(self) -> None:
        """Bring the byte counters of open connections up to date (before a scrape)."""
        for listener, data, moved_in, moved_out in self.core.counts():
            stats = listener.stats
            stats.bytes_in += moved_in
            stats.bytes_out += moved_out
            if data is not None:
                ep = data[2]
                ep.bytes_in += moved_in
                ep.bytes_out += moved_out

    def close(self) -> None:
        """Stop watching and close the core (every connection it holds)."""
        if self._closing:
            return
        self._closing = True
        if _planes.get(self.loop) is self:
            del _planes[self.loop]
        if self.owned:  # the loop waits in this core: it closes it with itself
            return
        if not self.loop.is_closed():
            self.loop.remove_reader(self.core.fileno())
        self.core.close()

    # ---- the events -----------------------------------------------------------------------

    def _handle(self, events: list[tuple[Any, ...]]) -> None:
        for event in events:
            kind = event[0]
            try:
                if kind == _ACCEPTED:
                    self._accepted(event[1], event[2], event[3], event[4])
                elif kind == _DIALED:
                    self._dialed(event[1], event[2], event[3], event[4])
                elif kind == _CLOSED:
                    self._closed(event[1], event[2], event[3], event[4], event[6])
                elif kind == _FAST:
                    self._fast(event[1], event[2], event[3], event[4], event[5])
                else:
                    self._accept_failed(event[1], event[2])
            except Exception:  # one connection's failure never stops the others' events
                log.exception("native data plane: handling %r failed", event[:2])

    def _accepted(self, listener: TcpListener, conn: int, ip: str, port: int) -> None:
        stats = listener.stats
        stats.accepted += 1
        stats.active += 1
        self.open[listener] = self.open.get(listener, 0) + 1
        picker = listener.picker
        address = picker.pick(ip)
        if address is None:
            stats.refused_no_endpoints += 1
            self._give_up(listener, conn)
            return
        self._dial(listener, conn, ip, port, address, picker.picked, 0)
        if listener not in self.tabled:
            self._use_table(listener)

    def _fast(
        self, listener: TcpListener, conn: int, entry: tuple[int, Any], outcome: int, err: int
    ) -> None:
        """The core dialed an accepted connection from a table: count it as accepted and
        picked here, then as a Python dial's outcome (a failure goes on down the ladder)."""
        data = entry[1]
        address, ep = data[1], data[2]
        stats = listener.stats
        stats.accepted += 1
        stats.active += 1
        stats.core_picks += 1
        self.open[listener] = self.open.get(listener, 0) + 1
        picker = listener.picker
        record = getattr(picker, "record_pick", None)
        if record is not None:
            record(address)
        if outcome == _CONNECTED:
            picker.dial_succeeded(address)
            ep.active += 1
            ep.total += 1
            return
        ip, port = self.core.peer(conn)
        self._dialed((listener, address, ep, ip, port, 0, 0), conn, outcome, err)

    def _dial(  # noqa: PLR0917 - one dial, field by field
        self,
        listener: TcpListener,
        conn: int,
        ip: str,
        port: int,
        address: tuple[str, int],
        ep: Any,
        rung: int,
    ) -> None:
        picker = listener.picker
        settings = listener.settings
        header = b""
        if picker.proxy_protocol:
            header = _proxy_header(picker.proxy_protocol, self.core.client_fd(conn), ip, port)
        reason, bind_ip = 0, None
        if picker.source is not None:
            reason, chosen = chooser_for(picker.source).choose(ip, address[0], ep.local)
            bind_ip = chosen or None
        timeout_ms = max(1, round(settings.dial_timeouts[rung] * 1000))
        data = (listener, address, ep, ip, port, rung, reason)
        try:
            self.core.dial(conn, address[0], address[1], timeout_ms, data, header, bind_ip)
        except (ValueError, TypeError, OverflowError) as exc:  # a malformed address
            log.warning("%s: cannot dial %r: %s", listener.name, address, exc)
            self._failed(listener, conn, data, int(DialOutcome.UNREACHABLE))

    def _dialed(self, data: tuple[Any, ...], conn: int, outcome: int, err: int) -> None:
        listener = data[0]
        if outcome == _CONNECTED:
            address, ep = data[1], data[2]
            listener.picker.dial_succeeded(address)
            ep.active += 1
            ep.total += 1
            if listener.picker.source is not None:
                count_source(listener.stats, data[6])
            if listener.settings.log_connections:
                log.debug("%s: %s:%d -> %s:%d", listener.name, data[3], data[4], *address)
            return
        if outcome == _NO_DESCRIPTORS:
            # This process is out of descriptors: the endpoint is not at fault.
            stats = listener.stats
            stats.no_descriptors += 1
            stats.failed += 1
            notices.no_descriptors(listener.name, "dial", OSError(err, os.strerror(err)))
            self._give_up(listener, conn)
            return
        log.debug("%s: dial %s failed: %s", listener.name, data[1], os.strerror(err))
        self._failed(listener, conn, data, outcome)

    def _failed(
        self, listener: TcpListener, conn: int, data: tuple[Any, ...], outcome: int
    ) -> None:
        """A dial failed: report it, then the next endpoint on the ladder, or give up."""
        _, address, _, ip, port, rung, _ = data
        stats = listener.stats
        stats.dial_failures += 1
        picker = listener.picker
        picker.dial_failed(address, outcome)
        rung += 1
        if rung < len(listener.settings.dial_timeouts):
            next_address = picker.pick(ip, retry=True)
            if next_address is not None:
                self._dial(listener, conn, ip, port, next_address, picker.picked, rung)
                return
        stats.failed += 1
        self._give_up(listener, conn)

    def _give_up(self, listener: TcpListener, conn: int) -> None:
        """The client gets a RST: no endpoint, or every dial failed."""
        self.core.reset(conn)
        listener.stats.active -= 1
        self._ended(listener)

    def _closed(
        self, listener: TcpListener, data: Any, moved_in: int, moved_out: int, spliced: int
    ) -> None:
        stats = listener.stats
        stats.active -= 1
        stats.completed += 1
        stats.spliced += spliced
        stats.bytes_in += moved_in
        stats.bytes_out += moved_out
        if data is not None:
            ep = data[2]
            ep.active -= 1
            ep.bytes_in += moved_in
            ep.bytes_out += moved_out
        if listener.settings.log_connections:
            log.debug("%s: %s:%d closed", listener.name, data[3], data[4])
        self._ended(listener)

    def _ended(self, listener: TcpListener) -> None:
        left = self.open.get(listener, 1) - 1
        if left > 0:
            self.open[listener] = left
            return
        self.open.pop(listener, None)
        waiter = self.idle.get(listener)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if listener not in self.listeners:
            self._close_if_unused()

    def _accept_failed(self, listener: TcpListener, err: int) -> None:
        exc = OSError(err, os.strerror(err))
        if err in NO_DESCRIPTORS:
            listener.stats.no_descriptors += 1
            notices.no_descriptors(listener.name, "accept", exc)
        elif err not in _GONE:
            log.warning("%s: accept failed: %s", listener.name, exc)
        listener.pause_accepting()


class PoolTable:
    """A pool's copy in the core (`_native.Table`), its `balancer.Mirror`: the accepts of
    the listeners that use it are dialed in C, round robin, while it is enabled.

    Its entries carry what a Python dial's events carry, (None, address, tally, ...), so the
    connection's later events are counted as any other's.
    """

    __slots__ = ("_addresses", "_tallies", "table", "timeout_ms")

    def __init__(self, timeout_ms: int) -> None:
        if _native is None:
            raise RuntimeError(f"the native data plane is not available: {unavailable()}")
        self.table: Any = _native.Table(timeout_ms)
        self.timeout_ms = timeout_ms
        self._addresses: tuple[tuple[str, int], ...] | None = None
        self._tallies: tuple[Any, ...] | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.table.enabled)

    def disable(self) -> int:
        return int(self.table.disable())

    def show(
        self, addresses: tuple[tuple[str, int], ...], tallies: tuple[Any, ...], cursor: int
    ) -> None:
        if addresses is self._addresses and tallies is self._tallies and cursor < len(addresses):
            self.table.resume(cursor)
            return
        entries = [
            (a[0], a[1], (None, a, t, None, None, 0, 0))
            for a, t in zip(addresses, tallies, strict=True)
        ]
        self._addresses = self._tallies = None
        try:
            self.table.set(entries, cursor)
        except (ValueError, TypeError, OverflowError) as exc:  # an address C cannot dial
            log.debug("a pool stays in Python: %s", exc)
            return
        self._addresses, self._tallies = addresses, tallies


def _proxy_header(version: int, fd: int, ip: str, port: int) -> bytes:
    """The PROXY header for the client socket `fd` (borrowed: never closed here)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, 0, fd)
    try:
        return proxyproto.for_connection(version, sock, (ip, port))
    finally:
        sock.detach()


def new_core() -> Any:
    """A new core (the C extension's `Core`): an epoll set and the connections it holds."""
    if _native is None:
        raise RuntimeError(f"the native data plane is not available: {unavailable()}")
    return _native.Core()


_planes: dict[asyncio.AbstractEventLoop, NativePlane] = {}
"""The plane of each loop that has native listeners (one, except in tests)."""


def for_loop(loop: asyncio.AbstractEventLoop) -> NativePlane:
    """The native plane of `loop`, made at the first native listener."""
    plane = _planes.get(loop)
    if plane is None:
        plane = _planes[loop] = NativePlane(loop)
    return plane


def count_bytes() -> None:
    """Every plane of this process brings its byte counters up to date (before a scrape)."""
    for plane in list(_planes.values()):
        if not plane._closing:
            plane.count_bytes()
