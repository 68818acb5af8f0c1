"""Proxy ports: allocation (`--proxy-port-range`, else the kernel's ephemeral range) and the
descriptor budget that bounds how many may be held."""

from __future__ import annotations

import errno
import os
import random
import resource
import socket
from collections.abc import Callable

from kube_userspace_proxy import logs
from kube_userspace_proxy.config.settings import MAX_PORT as _MAX_PORT
from kube_userspace_proxy.errors import DescriptorBudgetError, PortExhaustedError
from kube_userspace_proxy.model import Protocol

log = logs.get(__name__)


# A bind that fails with one of these means "someone else has it": try the next port.
_TAKEN_ERRNOS = frozenset({errno.EADDRINUSE, errno.EACCES})


def ephemeral_range() -> tuple[int, int] | None:
    """The kernel's ephemeral port range (net.ipv4.ip_local_port_range), None if unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return None
    return (low, high) if 0 < low <= high <= _MAX_PORT else None


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class PortAllocator:
    """Hands out bound sockets on free proxy ports; TCP and UDP are tracked separately.

    Within a range (without one: the kernel's ephemeral range) it goes on from where the
    previous search ended (the first from a random port) and wraps, skipping ports it already
    handed out and ports whose bind fails because another socket holds them.
    """

    def __init__(
        self, port_range: tuple[int, int] | None, *, host: str = "0.0.0.0", share_udp: bool = False
    ) -> None:
        if port_range is not None:
            low, high = port_range
            if not 0 < low <= high <= _MAX_PORT:
                raise ValueError(f"invalid port range {low}-{high}")
        self.port_range = port_range
        self.host = host
        # Worker processes join UDP ports with SO_REUSEPORT, which the first socket must
        # carry from its bind on (TCP listeners join a reservation that sets it later).
        self.share_udp = share_udp
        self._family = _family(host)
        self._taken: dict[Protocol, set[int]] = {Protocol.TCP: set(), Protocol.UDP: set()}
        self._cursor: dict[Protocol, int] = {}
        # Without a range the ports come from the kernel's ephemeral range, but picked here:
        # bind(0) searches that range for a free port every time, which took 9.3 s for
        # 10,000 ports; an explicit bind is one lookup.
        self._ephemeral = None if port_range is not None else ephemeral_range()

    def reserve(
        self, protocol: Protocol, *, name: str = "", prefer: int | None = None
    ) -> socket.socket:
        """A bound, non-blocking, not yet listening socket on a free port; the caller owns it.

        `prefer` (e.g. the port an earlier run's rules still point at) is taken when it is free
        and inside the range, if one is set; otherwise a port is chosen as usual. Raises
        PortExhaustedError (naming the range and `name`, the service port) when every port of
        the range is taken.
        """
        taken = self._taken[protocol]
        if prefer and prefer not in taken and self._in_range(prefer):
            # The earlier run's accepted connections may still sit in TIME_WAIT on this port;
            # they inherited SO_REUSEPORT (not SO_REUSEADDR) from its listener, and only
            # SO_REUSEPORT gets past them. It is a port this proxy's own rules name.
            sock = self._bind(protocol, prefer, reuseport=protocol is Protocol.TCP)
            if isinstance(sock, socket.socket):
                taken.add(prefer)
                return sock
            log.debug("%s: preferred %s port %d is taken", name or "?", protocol, prefer)
        scan = self.port_range or self._ephemeral
        if scan is None:
            sock = self._bind(protocol, 0)
            if not isinstance(sock, socket.socket):  # the kernel ran out of ephemeral ports
                raise PortExhaustedError(
                    f"no free {protocol} port on {self.host} chosen by the kernel"
                    + (f" for {name}" if name else "")
                )
            taken.add(sock.getsockname()[1])
            return sock
        low, high = scan
        size = high - low + 1
        # A cursor per protocol, from a random start: the next search begins where the last
        # one ended, so handing out many ports stays linear.
        start = self._cursor.get(protocol, random.randrange(size)) % size
        denied = 0
        for i in range(size):
            port = low + (start + i) % size
            if port in taken:
                continue
            # The ephemeral range is shared with the node's connections: bind strictly there.
            sock = self._bind(protocol, port, strict=self.port_range is None)
            if isinstance(sock, socket.socket):
                taken.add(port)
                self._cursor[protocol] = start + i + 1
                return sock
            denied += sock == errno.EACCES
        where = (
            f"--proxy-port-range={low}-{high}"
            if self.port_range
            else f"the kernel's ephemeral range (net.ipv4.ip_local_port_range={low}-{high})"
        )
        raise PortExhaustedError(
            f"no free {protocol} port left in {where} on {self.host}"
            + (f" for {name}" if name else "")
            + f" ({len(taken)} held by this proxy"
            + (f", {denied} not permitted" if denied else "")
            + ", the rest by other sockets); widen the range or free ports"
        )

    def _in_range(self, port: int) -> bool:
        if self.port_range is None:
            return 0 < port <= _MAX_PORT
        return self.port_range[0] <= port <= self.port_range[1]

    def adopt(self, protocol: Protocol, sock: socket.socket) -> socket.socket:
        """Count a bound socket another process handed over as handed out here; returns it."""
        self._taken[protocol].add(sock.getsockname()[1])
        return sock

    def release(self, protocol: Protocol, port: int) -> None:
        """Forget a port handed out by `reserve` (the caller closes the socket)."""
        self._taken[protocol].discard(port)

    def reserved(self, protocol: Protocol) -> frozenset[int]:
        """The ports of `protocol` currently handed out."""
        return frozenset(self._taken[protocol])

    def _bind(
        self, protocol: Protocol, port: int, *, reuseport: bool = False, strict: bool = False
    ) -> socket.socket | int:
        """A bound socket, or the errno saying the port is taken (other errors raise).

        `strict`: SO_REUSEADDR only after the bind, so that a port any socket uses (even a
        connection's, which would make the listen fail later) counts as taken.
        """
        kind = socket.SOCK_STREAM if protocol is Protocol.TCP else socket.SOCK_DGRAM
        sock = socket.socket(self._family, kind)
        try:
            if self.host == "::":
                # Take IPv4 too (as ::ffff:a.b.c.d), whatever net.ipv6.bindv6only says: the
                # rules send both families' Service traffic to this port.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            if protocol is Protocol.TCP and not strict:
                # A restart must be able to rebind a port whose old connections sit in TIME_WAIT.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuseport or (self.share_udp and protocol is Protocol.UDP):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((self.host, port))
            if protocol is Protocol.TCP and strict:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            if exc.errno in _TAKEN_ERRNOS:
                log.debug("port %s/%d is taken: %s", protocol, port, exc.strerror)
                return exc.errno
            raise
        return sock


MIN_DESCRIPTOR_RESERVE = 256


def descriptor_limit() -> int:
    """This process's RLIMIT_NOFILE soft limit."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_descriptors() -> int:
    """How many descriptors this process holds now (one directory listing: once per sync)."""
    return len(os.listdir("/proc/self/fd"))


class DescriptorBudget:
    """How many more descriptors proxy ports may take, keeping a reserve free.

    The reserve (a twentieth of RLIMIT_NOFILE, at least 256) is for everything else: the
    iptables runs, the ops server, the API connection, proxied connections. `start()` counts
    what is open at the beginning of a sync; each port opened during it is `take()`n.
    """

    def __init__(
        self,
        *,
        limit: Callable[[], int] = descriptor_limit,
        count: Callable[[], int] = open_descriptors,
        reserve: int | None = None,
    ) -> None:
        self._limit_of = limit
        self._count = count
        self._reserve = reserve
        self.limit = 0
        self.used = 0

    @property
    def reserve(self) -> int:
        if self._reserve is not None:
            return self._reserve
        return max(MIN_DESCRIPTOR_RESERVE, self.limit // 20)

    def start(self) -> None:
        """A sync begins: what is open is counted when it first opens a port."""
        self.limit = self._limit_of()
        self.used = -1

    def take(self, what: str, count: int = 1) -> None:
        """Account for `count` new descriptors for `what`, or raise DescriptorBudgetError."""
        if self.used < 0:  # listing /proc/self/fd costs 12 ms at 10,000 ports: only when needed
            self.used = self._count()
        allowed = self.limit - self.reserve
        if self.used + count > allowed:
            raise DescriptorBudgetError(
                f"refused {what}: no descriptor left within RLIMIT_NOFILE={self.limit} but"
                f" the {self.reserve} kept in reserve (iptables, ops server, API connection,"
                " proxied connections); raise the limit (LimitNOFILE, ulimit -n) or serve"
                " fewer Services on this node"
            )
        self.used += count
