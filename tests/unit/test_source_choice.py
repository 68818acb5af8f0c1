"""The choice of a dial's source address under --preserve-source-ip (dataplane/transparent)."""

from __future__ import annotations

import pytest

from kube_userspace_proxy.balancer import EndpointPool
from kube_userspace_proxy.dataplane.transparent import (
    CLIENT_POD,
    LOCAL_ENDPOINT,
    NODE,
    SourceChooser,
    chooser_for,
)
from kube_userspace_proxy.model import Endpoint, ServicePortName, SourcePolicy
from kube_userspace_proxy.topology import on_node

POLICY = SourcePolicy(client_cidrs=("10.244.1.0/24", "fd00:10:244:1::/64"))


@pytest.mark.parametrize(
    ("client", "endpoint", "local", "expected"),
    [
        # A pod of this node: its replies come back from any endpoint.
        ("10.244.1.10", "10.244.2.10", False, (CLIENT_POD, "10.244.1.10")),
        ("10.244.1.10", "10.244.1.11", True, (CLIENT_POD, "10.244.1.10")),
        # An external client and an endpoint on this node (externalTrafficPolicy: Local).
        ("192.0.2.7", "10.244.1.11", True, (LOCAL_ENDPOINT, "192.0.2.7")),
        # An external client and a remote endpoint: the reply would bypass the node.
        ("192.0.2.7", "10.244.2.10", False, (NODE, "")),
        # A pod of another node reaching this node's NodePort: the same.
        ("10.244.2.99", "10.244.2.10", False, (NODE, "")),
        # The node itself on loopback keeps a node address, even to a local endpoint.
        ("127.0.0.1", "10.244.1.11", True, (NODE, "")),
        ("::1", "fd00:10:244:1::11", True, (NODE, "")),
        # A v4 client of a dual-stack listener binds its v4 address.
        ("::ffff:10.244.1.10", "10.244.2.10", False, (CLIENT_POD, "10.244.1.10")),
        # IPv6 pods.
        ("fd00:10:244:1::10", "fd00:10:244:2::10", False, (CLIENT_POD, "fd00:10:244:1::10")),
        # A client of one family cannot be the source of a dial in the other.
        ("10.244.1.10", "fd00:10:244:2::10", False, (NODE, "")),
        ("fd00:10:244:1::10", "10.244.1.11", True, (NODE, "")),
        ("not-an-ip", "10.244.1.11", True, (NODE, "")),
    ],
)
def test_the_source_follows_where_the_reply_comes_back(
    client: str, endpoint: str, local: bool, expected: tuple[int, str]
) -> None:
    chooser = SourceChooser(POLICY)
    assert chooser.choose(client, endpoint, local) == expected
    assert chooser.choose(client, endpoint, local) == expected  # remembered, same answer


def test_without_local_client_cidrs_only_local_endpoints_keep_the_address() -> None:
    chooser = SourceChooser(SourcePolicy())
    assert chooser.choose("10.244.1.10", "10.244.2.10", False) == (NODE, "")
    assert chooser.choose("10.244.1.10", "10.244.1.11", True) == (LOCAL_ENDPOINT, "10.244.1.10")


def test_one_chooser_per_policy_in_a_process() -> None:
    assert chooser_for(POLICY) is chooser_for(SourcePolicy(POLICY.client_cidrs))
    assert chooser_for(POLICY) is not chooser_for(SourcePolicy())


def test_the_pool_marks_the_endpoints_of_this_node() -> None:
    endpoints = [
        Endpoint("10.244.1.11", 80, node_name="node-a"),
        Endpoint("10.244.2.10", 80, node_name="node-b"),
        Endpoint("10.244.3.10", 80),
    ]
    pool = EndpointPool(ServicePortName("ns", "web"))
    local = on_node(endpoints, "node-a")
    assert local == {("10.244.1.11", 80)}
    assert on_node(endpoints, None) == frozenset()
    pool.update(endpoints, affinity_timeout=None, local=local)
    assert pool.local_addresses == (("10.244.1.11", 80),)
    marks = {}
    for _ in range(3):
        address = pool.pick("10.0.0.1")
        marks[address] = pool.picked.local
    assert marks == {
        ("10.244.1.11", 80): True,
        ("10.244.2.10", 80): False,
        ("10.244.3.10", 80): False,
    }
    # The endpoint moves to another node: the same address, no longer local.
    pool.update(endpoints, affinity_timeout=None, local=frozenset())
    assert pool.local_addresses == ()
    assert all(not pool.picked.local for _ in range(3) if pool.pick("10.0.0.1"))
