"""ClusterState: Services + EndpointSlices -> Snapshot, the ignore rules, malformed objects."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kube_userspace_proxy.cluster.state import ClusterState
from kube_userspace_proxy.model import Change, Endpoint, Protocol, ServicePortName, Snapshot

HTTP = ServicePortName("default", "web", "http", Protocol.TCP)


def lines(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    """Distinct messages at `level` or above (the handler may see a record twice)."""
    seen = dict.fromkeys((id(r), r.getMessage()) for r in caplog.records if r.levelno >= level)
    return [message for _, message in seen]


def service(
    name: str = "web",
    namespace: str = "default",
    *,
    ports: list[dict[str, Any]] | None = None,
    labels: dict[str, str] | None = None,
    status: dict[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    spec.setdefault("clusterIP", "10.96.0.10")
    spec["ports"] = (
        ports if ports is not None else [{"name": "http", "port": 80, "protocol": "TCP"}]
    )
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }
    if labels is not None:
        obj["metadata"]["labels"] = labels
    if status is not None:
        obj["status"] = status
    return obj


def endpoint(ip: str, **fields: Any) -> dict[str, Any]:
    conditions = fields.pop("conditions", {"ready": True})
    return {"addresses": [ip], "conditions": conditions, **fields}


def endpoint_slice(
    name: str = "web-abc",
    namespace: str = "default",
    *,
    service_name: str | None = "web",
    endpoints: list[dict[str, Any]] | None = None,
    ports: list[dict[str, Any]] | None = None,
    address_type: str = "IPv4",
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if service_name is not None:
        meta["labels"] = {"kubernetes.io/service-name": service_name}
    if annotations is not None:
        meta["annotations"] = annotations
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": meta,
        "addressType": address_type,
        "ports": ports
        if ports is not None
        else [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints if endpoints is not None else [endpoint("10.244.1.5")],
    }


def build(
    services: list[dict[str, Any]],
    slices: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> Snapshot:
    state = ClusterState(**kwargs)
    state.replace("Service", services)
    state.replace("EndpointSlice", slices or [])
    return state.snapshot()


# -- building -----------------------------------------------------------------------------------


def test_service_port_has_its_cluster_ip_and_endpoints() -> None:
    snap = build([service()], [endpoint_slice()])
    info = snap.services[HTTP]
    assert (info.port, info.cluster_ips, info.protocol) == (80, ("10.96.0.10",), Protocol.TCP)
    assert snap.endpoints_of(HTTP) == (Endpoint("10.244.1.5", 8080),)


def test_endpoint_ports_match_service_ports_by_name() -> None:
    svc = service(
        ports=[
            {"name": "http", "port": 80, "protocol": "TCP"},
            {"name": "metrics", "port": 9090, "protocol": "TCP"},
        ]
    )
    piece = endpoint_slice(
        ports=[
            {"name": "metrics", "port": 19090, "protocol": "TCP"},
            {"name": "http", "port": 8080, "protocol": "TCP"},
            {"name": "other", "port": 1, "protocol": "TCP"},
        ]
    )
    snap = build([svc], [piece])
    metrics = ServicePortName("default", "web", "metrics")
    assert set(snap.services) == {HTTP, metrics}
    assert [e.port for e in snap.endpoints_of(HTTP)] == [8080]
    assert [e.port for e in snap.endpoints_of(metrics)] == [19090]


def test_a_slices_endpoints_are_the_snapshots_objects_for_its_first_port() -> None:
    # One object per endpoint, not one for the slice and one for the snapshot (~2.5 MiB at
    # 30,000 endpoints); a second port's endpoints are their own, with that port.
    svc = service(
        ports=[
            {"name": "http", "port": 80, "protocol": "TCP"},
            {"name": "metrics", "port": 9090, "protocol": "TCP"},
        ]
    )
    piece = endpoint_slice(
        ports=[
            {"name": "http", "port": 8080, "protocol": "TCP"},
            {"name": "metrics", "port": 19090, "protocol": "TCP"},
        ],
        endpoints=[endpoint("10.244.1.5", nodeName="node-a"), endpoint("10.244.1.6")],
    )
    state = ClusterState()
    state.replace("Service", [svc])
    state.replace("EndpointSlice", [piece])
    snap = state.snapshot()
    held = state._slices[("default", "web-abc")].endpoints
    http = snap.endpoints_of(HTTP)
    assert http == (
        Endpoint("10.244.1.5", 8080, node_name="node-a"),
        Endpoint("10.244.1.6", 8080),
    )
    assert all(a is b for a, b in zip(http, held, strict=True))
    metrics = snap.endpoints_of(ServicePortName("default", "web", "metrics"))
    assert [(e.ip, e.port, e.node_name) for e in metrics] == [
        ("10.244.1.5", 19090, "node-a"),
        ("10.244.1.6", 19090, None),
    ]


def test_unnamed_single_port_matches_unnamed_slice_port() -> None:
    svc = service(ports=[{"port": 80}])
    piece = endpoint_slice(ports=[{"port": 8080}])
    snap = build([svc], [piece])
    name = ServicePortName("default", "web")
    assert str(name) == "default/web"
    assert [e.port for e in snap.endpoints_of(name)] == [8080]


def test_same_port_name_with_other_protocol_does_not_match() -> None:
    piece = endpoint_slice(ports=[{"name": "http", "port": 8080, "protocol": "UDP"}])
    assert build([service()], [piece]).endpoints_of(HTTP) == ()


def test_endpoints_of_several_slices_are_merged() -> None:
    a = endpoint_slice("web-a", endpoints=[endpoint("10.244.1.5"), endpoint("10.244.1.6")])
    b = endpoint_slice("web-b", endpoints=[endpoint("10.244.2.7")])
    snap = build([service()], [a, b])
    assert [e.ip for e in snap.endpoints_of(HTTP)] == ["10.244.1.5", "10.244.1.6", "10.244.2.7"]


def test_duplicate_endpoint_across_slices_counts_once_and_ready_wins() -> None:
    a = endpoint_slice("web-a", endpoints=[endpoint("10.244.1.5", conditions={"ready": True})])
    b = endpoint_slice("web-b", endpoints=[endpoint("10.244.1.5", conditions={"ready": False})])
    for order in ([a, b], [b, a]):
        snap = build([service()], order)
        assert snap.endpoints_of(HTTP) == (Endpoint("10.244.1.5", 8080, ready=True),)


def test_slices_of_another_service_or_namespace_do_not_mix_in() -> None:
    other = endpoint_slice("api-a", service_name="api", endpoints=[endpoint("10.244.9.9")])
    elsewhere = endpoint_slice("web-x", namespace="prod", endpoints=[endpoint("10.244.8.8")])
    snap = build([service()], [endpoint_slice(), other, elsewhere])
    assert [e.ip for e in snap.endpoints_of(HTTP)] == ["10.244.1.5"]


def test_slice_without_service_name_label_is_ignored() -> None:
    snap = build([service()], [endpoint_slice(service_name=None)])
    assert snap.endpoints_of(HTTP) == ()


@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        ({}, (True, True, False)),  # nil ready is ready; nil serving follows ready
        (None, (True, True, False)),
        ({"ready": False}, (False, False, False)),
        ({"ready": False, "serving": True, "terminating": True}, (False, True, True)),
        ({"ready": True, "serving": None, "terminating": None}, (True, True, False)),
        ({"serving": False}, (True, False, False)),
    ],
)
def test_endpoint_conditions_follow_the_api_defaults(
    conditions: dict[str, Any] | None, expected: tuple[bool, bool, bool]
) -> None:
    piece = endpoint_slice(endpoints=[endpoint("10.244.1.5", conditions=conditions)])
    (got,) = build([service()], [piece]).endpoints_of(HTTP)
    assert (got.ready, got.serving, got.terminating) == expected


def test_endpoint_keeps_its_node_name() -> None:
    piece = endpoint_slice(endpoints=[endpoint("10.244.1.5", nodeName="node-1")])
    (got,) = build([service()], [piece]).endpoints_of(HTTP)
    assert got.node_name == "node-1"


def test_ipv6_slice_gives_ipv6_endpoints() -> None:
    svc = service(clusterIP="fd00::10", clusterIPs=["fd00::10"])
    piece = endpoint_slice(address_type="IPv6", endpoints=[endpoint("fd00:1::0005")])
    snap = build([svc], [piece])
    assert snap.services[HTTP].cluster_ips == ("fd00::10",)
    assert snap.endpoints_of(HTTP) == (Endpoint("fd00:1::5", 8080),)


def test_dual_stack_cluster_ips_are_kept() -> None:
    svc = service(clusterIP="10.96.0.10", clusterIPs=["10.96.0.10", "fd00::10"])
    v4 = endpoint_slice("web-4")
    v6 = endpoint_slice("web-6", address_type="IPv6", endpoints=[endpoint("fd00:1::5")])
    snap = build([svc], [v4, v6])
    assert snap.services[HTTP].cluster_ips == ("10.96.0.10", "fd00::10")
    assert [e.ip for e in snap.endpoints_of(HTTP)] == ["10.244.1.5", "fd00:1::5"]


def test_fqdn_slice_is_skipped_with_a_log_line(logged: pytest.LogCaptureFixture) -> None:
    piece = endpoint_slice(address_type="FQDN", endpoints=[endpoint("example.com")])
    assert build([service()], [piece]).endpoints_of(HTTP) == ()
    assert lines(logged) == [
        "skipping EndpointSlice default/web-abc: addressType FQDN is not proxied"
    ]


def test_udp_port_is_proxied() -> None:
    svc = service(ports=[{"name": "dns", "port": 53, "protocol": "UDP"}])
    piece = endpoint_slice(ports=[{"name": "dns", "port": 5353, "protocol": "UDP"}])
    snap = build([svc], [piece])
    name = ServicePortName("default", "web", "dns", Protocol.UDP)
    assert snap.services[name].protocol is Protocol.UDP
    assert [e.port for e in snap.endpoints_of(name)] == [5353]


def test_sctp_port_is_skipped_with_one_warning(logged: pytest.LogCaptureFixture) -> None:
    svc = service(
        ports=[
            {"name": "http", "port": 80, "protocol": "TCP"},
            {"name": "sig", "port": 3868, "protocol": "SCTP"},
        ]
    )
    state = ClusterState()
    for _ in range(3):
        state.replace("Service", [copy.deepcopy(svc)])
        state.apply("Service", "MODIFIED", copy.deepcopy(svc))
        state.replace("EndpointSlice", [endpoint_slice()])
        snap = state.snapshot()
        assert set(snap.services) == {HTTP}
    warnings = lines(logged, logging.WARNING)
    assert warnings == ["skipping service port default/web:sig: protocol SCTP is not proxied"]


def test_client_ip_affinity_with_default_timeout() -> None:
    info = build([service(sessionAffinity="ClientIP")]).services[HTTP]
    assert info.client_ip_affinity
    assert info.affinity_timeout_seconds == 10800


def test_client_ip_affinity_with_its_timeout() -> None:
    svc = service(
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 600}},
    )
    info = build([svc]).services[HTTP]
    assert (info.client_ip_affinity, info.affinity_timeout_seconds) == (True, 600)


def test_no_affinity_by_default() -> None:
    assert not build([service()]).services[HTTP].client_ip_affinity


def test_traffic_policies_local_become_flags() -> None:
    svc = service(type="NodePort", internalTrafficPolicy="Local", externalTrafficPolicy="Local")
    info = build([svc]).services[HTTP]
    assert info.internal_traffic_local
    assert info.external_traffic_local


def test_external_policy_means_nothing_without_external_paths() -> None:
    info = build([service(externalTrafficPolicy="Local")]).services[HTTP]
    assert not info.external_traffic_local


def test_node_port_external_ips_and_load_balancer_ingress() -> None:
    svc = service(
        type="LoadBalancer",
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        externalIPs=["192.0.2.10"],
        status={"loadBalancer": {"ingress": [{"ip": "198.51.100.7"}, {"hostname": "lb.example"}]}},
    )
    info = build([svc]).services[HTTP]
    assert info.node_port == 30080
    assert info.external_ips == ("192.0.2.10",)
    assert info.load_balancer_ips == ("198.51.100.7",)
    assert info.has_external_paths


def test_node_port_of_a_cluster_ip_service_is_not_used() -> None:
    svc = service(ports=[{"name": "http", "port": 80, "nodePort": 30080}])
    assert build([svc]).services[HTTP].node_port == 0


# -- ignore rules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "svc",
    [
        pytest.param(service(clusterIP="None"), id="headless"),
        pytest.param(service(clusterIP="None", clusterIPs=["None"]), id="headless-clusterIPs"),
        pytest.param(
            service(type="ExternalName", externalName="db.example", clusterIP=""),
            id="external-name",
        ),
        pytest.param(service(clusterIP=""), id="no-cluster-ip"),
        pytest.param(
            service(labels={"service.kubernetes.io/service-proxy-name": "cilium"}),
            id="other-proxy",
        ),
        pytest.param(service(labels={"service.kubernetes.io/headless": ""}), id="headless-label"),
    ],
)
def test_services_kube_proxy_ignores_are_ignored(
    svc: dict[str, Any], logged: pytest.LogCaptureFixture
) -> None:
    snap = build([svc], [endpoint_slice()])
    assert dict(snap.services) == {}
    assert dict(snap.endpoints) == {}
    assert lines(logged, logging.WARNING) == []  # ignoring is normal, not an error


def test_service_without_cluster_ip_key_is_ignored() -> None:
    svc = service()
    del svc["spec"]["clusterIP"]
    assert dict(build([svc]).services) == {}


def test_with_service_proxy_name_only_its_labelled_services_are_handled() -> None:
    ours = service("ours", labels={"service.kubernetes.io/service-proxy-name": "kup"})
    theirs = service("theirs", labels={"service.kubernetes.io/service-proxy-name": "other"})
    plain = service("plain")
    snap = build([ours, theirs, plain], service_proxy_name="kup")
    assert {n.name for n in snap.services} == {"ours"}


def test_with_service_proxy_name_headless_label_still_ignores() -> None:
    svc = service(
        labels={
            "service.kubernetes.io/service-proxy-name": "kup",
            "service.kubernetes.io/headless": "",
        }
    )
    assert dict(build([svc], service_proxy_name="kup").services) == {}


def test_service_that_becomes_ignored_is_removed() -> None:
    state = ClusterState()
    state.replace("Service", [service()])
    state.replace("EndpointSlice", [endpoint_slice()])
    assert HTTP in state.snapshot().services
    state.apply("Service", "MODIFIED", service(clusterIP="None"))
    snap = state.snapshot()
    assert HTTP not in snap.services
    assert HTTP not in snap.endpoints


# -- malformed objects -------------------------------------------------------------------------


def _svc_with(path: str, value: Any) -> dict[str, Any]:
    obj = service()
    target: Any = obj
    keys = path.split(".")
    for key in keys[:-1]:
        target = target[int(key)] if isinstance(target, list) else target.setdefault(key, {})
    last = keys[-1]
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return obj


MALFORMED_SERVICES = {
    "port-0": (_svc_with("spec.ports.0.port", 0), "spec.ports[0].port: 0 is not a port"),
    "port-too-big": (
        _svc_with("spec.ports.0.port", 70000),
        "spec.ports[0].port: 70000 is not a port",
    ),
    "port-missing": (_svc_with("spec.ports.0", {"name": "http"}), "spec.ports[0].port: None"),
    "port-string": (_svc_with("spec.ports.0.port", "80"), "spec.ports[0].port: '80'"),
    "port-bool": (_svc_with("spec.ports.0.port", True), "spec.ports[0].port: True"),
    "node-port-too-big": (
        _svc_with("spec.ports.0.nodePort", 99999),
        "spec.ports[0].nodePort: 99999",
    ),
    "ports-not-a-list": (_svc_with("spec.ports", {"port": 80}), "spec.ports: expected a list"),
    "port-not-an-object": (_svc_with("spec.ports.0", 80), "spec.ports[0]: expected an object"),
    "unknown-protocol": (
        _svc_with("spec.ports.0.protocol", "QUIC"),
        "spec.ports[0].protocol: unknown protocol 'QUIC'",
    ),
    "duplicate-port-name": (
        _svc_with("spec.ports", [{"name": "a", "port": 80}, {"name": "a", "port": 81}]),
        "duplicate port name 'a'",
    ),
    "bad-cluster-ip": (_svc_with("spec.clusterIP", "10.96.0.300"), "is not an IP address"),
    "cluster-ip-wrong-type": (_svc_with("spec.clusterIP", 10), "spec.clusterIP: expected"),
    "bad-external-ip": (
        _svc_with("spec.externalIPs", ["not-an-ip"]),
        "spec.externalIPs[0]: 'not-an-ip' is not an IP address",
    ),
    "bad-ingress-ip": (
        _svc_with("status.loadBalancer.ingress", [{"ip": "1.2.3"}]),
        "status.loadBalancer.ingress[0].ip",
    ),
    "spec-not-an-object": (_svc_with("spec", ["x"]), "spec: expected an object"),
    "labels-wrong-type": (_svc_with("metadata.labels", {"a": 1}), "metadata.labels"),
    "unknown-type": (_svc_with("spec.type", "Magic"), "spec.type: unknown type 'Magic'"),
    "unknown-affinity": (_svc_with("spec.sessionAffinity", "Cookie"), "spec.sessionAffinity"),
    "affinity-timeout-zero": (
        _svc_with("spec.sessionAffinityConfig", {"clientIP": {"timeoutSeconds": 0}}),
        "timeoutSeconds: 0 is not in 1-86400",
    ),
    "affinity-timeout-string": (
        _svc_with("spec.sessionAffinityConfig", {"clientIP": {"timeoutSeconds": "10"}}),
        "timeoutSeconds: expected an integer",
    ),
    "unknown-traffic-policy": (
        _svc_with("spec.internalTrafficPolicy", "Nearby"),
        "spec.internalTrafficPolicy: unknown policy 'Nearby'",
    ),
}
MALFORMED_SERVICES["affinity-timeout-zero"][0]["spec"]["sessionAffinity"] = "ClientIP"


@pytest.mark.parametrize("case", sorted(MALFORMED_SERVICES))
def test_malformed_service_is_skipped_with_one_log_line(
    case: str, logged: pytest.LogCaptureFixture
) -> None:
    bad, reason = MALFORMED_SERVICES[case]
    bad = copy.deepcopy(bad)
    bad["metadata"]["name"] = "broken"
    snap = build([bad, service()], [endpoint_slice()])
    assert set(snap.services) == {HTTP}  # the good one still works
    assert len(snap.endpoints_of(HTTP)) == 1
    (line,) = lines(logged, logging.WARNING)
    assert line.startswith("skipping Service default/broken: ")
    assert reason in line


def _slice_with(path: str, value: Any) -> dict[str, Any]:
    obj = endpoint_slice("broken")
    target: Any = obj
    keys = path.split(".")
    for key in keys[:-1]:
        target = target[int(key)] if isinstance(target, list) else target.setdefault(key, {})
    last = keys[-1]
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return obj


MALFORMED_SLICES = {
    "no-addresses": (_slice_with("endpoints.0.addresses", []), "endpoints[0].addresses is empty"),
    "bad-ip": (_slice_with("endpoints.0.addresses", ["10.0.0.999"]), "is not an IP address"),
    "ipv6-in-ipv4-slice": (
        _slice_with("endpoints.0.addresses", ["fd00::1"]),
        "'fd00::1' is not an IPv4 address",
    ),
    "ready-wrong-type": (
        _slice_with("endpoints.0.conditions", {"ready": "yes"}),
        "endpoints[0].conditions.ready: expected a boolean",
    ),
    "port-too-big": (_slice_with("ports.0.port", 70000), "ports[0].port: 70000"),
    "port-0": (_slice_with("ports.0.port", 0), "ports[0].port: 0"),
    "unknown-address-type": (_slice_with("addressType", "IPX"), "addressType: 'IPX'"),
    "endpoints-not-a-list": (_slice_with("endpoints", "10.0.0.1"), "endpoints: expected a list"),
    "node-name-wrong-type": (_slice_with("endpoints.0.nodeName", 7), "nodeName: expected"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_SLICES))
def test_malformed_slice_is_skipped_with_one_log_line(
    case: str, logged: pytest.LogCaptureFixture
) -> None:
    bad, reason = MALFORMED_SLICES[case]
    snap = build([service()], [copy.deepcopy(bad), endpoint_slice()])
    assert [e.ip for e in snap.endpoints_of(HTTP)] == ["10.244.1.5"]
    (line,) = lines(logged, logging.WARNING)
    assert line.startswith("skipping EndpointSlice default/broken: ")
    assert reason in line


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(None, id="none"),
        pytest.param("a string", id="string"),
        pytest.param({"metadata": {"name": "x"}}, id="no-namespace"),
        pytest.param({"metadata": {"namespace": "default"}}, id="no-name"),
        pytest.param({"metadata": "x"}, id="metadata-wrong-type"),
        pytest.param({}, id="empty"),
    ],
)
@pytest.mark.parametrize("kind", ["Service", "EndpointSlice"])
def test_object_without_identity_is_skipped(
    bad: Any, kind: Any, logged: pytest.LogCaptureFixture
) -> None:
    state = ClusterState()
    state.replace(kind, [bad])
    state.apply(kind, "ADDED", bad)
    state.apply(kind, "DELETED", bad)
    assert dict(state.snapshot().services) == {}
    assert all(line.startswith(f"skipping {kind} ") for line in lines(logged, logging.WARNING))
    assert lines(logged, logging.WARNING)


def test_malformed_object_is_logged_once_per_version(logged: pytest.LogCaptureFixture) -> None:
    bad = _svc_with("spec.ports.0.port", 0)
    state = ClusterState()
    for _ in range(5):
        state.replace("Service", [copy.deepcopy(bad)])
    state.apply("Service", "MODIFIED", copy.deepcopy(bad))
    assert len(lines(logged, logging.WARNING)) == 1
    state.apply("Service", "MODIFIED", _svc_with("spec.ports.0.port", -1))
    assert len(lines(logged, logging.WARNING)) == 2


def test_service_modified_into_malformed_is_removed() -> None:
    state = ClusterState()
    state.replace("Service", [service()])
    state.replace("EndpointSlice", [endpoint_slice()])
    assert HTTP in state.snapshot().services
    state.apply("Service", "MODIFIED", _svc_with("spec.ports.0.port", 0))
    assert HTTP not in state.snapshot().services


def test_unknown_kind_and_event_do_not_raise(logged: pytest.LogCaptureFixture) -> None:
    state = ClusterState()
    state.replace("Pod", [{}])  # type: ignore[arg-type]
    state.apply("Pod", "ADDED", {})  # type: ignore[arg-type]
    state.apply("Service", "BOOKMARK", service())  # type: ignore[arg-type]
    assert dict(state.snapshot().services) == {}
    assert len(lines(logged, logging.WARNING)) == 3


# -- events, counters, change notification --------------------------------------------------------


def test_listed_only_after_both_kinds() -> None:
    state = ClusterState()
    assert not state.listed
    state.replace("Service", [])
    assert not state.listed
    state.replace("EndpointSlice", [])
    assert state.listed


def test_first_full_listing_notifies_even_when_empty() -> None:
    calls: list[None] = []
    state = ClusterState(on_change=lambda: calls.append(None))
    state.replace("Service", [])
    state.replace("EndpointSlice", [])
    assert len(calls) == 1


def test_change_notifies_and_no_op_does_not() -> None:
    calls: list[None] = []
    state = ClusterState(on_change=lambda: calls.append(None))
    state.replace("Service", [service()])
    state.replace("EndpointSlice", [endpoint_slice()])
    count = len(calls)
    state.replace("Service", [service()])
    state.replace("EndpointSlice", [endpoint_slice()])
    state.apply("Service", "MODIFIED", service())
    state.apply("Service", "DELETED", service("absent"))
    assert len(calls) == count
    state.apply("EndpointSlice", "MODIFIED", endpoint_slice(endpoints=[endpoint("10.244.1.6")]))
    assert len(calls) == count + 1


def test_change_counts_are_pending_until_snapshot_and_totals_keep_growing() -> None:
    state = ClusterState()
    state.replace("Service", [service("a"), service("b")])
    state.replace("EndpointSlice", [endpoint_slice()])
    state.apply("Service", "DELETED", service("b"))
    assert (state.pending_service_changes, state.pending_endpoint_changes) == (3, 1)
    state.snapshot()
    assert (state.pending_service_changes, state.pending_endpoint_changes) == (0, 0)
    state.apply("EndpointSlice", "DELETED", endpoint_slice())
    assert (state.pending_service_changes, state.pending_endpoint_changes) == (0, 1)
    assert (state.service_changes_total, state.endpoint_changes_total) == (3, 2)


def test_deleted_service_and_slice_disappear() -> None:
    state = ClusterState()
    state.replace("Service", [service()])
    state.replace("EndpointSlice", [endpoint_slice()])
    state.apply("EndpointSlice", "DELETED", endpoint_slice())
    assert state.snapshot().endpoints_of(HTTP) == ()
    state.apply("Service", "DELETED", service())
    assert HTTP not in state.snapshot().services


def test_replace_drops_objects_missing_from_the_new_list() -> None:
    state = ClusterState()
    state.replace("Service", [service("a"), service("b")])
    state.replace("EndpointSlice", [])
    state.replace("Service", [service("b")])
    assert {n.name for n in state.snapshot().services} == {"b"}


def test_slice_moved_to_another_service_moves_its_endpoints() -> None:
    state = ClusterState()
    state.replace("Service", [service("web"), service("api")])
    state.replace("EndpointSlice", [endpoint_slice("s1", service_name="web")])
    state.apply("EndpointSlice", "MODIFIED", endpoint_slice("s1", service_name="api"))
    snap = state.snapshot()
    assert snap.endpoints_of(HTTP) == ()
    assert len(snap.endpoints_of(ServicePortName("default", "api", "http"))) == 1


def test_slice_arriving_before_its_service_is_used_once_the_service_comes() -> None:
    state = ClusterState()
    state.replace("EndpointSlice", [endpoint_slice()])
    state.replace("Service", [])
    assert dict(state.snapshot().services) == {}
    state.apply("Service", "ADDED", service())
    assert len(state.snapshot().endpoints_of(HTTP)) == 1


def test_snapshot_is_immutable_and_unaffected_by_later_changes() -> None:
    state = ClusterState()
    state.replace("Service", [service()])
    state.replace("EndpointSlice", [endpoint_slice()])
    first = state.snapshot()
    state.apply("Service", "DELETED", service())
    assert HTTP in first.services
    with pytest.raises(TypeError):
        first.services[HTTP] = first.services[HTTP]  # type: ignore[index]


def test_trigger_times_are_collected_and_reset_by_snapshot() -> None:
    state = ClusterState()
    state.replace("Service", [service()])
    stamp = {"endpoints.kubernetes.io/last-change-trigger-time": "2024-05-01T10:00:00Z"}
    state.replace("EndpointSlice", [endpoint_slice(annotations=stamp)])
    assert state.snapshot().trigger_times == (1714557600.0,)
    assert state.snapshot().trigger_times == ()


def test_bad_trigger_time_is_ignored() -> None:
    state = ClusterState()
    bad = {"endpoints.kubernetes.io/last-change-trigger-time": "yesterday"}
    state.replace("EndpointSlice", [endpoint_slice(annotations=bad)])
    state.replace("Service", [service()])
    snap = state.snapshot()
    assert snap.trigger_times == ()
    assert len(snap.endpoints_of(HTTP)) == 1


# -- node ---------------------------------------------------------------------------------------


def node(**fields: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {"name": "node-1"},
        "status": {
            "addresses": [
                {"type": "Hostname", "address": "node-1"},
                {"type": "ExternalIP", "address": "203.0.113.5"},
                {"type": "InternalIP", "address": "10.0.0.5"},
            ]
        },
    }
    obj.update(fields)
    return obj


def test_node_ips_are_the_primary_internal_ip_as_kubernetes_ranks_them() -> None:
    # GetNodeHostIPs: the first InternalIP (ExternalIPs only when there is none), plus the
    # first address of the other family on a dual-stack node.
    state = ClusterState(node_name="node-1")
    state.set_node(node())
    snap = state.snapshot()
    assert snap.node_ips == ("10.0.0.5",)
    assert snap.node_name == "node-1"
    assert state.node_eligible


def test_a_dual_stack_node_gives_one_ip_per_family() -> None:
    state = ClusterState()
    addresses = [
        {"type": "ExternalIP", "address": "203.0.113.5"},
        {"type": "InternalIP", "address": "10.0.0.5"},
        {"type": "InternalIP", "address": "10.0.0.6"},
        {"type": "InternalIP", "address": "fd00::5"},
    ]
    state.set_node(node(status={"addresses": addresses}))
    assert state.snapshot().node_ips == ("10.0.0.5", "fd00::5")


def test_node_being_deleted_is_not_eligible() -> None:
    state = ClusterState()
    state.set_node(node(metadata={"name": "node-1", "deletionTimestamp": "2024-05-01T10:00:00Z"}))
    assert not state.node_eligible


def test_node_tainted_for_scale_down_is_not_eligible() -> None:
    state = ClusterState()
    taint = {"key": "ToBeDeletedByClusterAutoscaler", "value": "1", "effect": "NoSchedule"}
    state.set_node(node(spec={"taints": [taint]}))
    assert not state.node_eligible
    state.set_node(node(spec={"taints": []}))
    assert state.node_eligible


def test_node_change_notifies_once() -> None:
    calls: list[None] = []
    state = ClusterState(on_change=lambda: calls.append(None))
    state.set_node(node())
    state.set_node(node())
    assert len(calls) == 1


def test_malformed_node_keeps_previous_addresses(logged: pytest.LogCaptureFixture) -> None:
    state = ClusterState()
    state.set_node(node())
    state.set_node(node(status={"addresses": [{"type": "InternalIP", "address": "x"}]}))
    assert state.snapshot().node_ips == ("10.0.0.5",)
    (line,) = lines(logged, logging.WARNING)
    assert line.startswith("skipping Node node-1: ")


# -- never raises -------------------------------------------------------------------------------

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
SERVICE_PATHS = [
    "metadata",
    "metadata.labels",
    "metadata.namespace",
    "spec",
    "spec.type",
    "spec.clusterIP",
    "spec.clusterIPs",
    "spec.ports",
    "spec.ports.0",
    "spec.ports.0.port",
    "spec.ports.0.name",
    "spec.ports.0.protocol",
    "spec.ports.0.nodePort",
    "spec.externalIPs",
    "spec.sessionAffinity",
    "spec.sessionAffinityConfig",
    "spec.internalTrafficPolicy",
    "status",
    "status.loadBalancer",
]
SLICE_PATHS = [
    "metadata",
    "metadata.labels",
    "metadata.annotations",
    "addressType",
    "ports",
    "ports.0",
    "ports.0.port",
    "ports.0.protocol",
    "endpoints",
    "endpoints.0",
    "endpoints.0.addresses",
    "endpoints.0.conditions",
    "endpoints.0.conditions.serving",
    "endpoints.0.nodeName",
]


@given(st.sampled_from(SERVICE_PATHS), JUNK, st.sampled_from(SLICE_PATHS), JUNK)
def test_junk_anywhere_never_raises(
    service_path: str, service_junk: Any, slice_path: str, slice_junk: Any
) -> None:
    state = ClusterState()
    bad_service = _svc_with(service_path, service_junk)
    bad_slice = _slice_with(slice_path, slice_junk)
    state.replace("Service", [bad_service, service("good")])
    state.replace("EndpointSlice", [bad_slice, endpoint_slice("good-abc", service_name="good")])
    state.apply("Service", "MODIFIED", bad_service)
    state.apply("EndpointSlice", "MODIFIED", bad_slice)
    state.set_node(bad_service)
    snap = state.snapshot()
    assert ServicePortName("default", "good", "http") in snap.services
    state.apply("EndpointSlice", "DELETED", bad_slice)
    state.apply("Service", "DELETED", bad_service)


def test_relist_of_same_resource_version_is_not_parsed_again() -> None:
    first = service()
    first["metadata"]["resourceVersion"] = "41"
    same_version = _svc_with("spec.ports.0.port", 81)
    same_version["metadata"]["resourceVersion"] = "41"  # the API never does this: proves the skip
    newer = _svc_with("spec.ports.0.port", 82)
    newer["metadata"]["resourceVersion"] = "42"
    state = ClusterState()
    state.replace("Service", [first])
    state.replace("Service", [same_version])
    assert state.snapshot().services[HTTP].port == 80
    state.replace("Service", [newer])
    assert state.snapshot().services[HTTP].port == 82
    state.apply("Service", "DELETED", newer)
    state.apply("Service", "ADDED", first)  # recreated objects are parsed even at an old version
    assert state.snapshot().services[HTTP].port == 80


# -- the PROXY protocol annotation ------------------------------------------------------------


def annotated(value: Any, **kwargs: Any) -> dict[str, Any]:
    obj = service(**kwargs)
    obj["metadata"]["annotations"] = {"kube-userspace-proxy.io/proxy-protocol": value}
    return obj


@pytest.mark.parametrize(("value", "version"), [("v1", 1), ("v2", 2)])
def test_proxy_protocol_annotation_sets_the_version(value: str, version: int) -> None:
    snapshot = build([annotated(value)], [endpoint_slice()])
    assert snapshot.services[HTTP].proxy_protocol == version


def test_service_without_the_annotation_gets_no_header() -> None:
    snapshot = build([service()], [endpoint_slice()])
    assert snapshot.services[HTTP].proxy_protocol == 0


@pytest.mark.parametrize("value", ["v3", "V1", "", "true", 2])
def test_bad_proxy_protocol_value_is_one_warning_and_no_header(
    logged: pytest.LogCaptureFixture, value: Any
) -> None:
    state = ClusterState()
    state.replace("Service", [annotated(value)])
    state.replace("EndpointSlice", [endpoint_slice()])
    state.replace("Service", [annotated(value)])  # a relist or reload: no second warning
    snapshot = state.snapshot()
    assert snapshot.services[HTTP].proxy_protocol == 0
    assert snapshot.endpoints_of(HTTP)  # still proxied
    warnings = lines(logged, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert "kube-userspace-proxy.io/proxy-protocol" in warnings[0]
    assert repr(value) in warnings[0]


def test_proxy_protocol_on_a_udp_port_is_tcp_only_with_a_warning(
    logged: pytest.LogCaptureFixture,
) -> None:
    ports = [
        {"name": "http", "port": 80, "protocol": "TCP"},
        {"name": "dns", "port": 53, "protocol": "UDP"},
    ]
    snapshot = build([annotated("v2", ports=ports)])
    dns = ServicePortName("default", "web", "dns", Protocol.UDP)
    assert snapshot.services[HTTP].proxy_protocol == 2
    assert snapshot.services[dns].proxy_protocol == 0
    assert any("TCP ports only" in line for line in lines(logged, logging.WARNING))


def test_changes_hold_only_the_service_ports_changed_since_the_last_snapshot() -> None:
    state = ClusterState()
    state.replace("Service", [service(f"s{i}", clusterIP=f"10.96.0.{i + 1}") for i in range(50)])
    state.replace(
        "EndpointSlice", [endpoint_slice(f"s{i}-a", service_name=f"s{i}") for i in range(50)]
    )
    first = state.changes()
    assert isinstance(first, Change) and len(first.services) == 50
    assert state.changes().changed == frozenset()  # nothing since
    state.apply(
        "EndpointSlice",
        "MODIFIED",
        endpoint_slice("s3-a", service_name="s3", endpoints=[endpoint("10.244.9.9")]),
    )
    state.apply("Service", "DELETED", service("s7"))
    delta = state.changes()
    s3, s7 = ServicePortName("default", "s3", "http"), ServicePortName("default", "s7", "http")
    assert delta.changed == {s3, s7}
    assert set(delta.services) == {s3}  # s7 is named as changed, and gone
    assert [e.ip for e in delta.endpoints[s3]] == ["10.244.9.9"]
    # The complete snapshot agrees.
    full = state.snapshot()
    assert isinstance(full, Snapshot) and len(full.services) == 49
    assert [e.ip for e in full.endpoints_of(s3)] == ["10.244.9.9"]


def test_changes_carry_the_trigger_times_and_counts_like_a_snapshot() -> None:
    state = ClusterState()
    state.replace("Service", [service()])
    state.replace("EndpointSlice", [])
    state.snapshot()
    when = "2026-01-01T00:00:00Z"
    annotations = {"endpoints.kubernetes.io/last-change-trigger-time": when}
    state.apply("EndpointSlice", "ADDED", endpoint_slice(annotations=annotations))
    delta = state.changes()
    assert delta.endpoint_changes == 1 and len(delta.trigger_times) == 1
    assert state.changes().trigger_times == ()


def test_an_endpoint_move_keeps_the_objects_of_the_endpoints_that_stay() -> None:
    state = ClusterState()
    state.replace("Service", [service()])
    ips = ["10.244.1.5", "10.244.1.6", "10.244.1.7"]
    state.replace("EndpointSlice", [endpoint_slice(endpoints=[endpoint(ip) for ip in ips])])
    before = state.snapshot().endpoints[HTTP]
    moved = [*ips[:2], "10.244.1.9"]
    state.apply(
        "EndpointSlice", "MODIFIED", endpoint_slice(endpoints=[endpoint(ip) for ip in moved])
    )
    after = state.changes().endpoints[HTTP]
    assert [e.ip for e in after] == moved
    assert after[0] is before[0] and after[1] is before[1]  # the same objects, not copies
    assert after[2] == Endpoint("10.244.1.9", 8080)


def test_a_slice_change_that_leaves_the_endpoints_as_they_were_keeps_their_tuple() -> None:
    state = ClusterState()
    state.replace("Service", [service()])
    state.replace("EndpointSlice", [endpoint_slice(endpoints=[endpoint("10.244.1.5")])])
    before = state.snapshot().endpoints[HTTP]
    # Another slice of the Service comes with an endpoint the first one has already.
    state.apply(
        "EndpointSlice",
        "ADDED",
        endpoint_slice("web-def", endpoints=[endpoint("10.244.1.5")]),
    )
    changes = state.changes()
    assert HTTP in changes.changed and changes.endpoints[HTTP] is before
