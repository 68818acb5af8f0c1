"""The control process's `EndpointSet` tells the workers what an `EndpointPool` would."""

from __future__ import annotations

import sys

from kube_userspace_proxy.balancer import EndpointPool
from kube_userspace_proxy.model import Endpoint, ServicePortName, SourcePolicy
from kube_userspace_proxy.topology import on_node
from kube_userspace_proxy.workers.pool import EndpointSet

NAME = ServicePortName("default", "web", "http")


def described(pool: EndpointPool | EndpointSet) -> tuple[object, ...]:
    """What the publisher sends the workers of a pool (its `PoolView`), and the debug view."""
    return (
        pool.name,
        pool.addresses,
        pool.affinity_timeout,
        pool.proxy_protocol,
        pool.transparency,
        pool.source_choices(),
        len(pool),
    )


def both() -> tuple[EndpointPool, EndpointSet]:
    return EndpointPool(NAME), EndpointSet(NAME)


def test_an_endpoint_set_describes_the_same_endpoints_as_a_pool() -> None:
    endpoints = [
        Endpoint("10.0.0.1", 80, node_name="here"),
        Endpoint("10.0.0.2", 80, node_name="there"),
        Endpoint("10.0.0.1", 80, node_name="here"),  # the same address twice: once
        Endpoint("10.0.0.3", 80),
    ]
    for timeout in (None, 0.0, -1.0, 30.0):
        for source in (None, SourcePolicy(("10.244.0.0/24",))):
            pool, kept = both()
            for each in (pool, kept):
                each.source = source
                each.proxy_protocol = 2
                each.update(endpoints, affinity_timeout=timeout, local=on_node(endpoints, "here"))
            assert described(kept) == described(pool)


def test_an_endpoint_set_follows_updates_as_a_pool_does() -> None:
    pool, kept = both()
    steps = [
        [Endpoint("10.0.0.1", 80), Endpoint("10.0.0.2", 80)],
        [],
        [Endpoint("10.0.0.2", 80, node_name="here"), Endpoint("10.0.0.4", 80)],
    ]
    for endpoints in steps:
        for each in (pool, kept):
            each.update(endpoints, affinity_timeout=10.0, local=on_node(endpoints, "here"))
        assert described(kept) == described(pool)


def test_an_unchanged_update_keeps_the_addresses_the_sent_entries_share() -> None:
    kept = EndpointSet(NAME)
    kept.update([Endpoint("10.0.0.1", 80)], affinity_timeout=None)
    first = kept.addresses
    kept.update([Endpoint("10.0.0.1", 80)], affinity_timeout=None)
    assert kept.addresses is first


def test_an_endpoint_set_is_smaller_than_a_pool() -> None:
    # Held once per service port and path in the control process: 10,000 at scale.
    endpoints = [Endpoint(f"10.0.0.{i}", 80) for i in range(1, 4)]
    pool, kept = both()
    for each in (pool, kept):
        each.update(endpoints, affinity_timeout=None)
    assert not hasattr(kept, "__dict__")
    # Both slotted (the pool since the worker-memory work): the set holds fewer slots.
    pool_size = sys.getsizeof(pool) + sys.getsizeof(getattr(pool, "__dict__", {}))
    assert sys.getsizeof(kept) < pool_size
