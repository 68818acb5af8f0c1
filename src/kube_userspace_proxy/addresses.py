"""Node identity and address helpers: node name, node IPs from a Node object, IP families."""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from kube_userspace_proxy.errors import ConfigError

Family = Literal[4, 6]

NODE_NAME_ENV = "NODE_NAME"
"""Environment variable naming the node (set from the downward API in the DaemonSet)."""


def node_name(
    hostname_override: str | None = None, *, environ: Mapping[str, str] | None = None
) -> str:
    """The node's name: `--hostname-override`, else `$NODE_NAME`, else the hostname (lowercased).

    Lowercased and trimmed like kube-proxy, since Node names are DNS subdomains.
    """
    env = os.environ if environ is None else environ
    for candidate in (hostname_override, env.get(NODE_NAME_ENV), socket.gethostname()):
        name = (candidate or "").strip().lower()
        if name:
            return name
    raise ConfigError("cannot determine the node name: set --hostname-override or $NODE_NAME")


def ip_family(address: str) -> Family | None:
    """4 or 6 for a valid IP address (no prefix length), None otherwise."""
    try:
        return 6 if isinstance(ipaddress.ip_address(address), ipaddress.IPv6Address) else 4
    except ValueError:
        return None


def forbidden_kind(packed: bytes) -> str | None:
    """Why a packed IPv4/IPv6 address may never be an endpoint or a VIP (None: it may).

    The kinds kube-apiserver's endpoint validation rejects, plus multicast and broadcast:
    loopback, link-local (169.254.0.0/16, the cloud metadata server included; fe80::/10),
    unspecified. Dialing or capturing one of these would reach the node itself, not a pod.
    An IPv4-mapped IPv6 address is judged by its IPv4 part (a dual-stack socket dials it).
    """
    if len(packed) == 16:
        if packed[:12] == _V4_MAPPED:
            packed = packed[12:]
        elif packed == _V6_LOOPBACK:
            return "loopback"
        elif packed == bytes(16):
            return "unspecified"
        elif packed[0] == 0xFE and packed[1] & 0xC0 == 0x80:
            return "link-local"
        elif packed[0] == 0xFF:
            return "multicast"
        else:
            return None
    first = packed[0]
    if first == 127:
        return "loopback"
    if first == 0:
        return "unspecified"
    if first == 169 and packed[1] == 254:
        return "link-local"
    if 224 <= first <= 239:
        return "multicast"
    if packed == b"\xff\xff\xff\xff":
        return "broadcast"
    return None


_V4_MAPPED = bytes(10) + b"\xff\xff"
_V6_LOOPBACK = bytes(15) + b"\x01"


def is_ipv6(address: str) -> bool:
    """True for a valid IPv6 address."""
    return ip_family(address) == 6


def by_family(addresses: Iterable[str], family: Family) -> tuple[str, ...]:
    """The valid addresses of one family, in their order."""
    return tuple(a for a in addresses if ip_family(a) == family)


def join_host_port(host: str, port: int) -> str:
    """`host:port`, bracketing IPv6 literals as `[::1]:80` (Go's net.JoinHostPort)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


NODEPORT_PRIMARY = "primary"
"""kube-proxy's nodePortAddresses keyword for the Node's primary IPs (one per family)."""


def primary_cidrs(node_ips: Iterable[str]) -> tuple[str, ...]:
    """What `nodePortAddresses: [primary]` means for `node_ips`: the first IP of each family,
    as a host CIDR (kube-proxy 1.29+ expands the keyword from the node's IPs the same way)."""
    cidrs: list[str] = []
    families: set[Family] = set()
    for ip in node_ips:
        family = ip_family(ip)
        if family is not None and family not in families:
            families.add(family)
            cidrs.append(f"{ip}/{32 if family == 4 else 128}")
    return tuple(cidrs)


def nodeport_cidrs(configured: Sequence[str], node_ips: Iterable[str]) -> tuple[str, ...]:
    """The CIDRs a `nodePortAddresses` setting names now: `primary` expanded from `node_ips`
    (none known: none), any other setting as it is."""
    if tuple(configured) == (NODEPORT_PRIMARY,):
        return primary_cidrs(node_ips)
    return tuple(configured)


def node_ips(node: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The node's primary IP, then the first IP of the other family (dual stack), if any.

    Mirrors Kubernetes' GetNodeHostIPs: InternalIPs rank before ExternalIPs; other address
    types (Hostname, InternalDNS) are not IPs and are skipped.
    """
    if not node:
        return ()
    addresses = (node.get("status") or {}).get("addresses") or ()
    ranked: list[str] = []
    for wanted in ("InternalIP", "ExternalIP"):
        for entry in addresses:
            if isinstance(entry, Mapping) and entry.get("type") == wanted:
                address = str(entry.get("address", ""))
                if ip_family(address) is not None and address not in ranked:
                    ranked.append(address)
    if not ranked:
        return ()
    primary = ranked[0]
    other: Family = 4 if ip_family(primary) == 6 else 6
    second = next((a for a in ranked if ip_family(a) == other), None)
    return (primary, second) if second else (primary,)


class _SockaddrIn(ctypes.Structure):
    _fields_ = (
        ("family", ctypes.c_ushort),
        ("port", ctypes.c_uint16),
        ("addr", ctypes.c_ubyte * 4),
    )


class _SockaddrIn6(ctypes.Structure):
    _fields_ = (
        ("family", ctypes.c_ushort),
        ("port", ctypes.c_uint16),
        ("flowinfo", ctypes.c_uint32),
        ("addr", ctypes.c_ubyte * 16),
        ("scope_id", ctypes.c_uint32),
    )


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = (
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockaddrIn6)),
    ("netmask", ctypes.c_void_p),
    ("ifu", ctypes.c_void_p),
    ("data", ctypes.c_void_p),
)


def local_addresses() -> tuple[str, ...]:
    """Every IP address configured on this network namespace's interfaces (getifaddrs(3)).

    Link-local IPv6 addresses are left out: NodePorts are not served on them.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"getifaddrs: {os.strerror(err)}")
    found: list[str] = []
    try:
        entry = head
        while entry:
            sockaddr = entry.contents.addr
            if sockaddr:
                family = sockaddr.contents.family
                if family == socket.AF_INET:
                    raw = ctypes.cast(sockaddr, ctypes.POINTER(_SockaddrIn)).contents.addr
                    found.append(str(ipaddress.IPv4Address(bytes(raw))))
                elif family == socket.AF_INET6:
                    v6 = ipaddress.IPv6Address(bytes(sockaddr.contents.addr))
                    if not v6.is_link_local:
                        found.append(str(v6))
            entry = entry.contents.next
    finally:
        libc.freeifaddrs(head)
    return tuple(dict.fromkeys(found))


def families_of(addresses: Iterable[str]) -> frozenset[Family]:
    """The families of the valid IP addresses among `addresses`."""
    return frozenset(f for a in addresses if (f := ip_family(a)) is not None)


def host_families() -> frozenset[Family]:
    """The families this network namespace has usable addresses in: loopback and link-local
    left out (a node that has only those in a family has no address of it the cluster can
    reach). Empty when the interfaces cannot be read."""
    try:
        found = local_addresses()
    except OSError:
        return frozenset()
    return families_of(a for a in found if not ipaddress.ip_address(a).is_loopback)


def ipv6_sockets() -> bool:
    """Whether this kernel makes IPv6 sockets (not with ipv6.disable=1 on its command line)."""
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    except OSError:
        return False
    return True


def unspecified_address(families: Iterable[Family]) -> str:
    """The unspecified address whose sockets take `families`: `::` when IPv6 is among them
    (dual-stack sockets, IPV6_V6ONLY off: one descriptor per port for both) and this kernel
    makes IPv6 sockets, else 0.0.0.0."""
    return "::" if 6 in set(families) and ipv6_sockets() else "0.0.0.0"
