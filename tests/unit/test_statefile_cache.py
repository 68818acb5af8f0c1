"""The state file's entry cache: a save after one change encodes that change only."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from kube_userspace_proxy import statefile
from kube_userspace_proxy.model import Endpoint, ServicePortInfo, ServicePortName, Snapshot


def _snapshot(count: int) -> Snapshot:
    names = [ServicePortName("default", f"s{i}", "http") for i in range(count)]
    return Snapshot(
        services=MappingProxyType(
            {n: ServicePortInfo(n, 80, (f"10.96.0.{i + 1}",)) for i, n in enumerate(names)}
        ),
        endpoints=MappingProxyType({n: (Endpoint("10.244.1.5", 8080),) for n in names}),
        node_name="node-1",
    )


def test_a_cached_encoding_equals_a_fresh_one_and_reencodes_only_the_changed_entry() -> None:
    first = _snapshot(50)
    cache: statefile.EntryCache = {}
    statefile.encode(first, {}, cache)
    before = {name: text for name, (_, _, text) in cache.items()}
    moved = ServicePortName("default", "s7", "http")
    endpoints = dict(first.endpoints)
    endpoints[moved] = (Endpoint("10.244.9.9", 8080),)
    second = replace(first, endpoints=MappingProxyType(endpoints))
    ports = {("default/s7:http", "TCP", "cluster"): 40007}
    assert statefile.encode(second, ports, cache) == statefile.encode(second, ports)
    again = [name for name, (_, _, text) in cache.items() if text is not before[name]]
    assert again == [moved]
    decoded, decoded_ports = statefile.decode(
        statefile.encode(second, ports, cache), node_name="node-1"
    )
    assert decoded.endpoints_of(moved) == (Endpoint("10.244.9.9", 8080),)
    assert dict(decoded.services) == dict(second.services) and decoded_ports == ports
