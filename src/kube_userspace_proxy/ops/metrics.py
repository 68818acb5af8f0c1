"""Prometheus metrics: kube-proxy's names where they apply, and `ProxyMetrics`, the one object
the sync runner, proxier and ops server report through.

The per-service-port families live in `portmetrics` (read from the data plane at scrape time,
written by a formatter of their own); this module adds them to the registry and `render()`.

`/metrics` is always the Prometheus text format 0.0.4 (kube-proxy serves the same).
"""

from __future__ import annotations

import time
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kube_userspace_proxy.cluster import objects
from kube_userspace_proxy.ops.portmetrics import (
    PREFIX,
    Capture,
    PortCollector,
    PortMetrics,
    PortStatsSource,
)
from kube_userspace_proxy.outliers import ejections

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Loop-lag buckets: fine around the 20 ms a control loop should stay under."""


def _exponential(start: float, factor: float, count: int) -> list[float]:
    return [start * factor**i for i in range(count)]


# kube-proxy's NetworkProgrammingLatency buckets: 0.25s, 0.5s, 1..59s, 60..115s, 2..5min.
_PROGRAMMING_BUCKETS: Sequence[float] = (
    [0.25, 0.5]
    + [float(s) for s in range(1, 60)]
    + [float(s) for s in range(60, 120, 5)]
    + [float(s) for s in range(120, 301, 30)]
)


class _ForbiddenAddressCollector(Collector):
    """Addresses dropped from objects because of their kind (`objects.forbidden_addresses`)."""

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            PREFIX + "forbidden_addresses",
            "Endpoint, ClusterIP, externalIP and LoadBalancer addresses never proxied because"
            " they are loopback, link-local, unspecified, multicast or broadcast.",
            labels=["kind", "field", "reason"],
        )
        for labels, count in sorted(objects.forbidden_addresses.items()):
            family.add_metric(list(labels), count)
        yield family


class _EjectionCollector(Collector):
    """Endpoints ejected after runs of failed dials (`outliers.ejections`)."""

    def collect(self) -> Iterable[Metric]:
        total = CounterMetricFamily(
            PREFIX + "endpoint_ejections",
            "Times an endpoint was ejected after consecutive failed dials, per service port.",
            labels=["service_port", "endpoint"],
        )
        for (service_port, endpoint), count in sorted(ejections.totals.items()):
            total.add_metric([service_port, endpoint], count)
        yield total
        yield GaugeMetricFamily(
            PREFIX + "endpoints_ejected",
            "Endpoints ejected now (their ejection time not over), on every service port.",
            value=ejections.ejected_now(),
        )


class SourceCounters(typing.Protocol):
    """The counters an API source keeps (plain ints, read at scrape time)."""

    relists_total: int
    errors_total: int
    bad_data_total: int


SOURCE_COUNTERS = (
    (
        "relists_total",
        "Lists after the first (410 Gone, periodic relist, bad data), each resource.",
    ),
    ("errors_total", "Failed lists and watches: errors, bad data and unexpected failures."),
    ("bad_data_total", "Malformed watch events and list bodies from the API server."),
)


class _SourceCollector(Collector):
    def __init__(self, owner: ProxyMetrics) -> None:
        self._owner = owner

    def describe(self) -> Iterable[Metric]:
        return []  # present only once a source is followed

    def collect(self) -> Iterable[Metric]:
        source = self._owner._source
        if source is None:
            return []
        families = []
        for attribute, text in SOURCE_COUNTERS:
            family = CounterMetricFamily(PREFIX + "source_" + attribute, text)
            family.add_metric([], getattr(source, attribute))
            families.append(family)
        return families


class WorkerCounters(typing.Protocol):
    """What the worker pool keeps about its processes (read at scrape time)."""

    @property
    def alive(self) -> int: ...

    @property
    def restarts(self) -> int: ...

    @property
    def unserved(self) -> int: ...


class _WorkerCollector(Collector):
    def __init__(self, owner: ProxyMetrics) -> None:
        self._owner = owner

    def describe(self) -> Iterable[Metric]:
        return []  # present only with worker processes

    def collect(self) -> Iterable[Metric]:
        pool = self._owner._workers
        if pool is None:
            return []
        alive = GaugeMetricFamily(PREFIX + "workers", "Worker processes serving now.")
        alive.add_metric([], pool.alive)
        restarts = CounterMetricFamily(
            PREFIX + "worker_restarts", "Worker processes replaced after an unexpected exit."
        )
        restarts.add_metric([], pool.restarts)
        unserved = GaugeMetricFamily(
            PREFIX + "worker_unserved_ports",
            "Proxy ports a worker could not open (descriptors short, say), summed over the"
            " workers; they are sent again with a backoff until they serve.",
        )
        unserved.add_metric([], pool.unserved)
        return [alive, restarts, unserved]


class FlowCounters(typing.Protocol):
    """What the stale-UDP-flow cleaner keeps (`portals.StaleFlows`, read at scrape time)."""

    deleted: dict[int, int]
    errors: int


class _FlowCollector(Collector):
    def __init__(self, owner: ProxyMetrics) -> None:
        self._owner = owner

    def describe(self) -> Iterable[Metric]:
        return []  # present only with rules installed

    def collect(self) -> Iterable[Metric]:
        flows = self._owner._flows
        if flows is None:
            return []
        deleted = CounterMetricFamily(
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler (stale UDP flows)",
            labels=["ip_family"],
        )
        for family, count in sorted(flows.deleted.items()):
            deleted.add_metric([f"IPv{family}"], count)
        errors = CounterMetricFamily(
            PREFIX + "conntrack_errors",
            "Failed reads and deletes of conntrack entries of stale UDP flows (each logged;"
            " those flows stay until they idle out)",
        )
        errors.add_metric([], flows.errors)
        return [deleted, errors]


class ProxyMetrics:
    """The proxy's metrics; the sync runner, proxier and ops server report through its methods.

    `registry` holds everything (kube-proxy's metrics, process metrics, the per-port
    families); `render()` is the fast path `/metrics` uses.
    """

    def __init__(
        self,
        port_stats: PortStatsSource,
        proxy_ports: Callable[[], int] | None = None,
        *,
        clock: Callable[[], float] = time.time,
        process_metrics: bool = True,
        per_service_port: bool = True,
        transparent: bool = False,
        ip_families: Sequence[str] = ("IPv4",),
        dataplane: str = "python",
    ) -> None:
        self._ports = PortMetrics(
            port_stats, proxy_ports, enabled=per_service_port, transparent=transparent
        )
        self._clock = clock
        # Everything but the per-port families: small, formatted by prometheus-client.
        self._base = base = CollectorRegistry(auto_describe=True)
        if process_metrics:
            ProcessCollector(registry=base)
            PlatformCollector(registry=base)
        Gauge(
            "kube_userspace_proxy_dataplane_info",
            "The TCP data plane that serves: native (C) or python (asyncio Protocols).",
            ["dataplane"],
            registry=base,
        ).labels(dataplane).set(1)
        # kube-proxy (1.28+) labels these by ip_family; one sync here serves every family the
        # proxy ports serve, so each sample is recorded under each of them.
        self._families = tuple(ip_families)
        family = ["ip_family"]
        sync_buckets = _exponential(0.001, 2, 15)
        self._sync_duration = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            family,
            buckets=sync_buckets,
            registry=base,
        )
        self._sync_full = Histogram(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            family,
            buckets=sync_buckets,
            registry=base,
        )
        self._sync_partial = Histogram(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            family,
            buckets=sync_buckets,
            registry=base,
        )
        self._last_sync = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            family,
            registry=base,
        )
        self._last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            family,
            registry=base,
        )
        self._programming = Histogram(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            family,
            buckets=_PROGRAMMING_BUCKETS,
            registry=base,
        )
        for name in self._families:  # present from the start, as kube-proxy's are
            for metric in (
                self._sync_duration,
                self._sync_full,
                self._sync_partial,
                self._last_sync,
                self._last_queued,
                self._programming,
            ):
                metric.labels(name)
        self._loop_lag = Histogram(
            PREFIX + "event_loop_lag_seconds",
            "How late a timer fired on the control process's event loop (sampled every 20 ms)",
            buckets=_LAG_BUCKETS,
            registry=base,
        )
        self._endpoints_pending = Gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            registry=base,
        )
        self._endpoints_total = Counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "Cumulative proxy rules Endpoint changes",
            registry=base,
        )
        self._services_pending = Gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            registry=base,
        )
        self._services_total = Counter(
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "Cumulative proxy rules Service changes",
            registry=base,
        )
        self._restore_failures = Counter(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
            "Cumulative proxy iptables restore failures",
            registry=base,
        )
        self._healthz = Counter(
            "kubeproxy_proxy_healthz_total",
            "Cumulative proxy healthz HTTP status",
            ["code"],
            registry=base,
        )
        self._livez = Counter(
            "kubeproxy_proxy_livez_total",
            "Cumulative proxy livez HTTP status",
            ["code"],
            registry=base,
        )
        self._no_local = Gauge(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of service ports with a Local traffic policy and no local endpoints",
            ["ip_family", "traffic_policy"],
            registry=base,
        )
        for name in self._families:
            for policy in ("internal", "external"):
                self._no_local.labels(name, policy).set(0)
        self._iptables_rules = Gauge(
            "kubeproxy_sync_proxy_rules_iptables_total",
            "Number of iptables rules the proxy has installed, per table",
            ["table"],
            registry=base,
        )
        self._over_budget = Gauge(
            PREFIX + "service_ports_over_descriptor_budget",
            "Service ports refused at the last sync because opening them would eat into the"
            " descriptors kept in reserve (RLIMIT_NOFILE)",
            registry=base,
        )
        base.register(_ForbiddenAddressCollector())
        base.register(_EjectionCollector())
        # client-go's names, labels and buckets, so API-server dashboards carry over.
        self._api_requests = Counter(
            "rest_client_requests_total",
            "Number of HTTP requests, partitioned by status code, method, and host.",
            ["code", "method", "host"],
            registry=base,
        )
        self._api_duration = Histogram(
            "rest_client_request_duration_seconds",
            "Request latency in seconds. Broken down by verb, and host.",
            ["verb", "host"],
            buckets=(0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0),
            registry=base,
        )
        self._source: SourceCounters | None = None
        base.register(_SourceCollector(self))
        self._workers: WorkerCounters | None = None
        self._sites: Collector | None = None
        base.register(_WorkerCollector(self))
        self._flows: FlowCounters | None = None
        base.register(_FlowCollector(self))
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(base)
        self.registry.register(PortCollector(self._ports))

    @property
    def per_service_port(self) -> bool:
        """False: the per-service-port families are left out (`--metrics-per-service-port`)."""
        return self._ports.enabled

    @per_service_port.setter
    def per_service_port(self, enabled: bool) -> None:
        self._ports.enabled = enabled

    # -- sync runner / proxier ------------------------------------------------------------

    def sync_done(self, duration_seconds: float, *, full: bool = True) -> None:
        """A sync succeeded after `duration_seconds`: a full one (the complete state: the
        first, a periodic resync, a retry) or a partial one (the changes since the last)."""
        now = self._clock()
        kind = self._sync_full if full else self._sync_partial
        for family in self._families:
            self._sync_duration.labels(family).observe(duration_seconds)
            kind.labels(family).observe(duration_seconds)
            self._last_sync.labels(family).set(now)

    def sync_queued(self) -> None:
        """A change asked for a sync."""
        now = self._clock()
        for family in self._families:
            self._last_queued.labels(family).set(now)

    def set_pending(self, services: int, endpoints: int) -> None:
        """Changes received but not yet synced."""
        self._services_pending.set(services)
        self._endpoints_pending.set(endpoints)

    def add_changes(self, services: int, endpoints: int) -> None:
        """Count Service and EndpointSlice changes seen."""
        if services:
            self._services_total.inc(services)
        if endpoints:
            self._endpoints_total.inc(endpoints)

    def loop_lag(self, seconds: float) -> None:
        """One sample of the control loop's lag (`health.watch_lag`)."""
        self._loop_lag.observe(seconds)

    def network_programming(self, seconds: float) -> None:
        """Time from an endpoint change (its trigger time) to the sync that applied it."""
        for family in self._families:
            self._programming.labels(family).observe(max(seconds, 0.0))

    def api_request(self, code: str, method: str, host: str, seconds: float) -> None:
        """One request to the API server answered (or failed) after `seconds`."""
        self._api_requests.labels(code, method, host).inc()
        self._api_duration.labels(method, host).observe(seconds)

    def follow_source(self, source: SourceCounters) -> None:
        """Export the API source's own counters (read at scrape time)."""
        self._source = source

    def follow_sites(self, sites: Collector) -> None:
        """Export the ops sites' bounds and counters (read at scrape time); once."""
        if self._sites is None:
            self._sites = sites
            self._base.register(sites)

    def follow_flows(self, flows: FlowCounters | None) -> None:
        """Export the stale-UDP-flow cleaner's counters (read at scrape time)."""
        self._flows = flows

    def follow_workers(self, pool: WorkerCounters) -> None:
        """Export the worker pool's process counts (read at scrape time)."""
        self._workers = pool

    def set_no_local_endpoints(self, internal: int, external: int) -> None:
        """Service ports whose Local policy found endpoints, but none on this node."""
        for family in self._families:
            self._no_local.labels(family, "internal").set(internal)
            self._no_local.labels(family, "external").set(external)

    def set_iptables_rules(self, per_table: dict[str, int]) -> None:
        """Rules of ours in each table after a commit (tables not named keep their value)."""
        for table, count in per_table.items():
            self._iptables_rules.labels(table).set(count)

    def set_over_budget(self, service_ports: int) -> None:
        """Service ports the last sync refused for want of descriptors."""
        self._over_budget.set(service_ports)

    def restore_failure(self) -> None:
        """Applying iptables rules failed."""
        self._restore_failures.inc()

    # -- ops server ----------------------------------------------------------------------

    def healthz_served(self, code: int) -> None:
        self._healthz.labels(str(code)).inc()

    def livez_served(self, code: int) -> None:
        self._livez.labels(str(code)).inc()

    def capture(self) -> Capture:
        """Copy every service port's counters now (cheap; run it on the event loop)."""
        return self._ports.capture()

    def render(self, captured: Capture | None = None) -> bytes:
        """The whole `/metrics` body at once (Prometheus text format 0.0.4)."""
        if captured is None:
            captured = self.capture()
        return self.render_base() + b"".join(self.render_ports(captured))

    def render_base(self) -> bytes:
        """kube-proxy's and the process metrics; reads /proc (ops runs it in a worker thread)."""
        return generate_latest(self._base)

    def render_ports(self, captured: Capture) -> Iterator[bytes]:
        """The per-port families, one chunk each, so a caller on the loop can yield between."""
        return self._ports.render(captured)


def sample_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of one sample in Prometheus text output (for tests, benchmarks, demo)."""
    want = labels or {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in want.items()):
                return float(sample.value)
    return None


def iter_samples(text: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """Every sample called `name` in Prometheus text output, with its labels."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                yield dict(sample.labels), float(sample.value)
