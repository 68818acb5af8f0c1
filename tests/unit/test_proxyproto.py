"""PROXY protocol headers: the v1 text and v2 bytes of HAProxy's spec, read back by a parser."""

from __future__ import annotations

import ipaddress
import socket
import struct

import pytest

from kube_userspace_proxy.dataplane import proxyproto

SIGNATURE = bytes.fromhex("0d0a0d0a000d0a515549540a")  # the spec's 12-byte v2 signature


def parse_v2(data: bytes) -> dict[str, object]:
    """A reader of v2 headers written from the spec (section 2.2), independent of the writer."""
    assert data[:12] == SIGNATURE
    ver_cmd, fam, length = data[12], data[13], struct.unpack("!H", data[14:16])[0]
    body = data[16 : 16 + length]
    assert len(body) == length
    out: dict[str, object] = {"version": ver_cmd >> 4, "command": ver_cmd & 0xF}
    family, transport = fam >> 4, fam & 0xF
    out["transport"] = {1: "STREAM", 2: "DGRAM"}[transport]
    size = {1: 4, 2: 16}[family]
    out["src"] = str(ipaddress.ip_address(body[:size]))
    out["dst"] = str(ipaddress.ip_address(body[size : 2 * size]))
    out["sport"], out["dport"] = struct.unpack("!HH", body[2 * size : 2 * size + 4])
    out["rest"] = data[16 + length :]
    return out


def test_v2_ipv4_bytes_follow_the_spec() -> None:
    head = proxyproto.header(2, ("10.244.1.10", 51234), ("10.96.0.10", 80))
    assert head == (
        SIGNATURE
        + bytes([0x21, 0x11, 0x00, 0x0C])  # v2 PROXY, TCP over IPv4, 12 address bytes
        + bytes([10, 244, 1, 10, 10, 96, 0, 10])
        + struct.pack("!HH", 51234, 80)
    )
    assert parse_v2(head + b"GET /") == {
        "version": 2,
        "command": 1,
        "transport": "STREAM",
        "src": "10.244.1.10",
        "dst": "10.96.0.10",
        "sport": 51234,
        "dport": 80,
        "rest": b"GET /",
    }


def test_v2_ipv6_header_has_36_address_bytes() -> None:
    head = proxyproto.header(2, ("fd00:1::10", 40000), ("fd00:96::10", 443))
    assert head[12:16] == bytes([0x21, 0x21, 0x00, 0x24])
    parsed = parse_v2(head)
    assert (parsed["src"], parsed["dst"], parsed["sport"], parsed["dport"]) == (
        "fd00:1::10",
        "fd00:96::10",
        40000,
        443,
    )


def test_v1_is_one_text_line() -> None:
    assert (
        proxyproto.header(1, ("10.244.1.10", 51234), ("10.96.0.10", 80))
        == b"PROXY TCP4 10.244.1.10 10.96.0.10 51234 80\r\n"
    )
    assert (
        proxyproto.header(1, ("fd00:1::10", 1), ("fd00:96::10", 2))
        == b"PROXY TCP6 fd00:1::10 fd00:96::10 1 2\r\n"
    )


def test_ipv4_mapped_addresses_are_sent_as_ipv4() -> None:
    head = proxyproto.header(1, ("::ffff:10.244.1.10", 5), ("::ffff:10.96.0.10", 80))
    assert head == b"PROXY TCP4 10.244.1.10 10.96.0.10 5 80\r\n"


def test_mixed_families_are_sent_as_ipv6() -> None:
    parsed = parse_v2(proxyproto.header(2, ("10.244.1.10", 5), ("fd00:96::10", 80)))
    mapped = ipaddress.IPv6Address(str(parsed["src"])).ipv4_mapped
    assert mapped == ipaddress.IPv4Address("10.244.1.10")
    assert parsed["dst"] == "fd00:96::10"


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_without_nat_the_original_destination_is_the_local_address(family: int) -> None:
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.bind((host, 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()[:2]) as client:
            accepted, peer = server.accept()
            with accepted:
                assert proxyproto.original_destination(accepted) == server.getsockname()[:2]
                head = proxyproto.for_connection(2, accepted, peer[:2])
                parsed = parse_v2(head)
                assert (parsed["src"], parsed["sport"]) == client.getsockname()[:2]
                assert (parsed["dst"], parsed["dport"]) == server.getsockname()[:2]


@pytest.mark.parametrize("version", [1, 2])
def test_a_socket_that_cannot_say_where_it_was_sent_gets_the_unknown_header(
    version: int,
) -> None:
    closed = socket.socket()
    closed.close()  # getsockname/getsockopt now fail, as on a client gone mid-dial
    head = proxyproto.for_connection(version, closed, ("10.244.1.10", 5))
    if version == 1:
        assert head == b"PROXY UNKNOWN\r\n"
    else:  # LOCAL, AF_UNSPEC, no address block
        assert head == proxyproto.V2_SIGNATURE + bytes([0x20, 0x00, 0, 0])
