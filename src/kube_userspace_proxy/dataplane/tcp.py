"""TCP listener: serves one proxy port, and refuses connections while there are no endpoints.

One descriptor per port: the socket handed in is both the reservation and the listener.
While the picker has endpoints it listens; while it has none, shutdown(SHUT_RD) takes it back
to a bound, non-listening socket (Linux: the backlog is reset, the port stays bound because it
was bound explicitly), and a SYN to it gets a RST: the client sees ECONNREFUSED. It keeps
SO_REUSEPORT, so that other processes' listeners may join the port.

Accepting is the listener's own (`loop.add_reader` on the listening socket, a burst of
accept() per wakeup) rather than `loop.create_server`: running out of descriptors (EMFILE)
is then counted, logged at most once a second and retried after a pause, on uvloop and
asyncio alike. (uvloop drops the waiting connections silently on EMFILE, and closes the
server for good when its reserve descriptor is gone too; asyncio logs every failed accept
and re-arms once per failure.) The accept also gives the client address for free.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
from collections.abc import Callable, Collection
from typing import Any

from kube_userspace_proxy import logs
from kube_userspace_proxy.dataplane import native
from kube_userspace_proxy.dataplane.connection import Connection, Settings, Shared
from kube_userspace_proxy.dataplane.stats import NO_DESCRIPTORS, ConnStats, Picker, notices

log = logs.get(__name__)

DIAL_TIMEOUTS = (0.25, 0.5, 1.0, 2.0)
KEEPALIVE = 15.0
"""TCP keepalive idle time and probe interval in seconds (Go's default); 0 turns it off."""
# Connections accepted per wakeup of the listening socket before other work gets a turn.
ACCEPT_BURST = 64
# After an accept failed for want of descriptors: wait this long before accepting again
# (the connections wait in the backlog meanwhile), instead of spinning on the failure.
ACCEPT_PAUSE = 0.1
# accept() errors about one connection that went away before it was accepted: take the next.
_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})

DATAPLANES = ("auto", "native", "python")
"""--dataplane: `native` moves bytes in C (`native.py`), `python` in asyncio Protocols
(`connection.py`, the reference); `auto` is native when the extension is built."""
_default = "auto"


def resolve(name: str) -> str:
    """`native` or `python` for a --dataplane value; ValueError for native when not built."""
    if name not in DATAPLANES:
        raise ValueError(f"--dataplane {name!r}: not one of {', '.join(DATAPLANES)}")
    if name == "auto":
        return "python" if native.unavailable() else "native"
    if name == "native" and native.unavailable():
        raise ValueError(f"--dataplane native: {native.unavailable()}")
    return name


def set_default(name: str) -> str:
    """Make `name` the data plane of listeners made without one; the resolved name."""
    global _default
    resolved = resolve(name)
    _default = name  # auto stays auto: resolved again as each listener is made
    return resolved


def default() -> str:
    """The data plane a listener made without one gets (`native` or `python`)."""
    return resolve(_default)


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


def is_listening(sock: socket.socket) -> bool:
    """True when `sock` listens (a socket handed over by another process may)."""
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def _unlisten(sock: socket.socket) -> None:
    """A listening socket back to bound and not listening; its backlog is reset."""
    with contextlib.suppress(OSError):  # ENOTCONN: it was not listening
        sock.shutdown(socket.SHUT_RD)


@functools.lru_cache(maxsize=16)
def keepalive_options(seconds: float, probes: int) -> tuple[tuple[int, int, int], ...]:
    """setsockopt triples for TCP keepalive: first probe after `seconds` idle, then one every
    `seconds`; after `probes` unanswered probes the kernel resets the connection.

    TCP_USER_TIMEOUT gets the same bound, so data left unacknowledged by a dead peer ends the
    connection as surely as silence does. Empty when `seconds` <= 0 (keepalive off). One
    object per value in a process (every listener of a worker holds it).
    """
    if seconds <= 0:
        return ()
    idle = max(1, round(seconds))  # the kernel counts in whole seconds
    return (
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle),
        (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, idle),
        (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, idle * (1 + probes) * 1000),
    )


@functools.lru_cache(maxsize=16)
def _settings(
    dial_timeouts: tuple[float, ...],
    high_water: int,
    keepalive: tuple[tuple[int, int, int], ...],
    log_connections: bool,
) -> Settings:
    """The Settings of these values: one object for every listener configured alike."""
    return Settings(dial_timeouts, high_water, high_water // 4, keepalive, log_connections)


class TcpListener:
    """Serves one proxy port; refuses connections (RST) while the picker has no endpoints.

    `sock` is a bound TCP socket (IPv4 or IPv6) that is not listening; the listener owns it
    from now on (replaced by its reservation, see `_reserve`) and closes it in `close()`.
    `stats` are the port's counters, or a function of `name` that gives them at the first
    connection. `keepalive` (seconds, 0 = off) applies TCP
    keepalive and TCP_USER_TIMEOUT to both sides of every connection.

    `adopt`: `sock` is a reservation another proxy process handed over (`handover.py`), used
    as it is; if it listens already, it is served at once and stays where it is in its
    reuseport group (`on_listen` is not told: it did not join). `release()` gives it back
    untouched. `pinned`: `sock` is a reservation already (bound to the port explicitly, with
    SO_REUSEPORT and without SO_REUSEADDR, as a worker binds its listeners), used as it is:
    making another costs 4 system calls and a socket per port, 10,000 times at a start.
    """

    __slots__ = (
        "__weakref__",
        "_address",
        "_adopted_listening",
        "_backlog",
        "_closed",
        "_dial_timeouts",
        "_family",
        "_high_water",
        "_keepalive",
        "_lid",
        "_listening",
        "_loop",
        "_picker",
        "_plane",
        "_resume",
        "_settings",
        "_shared",
        "_sock",
        "_splice",
        "_stats",
        "dataplane",
        "key",
        "name",
        "on_listen",
    )

    def __init__(
        self,
        sock: socket.socket,
        picker: Picker,
        stats: ConnStats | Callable[[str], ConnStats],
        *,
        name: str = "",
        dial_timeouts: tuple[float, ...] = DIAL_TIMEOUTS,
        splice: bool = True,
        high_water: int = 256 * 1024,
        backlog: int = 4096,
        keepalive: float = KEEPALIVE,
        adopt: bool = False,
        pinned: bool = False,
        dataplane: str | None = None,
    ) -> None:
        if sock.type != socket.SOCK_STREAM:
            raise ValueError(f"TcpListener needs a TCP socket, got {sock!r}")
        self._adopted_listening = adopt and is_listening(sock)
        if adopt or pinned:
            sock.setblocking(False)
        else:
            sock = _reserve(sock)
        self._sock: socket.socket | None = sock
        self._address = sock.getsockname()
        self._family = int(sock.family)
        self.name = name or f"tcp:{self._address[1]}"
        # The kernel's probe count (net.ipv4.tcp_keepalive_probes of this namespace).
        probes = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
        self._keepalive = keepalive_options(keepalive, probes)
        self._dial_timeouts = dial_timeouts
        self._high_water = high_water
        self._settings: Settings | None = None
        self._picker = picker
        # Or the function of the listener's name that gives them at the first connection (a
        # worker's ports share one: the counters of a port never used are not made).
        self._stats: ConnStats | Callable[[str], ConnStats] = stats
        self._splice = splice
        self._backlog = backlog
        # Accepted sockets inherit these: keepalive costs no syscall per accepted connection.
        for level, option, value in self._keepalive:
            sock.setsockopt(level, option, value)
        # What connections share (`Settings`, `Shared`): made at the first connection, as most
        # of a worker's 10,000 ports may never see one (0.5 KiB a port).
        self._shared: Shared | None = None
        self._listening = False  # listening, and registered with the loop
        self._resume: asyncio.TimerHandle | None = None  # accepting paused (no descriptors)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        # Told each time a listening socket joins the port (`key`, the socket) or leaves it
        # (`key`, None): worker processes track the order of their port's reuseport group
        # with it. `key` is the owner's name for this listener: one callback serves them all.
        self.on_listen: Callable[[Any, socket.socket | None], None] | None = None
        self.key: Any = None
        self.dataplane = resolve(dataplane) if dataplane is not None else default()
        """`native` or `python`: which data plane serves this port's connections."""
        self._plane: native.NativePlane | None = None  # the native plane, once started
        self._lid = -1  # the native plane's id of the listening socket while it accepts

    @property
    def settings(self) -> Settings:
        """What every connection of this listener is configured with."""
        settings = self._settings
        if settings is None:
            # Per-connection lines only at -v 4 and above; decided once per listener.
            debug = log.isEnabledFor(logging.DEBUG)
            settings = self._settings = _settings(
                self._dial_timeouts, self._high_water, self._keepalive, debug
            )
        return settings

    def _connections(self) -> Shared:
        """The state this listener's connections share, made at the first one."""
        shared = self._shared
        if shared is None:
            shared = self._shared = Shared(
                self.loop, self._picker, self.stats, self._splice, self.name
            )
        return shared

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "TcpListener.start() was not called"
        return self._loop

    @property
    def picker(self) -> Picker:
        """The picker new connections are served from (`set_picker` also refreshes)."""
        return self._picker

    @picker.setter
    def picker(self, picker: Picker) -> None:
        if picker is not self._picker and self._plane is not None:
            self._plane.untable(self)
        self._picker = picker
        if self._shared is not None:
            self._shared.picker = picker

    @property
    def keepalive_options(self) -> tuple[tuple[int, int, int], ...]:
        """The keepalive setsockopt triples of this listener's connections (() = off)."""
        return self._keepalive

    @property
    def stats(self) -> ConnStats:
        stats = self._stats
        if not isinstance(stats, ConnStats):
            stats = self._stats = stats(self.name)
        return stats

    @property
    def splice(self) -> bool:
        """True while connections may switch to splice (cleared if splice(2) is refused)."""
        if self._plane is not None:
            return self._splice and self._plane.splice
        return self._shared.splice if self._shared is not None else self._splice

    @property
    def conns(self) -> Collection[Connection]:
        """The open connections of the Python data plane (the native one keeps its own)."""
        return self._shared.conns if self._shared is not None else ()

    async def start(self) -> None:
        """Begin serving: listen now if the picker has endpoints, else refuse.

        Raises OSError when the port cannot listen.
        """
        self._loop = loop = asyncio.get_running_loop()
        if self.dataplane == "native" and self._plane is None and not self._closed:
            self._plane = native.for_loop(loop)
            self._plane.attach(self)
        if self._adopted_listening and not self._closed:
            # Handed over listening: accept from it as it is (its backlog and its place in
            # the reuseport group are kept); without endpoints it refuses from now on.
            self._adopted_listening = False
            assert self._sock is not None
            self._watch(self._sock)
            self._listening = True
            if not self._picker:
                self._stop_listening()
            return
        if self._picker and not self._closed:
            self._listen()

    def set_picker(self, picker: Picker) -> None:
        """Use another picker for new connections, then `refresh()`."""
        self.picker = picker
        self.refresh()

    def refresh(self) -> None:
        """Listen while the picker has endpoints; refuse (port kept) while it has none.

        The port listens when this returns. A failure to listen is logged; the next
        refresh() tries again.
        """
        if self._closed or self._loop is None:
            return
        if not self._picker:
            self._stop_listening()
        elif not self._listening:
            try:
                self._listen()
            except OSError as exc:
                log.error("%s: cannot listen on %s: %s", self.name, self._address, exc)

    def _listen(self) -> None:
        """Listen on the reserved socket and accept from it; raises OSError on failure."""
        sock = self._sock
        assert sock is not None
        sock.listen(self._backlog)
        try:
            self._watch(sock)
        except BaseException:
            _unlisten(sock)
            raise
        self._listening = True
        log.debug("%s: listening on %s", self.name, self._address)
        if self.on_listen is not None:
            self.on_listen(self.key, sock)

    def _watch(self, sock: socket.socket) -> None:
        """Accept from the listening `sock` from now on, on this listener's data plane."""
        if self._plane is not None:
            self._lid = self._plane.watch(self, sock)
        else:
            self.loop.add_reader(sock.fileno(), self._accept)

    def _unwatch(self, sock: socket.socket) -> None:
        if self._plane is not None:
            if self._lid >= 0:
                self._plane.unwatch(self, self._lid)
                self._lid = -1
        else:
            self.loop.remove_reader(sock.fileno())

    def pause_accepting(self) -> None:
        """Accepting failed (no descriptors): stop for ACCEPT_PAUSE seconds (native plane)."""
        if self._listening and self._sock is not None and self._resume is None:
            self._pause_accepting(self._sock)

    def _accept(self) -> None:
        """The listening socket is readable: accept a burst of connections."""
        lsock = self._sock
        if not self._listening or lsock is None:
            return
        shared = self._shared or self._connections()
        settings = self._settings or self.settings
        # The raw accept: socket.accept() would build the family and type enums per call.
        accept = lsock._accept  # type: ignore[attr-defined]
        family = self._family
        for _ in range(ACCEPT_BURST):
            try:
                fd, address = accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in NO_DESCRIPTORS:
                    self.stats.no_descriptors += 1
                    notices.no_descriptors(self.name, "accept", exc)
                    self._pause_accepting(lsock)
                    return
                if exc.errno in _GONE:
                    continue
                log.warning("%s: accept failed: %s", self.name, exc)
                return
            sock = socket.socket(family, socket.SOCK_STREAM, 0, fd)
            Connection(settings, shared).start(sock, address)

    def _pause_accepting(self, lsock: socket.socket) -> None:
        # Level-triggered readiness would call _accept again at once: stop watching the
        # socket for a moment; the kernel keeps new connections in the backlog meanwhile.
        loop = self.loop
        self._unwatch(lsock)
        self._resume = loop.call_later(ACCEPT_PAUSE, self._resume_accepting, lsock)

    def _resume_accepting(self, lsock: socket.socket) -> None:
        self._resume = None
        if self._listening and self._sock is lsock:
            self._watch(lsock)

    def _stop_listening(self) -> None:
        """Refuse from now on, keeping the port."""
        sock = self._sock
        if not self._listening or sock is None:
            return
        self._stop_accepting(sock)
        # Unlistening resets the connections still in the backlog, as closing would.
        _unlisten(sock)
        log.debug("%s: refusing on %s", self.name, self._address)
        if self.on_listen is not None:
            self.on_listen(self.key, None)

    async def close(self) -> None:
        """Stop accepting and release the port; connections in flight go on to finish."""
        self._closed = True
        if self._loop is not None:
            self._stop_listening()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._plane is not None:
            self._plane.detach(self)

    async def release(self) -> None:
        """Stop accepting and close this process's descriptor only: the socket, its backlog
        and its place in the reuseport group stay with the process it was handed over to
        (never shutdown(), which would stop that process's listening too). Connections in
        flight go on to finish."""
        self._closed = True
        sock = self._sock
        if sock is None:
            return
        if self._listening:
            self._stop_accepting(sock)
        sock.close()
        self._sock = None
        if self._plane is not None:
            self._plane.detach(self)

    def _stop_accepting(self, sock: socket.socket) -> None:
        """No more accept() calls here: the reader (or the resume after EMFILE) is dropped."""
        self._listening = False
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        else:
            self._unwatch(sock)

    def fileno(self) -> int:
        """The descriptor of the port's socket (to hand it over); -1 once closed."""
        return self._sock.fileno() if self._sock is not None else -1

    async def drain(self, timeout: float) -> None:  # noqa: ASYNC109 - the contract's shape
        """Wait up to `timeout` seconds for connections in flight, then close the rest (FIN)."""
        plane, shared = self._plane, self._shared
        if plane is not None:
            await plane.drain(self, timeout)
        elif shared is not None and shared.conns:
            conns = shared.conns
            shared.idle = self.loop.create_future()
            try:
                close = functools.partial(_abort_all, conns)
                await wait_idle(self.name, shared.idle, timeout, lambda: len(conns), close)
            finally:
                shared.idle = None

    @property
    def address(self) -> tuple[Any, ...]:
        """The bound address (host, port[, flowinfo, scope_id])."""
        return tuple(self._address)

    @property
    def port(self) -> int:
        return int(self._address[1])

    @property
    def active_connections(self) -> int:
        if self._plane is not None:
            return self._plane.active(self)
        return len(self.conns)

    @property
    def accepting(self) -> bool:
        """True while a socket listens on the port (the picker has endpoints)."""
        return self._listening

    @property
    def buffered_bytes(self) -> int:
        """Bytes the proxy holds for its connections: write and dial buffers, splice pipes."""
        if self._plane is not None:
            return self._plane.buffered(self)
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


def _abort_all(conns: Collection[Connection]) -> None:
    """End every connection with a FIN, as a process exit would: shutting down is no error."""
    for conn in list(conns):
        conn.abort(reset=False)


async def wait_idle(
    name: str,
    idle: asyncio.Future[None],
    timeout: float,  # noqa: ASYNC109 - drain's
    still_open: Callable[[], int],
    close: Callable[[], object],
) -> None:
    """Wait for `idle`; after `timeout` seconds close what is still open (and say so)."""
    try:
        async with asyncio.timeout(timeout):
            await idle
    except TimeoutError:
        log.info("%s: closing %d connections still open after %.1fs", name, still_open(), timeout)
        close()
