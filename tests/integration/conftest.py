"""Fixtures for tests that run the proxy and real iptables inside network namespaces.

Skipped unless root with working `ip netns` (the suite conftest turns the skip into a failure
under CI=true). Every namespace is created per test and deleted in the finalizer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.netns import NODE_IP, POD_PORT, PODS, Topology, stop, wait_for

PROXY = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kube-userspace-proxy"
BACKENDS = ("iptc", "restore")
SAVE = {"iptc": "iptables-legacy-save", "restore": "iptables-nft-save"}
SAVE6 = {"iptc": "ip6tables-legacy-save", "restore": "ip6tables-nft-save"}
IPTABLES = {"iptc": "iptables-legacy", "restore": "iptables-nft"}


@pytest.fixture(scope="session")
def netns_ok() -> None:
    from tests.integration.netns import available

    reason = available()
    if reason:
        pytest.skip(f"integration tests: {reason}")


@contextlib.contextmanager
def topology_in(tmp: Path) -> Iterator[Topology]:
    """A fresh topology, destroyed on exit even when the test fails."""
    topo = Topology.create(tmp)
    try:
        yield topo
    finally:
        topo.destroy()


@pytest.fixture
def topology(netns_ok: None, tmp_path: Path) -> Iterator[Topology]:
    with topology_in(tmp_path) as topo:
        yield topo


def service(
    name: str,
    cluster_ip: str,
    port: int,
    *,
    protocol: str = "TCP",
    node_port: int = 0,
    external_ips: tuple[str, ...] = (),
    affinity: bool = False,
    pods: tuple[str, ...] = tuple(PODS),
    ipv6_cluster_ip: str = "",
) -> list[dict[str, Any]]:
    """A Service and its EndpointSlice (the given pods, all ready), as `kubectl` takes them.

    With `ipv6_cluster_ip` the Service is dual-stack (its pods stay IPv4 only).
    """
    spec: dict[str, Any] = {
        "type": "NodePort" if node_port else "ClusterIP",
        "clusterIP": cluster_ip,
        "clusterIPs": [cluster_ip],
        "ports": [{"name": "p", "protocol": protocol, "port": port, "targetPort": POD_PORT}],
    }
    if ipv6_cluster_ip:
        spec["clusterIPs"].append(ipv6_cluster_ip)
        spec["ipFamilies"] = ["IPv4", "IPv6"]
        spec["ipFamilyPolicy"] = "RequireDualStack"
    if node_port:
        spec["ports"][0]["nodePort"] = node_port
    if external_ips:
        spec["externalIPs"] = list(external_ips)
    if affinity:
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 600}}
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-x",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "ports": [{"name": "p", "protocol": protocol, "port": POD_PORT}],
        "endpoints": [
            {"addresses": [PODS[pod]], "conditions": {"ready": True}, "nodeName": "node"}
            for pod in pods
        ],
    }
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }
    return [svc, slice_]


def write_manifest(path: Path, objects: list[dict[str, Any]]) -> None:
    """Replace the file in one rename, so the proxy never reads half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(objects))
    os.replace(tmp, path)


@dataclass
class Proxy:
    """The proxy CLI running in the node namespace, with its logs kept for failures."""

    topo: Topology
    backend: str
    manifest: Path
    log: Path
    extra: tuple[str, ...] = ()
    wrapper: tuple[str, ...] = ()  # e.g. prlimit: a command the proxy runs under
    proc: subprocess.Popen[bytes] | None = None
    runs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> None:
        self.proc = self.topo.node.popen(self.argv(), self.log)
        self.runs.append(self.proc)

    def argv(self) -> list[str]:
        """The command line `start` runs."""
        return [
            *self.wrapper,
            str(PROXY),
            "run",
            "--manifests",
            str(self.manifest),
            "--node-ip",
            NODE_IP,
            "--iptables-backend",
            self.backend,
            "--proxy-port-range",
            "40000-40999",
            "--healthz-bind-address",
            "127.0.0.1:0",
            "--metrics-bind-address",
            "127.0.0.1:0",
            "--iptables-sync-period",
            "1s",
            "--state-dir",
            str(self.log.parent / f"state-{self.log.stem}"),
            "--iptables-min-sync-period",
            "100ms",
            *self.extra,
        ]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        stop(self.proc, sig)

    def save(self, table: str = "nat", family: int = 4) -> str:
        return self.topo.node.run((SAVE6 if family == 6 else SAVE)[self.backend], "-t", table)

    def rules(self, table: str = "nat") -> list[str]:
        return [line for line in self.save(table).splitlines() if line.startswith("-A ")]

    def iptables(self, *args: str) -> str:
        return self.topo.node.run(IPTABLES[self.backend], *args)

    def wait_rules(self, *needles: str, table: str = "nat", timeout: float = 20) -> None:
        def present() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"proxy exited: {self.log.read_text()[-3000:]}")
            text = self.save(table)
            return all(n in text for n in needles)

        wait_for(present, f"rules {needles} in {table}", timeout=timeout)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.contextmanager
def running_proxies(topo: Topology, tmp: Path, backend: str) -> Iterator[Callable[..., Proxy]]:
    """A factory of proxies in `topo`'s node namespace; all are SIGKILLed on exit."""
    made: list[Proxy] = []

    def make(objects: list[dict[str, Any]], *extra: str) -> Proxy:
        manifest = tmp / "services.yaml"
        write_manifest(manifest, objects)
        proxy = Proxy(topo, backend, manifest, tmp / "proxy.log", extra)
        made.append(proxy)
        proxy.start()
        return proxy

    try:
        yield make
    finally:
        for proxy in made:
            for proc in proxy.runs:
                stop(proc, signal.SIGKILL)


@pytest.fixture
def proxy_factory(topology: Topology, tmp_path: Path, backend: str) -> Iterator[Any]:
    with running_proxies(topology, tmp_path, backend) as make:
        yield make
