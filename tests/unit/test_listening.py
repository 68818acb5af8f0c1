"""Where the proxy ports listen and which families the node's rules get (`app.proxy.listening`)."""

from __future__ import annotations

import logging
import socket

import pytest

from kube_userspace_proxy import addresses
from kube_userspace_proxy.app.proxy import listening
from kube_userspace_proxy.config.settings import ProxyConfig


def test_an_explicit_bind_address_decides_alone() -> None:
    for bind in ("0.0.0.0", "::", "10.0.0.7"):
        config = ProxyConfig(bind_address=bind, node_ips=("10.0.0.1", "fd00::1"))
        assert listening(config) == (bind, None)


def test_unspecified_follows_the_node_ips_families() -> None:
    v4 = ProxyConfig(node_ips=("10.0.0.1",))
    assert listening(v4) == ("0.0.0.0", frozenset({4}))  # as before: one IPv4 socket a port
    dual = ProxyConfig(node_ips=("10.0.0.1", "fd00::1"))
    assert listening(dual) == ("::", frozenset({4, 6}))  # one dual-stack socket a port
    v6 = ProxyConfig(node_ips=("fd00::1",))
    assert listening(v6) == ("::", frozenset({6}))


def test_without_node_ips_the_hosts_own_addresses_decide() -> None:
    found = addresses.host_families()
    address, families = listening(ProxyConfig())
    assert families == (found or {4})
    assert address == ("::" if 6 in (found or {4}) else "0.0.0.0")


def test_a_handover_keeps_the_earlier_listeners_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dual = ProxyConfig(node_ips=("10.0.0.1", "fd00::1"))
    with caplog.at_level(logging.WARNING):
        assert listening(dual, "0.0.0.0") == ("0.0.0.0", frozenset({4, 6}))
    assert "the handed-over proxy ports listen on 0.0.0.0, not on ::" in caplog.text
    caplog.clear()
    assert listening(dual, "::") == ("::", frozenset({4, 6}))
    assert not caplog.text


def test_ipv6_sockets_are_probed_not_assumed() -> None:
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
        works = True
    except OSError:
        works = False
    assert addresses.ipv6_sockets() is works
    assert addresses.unspecified_address({4}) == "0.0.0.0"
    assert addresses.unspecified_address({4, 6}) == ("::" if works else "0.0.0.0")
