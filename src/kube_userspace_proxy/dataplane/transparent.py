"""Transparent dialing (--preserve-source-ip): which source address a backend socket gets.

A backend is dialed from the client's own address only where its reply comes back through
this node: the client is a pod of this node (its address is in one of the node's local-client
CIDRs: replies from anywhere are routed to this node), or the endpoint runs on this node
(its replies leave through this node whatever the client). Anywhere else (an external client
and a remote endpoint) the reply would go straight to the client and the spoofed connect
would time out: the node dials from its own address, as kube-proxy masquerades there.
Clients on the node itself (loopback, or any of the node's addresses) keep that address and are
dialed as today: a pod cannot answer 127.0.0.1, and the node's own address needs no spoofing.

The socket gets IP_TRANSPARENT (IPV6_TRANSPARENT), which lets it bind a foreign address, and
is bound to (client ip, 0): the kernel picks the source port. Reusing the client's own port
(as Envoy's original_src can) collides with a direct connection the client may already have
from that port to the same endpoint; a kernel-chosen port cannot. IP_BIND_ADDRESS_NO_PORT
defers the port choice to connect(), where the kernel picks it per 4-tuple. The replies reach
the socket through the portals' return path (a `-m socket --transparent` mark and a routing
table with `local default dev lo`).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
import os
import socket
from collections.abc import Callable

from kube_userspace_proxy.dataplane.stats import ConnStats
from kube_userspace_proxy.model import SourcePolicy

# Not in Python's socket module on every version (values from linux/in.h, linux/in6.h).
IP_TRANSPARENT = getattr(socket, "IP_TRANSPARENT", 19)
IPV6_TRANSPARENT = 75
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)

NODE, CLIENT_POD, LOCAL_ENDPOINT = 0, 1, 2
"""Why a dial got its source address: the node's own, or the client's (and why)."""
REASONS = ("node", "client-pod", "local-endpoint")
"""The names of NODE, CLIENT_POD and LOCAL_ENDPOINT, as metrics and /debug/state show them."""

# Client addresses remembered per policy; past it the memory starts over (a flood of new
# client addresses costs a parse each, not unbounded memory).
_MAX_REMEMBERED = 65536


class SourceChooser:
    """Decides the source address of each dial under one SourcePolicy (see `choose`)."""

    __slots__ = ("_known", "_networks", "policy")

    def __init__(self, policy: SourcePolicy) -> None:
        self.policy = policy
        self._networks = tuple(ipaddress.ip_network(c, strict=False) for c in policy.client_cidrs)
        # client ip -> (address to bind, in a local-client CIDR); None: never bind it.
        self._known: dict[str, tuple[str, bool] | None] = {}

    def choose(self, client_ip: str, endpoint_ip: str, endpoint_local: bool) -> tuple[int, str]:
        """(reason, address to bind): CLIENT_POD or LOCAL_ENDPOINT with the client's address
        in the endpoint's family, or NODE with "" (dial from the node, as usual)."""
        known = self._known.get(client_ip, _UNKNOWN)
        if known is _UNKNOWN:
            known = self._learn(client_ip)
        if known is None or (":" in known[0]) != (":" in endpoint_ip):
            return NODE, ""
        if known[1]:
            return CLIENT_POD, known[0]
        if endpoint_local:
            return LOCAL_ENDPOINT, known[0]
        return NODE, ""

    def _learn(self, client_ip: str) -> tuple[str, bool] | None:
        known = self._known
        if len(known) >= _MAX_REMEMBERED:
            known.clear()
        try:
            ip = ipaddress.ip_address(client_ip.partition("%")[0])
        except ValueError:
            known[client_ip] = None
            return None
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # a v4 client of a dual-stack listener
        verdict = None
        if not (ip.is_loopback or ip.is_unspecified or _is_local(str(ip))):
            verdict = (str(ip), any(ip in n for n in self._networks))
        known[client_ip] = verdict
        return verdict


_UNKNOWN: tuple[str, bool] = ("?", False)
_CONNECTING = frozenset((errno.EALREADY, errno.EINPROGRESS))


def _is_local(ip: str) -> bool:
    """True when `ip` is one of this host's addresses (a hostNetwork client: the node itself,
    which keeps its own address). Asked once per client address: a bind without
    IP_TRANSPARENT succeeds only on a local address."""
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def count_source(stats: ConnStats, reason: int) -> None:
    """Count one dial of the transparent mode by the source address it got, and why."""
    if reason == CLIENT_POD:
        stats.source_client_pod += 1
    elif reason == LOCAL_ENDPOINT:
        stats.source_local_endpoint += 1
    else:
        stats.source_node += 1


@functools.lru_cache(maxsize=8)
def chooser_for(policy: SourcePolicy) -> SourceChooser:
    """The one chooser of `policy` in this process (its memory of clients is shared)."""
    return SourceChooser(policy)


def transparent_socket(kind: int, bind_ip: str) -> socket.socket:
    """A non-blocking socket of `kind` bound to (`bind_ip`, 0) with IP(V6)_TRANSPARENT set.

    Raises OSError (EPERM without CAP_NET_ADMIN); the socket is closed then.
    """
    v6 = ":" in bind_ip
    sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, kind | socket.SOCK_NONBLOCK)
    try:
        if v6:
            sock.setsockopt(socket.IPPROTO_IPV6, IPV6_TRANSPARENT, 1)
        else:
            sock.setsockopt(socket.IPPROTO_IP, IP_TRANSPARENT, 1)
            if kind == socket.SOCK_STREAM:
                sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((bind_ip, 0))
    except BaseException:
        sock.close()
        raise
    return sock


async def connect_from(
    loop: asyncio.AbstractEventLoop,
    protocol: Callable[[], asyncio.Protocol],
    address: tuple[str, int],
    bind_ip: str,
) -> None:
    """Connect a transparent TCP socket bound to `bind_ip` to `address`, served by the
    protocol `protocol()` makes (as `loop.create_connection(protocol, *address)` would).

    The connect is the socket's own (connect_ex, then one writability wait): measured, half
    the CPU of `loop.sock_connect`, which costs a future, a callback and a retry per call.
    The wait is skipped when a second connect_ex already has the outcome: an endpoint on this
    node (a veth away) had answered the SYN by then in every dial measured, and the wait (a
    poll handle, a future, a pass of the loop) was a quarter of a transparent dial's CPU.
    A farther endpoint pays one system call more.
    """
    sock = transparent_socket(socket.SOCK_STREAM, bind_ip)
    try:
        err = sock.connect_ex(address)
        if err == errno.EINPROGRESS:
            # 0 (or EISCONN): established; an errno: failed; EALREADY: still connecting.
            err = sock.connect_ex(address)
            if err == errno.EISCONN:
                err = 0
        if err in _CONNECTING:
            fd = sock.fileno()
            waiter = loop.create_future()
            loop.add_writer(fd, _writable, waiter)
            try:
                await waiter
            finally:
                loop.remove_writer(fd)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, f"connect to {address[0]}:{address[1]}: {os.strerror(err)}")
        await loop.create_connection(protocol, sock=sock)
    except BaseException:
        sock.close()
        raise


async def dial_from(  # noqa: PLR0917 - one dial, field by field
    loop: asyncio.AbstractEventLoop,
    protocol: Callable[[], asyncio.Protocol],
    address: tuple[str, int],
    chooser: SourceChooser,
    client_ip: str,
    endpoint_local: bool,
    stats: ConnStats,
) -> None:
    """Dial `address` from the address `chooser` picks for `client_ip` (the client's, or the
    node's as usual); the dial is counted in `stats` by that choice once it succeeded."""
    reason, bind_ip = chooser.choose(client_ip, address[0], endpoint_local)
    if reason:
        await connect_from(loop, protocol, address, bind_ip)
    else:
        await loop.create_connection(protocol, address[0], address[1])
    count_source(stats, reason)


def _writable(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
