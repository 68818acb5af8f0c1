"""The proxy at scale, following the fake API server on loopback (no iptables).

A new Service reaches the proxy as two events: the Service, and a moment later the
EndpointSlice the cluster's controller makes for it. The second goes live at once instead of
waiting a whole `--iptables-min-sync-period` behind the first: each change is applied to
listeners and pools as it comes, and the rule syncs, after a quiet spell, have kube-proxy's
burst of two. The proxy's own count of syncs held back for `min_sync_period` says so, not the
wall clock, so the check holds on a busy machine.
"""

from __future__ import annotations

import time

import pytest

from kube_userspace_proxy.model import ServicePortName
from tests.control.conftest import endpoint_slice, eventually, service
from tests.control.test_kube_end_to_end import kube_config
from tests.fakes.apiserver import FakeApiServer
from tests.loopback.proxyrun import ask, running_proxy, start_named_backends

SERVICES = 1000
MIN_SYNC_PERIOD = 2.0  # long, so that a change waiting for it cannot pass for a fast one
SYNC_PERIOD = 3600.0  # no periodic resync during the test: none can make the Service live


def _cluster_ip(i: int) -> str:
    return f"10.96.{i // 250}.{i % 250 + 1}"


@pytest.mark.timeout(120)
async def test_a_service_and_its_slice_created_together_are_live_at_once_among_1000(
    apiserver: FakeApiServer, kubeconfig: str
) -> None:
    [(name, port, backend)] = await start_named_backends(["pod-a"])
    try:
        await _create_then_measure(apiserver, kubeconfig, name, port)
    finally:
        backend.close()


async def _create_then_measure(
    apiserver: FakeApiServer, kubeconfig: str, name: str, port: int
) -> None:
    for i in range(SERVICES):
        apiserver.create(service(f"svc-{i}", cluster_ip=_cluster_ip(i)))
        apiserver.create(endpoint_slice(f"svc-{i}-a", f"svc-{i}", ["127.0.0.1"], port=port))
    config = kube_config(kubeconfig, min_sync_period=MIN_SYNC_PERIOD, sync_period=SYNC_PERIOD)
    async with running_proxy(config) as proxy:
        await eventually(
            lambda: len(proxy.proxier.proxied_ports()) == SERVICES, timeout=60, what="all served"
        )
        # Let the runner earn its burst back, as after any quiet spell.
        quiet_until = time.monotonic() + 2 * MIN_SYNC_PERIOD
        await eventually(lambda: time.monotonic() > quiet_until, timeout=60, what="quiet")
        new = ServicePortName("default", "new", "http")
        held = proxy.runner.held  # syncs held back for min_sync_period so far
        done = proxy.pipeline.syncs + proxy.pipeline.applies
        started = time.monotonic()
        apiserver.create(service("new", cluster_ip="10.96.200.1"))
        # The slice arrives once the Service's own sync has run (the controller is slower).
        await eventually(lambda: proxy.proxier.port_of(new), timeout=60, what="Service synced")
        apiserver.create(endpoint_slice("new-a", "new", ["127.0.0.1"], port=port))

        def live() -> bool:
            served = proxy.proxier.debug_state().get(str(new))
            return bool(served and served["endpoints"].get("cluster"))

        await eventually(live, timeout=60, what="the new Service live")
        latency = time.monotonic() - started
        assert await ask(proxy.proxier.port_of(new)) == name
        print(f"new Service + slice live after {latency * 1000:.0f} ms among {SERVICES}")
        # The proxy's work made them live (applies, requested syncs; no periodic resync runs
        # within SYNC_PERIOD), and none of it waited for min_sync_period: the slice did not
        # queue behind the Service's sync, however long this busy machine took for either.
        assert proxy.pipeline.syncs + proxy.pipeline.applies > done
        assert proxy.runner.held == held, f"{proxy.runner.held - held} sync(s) held back"
