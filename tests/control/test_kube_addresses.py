"""addresses: the node's name and addresses, as the control plane derives them."""

from __future__ import annotations

import socket

import pytest

from kube_userspace_proxy import addresses
from kube_userspace_proxy.errors import ConfigError
from tests.control.conftest import node


def test_hostname_override_wins_and_is_lowercased() -> None:
    assert addresses.node_name("  Node-A ", environ={"NODE_NAME": "node-b"}) == "node-a"


def test_node_name_env_comes_before_the_hostname() -> None:
    assert addresses.node_name(None, environ={"NODE_NAME": "node-b"}) == "node-b"


def test_hostname_is_the_last_resort() -> None:
    assert addresses.node_name("", environ={}) == socket.gethostname().strip().lower()


def test_no_name_at_all_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "")
    with pytest.raises(ConfigError, match="hostname-override"):
        addresses.node_name(None, environ={})


def test_node_ips_rank_internal_before_external() -> None:
    obj = node(addresses=[("ExternalIP", "203.0.113.5"), ("InternalIP", "10.0.0.5")])
    assert addresses.node_ips(obj) == ("10.0.0.5",)


def test_node_ips_add_the_first_address_of_the_other_family() -> None:
    obj = node(
        addresses=[
            ("Hostname", "node-1"),
            ("InternalIP", "10.0.0.5"),
            ("InternalIP", "10.0.0.6"),
            ("ExternalIP", "2001:db8::5"),
        ]
    )
    assert addresses.node_ips(obj) == ("10.0.0.5", "2001:db8::5")


def test_node_ips_of_no_node_are_empty() -> None:
    assert addresses.node_ips(None) == ()
    assert addresses.node_ips(node(addresses=[("Hostname", "node-1")])) == ()


def test_address_families() -> None:
    assert addresses.ip_family("10.0.0.1") == 4
    assert addresses.ip_family("fd00::1") == 6
    assert addresses.ip_family("10.0.0.0/8") is None
    assert addresses.is_ipv6("::1") and not addresses.is_ipv6("127.0.0.1")
    assert addresses.by_family(["10.0.0.1", "fd00::1", "x", "::1"], 6) == ("fd00::1", "::1")


def test_join_host_port_brackets_ipv6() -> None:
    assert addresses.join_host_port("10.0.0.1", 80) == "10.0.0.1:80"
    assert addresses.join_host_port("fd00::1", 80) == "[fd00::1]:80"


def test_local_addresses_include_loopback() -> None:
    local = addresses.local_addresses()
    assert "127.0.0.1" in local
    assert all(addresses.ip_family(a) for a in local)
