"""The proxy CLI in a node namespace: traffic through its rules, resyncs, restarts, cleanup.

Every test runs once per iptables backend (python-iptables on the legacy tables, and
iptables-restore on the nft tables).
"""

from __future__ import annotations

import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kube_userspace_proxy.ops.metrics import sample_value
from tests.integration.conftest import (
    BACKENDS,
    PROXY,
    SAVE,
    Proxy,
    running_proxies,
    service,
    topology_in,
    write_manifest,
)
from tests.integration.netns import NODE_IP, PODS, wait_for

pytestmark = pytest.mark.integration

EXTERNAL_IP = "192.0.2.50"
STANDARD = [
    *service("web", "10.96.0.10", 80, node_port=30080, external_ips=(EXTERNAL_IP,)),
    *service("dns", "10.96.0.53", 53, protocol="UDP"),
    *service("sticky", "10.96.0.11", 80, affinity=True),
    *service("empty", "10.96.0.12", 80, pods=()),
]
COMMENTS = ('"default/web:p"', '"default/dns:p"', '"default/sticky:p"', '"default/empty:p"')


def start_standard(make: Callable[..., Proxy]) -> Proxy:
    proxy = make(STANDARD)
    proxy.wait_rules(*COMMENTS)
    client = proxy.topo.client
    wait_for(lambda: client.ask("tcp", "10.96.0.10", 80)[0] in PODS, "web answering")
    return proxy


@pytest.fixture
def running(proxy_factory: Callable[..., Proxy]) -> Proxy:
    """A proxy of its own, for tests that change or break things."""
    return start_standard(proxy_factory)


@pytest.fixture(scope="module", params=BACKENDS)
def shared(
    request: pytest.FixtureRequest, netns_ok: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    """One proxy per backend for the tests that only send traffic."""
    tmp = tmp_path_factory.mktemp(f"shared-{request.param}")
    with topology_in(tmp) as topo, running_proxies(topo, tmp, str(request.param)) as make:
        yield start_standard(make)


def test_cluster_ip_tcp_spreads_over_three_pods(shared: Proxy) -> None:
    answers = shared.topo.client.ask("tcp", "10.96.0.10", 80, 9)
    assert Counter(answers) == dict.fromkeys(PODS, 3)


def test_cluster_ip_udp_spreads_over_three_pods(shared: Proxy) -> None:
    answers = shared.topo.client.ask("udp", "10.96.0.53", 53, 9)
    assert Counter(answers) == dict.fromkeys(PODS, 3)


def test_client_ip_affinity_sticks_to_one_pod(shared: Proxy) -> None:
    answers = shared.topo.client.ask("tcp", "10.96.0.11", 80, 6)
    assert len(set(answers)) == 1 and answers[0] in PODS


def test_node_port_answers_on_the_node_ip(shared: Proxy) -> None:
    answers = shared.topo.client.ask("tcp", NODE_IP, 30080, 3)
    assert set(answers) == set(PODS)


def test_external_ip_reaches_the_service(shared: Proxy) -> None:
    answers = shared.topo.client.ask("tcp", EXTERNAL_IP, 80, 3)
    assert set(answers) == set(PODS)


def test_service_without_endpoints_refuses_at_once(shared: Proxy) -> None:
    started = time.monotonic()
    assert shared.topo.client.ask("tcp", "10.96.0.12", 80) == ["refused"]
    assert time.monotonic() - started < 2.0


def test_node_itself_reaches_a_cluster_ip(shared: Proxy) -> None:
    assert shared.topo.node.ask("tcp", "10.96.0.10", 80)[0] in PODS


def test_node_itself_reaches_a_node_port(shared: Proxy) -> None:
    assert shared.topo.node.ask("tcp", NODE_IP, 30080)[0] in PODS


def test_deleted_service_loses_rules_listener_and_node_port_socket(running: Proxy) -> None:
    web = next(line for line in running.rules() if '"default/web:p"' in line)
    proxy_port = re.search(r"--to-ports (\d+)", web)
    assert proxy_port is not None
    listening = running.topo.node.run("ss", "-ltn")
    assert f":{proxy_port[1]} " in listening and ":30080 " in listening

    write_manifest(running.manifest, STANDARD[2:])

    def gone() -> bool:
        return '"default/web:p"' not in running.save("nat") + running.save("filter")

    wait_for(gone, "web's rules removed")
    wait_for(
        lambda: not re.search(rf":({proxy_port[1]}|30080)\s", running.topo.node.run("ss", "-ltn")),
        "web's proxy port and NodePort closed",
    )
    assert '"default/dns:p"' in running.save()


def _web_shard(proxy: Proxy) -> str:
    """The shard of KUBE-PORTALS-CONTAINER that holds web's ClusterIP rule."""
    found = re.search(r"-A (KUBE-PORTALS-CONTAINER-[0-9A-F]{2}) -d 10\.96\.0\.10/32", proxy.save())
    assert found is not None
    return found[1]


def test_flushed_chain_is_restored_by_the_next_resync(running: Proxy) -> None:
    shard = _web_shard(running)
    running.iptables("-t", "nat", "-F", "KUBE-PORTALS-CONTAINER")
    assert not [line for line in running.rules() if line.startswith("-A KUBE-PORTALS-CONTAINER ")]
    running.wait_rules("-A KUBE-PORTALS-CONTAINER -d 0.0.0.10/0.0.0.255", f"-j {shard}", timeout=10)
    assert running.topo.client.ask("tcp", "10.96.0.10", 80)[0] in PODS


def test_deleted_jump_and_shard_are_recreated_within_one_sync_period(running: Proxy) -> None:
    # --iptables-sync-period is 1s here; the full verify (1h by default) never runs.
    shard = _web_shard(running)
    comment = f"shard {shard[-2:]}: destinations ending in {shard[-2:]}"
    jump = ["-d", "0.0.0.10/0.0.0.255", "-m", "comment", "--comment", comment, "-j", shard]
    running.iptables("-t", "nat", "-D", "PREROUTING", "1")  # the jump into the portals
    running.iptables("-t", "nat", "-D", "KUBE-PORTALS-CONTAINER", *jump)
    running.iptables("-t", "nat", "-F", shard)
    running.iptables("-t", "nat", "-X", shard)
    running.wait_rules(
        '-A PREROUTING -m comment --comment "handle ClusterIPs',
        f"-A {shard} -d 10.96.0.10/32",
        f"-j {shard}",
        timeout=10,
    )
    assert running.topo.client.ask("tcp", "10.96.0.10", 80)[0] in PODS


def test_restart_after_sigkill_replaces_rules_without_duplicates(running: Proxy) -> None:
    before = {table: Counter(running.rules(table)) for table in ("nat", "filter")}
    portals = [line for line in before["nat"] if line.startswith("-A KUBE-PORTALS-CONTAINER")]
    named = {
        comment: int(port)
        for line in portals
        for comment, port in re.findall(r'--comment "?([^" ]+)"? .*--to-ports (\d+)', line)
    }
    running.kill(signal.SIGKILL)
    running.start()

    def announced_by_new_run() -> dict[str, int]:
        seen: dict[str, list[int]] = {}
        for name, port in re.findall(r"\] (\S+) -> [\d.]+:(\d+) \(", running.log.read_text()):
            seen.setdefault(name, []).append(int(port))
        return {name: ports[-1] for name, ports in seen.items() if len(ports) >= 2}

    # The new run serves each service port on the proxy port the old rules still name, so
    # clients keep working while it starts (and no other port receives that traffic).
    wait_for(lambda: len(announced_by_new_run()) == len(named), "the new run's first sync")
    assert announced_by_new_run() == named
    # Then its rules are identical to the first run's, proxy ports included.
    wait_for(
        lambda: {table: Counter(running.rules(table)) for table in ("nat", "filter")} == before,
        "the restarted proxy's rules to equal the first run's",
    )
    for jump in ("KUBE-PORTALS-CONTAINER", "KUBE-NODEPORT-CONTAINER"):
        assert sum(line.endswith(f"-j {jump}") for line in running.rules()) == 1
    client = running.topo.client
    wait_for(lambda: client.ask("tcp", "10.96.0.10", 80)[0] in PODS, "web answering again")


def test_cleanup_leaves_foreign_rules_untouched(running: Proxy) -> None:
    foreign = ["-p", "tcp", "--dport", "9999", "-m", "comment", "--comment", "foreign", "-j"]
    running.iptables("-t", "nat", "-I", "PREROUTING", "1", *foreign, "RETURN")
    running.iptables("-t", "filter", "-A", "INPUT", *foreign, "ACCEPT")
    running.kill(signal.SIGTERM)
    out = running.topo.node.run(str(PROXY), "cleanup")
    assert "removed" in out
    for save in set(SAVE.values()):
        assert "KUBE-" not in running.topo.node.run(save), save
    nat, filter_ = running.save("nat"), running.save("filter")
    assert "-A PREROUTING -p tcp -m tcp --dport 9999 -m comment --comment foreign -j RETURN" in nat
    assert "-A INPUT -p tcp -m tcp --dport 9999 -m comment --comment foreign -j ACCEPT" in filter_


def test_nodeport_addresses_limit_which_local_addresses_answer(
    proxy_factory: Callable[..., Any],
) -> None:
    proxy: Proxy = proxy_factory(STANDARD[:2], "--nodeport-addresses", "10.244.1.0/24")
    proxy.wait_rules('-d 10.244.1.0/24 -p tcp -m comment --comment "default/web:p"')
    client = proxy.topo.client
    wait_for(lambda: client.ask("tcp", "10.244.1.1", 30080)[0] in PODS, "NodePort on 10.244.1.1")
    assert client.ask("tcp", NODE_IP, 30080) == ["refused"]


def test_iptables_total_counts_the_rules_in_our_chains(proxy_factory: Callable[..., Proxy]) -> None:
    # The node namespace has a loopback of its own, so the usual metrics port is free there.
    proxy = proxy_factory(STANDARD, "--metrics-bind-address", "127.0.0.1:10249")
    proxy.wait_rules(*COMMENTS)
    fetch = (
        "import urllib.request as u;"
        "print(u.urlopen('http://127.0.0.1:10249/metrics', timeout=5).read().decode())"
    )

    def scraped() -> float | None:
        text = proxy.topo.node.run(sys.executable, "-c", fetch)
        return sample_value(text, "kubeproxy_sync_proxy_rules_iptables_total", {"table": "nat"})

    ours = [r for r in proxy.rules() if re.match(r"-A KUBE-(PORTALS|NODEPORT)-", r)]
    wait_for(lambda: scraped() == len(ours), f"iptables_total == {len(ours)} rules")
