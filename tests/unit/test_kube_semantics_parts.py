"""Today's kube-proxy semantics: endpoint hints and the node's zone, LoadBalancer ipMode,
`nodePortAddresses: [primary]` (issue 25, items 1-3)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kube_userspace_proxy.addresses import primary_cidrs
from kube_userspace_proxy.cluster.state import ClusterState
from kube_userspace_proxy.config.settings import build_config
from kube_userspace_proxy.model import Endpoint
from kube_userspace_proxy.portals.settings import Settings
from kube_userspace_proxy.restart import statefile
from kube_userspace_proxy.topology import Topology, topology_mode, usable_endpoints
from tests.unit.test_state import HTTP, build, endpoint, endpoint_slice, lines, service

NODE = "node-a"
ZONE = "zone-a"


def ep(
    ip: str, nodes: tuple[str, ...] = (), zones: tuple[str, ...] = (), **conditions: Any
) -> Endpoint:
    return Endpoint(ip, 8080, node_hints=nodes, zone_hints=zones, **conditions)


def chosen(endpoints: list[Endpoint], zone: str = ZONE, node: str = NODE) -> tuple[str, ...]:
    mode = topology_mode(endpoints, node, zone)
    usable = usable_endpoints(endpoints, local_only=False, node_name=node, topology=mode, zone=zone)
    return tuple(e.ip for e in usable)


# -- hint selection ---------------------------------------------------------------------------


def test_node_hints_win_when_every_ready_endpoint_has_one_and_one_names_this_node() -> None:
    eps = [ep("10.0.0.1", (NODE,), (ZONE,)), ep("10.0.0.2", ("node-b",), (ZONE,))]
    assert topology_mode(eps, NODE, ZONE) is Topology.SAME_NODE
    assert chosen(eps) == ("10.0.0.1",)


def test_node_hints_fall_back_to_zone_hints_when_none_names_this_node() -> None:
    eps = [ep("10.0.0.1", ("node-b",), (ZONE,)), ep("10.0.0.2", ("node-c",), ("zone-b",))]
    assert topology_mode(eps, NODE, ZONE) is Topology.SAME_ZONE
    assert chosen(eps) == ("10.0.0.1",)


def test_node_hints_fall_back_to_zone_hints_when_one_ready_endpoint_lacks_one() -> None:
    eps = [ep("10.0.0.1", (NODE,), ("zone-b",)), ep("10.0.0.2", (), (ZONE,))]
    assert topology_mode(eps, NODE, ZONE) is Topology.SAME_ZONE
    assert chosen(eps) == ("10.0.0.2",)


def test_zone_hints_fall_back_to_every_endpoint_when_none_names_this_zone() -> None:
    eps = [ep("10.0.0.1", zones=("zone-b",)), ep("10.0.0.2", zones=("zone-c",))]
    assert topology_mode(eps, NODE, ZONE) is Topology.ALL
    assert chosen(eps) == ("10.0.0.1", "10.0.0.2")


def test_zone_hints_fall_back_to_every_endpoint_when_one_ready_endpoint_lacks_one() -> None:
    eps = [ep("10.0.0.1", zones=(ZONE,)), ep("10.0.0.2")]
    assert topology_mode(eps, NODE, ZONE) is Topology.ALL
    assert chosen(eps) == ("10.0.0.1", "10.0.0.2")


def test_a_node_without_a_zone_label_uses_no_zone_hints() -> None:
    eps = [ep("10.0.0.1", zones=("",)), ep("10.0.0.2", zones=("zone-b",))]
    assert topology_mode(eps, NODE, "") is Topology.ALL


def test_endpoints_that_are_not_ready_neither_need_hints_nor_are_chosen() -> None:
    eps = [ep("10.0.0.1", zones=(ZONE,)), ep("10.0.0.2", ready=False), ep("10.0.0.3", zones=("b",))]
    assert chosen(eps) == ("10.0.0.1",)


def test_the_serving_terminating_fallback_ignores_hints() -> None:
    eps = [
        ep("10.0.0.1", zones=("zone-b",), ready=False, serving=True, terminating=True),
        ep("10.0.0.2", ready=False, serving=True, terminating=True),
    ]
    assert topology_mode(eps, NODE, ZONE) is Topology.ALL
    assert chosen(eps) == ("10.0.0.1", "10.0.0.2")


def test_local_policy_ignores_hints() -> None:
    eps = [
        Endpoint("10.0.0.1", 8080, node_name=NODE, zone_hints=("zone-b",)),
        Endpoint("10.0.0.2", 8080, node_name="node-b", zone_hints=(ZONE,)),
    ]
    mode = topology_mode(eps, NODE, ZONE)
    assert mode is Topology.SAME_ZONE
    usable = usable_endpoints(eps, local_only=True, node_name=NODE, topology=mode, zone=ZONE)
    assert [e.ip for e in usable] == ["10.0.0.1"]


# -- parsing hints and the node's zone --------------------------------------------------------


def hinted(ip: str, nodes: list[str] | None = None, zones: list[str] | None = None) -> Any:
    hints: dict[str, Any] = {}
    if nodes is not None:
        hints["forNodes"] = [{"name": n} for n in nodes]
    if zones is not None:
        hints["forZones"] = [{"name": z} for z in zones]
    return endpoint(ip, hints=hints)


def test_slice_hints_reach_the_snapshot() -> None:
    snap = build([service()], [endpoint_slice(endpoints=[hinted("10.244.1.5", [NODE], [ZONE])])])
    (only,) = snap.endpoints[HTTP]
    assert (only.node_hints, only.zone_hints) == ((NODE,), (ZONE,))


@pytest.mark.parametrize(
    ("hints", "field"),
    [
        ("zone-a", "endpoints[0].hints: expected an object"),
        ({"forZones": "zone-a"}, "endpoints[0].hints.forZones: expected a list"),
        ({"forZones": ["zone-a"]}, "endpoints[0].hints.forZones[0]: expected an object"),
        ({"forNodes": [{"name": 7}]}, "endpoints[0].hints.forNodes[0].name: expected a string"),
        ({"forNodes": [{}]}, "endpoints[0].hints.forNodes[0].name is missing"),
    ],
)
def test_malformed_hints_skip_the_slice_with_one_line_naming_the_field(
    caplog: pytest.LogCaptureFixture, hints: Any, field: str
) -> None:
    bad = endpoint_slice(endpoints=[endpoint("10.244.1.5", hints=hints)])
    with caplog.at_level(logging.WARNING):
        snap = build([service()], [bad, endpoint_slice("web-ok")])
    warned = [m for m in lines(caplog, logging.WARNING) if "web-abc" in m]
    assert len(warned) == 1 and field in warned[0], warned
    assert [e.ip for e in snap.endpoints[HTTP]] == ["10.244.1.5"]  # the good slice stays


def node(zone: Any = None, ips: tuple[str, ...] = ("10.0.0.7",)) -> dict[str, Any]:
    labels = {} if zone is None else {"topology.kubernetes.io/zone": zone}
    return {
        "kind": "Node",
        "metadata": {"name": NODE, "labels": labels},
        "status": {"addresses": [{"type": "InternalIP", "address": ip} for ip in ips]},
    }


def test_the_node_zone_label_is_followed_and_touches_every_service_port() -> None:
    changes: list[int] = []
    state = ClusterState(node_name=NODE, on_change=lambda: changes.append(1))
    state.replace("Service", [service()])
    state.replace("EndpointSlice", [endpoint_slice()])
    state.set_node(node(ZONE))
    assert state.snapshot().node_zone == ZONE
    changes.clear()
    state.set_node(node("zone-b"))  # relabelled
    assert changes == [1]
    partial = state.changes()
    assert partial.node_zone == "zone-b"
    assert partial.changed == {HTTP} and HTTP in partial.endpoints
    state.set_node(node("zone-b"))
    assert changes == [1]  # the same labels again change nothing


def test_a_malformed_zone_label_keeps_the_previous_node(caplog: pytest.LogCaptureFixture) -> None:
    state = ClusterState(node_name=NODE)
    state.set_node(node(ZONE))
    with caplog.at_level(logging.WARNING):
        state.set_node(node(["zone-b"]))
    assert state.node_zone == ZONE
    assert any("metadata.labels" in m for m in lines(caplog, logging.WARNING))


def test_the_state_file_keeps_hints_and_the_zone() -> None:
    state = ClusterState(node_name=NODE)
    state.set_node(node(ZONE))
    state.replace("Service", [service()])
    state.replace("EndpointSlice", [endpoint_slice(endpoints=[hinted("10.244.1.5", [NODE])])])
    snap = state.snapshot()
    back, _ = statefile.decode(statefile.encode(snap, {}), node_name=NODE)
    assert back.node_zone == ZONE
    assert back.endpoints[HTTP] == snap.endpoints[HTTP]


# -- LoadBalancer ipMode ----------------------------------------------------------------------


def lb(*ingress: dict[str, Any]) -> dict[str, Any]:
    return service(
        type="LoadBalancer",
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        status={"loadBalancer": {"ingress": list(ingress)}},
    )


def test_ip_mode_proxy_is_left_to_the_load_balancer() -> None:
    svc = lb(
        {"ip": "198.51.100.7", "ipMode": "Proxy"},
        {"ip": "198.51.100.8", "ipMode": "VIP"},
        {"ip": "198.51.100.9"},
    )
    assert build([svc]).services[HTTP].load_balancer_ips == ("198.51.100.8", "198.51.100.9")


@pytest.mark.parametrize("mode", [7, "proxy", ""])
def test_a_bad_ip_mode_skips_the_service_with_one_line_naming_the_field(
    caplog: pytest.LogCaptureFixture, mode: Any
) -> None:
    with caplog.at_level(logging.WARNING):
        snap = build([lb({"ip": "198.51.100.7", "ipMode": mode})])
    assert HTTP not in snap.services
    warned = lines(caplog, logging.WARNING)
    assert len(warned) == 1 and "status.loadBalancer.ingress[0].ipMode" in warned[0], warned


def test_an_ip_mode_change_changes_the_service_port() -> None:
    state = ClusterState()
    state.replace("Service", [lb({"ip": "198.51.100.7"})])
    state.replace("EndpointSlice", [])
    assert state.snapshot().services[HTTP].load_balancer_ips == ("198.51.100.7",)
    state.apply("Service", "MODIFIED", lb({"ip": "198.51.100.7", "ipMode": "Proxy"}))
    assert state.changes().services[HTTP].load_balancer_ips == ()


# -- nodePortAddresses: [primary] -------------------------------------------------------------


def test_primary_is_the_first_ip_of_each_family() -> None:
    assert primary_cidrs(("10.0.0.7", "fd00::7", "10.0.0.8")) == ("10.0.0.7/32", "fd00::7/128")
    assert primary_cidrs(()) == ()


@pytest.mark.parametrize(
    ("flags", "file"),
    [({"nodeport_addresses": ("primary",)}, {}), ({}, {"nodeport_addresses": ("primary",)})],
)
def test_primary_is_kept_from_flags_and_file(flags: Any, file: Any) -> None:
    assert build_config(file, flags, source="test").nodeport_addresses == ("primary",)


def test_primary_restricts_node_port_rules_to_the_node_ips_and_follows_them() -> None:
    settings = Settings(node_ips=("10.0.0.7", "fd00::7"), nodeport_addresses=("primary",))
    assert settings.nodeport_dsts(4) == ["10.0.0.7/32"]
    assert settings.nodeport_dsts(6) == ["fd00::7/128"]
    moved = Settings(node_ips=("10.0.0.9",), nodeport_addresses=("primary",))
    assert moved.nodeport_dsts(4) == ["10.0.0.9/32"]
    assert moved.nodeport_dsts(6) == []  # no IPv6 node IP: no IPv6 NodePorts


def test_primary_before_the_node_is_known_serves_no_node_ports() -> None:
    assert Settings(nodeport_addresses=("primary",)).nodeport_dsts(4) == []
