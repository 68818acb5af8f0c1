"""Faults the proxy must ride out, in network namespaces with real iptables (docs/failure-modes.md):
iptables runs that fail on every call.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import Proxy, service, write_manifest
from tests.integration.netns import NODE_IP, PODS, Topology, stop, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("dataplane")]

HEALTHZ = "127.0.0.1:10256"
METRICS = "127.0.0.1:10249"

_PROBE = """
import json, sys, urllib.error, urllib.request
out = {}
for url in sys.argv[1:]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            out[url] = [resp.status, resp.read().decode()]
    except urllib.error.HTTPError as err:
        out[url] = [err.code, err.read().decode()]
print(json.dumps(out))
"""


def probe(topo: Topology, *urls: str) -> dict[str, tuple[int, str]]:
    """GET each URL from inside the node namespace: {url: (status, body)}."""
    answers: dict[str, tuple[int, str]] = json.loads(topo.node.python(_PROBE, *urls))
    return answers


def failing_restore(tmp: Path) -> tuple[Path, Path]:
    """A directory of iptables-restore wrappers that fail while `flag` exists; (dir, flag)."""
    fakebin, flag = tmp / "bin", tmp / "fail-iptables"
    fakebin.mkdir()
    for name in ("iptables-nft-restore", "ip6tables-nft-restore", "iptables-restore"):
        real = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
        assert real, f"{name} is not installed"
        wrapper = fakebin / name
        wrapper.write_text(
            f'#!/bin/sh\nif [ -e "{flag}" ]; then echo "injected failure" >&2; exit 1; fi\n'
            f'exec "{real}" "$@"\n'
        )
        wrapper.chmod(0o755)
    return fakebin, flag


def test_iptables_failing_on_every_call_keeps_livez_and_traffic_and_fails_healthz(
    topology: Topology, tmp_path: Path
) -> None:
    fakebin, flag = failing_restore(tmp_path)
    manifest = tmp_path / "services.yaml"
    web = service("web", "10.96.0.10", 80)
    write_manifest(manifest, web)
    proxy = Proxy(
        topology,
        "restore",
        manifest,
        tmp_path / "proxy.log",
        ("--healthz-bind-address", HEALTHZ, "--metrics-bind-address", METRICS),
        wrapper=("env", f"PATH={fakebin}:{os.environ['PATH']}"),
    )
    proxy.start()
    try:
        proxy.wait_rules("10.96.0.10/32")
        assert set(topology.client.ask("tcp", "10.96.0.10", 80, count=6)) == set(PODS)

        flag.touch()  # from now on every iptables-restore run fails
        write_manifest(manifest, web + service("late", "10.96.0.20", 80))  # a queued change
        livez, healthz = f"http://{HEALTHZ}/livez", f"http://{HEALTHZ}/healthz"
        began = time.monotonic()
        seen_503_at = None
        # --iptables-sync-period 1s: /healthz turns 503 once the change waited 2 s.
        while time.monotonic() - began < 40:
            answers = probe(topology, livez, healthz)
            assert answers[livez][0] == 200, f"/livez failed: {answers[livez]}"
            if answers[healthz][0] == 503 and seen_503_at is None:
                seen_503_at = time.monotonic()
            if seen_503_at is not None and time.monotonic() - seen_503_at > 5:
                break
            time.sleep(0.2)
        assert seen_503_at is not None, "/healthz never turned 503"
        assert probe(topology, healthz)[healthz][0] == 503
        # The data plane never stopped: the Service programmed before keeps flowing.
        assert set(topology.client.ask("tcp", "10.96.0.10", 80, count=6)) == set(PODS)
        assert "10.96.0.20" not in proxy.save()
        metrics = probe(topology, f"http://{METRICS}/metrics")[f"http://{METRICS}/metrics"][1]
        failures = [
            line
            for line in metrics.splitlines()
            if line.startswith("kubeproxy_sync_proxy_rules_iptables_restore_failures_total ")
        ]
        assert failures and float(failures[0].split()[1]) >= 2
        assert proxy.proc is not None and proxy.proc.poll() is None

        flag.unlink()  # iptables works again: the change goes through, /healthz recovers
        proxy.wait_rules("10.96.0.20/32")
        wait_for(lambda: probe(topology, healthz)[healthz][0] == 200, "/healthz back to 200")
    finally:
        for proc in proxy.runs:
            stop(proc, signal.SIGKILL)


def _proxy_port(proxy: Proxy, chain: str, needle: str) -> int:
    """The proxy port a nat rule of `chain` (in one of its shards) mentioning `needle` sends
    traffic to."""
    for line in proxy.rules("nat"):
        if re.match(rf"-A {chain}-[0-9A-F]{{2}} ", line) and needle in line:
            return int(re.findall(r"(?:--to-ports |:)(\d+)$", line)[0])
    raise AssertionError(f"no {chain} rule with {needle}")


@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "unguarded"])
def test_a_proxy_port_answers_only_what_the_nat_rules_sent_there(
    proxy_factory: Callable[..., Proxy], guard: bool
) -> None:
    objects = [
        *service("web", "10.96.0.10", 80, node_port=30080),
        *service("dns", "10.96.0.53", 53, protocol="UDP"),
        *service("api", "10.96.0.11", 80),
    ]
    # Two TCP proxy ports in all (the last --proxy-port-range wins): web and api get both,
    # in a row and in one port shard, whichever the allocator starts from.
    pinned = ["--proxy-port-range", "40000-40001"]
    proxy = proxy_factory(objects, *pinned, *([] if guard else ["--guard-proxy-ports=false"]))
    proxy.wait_rules('"default/web:p"', '"default/dns:p"', '"default/api:p"')
    client = proxy.topo.client
    wait_for(lambda: client.ask("tcp", "10.96.0.10", 80)[0] in PODS, "web answering")
    web = _proxy_port(proxy, "KUBE-PORTALS-CONTAINER", "10.96.0.10/32")
    dns = _proxy_port(proxy, "KUBE-PORTALS-CONTAINER", "10.96.0.53/32")
    # Through the rules: ClusterIP (TCP and UDP) and the NodePort keep working.
    assert set(client.ask("tcp", "10.96.0.10", 80, 6)) == set(PODS)
    assert set(client.ask("udp", "10.96.0.53", 53, 6)) == set(PODS)
    assert set(client.ask("tcp", NODE_IP, 30080, 6)) == set(PODS)
    # Straight to node-ip:proxy-port from another host (the client namespace).
    api = _proxy_port(proxy, "KUBE-PORTALS-CONTAINER", "10.96.0.11/32")
    direct_tcp = client.ask("tcp", NODE_IP, web, 3)
    direct_udp = client.ask("udp", NODE_IP, dns, 2)
    if guard:
        assert direct_tcp == ["refused"] * 3
        assert client.ask("tcp", NODE_IP, api, 2) == ["refused"] * 2
        assert all(answer not in PODS for answer in direct_udp)
        saved = proxy.save("filter")
        assert "-j KUBE-PROXY-PORTS" in saved
        # The two TCP Services' proxy ports, in a row: one guard rule, a range.
        assert sorted((web, api)) == [40000, 40001]
        assert '--comment "proxy ports 40000-40001" -m tcp --dport 40000:40001 -j REJECT' in saved
    else:
        assert set(direct_tcp) <= set(PODS)
        assert set(direct_udp) <= set(PODS)
