"""Metrics an operator already graphs, scraped over real HTTP from a proxy following the fake."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
import pytest

from kube_userspace_proxy.app.proxy import Proxy
from kube_userspace_proxy.model import ServicePortName
from kube_userspace_proxy.ops.metrics import iter_samples, sample_value
from tests.control.conftest import NODE, endpoint_slice, eventually, service
from tests.control.test_kube_end_to_end import kube_config
from tests.fakes.apiserver import FakeApiServer
from tests.loopback.proxyrun import ask, running_proxy, start_named_backends

T = TypeVar("T")


async def scrape(proxy: Proxy) -> str:
    assert proxy.ops is not None
    url = f"http://127.0.0.1:{proxy.ops.metrics_port}/metrics"
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        assert resp.status == 200
        return await resp.text()


async def test_per_service_port_series_carry_namespace_service_and_port(
    apiserver: FakeApiServer, kubeconfig: str
) -> None:
    [(_, port, server)] = await start_named_backends(["pod-a"])
    try:
        async with running_proxy(kube_config(kubeconfig, workers="1")) as proxy:
            apiserver.create(service("web", namespace="shop"))
            apiserver.create(
                endpoint_slice("web-a", "web", ["127.0.0.1"], port=port, namespace="shop")
            )
            await eventually(lambda: proxy.proxier.debug_state().get("shop/web:http"))
            await eventually(
                lambda: proxy.proxier.debug_state()["shop/web:http"]["endpoints"].get("cluster")
            )
            assert (
                await ask(proxy.proxier.port_of(ServicePortName("shop", "web", "http"))) == "pod-a"
            )
            text = await scrape(proxy)
    finally:
        server.close()
    labels = {
        "namespace": "shop",
        "service": "web",
        "port": "http",
        "service_port": "shop/web:http",
        "protocol": "TCP",
        "result": "accepted",
    }
    assert sample_value(text, "kube_userspace_proxy_connections_total", labels) == 1


async def test_per_service_port_series_can_be_turned_off(
    apiserver: FakeApiServer, kubeconfig: str
) -> None:
    config = kube_config(kubeconfig, metrics_per_service_port=False, workers="1")
    async with running_proxy(config) as proxy:
        apiserver.create(service("web"))
        await eventually(lambda: "default/web:http" in proxy.proxier.debug_state())
        text = await scrape(proxy)
    assert list(iter_samples(text, "kube_userspace_proxy_connections_total")) == []
    assert list(iter_samples(text, "kube_userspace_proxy_bytes_total")) == []
    assert sample_value(text, "kube_userspace_proxy_proxy_ports") == 1  # the totals stay


async def test_no_local_endpoints_counts_local_policies_served_only_elsewhere(
    apiserver: FakeApiServer, kubeconfig: str
) -> None:
    async with running_proxy(kube_config(kubeconfig, workers="1")) as proxy:
        apiserver.create(service("in", internalTrafficPolicy="Local"))
        apiserver.create(endpoint_slice("in-a", "in", ["10.1.0.1"], node_name="node-2"))
        lb = service("lb", cluster_ip="10.96.0.11", type="NodePort", externalTrafficPolicy="Local")
        lb["spec"]["ports"][0]["nodePort"] = 30080
        apiserver.create(lb)
        apiserver.create(endpoint_slice("lb-a", "lb", ["10.1.0.2"], node_name="node-2"))
        name = "kubeproxy_sync_proxy_rules_no_local_endpoints_total"

        async def counts() -> tuple[float | None, float | None]:
            text = await scrape(proxy)
            return (
                sample_value(text, name, {"traffic_policy": "internal"}),
                sample_value(text, name, {"traffic_policy": "external"}),
            )

        assert await poll(counts, (1.0, 1.0)) == (1.0, 1.0)
        # An endpoint on this node: nothing is counted any more.
        apiserver.update(endpoint_slice("in-a", "in", ["10.1.0.1"], node_name=NODE))
        apiserver.update(endpoint_slice("lb-a", "lb", ["10.1.0.2"], node_name=NODE))
        assert await poll(counts, (0.0, 0.0)) == (0.0, 0.0)


async def poll(read: Callable[[], Awaitable[T]], want: T, timeout: float = 10.0) -> T:
    """Call `read` until it returns `want` or `timeout` passes; returns the last value."""
    end = time.monotonic() + timeout
    value = await read()
    while value != want and time.monotonic() < end:
        await asyncio.sleep(0.05)
        value = await read()
    return value


async def test_api_requests_are_counted_as_client_go_counts_them(
    apiserver: FakeApiServer, kubeconfig: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_proxy(kube_config(kubeconfig, workers="1")) as proxy:
        apiserver.fail_next(2, 500, plural="services", verb="watch")
        apiserver.drop_watches()
        host = f"127.0.0.1:{apiserver.port}"

        async def failures_seen() -> float | None:
            text = await scrape(proxy)
            labels = {"code": "500", "method": "GET", "host": host}
            return sample_value(text, "rest_client_requests_total", labels)

        assert await poll(failures_seen, 2.0) == 2.0
        text = await scrape(proxy)
    ok = sample_value(text, "rest_client_requests_total", {"code": "200", "method": "GET"})
    assert ok is not None and ok >= 3  # the Service, EndpointSlice and Node lists at least
    count = sample_value(
        text, "rest_client_request_duration_seconds_count", {"verb": "GET", "host": host}
    )
    assert count is not None and count >= ok + 2
    # The source's own counters: every cut or refused watch is an error (each one logged);
    # the watches resumed from where they were, so nothing was listed again.
    failures = [r for r in caplog.records if "watch failed (" in r.getMessage()]
    assert len(failures) >= 2
    assert sample_value(text, "kube_userspace_proxy_source_errors_total") == len(failures)
    assert sample_value(text, "kube_userspace_proxy_source_relists_total") == 0
    assert sample_value(text, "kube_userspace_proxy_source_bad_data_total") == 0


async def test_full_and_partial_syncs_are_timed_apart_per_ip_family(
    apiserver: FakeApiServer, kubeconfig: str
) -> None:
    family = {"ip_family": "IPv4"}  # bind address 127.0.0.1: the proxy ports serve IPv4
    full = "kubeproxy_sync_full_proxy_rules_duration_seconds_count"
    partial = "kubeproxy_sync_partial_proxy_rules_duration_seconds_count"
    every = "kubeproxy_sync_proxy_rules_duration_seconds_count"
    async with running_proxy(kube_config(kubeconfig, workers="1")) as proxy:
        apiserver.create(service("web"))
        apiserver.create(endpoint_slice("web-a", "web", ["10.1.0.1"], node_name=NODE))
        await eventually(lambda: proxy.proxier.debug_state().get("default/web:http"))

        async def counts() -> tuple[float, float, float]:
            text = await scrape(proxy)
            return tuple(  # type: ignore[return-value]
                sample_value(text, name, family) or 0.0 for name in (full, partial, every)
            )

        async def first_full() -> bool:
            return (await counts())[0] >= 1

        assert await poll(first_full, True)
        before = await counts()
        # An endpoint change: served at once, without a complete sync (a partial one).
        apiserver.update(endpoint_slice("web-a", "web", ["10.1.0.2"], node_name=NODE))

        async def partial_seen() -> bool:
            return (await counts())[1] > before[1]

        assert await poll(partial_seen, True)
        text = await scrape(proxy)
    after = tuple(sample_value(text, name, family) or 0.0 for name in (full, partial, every))
    assert after[2] == after[0] + after[1]  # every sync is one or the other
    assert sample_value(text, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", family)
    assert sample_value(text, every, {"ip_family": "IPv6"}) is None  # no IPv6 served
