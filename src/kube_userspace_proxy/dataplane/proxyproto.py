"""PROXY protocol headers (HAProxy's spec, v1 text and v2 binary) for backends that ask.

A userspace proxy dials the backend from the node, so the backend sees the node's address. A
Service annotated `kube-userspace-proxy.io/proxy-protocol: v1|v2` gets this header in front
of the first byte of every connection instead: the client's address and port, and the
address and port the client dialed (the ClusterIP, NodePort or external IP before iptables
rewrote it, read from conntrack with SO_ORIGINAL_DST), so the backend can log or filter on
them. Built once per connection, after the dial succeeded; TCP only.

The client's address is the one accept() returned, never read back from the socket later: a
client that resets while the dial runs leaves a socket with no peer, and forwarding its bytes
without a header would let it write the header itself. Where the destination cannot be read
either, the header says so (`PROXY UNKNOWN`, v2 LOCAL), as HAProxy's does.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from kube_userspace_proxy.model import Address

SO_ORIGINAL_DST = 80
"""linux/netfilter_ipv4.h; IP6T_SO_ORIGINAL_DST (linux/netfilter_ipv6/ip6_tables.h) is 80 too."""
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
_V2_PROXY = 0x21  # version 2, command PROXY
_V2_LOCAL = 0x20  # version 2, command LOCAL: the receiver uses the connection's own addresses
_V2_UNSPEC = 0x00  # AF_UNSPEC, UNSPEC
_V2_TCP4 = 0x11  # AF_INET, STREAM
_V2_TCP6 = 0x21  # AF_INET6, STREAM
_MAPPED = "::ffff:"


def original_destination(sock: Any) -> Address:
    """Where the client sent the connection before NAT; the local address when not NATed.

    `sock` is the accepted socket (or uvloop's stand-in for it, which has getsockopt).
    """
    try:
        if sock.family == socket.AF_INET6:
            raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
            port, packed = struct.unpack_from("!2xH4x16s", raw)
            return socket.inet_ntop(socket.AF_INET6, packed), port
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, packed = struct.unpack_from("!2xH4s", raw)
        return socket.inet_ntop(socket.AF_INET, packed), port
    except OSError:  # ENOENT: no conntrack entry (a direct connection to the proxy port)
        local = sock.getsockname()
        return local[0], local[1]


def header(version: int, client: Address, destination: Address) -> bytes:
    """The PROXY header (`version` 1 or 2) for a TCP connection from `client` to `destination`."""
    src, dst = _same_family(client[0], destination[0])
    v6 = ":" in src
    if version == 1:
        return b"PROXY %s %s %s %d %d\r\n" % (
            b"TCP6" if v6 else b"TCP4",
            src.encode(),
            dst.encode(),
            client[1],
            destination[1],
        )
    family = socket.AF_INET6 if v6 else socket.AF_INET
    addresses = (
        socket.inet_pton(family, src)
        + socket.inet_pton(family, dst)
        + struct.pack("!HH", client[1], destination[1])
    )
    return (
        V2_SIGNATURE
        + struct.pack("!BBH", _V2_PROXY, _V2_TCP6 if v6 else _V2_TCP4, len(addresses))
        + addresses
    )


def unknown(version: int) -> bytes:
    """The header that names no addresses: v1 `PROXY UNKNOWN`, v2 LOCAL with no address block."""
    if version == 1:
        return b"PROXY UNKNOWN\r\n"
    return V2_SIGNATURE + struct.pack("!BBH", _V2_LOCAL, _V2_UNSPEC, 0)


def for_connection(version: int, sock: Any, client: Address) -> bytes:
    """The header for the accepted socket `sock` from `client` (the address accept() returned).

    `PROXY UNKNOWN` / LOCAL when the socket can no longer say where it was sent.
    """
    try:
        return header(version, client, original_destination(sock))
    except (OSError, AttributeError, ValueError):  # the socket is gone, or an odd address
        return unknown(version)


def _same_family(src: str, dst: str) -> tuple[str, str]:
    """Both addresses in one family, as the header needs: IPv4 when both are IPv4(-mapped)."""
    src_v4 = _unmapped(src)
    dst_v4 = _unmapped(dst)
    if ":" not in src_v4 and ":" not in dst_v4:
        return src_v4, dst_v4
    return (src if ":" in src else _MAPPED + src), (dst if ":" in dst else _MAPPED + dst)


def _unmapped(address: str) -> str:
    if address.startswith(_MAPPED) and "." in address:
        return address[len(_MAPPED) :]
    return address
