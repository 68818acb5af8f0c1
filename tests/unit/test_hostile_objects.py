"""Hostile or broken objects: addresses that are never proxied, names that reach iptables.

Each bad address or object is dropped alone, with one log line naming the object and a
counter; the other Services (and the other addresses of the same object) are kept.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from kube_userspace_proxy.cluster import objects
from kube_userspace_proxy.cluster.state import ClusterState
from kube_userspace_proxy.model import Protocol, ProxiedPort, ServicePortName
from kube_userspace_proxy.ops.metrics import ProxyMetrics, sample_value
from kube_userspace_proxy.portals.desired import render
from kube_userspace_proxy.portals.rules import Rule, Settings
from tests.unit.test_state import endpoint, endpoint_slice, lines, service

WEB = ServicePortName("default", "web", "http", Protocol.TCP)
FORBIDDEN = [
    ("127.0.0.1", "loopback"),
    ("127.3.4.5", "loopback"),
    ("169.254.169.254", "link-local"),
    ("169.254.1.1", "link-local"),
    ("0.0.0.0", "unspecified"),
    ("224.0.0.1", "multicast"),
    ("239.1.2.3", "multicast"),
    ("255.255.255.255", "broadcast"),
]
FORBIDDEN_V6 = [
    ("::1", "loopback"),
    ("::", "unspecified"),
    ("fe80::1", "link-local"),
    ("febf::1", "link-local"),
    ("ff02::1", "multicast"),
    ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:169.254.169.254", "link-local"),
]


def metric(reason: str, field: str, kind: str) -> float:
    text = ProxyMetrics(lambda: (), process_metrics=False).render().decode()
    labels = {"kind": kind, "field": field, "reason": reason}
    return sample_value(text, "kube_userspace_proxy_forbidden_addresses_total", labels) or 0.0


@pytest.mark.parametrize(("ip", "reason"), FORBIDDEN)
def test_endpoint_on_a_forbidden_address_is_never_dialed(
    ip: str, reason: str, logged: pytest.LogCaptureFixture
) -> None:
    before = metric(reason, "endpoint", "EndpointSlice")
    state = ClusterState()
    state.replace("Service", [service()])
    state.replace(
        "EndpointSlice",
        [endpoint_slice(endpoints=[endpoint(ip), endpoint("10.244.1.5")])],
    )
    assert [e.ip for e in state.snapshot().endpoints_of(WEB)] == ["10.244.1.5"]
    warned = [m for m in lines(logged, logging.WARNING) if ip in m]
    assert len(warned) == 1 and "default/web-abc" in warned[0] and reason in warned[0]
    assert metric(reason, "endpoint", "EndpointSlice") == before + 1


@pytest.mark.parametrize(("ip", "reason"), FORBIDDEN_V6)
def test_ipv6_endpoint_on_a_forbidden_address_is_never_dialed(ip: str, reason: str) -> None:
    state = ClusterState()
    state.replace("Service", [service(clusterIP="fd00::10", clusterIPs=["fd00::10"])])
    slice_ = endpoint_slice(endpoints=[endpoint(ip), endpoint("fd00:1::5")], address_type="IPv6")
    state.replace("EndpointSlice", [slice_])
    assert [e.ip for e in state.snapshot().endpoints_of(WEB)] == ["fd00:1::5"]


def test_loopback_endpoints_are_allowed_only_when_asked_and_link_local_never() -> None:
    state = ClusterState(loopback_endpoints=True)
    state.replace("Service", [service()])
    state.replace(
        "EndpointSlice",
        [endpoint_slice(endpoints=[endpoint("127.0.0.11"), endpoint("169.254.169.254")])],
    )
    assert [e.ip for e in state.snapshot().endpoints_of(WEB)] == ["127.0.0.11"]


@pytest.mark.parametrize(("ip", "reason"), FORBIDDEN + FORBIDDEN_V6[:5])
def test_forbidden_external_and_ingress_ips_get_no_rules(
    ip: str, reason: str, logged: pytest.LogCaptureFixture
) -> None:
    before_ext = metric(reason, "externalIP", "Service")
    before_lb = metric(reason, "loadBalancerIP", "Service")
    state = ClusterState()
    lb = {"loadBalancer": {"ingress": [{"ip": ip}, {"ip": "203.0.113.7"}]}}
    state.replace(
        "Service",
        [service(type="LoadBalancer", externalIPs=[ip, "198.51.100.9"], status=lb)],
    )
    info = state.snapshot().services[WEB]
    assert info.external_ips == ("198.51.100.9",)
    assert info.load_balancer_ips == ("203.0.113.7",)
    rules = render([ProxiedPort(info, 40001, 40001)], Settings(node_ips=("10.0.0.1",)))
    assert not [r for r in rules if ip in r.line]
    assert [r for r in rules if "203.0.113.7" in r.line]
    warned = [m for m in lines(logged, logging.WARNING) if f" {ip}:" in m or f" {ip} " in m]
    assert len(warned) == 2 and all("default/web" in m for m in warned)
    assert metric(reason, "externalIP", "Service") == before_ext + 1
    assert metric(reason, "loadBalancerIP", "Service") == before_lb + 1


def test_loopback_cluster_ip_skips_that_service_alone() -> None:
    state = ClusterState()
    state.replace("Service", [service("bad", clusterIP="127.0.0.1"), service()])
    assert set(state.snapshot().services) == {WEB}


INJECTION = 'x"\nCOMMIT\n*filter\n-I INPUT 1 -j ACCEPT\n#'


@pytest.mark.parametrize(
    "bad",
    [
        service(INJECTION),
        service("a" * 300),
        service("Upper"),
        service("web", namespace='ns"x'),
        service("web", namespace="n" * 64),
        service("x", ports=[{"name": 'h"\n-j ACCEPT', "port": 80}]),
        service("y", ports=[{"name": "p" * 64, "port": 80}]),
    ],
    ids=["injection", "300-chars", "uppercase", "quote-in-ns", "long-ns", "port-quote", "port-64"],
)
def test_bad_names_skip_that_object_alone(
    bad: dict[str, object], logged: pytest.LogCaptureFixture
) -> None:
    state = ClusterState()
    state.replace("Service", [bad, service()])
    snapshot = state.snapshot()
    assert set(snapshot.services) == {WEB}
    assert any("DNS-1123" in m for m in lines(logged, logging.WARNING))
    rules = render(
        [ProxiedPort(info, 40001, 40001) for info in snapshot.services.values()], Settings()
    )
    assert all('"' not in r.comment and "\n" not in r.comment for r in rules)


def test_slice_with_a_bad_port_name_is_skipped() -> None:
    state = ClusterState()
    state.replace("Service", [service()])
    bad = endpoint_slice("bad", endpoints=[endpoint("10.244.1.9")])
    bad["ports"] = [{"name": "h\ttp", "port": 8080}]
    state.replace("EndpointSlice", [bad, endpoint_slice(endpoints=[endpoint("10.244.1.5")])])
    assert [e.ip for e in state.snapshot().endpoints_of(WEB)] == ["10.244.1.5"]


@pytest.mark.parametrize("comment", ['a"b', "a\nb", "a\\b", "x" * 257, "é" * 129])
def test_a_rule_comment_that_could_break_the_restore_input_is_refused(comment: str) -> None:
    with pytest.raises(ValueError, match="comment"):
        Rule(4, "nat", "KUBE-PORTALS-HOST", "DNAT", comment)


def test_an_unsafe_comment_is_refused_every_time_even_right_after_a_safe_one() -> None:
    # The check is cached per comment (a port's rules share theirs): a refusal never is.
    for _ in range(3):
        Rule(4, "nat", "KUBE-PORTALS-HOST", "DNAT", "default/web:http")
        with pytest.raises(ValueError, match="comment"):
            Rule(4, "nat", "KUBE-PORTALS-HOST", "DNAT", 'default/web:http"')
        with pytest.raises(ValueError, match="comment"):
            Rule(4, "nat", "KUBE-PORTALS-HOST", "DNAT", "default/web:http" + "x" * 250)


def test_a_port_whose_comment_is_refused_is_rendered_without_the_others_losing_rules() -> None:
    good = objects.parse_service(service(), ("default", "web"))[0][0]
    # Bypass the parser, as a future source might: the renderer still refuses it alone.
    evil = replace(good, name=ServicePortName("default", 'evil"\nCOMMIT', "http"))
    rules = render(
        [ProxiedPort(good, 40001, 40001), ProxiedPort(evil, 40002, 40002)],
        Settings(node_ips=("10.0.0.1",)),
    )
    assert [r for r in rules if r.comment == "default/web:http"]
    assert not [r for r in rules if "evil" in r.comment]
    again = render([ProxiedPort(evil, 40002, 40002)], Settings(node_ips=("10.0.0.1",)))
    assert not [r for r in again if "evil" in r.comment]
