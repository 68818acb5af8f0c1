"""Today's kube-proxy semantics with the proxy following the fake API server in a node
namespace: endpoint hints and the node's zone, LoadBalancer ipMode, NodePorts on `primary`.

Each test runs per iptables backend, with one worker (`--workers 1`) and with the default.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.browser import Browser, chromium
from tests.integration.conftest import BACKENDS, PROXY, SAVE, topology_in
from tests.integration.kubeapi import ApiInNamespace, api_in
from tests.integration.netns import NODE_IP, POD_PORT, PODS, Topology, stop, wait_for

pytestmark = pytest.mark.integration

NODE = "node"
METRICS = "127.0.0.1:10249"  # in the node namespace: nothing else listens there
CLUSTER_IP = "10.96.0.10"
LB_IP = "192.0.2.60"
NODE_PORT = 30080
VETH_IP = "10.244.1.1"  # the node's address toward the client: a second local address
NODE_PORT_SPEC = [
    {"name": "p", "protocol": "TCP", "port": 80, "targetPort": POD_PORT, "nodePort": NODE_PORT}
]


@dataclass
class Cluster:
    """The namespaces, the fake API server in the node namespace, and the proxy following it."""

    topo: Topology
    api: ApiInNamespace
    backend: str
    log: Path

    def asks(self, host: str, port: int, count: int = 9) -> list[str]:
        return self.topo.client.ask("tcp", host, port, count)

    def answers_settle_on(self, host: str, port: int, expected: set[str]) -> None:
        """Wait until `count` requests reach exactly `expected` (each of them), then check again."""
        wait_for(
            lambda: set(self.asks(host, port)) == expected,
            f"{host}:{port} answered by {sorted(expected)} ({self.log})",
            timeout=30,
        )
        assert set(self.asks(host, port)) == expected

    def nat(self) -> str:
        return self.topo.node.run(SAVE[self.backend], "-t", "nat")

    def debug_state(self) -> dict[str, Any]:
        code = (
            "import json, urllib.request;"
            f"print(urllib.request.urlopen('http://{METRICS}/debug/state', timeout=10).read()"
            ".decode())"
        )
        text = self.topo.node.python(code)
        state: dict[str, Any] = json.loads(text)
        return state

    def topology_of(self, name: str) -> str:
        return str(self.debug_state()[f"default/{name}:p"]["topology"])


StartCluster = Callable[..., Cluster]


def node(zone: str, ips: tuple[str, ...] = (NODE_IP,)) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE, "labels": {"topology.kubernetes.io/zone": zone}},
        "status": {"addresses": [{"type": "InternalIP", "address": ip} for ip in ips]},
    }


def service(name: str, **spec: Any) -> dict[str, Any]:
    status = spec.pop("status", None)
    obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "clusterIP": CLUSTER_IP,
            "ports": [{"name": "p", "protocol": "TCP", "port": 80, "targetPort": POD_PORT}],
            **spec,
        },
    }
    if status is not None:
        obj["status"] = status
    return obj


def endpoint_slice(name: str, hints: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The three pods, ready, with `hints[pod]` as each one's `hints` (none when absent)."""
    endpoints = []
    for pod, ip in PODS.items():
        endpoint: dict[str, Any] = {"addresses": [ip], "conditions": {"ready": True}}
        if hints and pod in hints:
            endpoint["hints"] = hints[pod]
        endpoints.append(endpoint)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-x",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "ports": [{"name": "p", "protocol": "TCP", "port": POD_PORT}],
        "endpoints": endpoints,
    }


def zones(**by_pod: str) -> dict[str, dict[str, Any]]:
    return {pod.replace("_", "-"): {"forZones": [{"name": z}]} for pod, z in by_pod.items()}


def hinted(nodes: dict[str, str], zones_: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {
        pod: {"forNodes": [{"name": nodes[pod]}], "forZones": [{"name": zones_[pod]}]}
        for pod in PODS
    }


@contextmanager
def running_cluster(tmp_path: Path, backend: str, workers: str) -> Iterator[StartCluster]:
    """`start(objects, *flags)`: the objects in the fake, then the proxy following it; all of it
    (namespaces, the fake, the proxy) is gone on exit."""
    with topology_in(tmp_path) as topo, api_in(topo.node) as api:
        procs = []

        def start(objects: list[dict[str, Any]], *extra: str) -> Cluster:
            for obj in objects:
                api.apply(obj)
            log = tmp_path / "proxy.log"
            argv = [
                str(PROXY),
                "run",
                "--kubeconfig",
                str(api.kubeconfig(tmp_path / "kubeconfig")),
                "--hostname-override",
                NODE,
                "--iptables-backend",
                backend,
                "--proxy-port-range",
                "40000-40999",
                "--healthz-bind-address",
                "127.0.0.1:0",
                "--metrics-bind-address",
                METRICS,
                "--iptables-min-sync-period",
                "100ms",
                # Its own: the default /var/lib/kube-userspace-proxy would hand this test the
                # previous test's served ports (and another run's handover socket).
                "--state-dir",
                str(tmp_path / "state"),
                *(("--workers", workers) if workers != "default" else ()),
                *extra,
            ]
            procs.append(topo.node.popen(argv, log))
            return Cluster(topo, api, backend, log)

        try:
            yield start
        finally:
            for proc in procs:
                stop(proc, signal.SIGKILL)


@pytest.fixture(
    # Each backend and each worker count; pairs, as neither depends on the other.
    params=list(zip(BACKENDS, ("1", "default"), strict=True)),
    ids=lambda p: f"{p[0]}-workers-{p[1]}",
)
def cluster_factory(
    request: pytest.FixtureRequest, netns_ok: None, tmp_path: Path
) -> Iterator[StartCluster]:
    with running_cluster(tmp_path, *request.param) as start:
        yield start


def test_endpoints_follow_node_then_zone_hints_with_both_fallbacks_and_a_relabelled_node(
    cluster_factory: StartCluster,
) -> None:
    everyone = set(PODS)
    c: Cluster = cluster_factory(
        [
            node("zone-a"),
            service("web"),
            endpoint_slice("web", zones(pod_a="zone-a", pod_b="zone-b", pod_c="zone-b")),
        ]
    )
    # Zone hints: only this node's zone.
    c.answers_settle_on(CLUSTER_IP, 80, {"pod-a"})
    assert c.topology_of("web") == "PreferSameZone"
    # The node is relabelled: its picks follow.
    c.api.apply(node("zone-b"))
    c.answers_settle_on(CLUSTER_IP, 80, {"pod-b", "pod-c"})
    # Node hints win over zone hints when one names this node.
    nodes = {"pod-a": "node-1", "pod-b": "node-2", "pod-c": NODE}
    by_zone = {"pod-a": "zone-a", "pod-b": "zone-b", "pod-c": "zone-b"}
    c.api.apply(endpoint_slice("web", hinted(nodes, by_zone)))
    c.answers_settle_on(CLUSTER_IP, 80, {"pod-c"})
    assert c.topology_of("web") == "PreferSameNode"
    # No node hint names this node: zone hints.
    c.api.apply(endpoint_slice("web", hinted({**nodes, "pod-c": "node-3"}, by_zone)))
    c.answers_settle_on(CLUSTER_IP, 80, {"pod-b", "pod-c"})
    assert c.topology_of("web") == "PreferSameZone"
    # No zone hint names this zone: every endpoint.
    c.api.apply(endpoint_slice("web", zones(pod_a="zone-a", pod_b="zone-c", pod_c="zone-c")))
    c.answers_settle_on(CLUSTER_IP, 80, everyone)
    assert c.topology_of("web") == "none"
    # One endpoint without a zone hint: every endpoint, even though one names this zone.
    c.api.apply(endpoint_slice("web", zones(pod_a="zone-b", pod_b="zone-c")))
    c.answers_settle_on(CLUSTER_IP, 80, everyone)


def test_a_load_balancer_ip_with_ip_mode_proxy_is_left_to_the_load_balancer_at_runtime(
    cluster_factory: StartCluster,
) -> None:
    def lb(mode: str | None) -> dict[str, Any]:
        ingress: dict[str, Any] = {"ip": LB_IP}
        if mode is not None:
            ingress["ipMode"] = mode
        return service(
            "lb",
            type="LoadBalancer",
            ports=NODE_PORT_SPEC,
            status={"loadBalancer": {"ingress": [ingress]}},
        )

    c: Cluster = cluster_factory([node("zone-a"), lb(None), endpoint_slice("lb")])
    c.answers_settle_on(LB_IP, 80, set(PODS))
    c.api.apply(lb("Proxy"))
    wait_for(lambda: LB_IP not in c.nat(), f"the rules for {LB_IP} gone", timeout=30)
    assert f"--dport {NODE_PORT}" in c.nat()  # the load balancer's way in stays
    assert all(answer not in PODS for answer in c.asks(LB_IP, 80, 1))
    c.answers_settle_on(NODE_IP, NODE_PORT, set(PODS))
    c.api.apply(lb("VIP"))
    c.answers_settle_on(LB_IP, 80, set(PODS))


def test_node_ports_on_primary_serve_the_node_ip_only_and_follow_the_node(
    cluster_factory: StartCluster,
) -> None:
    svc = service(
        "np",
        type="NodePort",
        ports=NODE_PORT_SPEC,
    )
    c: Cluster = cluster_factory(
        [node("zone-a"), svc, endpoint_slice("np")], "--nodeport-addresses", "primary"
    )
    c.answers_settle_on(NODE_IP, NODE_PORT, set(PODS))
    assert f"-d {NODE_IP}/32" in c.nat()
    assert all(answer not in PODS for answer in c.asks(VETH_IP, NODE_PORT, 1))
    # The Node's address changes: NodePorts move with it.
    c.api.apply(node("zone-a", (VETH_IP,)))
    c.answers_settle_on(VETH_IP, NODE_PORT, set(PODS))
    assert f"-d {NODE_IP}/32" not in c.nat()
    assert all(answer not in PODS for answer in c.asks(NODE_IP, NODE_PORT, 1))


def test_the_debug_ui_shows_the_topology_mode_as_it_changes(netns_ok: None, tmp_path: Path) -> None:
    if chromium() is None:
        pytest.skip("needs chromium (Debian's chromium; scripts/dev installs it as root)")
    with running_cluster(tmp_path, "restore", "1") as start:
        slice_ = endpoint_slice("web", zones(pod_a="zone-a", pod_b="zone-b", pod_c="zone-b"))
        c: Cluster = start([node("zone-a"), service("web"), slice_])
        c.answers_settle_on(CLUSTER_IP, 80, {"pod-a"})
        browser = Browser(
            f"http://{METRICS}/debug/ui",
            tmp_path / "profile",
            prefix=("ip", "netns", "exec", c.topo.node.name),
        )
        shown = "document.querySelector('[data-service=\"default/web:p\"] .topology')?.textContent"
        try:
            wait_for(
                lambda: browser.eval(shown) == "topology PreferSameZone", "zone mode shown", 60
            )
            c.api.apply(node("zone-c"))  # no hint names this zone now: every endpoint
            wait_for(lambda: browser.eval(shown) == "topology none", "no mode shown", 60)
        finally:
            browser.close()
