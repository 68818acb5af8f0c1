"""The ops sites over real HTTP on 127.0.0.1: health, metrics, proxy mode, configz, debug state."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kube_userspace_proxy.dataplane import ConnStats
from kube_userspace_proxy.errors import ConfigError, PortInUseError
from kube_userspace_proxy.model import Protocol, ServicePortName
from kube_userspace_proxy.ops.health import ProxyHealth
from kube_userspace_proxy.ops.metrics import ProxyMetrics, iter_samples, sample_value
from kube_userspace_proxy.ops.server import OpsServer, parse_bind_address, start_ops

SYNC_PERIOD = 30.0
MYAPP = ServicePortName("default", "myapp", "http")
DNS = ServicePortName("kube-system", "kube-dns", "dns", Protocol.UDP)


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Proxy:
    """Stands in for the proxier's tables: the stats the metrics collector reads."""

    stats: dict[ServicePortName, list[ConnStats]] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=lambda: {"services": {}})

    def port_stats(self) -> list[tuple[ServicePortName, ConnStats]]:
        return [(name, s) for name, many in self.stats.items() for s in many]

    def proxy_ports(self) -> int:
        return sum(len(many) for many in self.stats.values())


@dataclass
class Ops:
    server: OpsServer
    health: ProxyHealth
    metrics: ProxyMetrics
    clock: Clock
    proxy: Proxy
    http: aiohttp.ClientSession

    def healthz_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.healthz_port}{path}"

    def metrics_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.metrics_port}{path}"

    async def get(self, url: str, **kw: Any) -> tuple[int, str, aiohttp.ClientResponse]:
        async with self.http.get(url, **kw) as resp:
            return resp.status, await resp.text(), resp

    async def scrape(self) -> str:
        status, text, _ = await self.get(self.metrics_url("/metrics"))
        assert status == 200
        return text


CONFIGZ = {"kubeproxy.config.k8s.io": {"mode": "userspace", "syncPeriod": "30s"}}


@pytest.fixture
async def ops() -> AsyncIterator[Ops]:
    clock = Clock()
    proxy = Proxy()
    health = ProxyHealth(SYNC_PERIOD, clock=clock)
    metrics = ProxyMetrics(proxy.port_stats, proxy.proxy_ports)
    server = await start_ops(
        healthz_bind="127.0.0.1:0",
        metrics_bind="127.0.0.1:0",
        health=health,
        metrics=metrics,
        debug_state=lambda: proxy.state,
        configz=lambda: CONFIGZ,
    )
    try:
        async with aiohttp.ClientSession() as http:
            yield Ops(server, health, metrics, clock, proxy, http)
    finally:
        await server.close()


# -- health site ---------------------------------------------------------------------------


async def test_healthz_and_livez_answer_200_with_json_while_starting(ops: Ops) -> None:
    for path, keys in (
        ("/healthz", {"lastUpdated", "currentTime", "nodeEligible", "healthy", "status"}),
        ("/livez", {"lastUpdated", "currentTime", "healthy", "status"}),
    ):
        async with ops.http.get(ops.healthz_url(path)) as resp:
            assert resp.status == 200
            assert resp.content_type == "application/json"
            assert resp.headers["X-Content-Type-Options"] == "nosniff"
            body = await resp.json()
        assert set(body) == keys


async def test_healthz_turns_503_when_syncs_stall_and_back_after_a_sync(ops: Ops) -> None:
    ops.health.queued_update()
    ops.clock.now += 2 * SYNC_PERIOD + 1
    assert (await ops.get(ops.healthz_url("/healthz")))[0] == 503
    assert (await ops.get(ops.healthz_url("/livez")))[0] == 200  # the loop is alive
    ops.health.synced()
    for path in ("/healthz", "/livez"):
        assert (await ops.get(ops.healthz_url(path)))[0] == 200


async def test_readyz_is_503_until_the_first_sync_then_200(ops: Ops) -> None:
    async with ops.http.get(ops.healthz_url("/readyz")) as resp:
        assert resp.status == 503
        assert (await resp.json())["ready"] is False
    assert (await ops.get(ops.healthz_url("/healthz")))[0] == 200  # kube-proxy's rule
    ops.health.synced()
    async with ops.http.get(ops.healthz_url("/readyz")) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["ready"] is True and body["status"]["IPv4"]["healthy"] is True


async def test_ineligible_node_fails_healthz_but_livez_stays_200(ops: Ops) -> None:
    ops.health.set_node_eligible(False)
    async with ops.http.get(ops.healthz_url("/healthz")) as resp:
        assert resp.status == 503
        assert (await resp.json())["nodeEligible"] is False
    assert (await ops.get(ops.healthz_url("/livez")))[0] == 200


async def test_health_probes_are_counted_by_status_code(ops: Ops) -> None:
    await ops.get(ops.healthz_url("/healthz"))
    ops.health.set_node_eligible(False)
    await ops.get(ops.healthz_url("/healthz"))
    await ops.get(ops.healthz_url("/healthz"))
    await ops.get(ops.healthz_url("/livez"))
    text = await ops.scrape()
    assert sample_value(text, "kubeproxy_proxy_healthz_total", {"code": "200"}) == 1
    assert sample_value(text, "kubeproxy_proxy_healthz_total", {"code": "503"}) == 2
    assert sample_value(text, "kubeproxy_proxy_livez_total", {"code": "200"}) == 1


async def test_health_site_serves_only_the_probes(ops: Ops) -> None:
    assert (await ops.get(ops.healthz_url("/metrics")))[0] == 404


# -- metrics site --------------------------------------------------------------------------


async def test_proxy_mode_is_plain_userspace(ops: Ops) -> None:
    status, text, resp = await ops.get(ops.metrics_url("/proxyMode"))
    assert (status, text, resp.content_type) == (200, "userspace", "text/plain")


async def test_metrics_site_healthz_is_a_plain_ok(ops: Ops) -> None:
    ops.health.set_node_eligible(False)  # it says the metrics server is up, nothing more
    assert (await ops.get(ops.metrics_url("/healthz")))[:2] == (200, "ok")


async def test_configz_serves_the_configuration_as_json(ops: Ops) -> None:
    async with ops.http.get(ops.metrics_url("/configz")) as resp:
        assert resp.status == 200
        assert await resp.json() == CONFIGZ


async def test_debug_state_serves_what_the_callable_returns_now(ops: Ops) -> None:
    ops.proxy.state = {"services": {str(MYAPP): {"proxyPort": 40001, "endpoints": []}}}
    async with ops.http.get(ops.metrics_url("/debug/state")) as resp:
        assert resp.status == 200
        assert await resp.json() == ops.proxy.state


async def test_metrics_carry_kube_proxy_names(ops: Ops) -> None:
    text = await ops.scrape()
    for name in (
        "kubeproxy_sync_proxy_rules_duration_seconds_count",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        "kubeproxy_network_programming_duration_seconds_count",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "kubeproxy_sync_proxy_rules_service_changes_pending",
        "kubeproxy_sync_proxy_rules_service_changes_total",
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
        "kube_userspace_proxy_proxy_ports",
        "process_open_fds",
    ):
        assert sample_value(text, name) is not None, name


async def test_sync_reports_move_the_kube_proxy_metrics(ops: Ops) -> None:
    m = ops.metrics
    m.sync_queued()
    m.set_pending(services=2, endpoints=5)
    m.add_changes(services=2, endpoints=5)
    m.add_changes(services=0, endpoints=1)
    m.sync_done(0.003)
    m.network_programming(0.4)
    m.restore_failure()
    text = await ops.scrape()
    assert sample_value(text, "kubeproxy_sync_proxy_rules_duration_seconds_count") == 1
    assert sample_value(text, "kubeproxy_sync_proxy_rules_duration_seconds_sum") == 0.003
    assert (
        sample_value(text, "kubeproxy_network_programming_duration_seconds_bucket", {"le": "0.5"})
        == 1
    )
    assert sample_value(text, "kubeproxy_sync_proxy_rules_service_changes_pending") == 2
    assert sample_value(text, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 5
    assert sample_value(text, "kubeproxy_sync_proxy_rules_service_changes_total") == 2
    assert sample_value(text, "kubeproxy_sync_proxy_rules_endpoint_changes_total") == 6
    assert sample_value(text, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total") == 1
    assert (sample_value(text, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") or 0) > 0
    assert (sample_value(text, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds") or 0) > 0


def conn(text: str, result: str, name: ServicePortName = MYAPP) -> float | None:
    return sample_value(
        text,
        "kube_userspace_proxy_connections_total",
        {"service_port": str(name), "protocol": "TCP", "result": result},
    )


async def test_connection_counters_are_read_from_conn_stats_at_scrape_time(ops: Ops) -> None:
    stats = ConnStats()
    ops.proxy.stats[MYAPP] = [stats]
    before = await ops.scrape()
    # What the data plane does for 10 connections, 2 of them still open.
    stats.accepted += 10
    stats.completed += 8
    stats.active = 2
    stats.bytes_in += 1000
    stats.bytes_out += 5000
    stats.dial_failures += 3
    stats.failed += 1
    stats.refused_no_endpoints += 4
    after = await ops.scrape()
    labels = {"service_port": "default/myapp:http", "protocol": "TCP"}
    assert conn(before, "accepted") == 0
    assert conn(after, "accepted") == 10
    assert conn(after, "completed") == 8
    assert conn(after, "failed") == 1
    assert conn(after, "refused") == 4
    assert sample_value(after, "kube_userspace_proxy_connections_active", labels) == 2
    assert sample_value(after, "kube_userspace_proxy_dial_failures_total", labels) == 3
    bytes_total = "kube_userspace_proxy_bytes_total"
    assert sample_value(after, bytes_total, {**labels, "direction": "client_to_backend"}) == 1000
    assert sample_value(after, bytes_total, {**labels, "direction": "backend_to_client"}) == 5000


async def test_udp_ports_report_sessions_and_datagrams(ops: Ops) -> None:
    stats = ConnStats(udp_sessions_active=1, udp_sessions_total=3, udp_datagrams_in=7)
    stats.udp_datagrams_out, stats.udp_dropped_table_full, stats.refused_no_endpoints = 6, 1, 2
    stats.udp_dropped_send_failed, stats.no_descriptors = 4, 5
    ops.proxy.stats[DNS] = [stats]
    text = await ops.scrape()
    labels = {"service_port": "kube-system/kube-dns:dns", "protocol": "UDP"}
    p = "kube_userspace_proxy_"
    assert sample_value(text, p + "udp_sessions_active", labels) == 1
    assert sample_value(text, p + "udp_sessions_total", labels) == 3
    assert (
        sample_value(text, p + "udp_datagrams_total", {**labels, "direction": "client_to_backend"})
        == 7
    )
    assert (
        sample_value(text, p + "udp_datagrams_total", {**labels, "direction": "backend_to_client"})
        == 6
    )
    dropped = p + "udp_dropped_total"
    assert sample_value(text, dropped, {**labels, "reason": "table_full"}) == 1
    assert sample_value(text, dropped, {**labels, "reason": "send_failed"}) == 4
    assert sample_value(text, dropped, {**labels, "reason": "no_descriptors"}) == 0
    assert sample_value(text, p + "no_descriptors_total", labels) == 5
    assert sample_value(text, p + "udp_refused_total", labels) == 2
    assert conn(text, "accepted", DNS) is None  # no TCP connection series for a UDP port


async def test_series_vanish_when_the_service_goes(ops: Ops) -> None:
    ops.proxy.stats[MYAPP] = [ConnStats(accepted=5)]
    ops.proxy.stats[DNS] = [ConnStats()]
    assert conn(await ops.scrape(), "accepted") == 5
    del ops.proxy.stats[MYAPP]
    text = await ops.scrape()
    for name in (
        "kube_userspace_proxy_connections_total",
        "kube_userspace_proxy_connections_active",
        "kube_userspace_proxy_bytes_total",
        "kube_userspace_proxy_dial_failures_total",
    ):
        assert all(labels["service_port"] != str(MYAPP) for labels, _ in iter_samples(text, name))
    assert sample_value(text, "kube_userspace_proxy_proxy_ports") == 1


async def test_two_listeners_of_one_service_port_add_up_to_one_series(ops: Ops) -> None:
    ops.proxy.stats[MYAPP] = [ConnStats(accepted=3), ConnStats(accepted=4)]
    text = await ops.scrape()
    assert conn(text, "accepted") == 7
    assert sample_value(text, "kube_userspace_proxy_proxy_ports") == 2


async def test_metrics_are_prometheus_text_even_when_openmetrics_is_asked_for(ops: Ops) -> None:
    # Prometheus asks for OpenMetrics first; like kube-proxy we answer with the text format.
    headers = {"Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"}
    status, text, resp = await ops.get(ops.metrics_url("/metrics"), headers=headers)
    assert status == 200
    assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# EOF" not in text


PROCESS_WIDE = (
    "kube_userspace_proxy_forbidden_addresses",
    "kube_userspace_proxy_endpoint_ejections",  # and endpoints_ejected: per endpoint, node-wide
    "kube_userspace_proxy_endpoints_ejected",
    "kube_userspace_proxy_event_loop_lag_seconds",  # and its _created
    "kube_userspace_proxy_ops_",  # the ops sites' connection bounds and counters
)
"""Families of ours that are not per service port."""


async def test_fast_metrics_text_matches_the_registry(ops: Ops) -> None:
    ops.proxy.stats[MYAPP] = [ConnStats(accepted=3, active=1, bytes_in=7, spliced=2)]
    ops.proxy.stats[DNS] = [ConnStats(udp_sessions_total=4, refused_no_endpoints=1)]
    served = await ops.scrape()
    registry_text = generate_latest(ops.metrics.registry).decode()

    def port_samples(text: str) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
        return {
            (sample.name, tuple(sorted(sample.labels.items())), sample.value)
            for family in text_string_to_metric_families(text)
            if family.name.startswith("kube_userspace_proxy_")
            and not family.name.startswith(PROCESS_WIDE)
            for sample in family.samples
        }

    assert port_samples(served) == port_samples(registry_text)
    # 13 TCP + 11 UDP series + proxy_ports + service_ports_over_descriptor_budget
    # + dataplane_info
    assert len(port_samples(served)) == 27


# -- binding -------------------------------------------------------------------------------


def make_ops_args() -> dict[str, Any]:
    proxy = Proxy()
    return {
        "health": ProxyHealth(SYNC_PERIOD),
        "metrics": ProxyMetrics(proxy.port_stats),
        "debug_state": dict,
        "configz": dict,
    }


async def test_port_in_use_is_a_clear_error_naming_address_and_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError) as caught:
            await start_ops(
                healthz_bind="127.0.0.1:0", metrics_bind=f"127.0.0.1:{port}", **make_ops_args()
            )
    message = str(caught.value)
    assert f"127.0.0.1:{port}" in message
    assert "--metrics-bind-address" in message
    assert "in use" in message


async def test_failed_start_leaves_no_port_open() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # Find a free port for the healthz site, then check it is free again after the failure.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        with pytest.raises(PortInUseError):
            await start_ops(
                healthz_bind=f"127.0.0.1:{free}",
                metrics_bind=f"127.0.0.1:{port}",
                **make_ops_args(),
            )
    with socket.socket() as again:
        again.bind(("127.0.0.1", free))


async def test_close_frees_both_ports() -> None:
    server = await start_ops(
        healthz_bind="127.0.0.1:0", metrics_bind="127.0.0.1:0", **make_ops_args()
    )
    ports = (server.healthz_port, server.metrics_port)
    await server.close()
    for port in ports:
        assert port
        with socket.socket() as again:
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            again.bind(("127.0.0.1", port))
            again.listen()


@pytest.mark.parametrize("disabled", ["", "0"])
async def test_empty_or_zero_address_disables_the_site(disabled: str) -> None:
    server = await start_ops(healthz_bind="127.0.0.1:0", metrics_bind=disabled, **make_ops_args())
    try:
        assert server.metrics_port is None
        assert server.healthz_port
        url = f"http://127.0.0.1:{server.healthz_port}/livez"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            assert resp.status == 200
    finally:
        await server.close()


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback on this host")
async def test_ipv6_address_in_brackets_is_served() -> None:
    server = await start_ops(healthz_bind="[::1]:0", metrics_bind="", **make_ops_args())
    try:
        assert server.healthz_address == ("::1", server.healthz_port)
        url = f"http://[::1]:{server.healthz_port}/healthz"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            assert resp.status == 200
    finally:
        await server.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.0.0.0:10256", ("0.0.0.0", 10256)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::]:10249", ("::", 10249)),
        ("[::1]", ("::1", 7)),
        ("::", ("::", 7)),
        (":9000", ("0.0.0.0", 9000)),
        ("10.0.0.1", ("10.0.0.1", 7)),
        ("", None),
        ("0", None),
    ],
)
def test_bind_address_forms(text: str, expected: tuple[str, int] | None) -> None:
    assert parse_bind_address(text, default_port=7, flag="--x") == expected


@pytest.mark.parametrize("text", ["localhost:10256", "1.2.3.4:99999", "1.2.3.4:http", "[::1"])
def test_bad_bind_address_is_a_config_error_naming_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match="--healthz-bind-address"):
        parse_bind_address(text, default_port=7, flag="--healthz-bind-address")
