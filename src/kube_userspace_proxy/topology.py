"""Which endpoints a service port may use: readiness, the serving-and-terminating fallback,
traffic policy Local and topology hints (kube-proxy's pkg/proxy/topology.go)."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kube_userspace_proxy.model import Address, Endpoint


class Topology(enum.StrEnum):
    """Which endpoints a Cluster-policy path uses, as kube-proxy's topology modes name them."""

    ALL = ""
    """No usable hints: every endpoint."""
    SAME_NODE = "PreferSameNode"
    """Those whose `hints.forNodes` name this node."""
    SAME_ZONE = "PreferSameZone"
    """Those whose `hints.forZones` name this node's zone (trafficDistribution PreferClose)."""


def topology_mode(endpoints: Sequence[Endpoint], node_name: str | None, zone: str) -> Topology:
    """The hints a Cluster-policy path follows: node hints when every ready endpoint has some
    and one names this node, else zone hints likewise for this node's zone, else none."""
    any_ready = False
    all_node_hints = all_zone_hints = True
    for_node = for_zone = False
    for e in endpoints:
        if not e.ready:
            continue
        any_ready = True
        if not e.node_hints:
            all_node_hints = False
        elif node_name is not None and node_name in e.node_hints:
            for_node = True
        if not e.zone_hints:
            all_zone_hints = False
        elif zone and zone in e.zone_hints:
            for_zone = True
    if not any_ready:
        return Topology.ALL
    if all_node_hints and for_node:
        return Topology.SAME_NODE
    if all_zone_hints and for_zone:
        return Topology.SAME_ZONE
    return Topology.ALL


def usable_endpoints(
    endpoints: Sequence[Endpoint],
    *,
    local_only: bool,
    node_name: str | None,
    topology: Topology = Topology.ALL,
    zone: str = "",
) -> tuple[Endpoint, ...]:
    """The endpoints traffic may go to: ready ones, else serving-and-terminating ones.

    With `local_only` (traffic policy Local) only endpoints on `node_name` count, before the
    fallback is applied, as in kube-proxy; an unknown node name has no local endpoints.
    Otherwise `topology` (from `topology_mode`) narrows the ready ones to those hinted for
    this node or `zone`; the serving-and-terminating fallback ignores hints, as kube-proxy's.
    """
    if local_only:
        endpoints = [e for e in endpoints if node_name is not None and e.node_name == node_name]
        topology = Topology.ALL
    if topology is Topology.SAME_NODE:
        ready = tuple(e for e in endpoints if e.ready and node_name in e.node_hints)
    elif topology is Topology.SAME_ZONE:
        ready = tuple(e for e in endpoints if e.ready and zone in e.zone_hints)
    else:
        ready = tuple(e for e in endpoints if e.ready)
    if ready:
        return ready
    return tuple(e for e in endpoints if e.serving and e.terminating)


def unused_endpoints(
    endpoints: Sequence[Endpoint],
    *,
    local_only: bool,
    node_name: str | None,
    topology: Topology = Topology.ALL,
    zone: str = "",
) -> list[tuple[Endpoint, str]]:
    """(endpoint, why) for each endpoint `usable_endpoints` (same arguments) leaves out."""
    used = set(
        usable_endpoints(
            endpoints, local_only=local_only, node_name=node_name, topology=topology, zone=zone
        )
    )
    out = []
    for e in endpoints:
        if e in used:
            continue
        if local_only and (node_name is None or e.node_name != node_name):
            where = f"on node {e.node_name}" if e.node_name else "on no node named"
            why = f"{where}, not this one, under traffic policy Local"
        elif e.terminating:
            why = "terminating" + ("; used only while no endpoint is ready" if e.serving else "")
        elif not e.ready:
            why = "not ready"
        elif topology is Topology.SAME_NODE:
            why = f"its topology hints (forNodes) do not name this node {node_name}"
        else:
            why = f"its topology hints (forZones) do not name this node's zone {zone}"
        out.append((e, why))
    return out


def on_node(endpoints: Sequence[Endpoint], node_name: str | None) -> frozenset[Address]:
    """The addresses of the endpoints that run on `node_name` (none when it is unknown)."""
    if node_name is None:
        return frozenset()
    return frozenset(e.address for e in endpoints if e.node_name == node_name)
