"""The descriptor budget: with a low RLIMIT_NOFILE the Services over budget are refused alone.

The proxy runs under `prlimit --nofile=400:400` with more Services than 400 descriptors can
hold beside the reserve. The Services within budget are served and their rules installed (an
iptables run still finds descriptors to start); the others are refused one by one, each with
an error naming it, and counted by a metric.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from tests.integration.conftest import Proxy, service, write_manifest
from tests.integration.netns import PODS, Topology, stop, wait_for

pytestmark = pytest.mark.integration

SERVICES = 200
LIMIT = 400
METRICS = "127.0.0.1:10249"  # inside the node namespace
OVER_BUDGET = "kube_userspace_proxy_service_ports_over_descriptor_budget"

FETCH = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
"""


def _cluster_ip(i: int) -> str:
    return f"10.96.{1 + i // 250}.{1 + i % 250}"


def _programmed(proxy: Proxy) -> set[str]:
    """The Services that have a rule in the portal chain."""
    text = proxy.save()
    chain = r"KUBE-PORTALS-CONTAINER-[0-9A-F]{2}"  # a shard of it
    return set(re.findall(rf"-A {chain} .*?--comment \"?default/(svc-\d+):p", text))


def _refused(log: Path) -> set[str]:
    return set(re.findall(r"default/(svc-\d+):p: refused", log.read_text()))


def test_services_over_the_descriptor_budget_are_refused_alone(
    topology: Topology, tmp_path: Path, backend: str
) -> None:
    objects = []
    for i in range(SERVICES):
        objects.extend(service(f"svc-{i}", _cluster_ip(i), 80))
    manifest = tmp_path / "services.yaml"
    write_manifest(manifest, objects)
    proxy = Proxy(
        topology,
        backend,
        manifest,
        tmp_path / "proxy.log",
        extra=("--metrics-bind-address", METRICS),
        wrapper=("prlimit", f"--nofile={LIMIT}:{LIMIT}"),
    )
    proxy.start()
    assert proxy.proc is not None
    try:

        def settled() -> bool:
            assert proxy.proc is not None
            if proxy.proc.poll() is not None:
                raise AssertionError(f"proxy exited: {proxy.log.read_text()[-3000:]}")
            return len(_programmed(proxy)) + len(_refused(proxy.log)) == SERVICES

        wait_for(settled, "every Service programmed or refused", timeout=60)
        programmed, refused = _programmed(proxy), _refused(proxy.log)
        print(f"{len(programmed)} programmed, {len(refused)} refused")
        assert programmed and refused, (len(programmed), len(refused))
        assert not programmed & refused
        log = proxy.log.read_text()
        assert "RLIMIT_NOFILE=400" in log
        # The rules of the Services within budget work: both ends of the served range answer.
        served = sorted(programmed, key=lambda name: int(name.split("-")[1]))
        client = topology.client
        for name in (served[0], served[-1]):
            ip = _cluster_ip(int(name.split("-")[1]))
            wait_for(lambda ip=ip: client.ask("tcp", ip, 80)[0] in PODS, f"{name} answering")
        metrics = topology.node.python(FETCH, f"http://{METRICS}/metrics")
        [value] = [
            float(line.split()[1]) for line in metrics.splitlines() if line.startswith(OVER_BUDGET)
        ]
        assert value == len(refused)
        # Later syncs keep serving the same ones and do not fail (no restore failure).
        failures = [
            line
            for line in metrics.splitlines()
            if line.startswith("kubeproxy_sync_proxy_rules_iptables_restore_failures_total")
        ]
        assert failures and float(failures[0].split()[1]) == 0, failures
        assert json.dumps(sorted(_programmed(proxy))) == json.dumps(sorted(programmed))
    finally:
        stop(proxy.proc, signal.SIGKILL)
