"""Dual-stack Services: which families the proxy ports serve decides which rules exist.

`--bind-address ::` gives dual-stack proxy ports (IPV6_V6ONLY off, even where the namespace's
net.ipv6.bindv6only says otherwise), so a Service's IPv4 and IPv6 ClusterIPs both answer. The
default 0.0.0.0 serves IPv4 only: the IPv6 ClusterIP gets no rules (they would send its clients
to a port that refuses them) and a warning says what to do.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.integration.conftest import Proxy, service
from tests.integration.netns import NODE_IP6, PODS, Topology, wait_for

pytestmark = pytest.mark.integration

DUAL = [
    *service("web", "10.96.0.10", 80, ipv6_cluster_ip="fd00:96::10"),
    *service("dns", "10.96.0.53", 53, protocol="UDP", ipv6_cluster_ip="fd00:96::53"),
]


@pytest.mark.parametrize(
    ("protocol", "ips", "port"),
    [("tcp", ("10.96.0.10", "fd00:96::10"), 80), ("udp", ("10.96.0.53", "fd00:96::53"), 53)],
)
def test_dual_stack_service_answers_on_both_cluster_ips_with_bind_address_any6(
    topology: Topology,
    proxy_factory: Callable[..., Proxy],
    protocol: str,
    ips: tuple[str, str],
    port: int,
) -> None:
    # Sockets on :: would be IPv6 only here unless the proxy turns IPV6_V6ONLY off itself.
    topology.node.run("sysctl", "-qw", "net.ipv6.bindv6only=1")
    proxy = proxy_factory(DUAL, "--bind-address", "::", "--node-ip", NODE_IP6)
    client = topology.client
    for ip in ips:
        wait_for(lambda ip=ip: client.ask(protocol, ip, port)[0] in PODS, f"{ip}:{port} answering")
    for ip in ips:
        assert set(client.ask(protocol, ip, port, 6)) == set(PODS), ip
    assert "fd00:96::10/128" in proxy.save("nat", family=6)


def test_default_bind_address_installs_no_ipv6_rules_and_says_why(
    topology: Topology, proxy_factory: Callable[..., Proxy]
) -> None:
    proxy = proxy_factory(DUAL, "--node-ip", NODE_IP6)
    wait_for(lambda: topology.client.ask("tcp", "10.96.0.10", 80)[0] in PODS, "IPv4 answering")
    warning = "use --bind-address :: for dual stack"
    wait_for(lambda: warning in proxy.log.read_text(), "the warning")
    proxy.iptables("-t", "nat", "-F", "KUBE-PORTALS-CONTAINER")  # wait for another sync
    proxy.wait_rules("-A KUBE-PORTALS-CONTAINER -d 0.0.0.10/0.0.0.255", timeout=10)
    assert proxy.log.read_text().count(warning) == 2  # once per service port, not per sync
    assert "KUBE-" not in proxy.save("nat", family=6) + proxy.save("filter", family=6)
