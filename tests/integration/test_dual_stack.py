"""Dual stack follows the node, as kube-proxy does; an explicit --bind-address keeps its meaning.

Left unspecified (the default, and kubeadm's `bindAddress: 0.0.0.0`), the proxy serves every
family the node has addresses in: on a dual-stack node its proxy ports are dual-stack sockets
(IPV6_V6ONLY off, even where net.ipv6.bindv6only says otherwise) and both families get rules;
on a single-stack node the other family's ClusterIPs are left out, one warning each. Every
test runs with both iptables backends (the `backend` fixture).
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import Proxy, service, write_manifest
from tests.integration.netns import NODE_IP, NODE_IP6, PODS, Netns, Topology, sh, wait_for

pytestmark = pytest.mark.integration

DUAL = [
    *service("web", "10.96.0.10", 80, ipv6_cluster_ip="fd00:96::10"),
    *service("dns", "10.96.0.53", 53, protocol="UDP", ipv6_cluster_ip="fd00:96::53"),
]
ASKED = [("tcp", "10.96.0.10", 80), ("tcp", "fd00:96::10", 80)]
ASKED += [("udp", "10.96.0.53", 53), ("udp", "fd00:96::53", 53)]
KUBEADM = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
KUBEADM += "bindAddress: 0.0.0.0\n"


def answers_everywhere(topology: Topology, asked: list[tuple[str, str, int]]) -> None:
    client = topology.client
    for proto, ip, port in asked:
        wait_for(lambda p=proto, i=ip, n=port: client.ask(p, i, n)[0] in PODS, f"{ip}:{port}")
    for proto, ip, port in asked:
        assert set(client.ask(proto, ip, port, 6)) == set(PODS), (proto, ip)


@pytest.mark.parametrize("source", ["default", "kubeadm config"])
def test_a_dual_stack_node_serves_both_families_by_default(
    topology: Topology, proxy_factory: Callable[..., Proxy], tmp_path: Path, source: str
) -> None:
    # Sockets on :: would be IPv6 only here unless the proxy turns IPV6_V6ONLY off itself.
    topology.node.run("sysctl", "-qw", "net.ipv6.bindv6only=1")
    flags = ["--node-ip", f"{NODE_IP},{NODE_IP6}"]
    if source == "kubeadm config":
        (tmp_path / "kube-proxy.conf").write_text(KUBEADM)
        flags += ["--config", str(tmp_path / "kube-proxy.conf")]
    proxy = proxy_factory(DUAL, *flags)
    answers_everywhere(topology, ASKED)
    assert "fd00:96::10/128" in proxy.save("nat", family=6)
    assert "-d 10.96.0.10/32" in proxy.save("nat")
    assert "no rules for its" not in proxy.log.read_text()
    listening = topology.node.run("ss", "-ltnH")
    # Dual-stack sockets (ss prints them as *:port): one per port, not one per family.
    assert " *:40" in listening and "0.0.0.0:40" not in listening and "[::]:40" not in listening


def test_a_single_stack_node_leaves_the_other_family_out_once_each(
    topology: Topology, proxy_factory: Callable[..., Proxy]
) -> None:
    proxy = proxy_factory(DUAL)  # --node-ip 10.244.0.1 only: an IPv4 node
    answers_everywhere(topology, [a for a in ASKED if ":" not in a[1]])
    warning = "the node has no IPv6 address (node IPs: 10.244.0.1; see --node-ip)"
    wait_for(lambda: proxy.log.read_text().count(warning) == 2, "one warning per service port")
    proxy.iptables("-t", "nat", "-F", "KUBE-PORTALS-CONTAINER")  # wait for another sync
    proxy.wait_rules("-A KUBE-PORTALS-CONTAINER -d 0.0.0.10/0.0.0.255", timeout=10)
    text = proxy.log.read_text()
    assert text.count(warning) == 2  # once per service port, not per sync
    assert "default/web:p: no rules for its IPv6 ClusterIP fd00:96::10" in text
    # Its proxy ports are IPv4 sockets, as before: IPv6 gets nothing, not even a guard.
    assert "KUBE-" not in proxy.save("nat", family=6) + proxy.save("filter", family=6)
    listening = topology.node.run("ss", "-ltnH")
    assert "0.0.0.0:40" in listening and " *:40" not in listening and "[::]:40" not in listening


def test_an_explicit_bind_address_keeps_its_meaning(
    topology: Topology, proxy_factory: Callable[..., Proxy]
) -> None:
    dual_node = ("--node-ip", f"{NODE_IP},{NODE_IP6}")
    proxy = proxy_factory(DUAL, *dual_node, "--bind-address", "0.0.0.0")
    answers_everywhere(topology, [a for a in ASKED if ":" not in a[1]])
    warning = "use --bind-address :: for dual stack"
    wait_for(lambda: proxy.log.read_text().count(warning) == 2, "the warning, per service port")
    assert "KUBE-" not in proxy.save("nat", family=6) + proxy.save("filter", family=6)
    proxy.kill()
    # `::` serves both families even where the node names one: the sockets decide.
    topology.node.run("sysctl", "-qw", "net.ipv6.bindv6only=1")
    proxy = proxy_factory(DUAL, "--bind-address", "::")
    answers_everywhere(topology, ASKED)


HOST_FAMILIES = (
    "from kube_userspace_proxy import addresses; print(sorted(addresses.host_families()))"
)


def test_without_a_node_ip_the_hosts_addresses_name_the_families(topology: Topology) -> None:
    def families(ns: Netns) -> list[int]:
        return list(json.loads(ns.run(sys.executable, "-c", HOST_FAMILIES)))

    assert families(topology.node) == [4, 6]
    bare = Netns(f"{topology.node.name}b")
    sh("ip", "netns", "add", bare.name)
    try:
        bare.ip("link", "set", "lo", "up")
        assert families(bare) == []  # loopback is no node address: the proxy assumes IPv4
        bare.ip("link", "add", "d0", "type", "veth", "peer", "name", "d1")
        for link in ("d0", "d1"):  # up: IPv6 link-local addresses, which are not node addresses
            bare.ip("link", "set", link, "up")
        bare.ip("addr", "add", "192.0.2.5/24", "dev", "d0")
        wait_for(lambda: "fe80" in bare.run("ip", "-6", "addr"), "a link-local address")
        assert families(bare) == [4]
    finally:
        sh("ip", "netns", "del", bare.name, check=False)


def test_a_handover_keeps_the_earlier_listeners_until_a_restart_without_one(
    topology: Topology, backend: str, tmp_path: Path
) -> None:
    """From `--bind-address 0.0.0.0` to the default on a dual-stack node: the new process
    takes the IPv4 sockets over (nothing refused) and says IPv6 waits for a plain restart."""
    manifest = tmp_path / "services.yaml"
    write_manifest(manifest, DUAL)
    flags = ("--node-ip", f"{NODE_IP},{NODE_IP6}", "--state-dir", str(tmp_path / "state"))
    runs: list[Proxy] = []

    def start(name: str, *extra: str) -> Proxy:
        proxy = Proxy(topology, backend, manifest, tmp_path / f"{name}.log", (*flags, *extra))
        proxy.start()
        runs.append(proxy)
        return proxy

    v4 = [a for a in ASKED if ":" not in a[1]]
    try:
        old = start("old", "--bind-address", "0.0.0.0")
        answers_everywhere(topology, v4)
        wait_for(lambda: "a new proxy process can take over" in old.log.read_text(), "ready")
        new = start("new")
        assert old.proc is not None and old.proc.wait(60) == 0
        answers_everywhere(topology, v4)
        text = new.log.read_text()
        assert "the handed-over proxy ports listen on 0.0.0.0, not on ::" in text
        wait_for(lambda: "a handover kept the earlier listeners" in new.log.read_text(), "why")
        assert "fd00:96" not in new.save("nat", family=6)
        new.kill(signal.SIGTERM)
        assert new.proc is not None and new.proc.wait(60) == 0
        start("restarted")  # no handover: the state file's ports, now on ::
        answers_everywhere(topology, ASKED)
    finally:
        for proxy in runs:
            proxy.kill()
