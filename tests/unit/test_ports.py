"""PortAllocator and --proxy-port-range: real sockets bound on 127.0.0.1."""

from __future__ import annotations

import contextlib
import errno
import random
import socket
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kube_userspace_proxy.config.settings import format_port_range, parse_port_range
from kube_userspace_proxy.errors import DescriptorBudgetError, PortExhaustedError
from kube_userspace_proxy.model import Protocol
from kube_userspace_proxy.ports import DescriptorBudget, PortAllocator

HOST = "127.0.0.1"


def _kind(protocol: Protocol) -> int:
    return socket.SOCK_STREAM if protocol is Protocol.TCP else socket.SOCK_DGRAM


def _free_range(size: int) -> tuple[int, int]:
    """`size` consecutive ports free for TCP and UDP on 127.0.0.1, below the ephemeral range."""
    for _ in range(200):
        low = random.randrange(20000, 32000 - size)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(low, low + size):
                    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                        sock = stack.enter_context(socket.socket(socket.AF_INET, kind))
                        sock.bind((HOST, port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
            return (low, low + size - 1)
    pytest.fail(f"no {size} consecutive free ports found")


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """Every socket a test gets or makes is closed at the end."""
    held: list[socket.socket] = []
    yield held
    for sock in held:
        sock.close()


def _occupy(protocol: Protocol, port: int) -> socket.socket:
    """A socket of 'someone else' holding `port` (listening, for TCP)."""
    sock = socket.socket(socket.AF_INET, _kind(protocol))
    sock.bind((HOST, port))
    if protocol is Protocol.TCP:
        sock.listen()
    return sock


# -- parse_port_range -------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "  ", "0-0", "0", "0+0"])
def test_empty_or_zero_range_means_kernel_chosen(text: str) -> None:
    assert parse_port_range(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30000-30010", (30000, 30010)),
        ("30000+10", (30000, 30010)),
        ("8080", (8080, 8080)),
        ("8080+0", (8080, 8080)),
        (" 100-200 ", (100, 200)),
        ("1-65535", (1, 65535)),
    ],
)
def test_range_syntax_of_kube_proxy(text: str, expected: tuple[int, int]) -> None:
    assert parse_port_range(text) == expected


@pytest.mark.parametrize(
    "text",
    ["abc", "200-100", "70000", "1-70000", "65530+10", "-5", "1-2-3", "10-", "+5", "0-100", "x+1"],
)
def test_malformed_range_is_a_value_error_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text).replace("+", r"\+")):
        parse_port_range(text)


@given(st.integers(1, 65535), st.integers(0, 65534))
def test_dash_and_plus_forms_agree(low: int, offset: int) -> None:
    high = min(low + offset, 65535)
    assert parse_port_range(f"{low}-{high}") == (low, high)
    assert parse_port_range(f"{low}+{high - low}") == (low, high)
    assert parse_port_range(format_port_range((low, high))) == (low, high)


# -- kernel-chosen --------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", list(Protocol))
def test_kernel_chosen_port_is_bound_on_the_bind_host(
    protocol: Protocol, sockets: list[socket.socket]
) -> None:
    allocator = PortAllocator(None, host=HOST)
    sock = allocator.reserve(protocol)
    sockets.append(sock)
    host, port = sock.getsockname()
    assert host == HOST
    assert port > 0
    assert sock.type == _kind(protocol)
    assert port in allocator.reserved(protocol)


def test_tcp_socket_has_reuseaddr_and_is_not_listening(sockets: list[socket.socket]) -> None:
    sock = PortAllocator(None, host=HOST).reserve(Protocol.TCP)
    sockets.append(sock)
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0
    assert not sock.getblocking()


# -- ranges -----------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", list(Protocol))
def test_range_is_used_whole_then_exhausted(
    protocol: Protocol, sockets: list[socket.socket]
) -> None:
    low, high = _free_range(4)
    allocator = PortAllocator((low, high), host=HOST)
    sockets.extend(allocator.reserve(protocol) for _ in range(4))
    assert sorted(s.getsockname()[1] for s in sockets) == list(range(low, high + 1))
    with pytest.raises(PortExhaustedError, match=f"--proxy-port-range={low}-{high}"):
        allocator.reserve(protocol, name="default/web:http")


def test_exhaustion_names_the_service_port(sockets: list[socket.socket]) -> None:
    low, high = _free_range(1)
    allocator = PortAllocator((low, high), host=HOST)
    sockets.append(allocator.reserve(Protocol.TCP))
    with pytest.raises(PortExhaustedError, match="default/web:http"):
        allocator.reserve(Protocol.TCP, name="default/web:http")


@pytest.mark.parametrize("protocol", list(Protocol))
def test_ports_taken_by_other_sockets_are_skipped(
    protocol: Protocol, sockets: list[socket.socket]
) -> None:
    low, high = _free_range(4)
    sockets.append(_occupy(protocol, low))
    sockets.append(_occupy(protocol, low + 2))
    allocator = PortAllocator((low, high), host=HOST)
    got = [allocator.reserve(protocol) for _ in range(2)]
    sockets.extend(got)
    assert sorted(s.getsockname()[1] for s in got) == [low + 1, low + 3]
    with pytest.raises(PortExhaustedError):
        allocator.reserve(protocol)


def test_tcp_and_udp_may_share_a_port_number(sockets: list[socket.socket]) -> None:
    low, high = _free_range(1)
    allocator = PortAllocator((low, high), host=HOST)
    tcp = allocator.reserve(Protocol.TCP)
    udp = allocator.reserve(Protocol.UDP)
    sockets.extend([tcp, udp])
    assert tcp.getsockname()[1] == udp.getsockname()[1] == low


def test_released_port_can_be_reserved_again(sockets: list[socket.socket]) -> None:
    low, high = _free_range(1)
    allocator = PortAllocator((low, high), host=HOST)
    first = allocator.reserve(Protocol.TCP)
    first.close()
    allocator.release(Protocol.TCP, low)
    again = allocator.reserve(Protocol.TCP)
    sockets.append(again)
    assert again.getsockname()[1] == low


def test_reserved_but_unreleased_port_is_not_handed_out_twice(
    sockets: list[socket.socket],
) -> None:
    # SO_REUSEADDR lets two non-listening TCP sockets share a port on Linux: the allocator's
    # own bookkeeping must prevent that.
    low, high = _free_range(1)
    allocator = PortAllocator((low, high), host=HOST)
    sockets.append(allocator.reserve(Protocol.TCP))
    with pytest.raises(PortExhaustedError):
        allocator.reserve(Protocol.TCP)


def test_bind_host_other_than_local_fails_loudly() -> None:
    allocator = PortAllocator(None, host="192.0.2.1")  # TEST-NET-1: never a local address
    with pytest.raises(OSError, match="assign"):
        allocator.reserve(Protocol.TCP)


def test_invalid_range_is_rejected_by_the_allocator() -> None:
    with pytest.raises(ValueError, match="invalid port range"):
        PortAllocator((10, 5))


# -- preferred ports --------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", list(Protocol))
def test_preferred_port_is_taken_when_free(
    protocol: Protocol, sockets: list[socket.socket]
) -> None:
    low, high = _free_range(8)
    allocator = PortAllocator((low, high), host=HOST)
    for want in (low + 5, low + 2, high):
        sockets.append(allocator.reserve(protocol, prefer=want))
        assert sockets[-1].getsockname()[1] == want
    assert allocator.reserved(protocol) == {low + 5, low + 2, high}


def test_preferred_port_outside_the_range_is_not_taken(sockets: list[socket.socket]) -> None:
    low, high = _free_range(3)
    allocator = PortAllocator((low + 1, high), host=HOST)
    sockets.append(allocator.reserve(Protocol.TCP, prefer=low))
    assert low + 1 <= sockets[-1].getsockname()[1] <= high


def test_preferred_port_held_by_another_socket_falls_back_to_a_free_one(
    sockets: list[socket.socket],
) -> None:
    low, high = _free_range(2)
    sockets.append(_occupy(Protocol.UDP, low))
    allocator = PortAllocator((low, high), host=HOST)
    sockets.append(allocator.reserve(Protocol.UDP, prefer=low))
    assert sockets[-1].getsockname()[1] == high


def test_preferred_port_already_handed_out_is_not_handed_out_again(
    sockets: list[socket.socket],
) -> None:
    low, high = _free_range(2)
    allocator = PortAllocator((low, high), host=HOST)
    sockets.append(allocator.reserve(Protocol.TCP, prefer=low))
    sockets.append(allocator.reserve(Protocol.TCP, prefer=low))
    assert [s.getsockname()[1] for s in sockets] == [low, high]


def test_preferred_port_is_taken_without_a_range_too(sockets: list[socket.socket]) -> None:
    low, _ = _free_range(1)
    allocator = PortAllocator(None, host=HOST)
    sockets.append(allocator.reserve(Protocol.TCP, prefer=low))
    assert sockets[-1].getsockname()[1] == low
    sockets.append(allocator.reserve(Protocol.TCP, prefer=low))
    assert sockets[-1].getsockname()[1] not in (0, low)


# -- dual stack ---------------------------------------------------------------------------------


def test_unspecified_ipv6_host_gives_sockets_that_take_ipv4_too(
    sockets: list[socket.socket],
) -> None:
    sock = PortAllocator(None, host="::").reserve(Protocol.TCP)  # bound, never listening
    sockets.append(sock)
    assert sock.family == socket.AF_INET6
    assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
    ipv4 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sockets.append(ipv4)
    with pytest.raises(OSError) as held:  # the port is held for IPv4 as well
        ipv4.bind((HOST, sock.getsockname()[1]))
    assert held.value.errno == errno.EADDRINUSE


def test_preferred_port_is_taken_back_past_the_earlier_runs_time_wait_connections() -> None:
    # An earlier run's listener (SO_REUSEPORT, as the data plane sets it) closed a connection
    # first, leaving it in TIME_WAIT on the port; then the process went away.
    old = socket.socket()
    old.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    old.bind(("127.0.0.1", 0))
    old.listen()
    port = old.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = old.accept()
    accepted.close()  # the proxy side closes first: its end goes to TIME_WAIT
    client.close()
    old.close()
    allocator = PortAllocator(None, host="127.0.0.1")
    sock = allocator.reserve(Protocol.TCP, prefer=port)
    try:
        assert sock.getsockname()[1] == port
    finally:
        sock.close()


def test_descriptor_budget_keeps_the_reserve_free() -> None:
    budget = DescriptorBudget(limit=lambda: 1000, count=lambda: 700, reserve=256)
    budget.start()
    budget.take("a", 40)
    budget.take("b", 4)  # 744 = 1000 - 256
    with pytest.raises(DescriptorBudgetError, match=r"refused c: .*RLIMIT_NOFILE=1000.*256"):
        budget.take("c")
    budget.start()  # a new sync counts again
    budget.take("c")


def test_descriptor_reserve_is_a_twentieth_of_the_limit_and_at_least_256() -> None:
    small = DescriptorBudget(limit=lambda: 1024, count=lambda: 0)
    small.start()
    large = DescriptorBudget(limit=lambda: 20000, count=lambda: 0)
    large.start()
    assert (small.reserve, large.reserve) == (256, 1000)
