"""Prometheus metrics: kube-proxy's names where they apply, plus per-service-port counters.

The per-service-port series are not stored in prometheus-client objects: the data plane bumps
plain ints in its `ConnStats`, and a collector reads them when `/metrics` is scraped. So a
connection costs nothing extra, and a Service's series vanish with its stats.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kube_userspace_proxy.dataplane import ConnStats
from kube_userspace_proxy.model import Protocol as L4Protocol
from kube_userspace_proxy.model import ServicePortName

PREFIX = "kube_userspace_proxy_"


PortStatsSource = Callable[[], Iterable[tuple[ServicePortName, ConnStats]]]


class Row(NamedTuple):
    """One service port's counters, copied from its ConnStats."""

    accepted: int
    active: int
    completed: int
    refused_no_endpoints: int
    dial_failures: int
    failed: int
    bytes_in: int
    bytes_out: int
    spliced: int
    udp_sessions_active: int
    udp_sessions_total: int
    udp_datagrams_in: int
    udp_datagrams_out: int
    udp_dropped: int


def _read(s: ConnStats) -> Row:
    return Row(
        s.accepted,
        s.active,
        s.completed,
        s.refused_no_endpoints,
        s.dial_failures,
        s.failed,
        s.bytes_in,
        s.bytes_out,
        s.spliced,
        s.udp_sessions_active,
        s.udp_sessions_total,
        s.udp_datagrams_in,
        s.udp_datagrams_out,
        s.udp_dropped,
    )


class Capture:
    """The per-port counters and the proxy port count, copied at one instant."""

    __slots__ = ("proxy_ports", "rows")

    def __init__(self, rows: dict[ServicePortName, Row], proxy_ports: int) -> None:
        self.rows = rows
        self.proxy_ports = proxy_ports


# Set while `render` runs in a worker thread, so the collector uses counters copied on the
# event loop instead of walking the proxier's live tables from another thread.
_CAPTURED: contextvars.ContextVar[Capture | None] = contextvars.ContextVar(
    "kube_userspace_proxy_metrics_capture", default=None
)


def _exponential(start: float, factor: float, count: int) -> list[float]:
    return [start * factor**i for i in range(count)]


# kube-proxy's NetworkProgrammingLatency buckets: 0.25s, 0.5s, 1..59s, 60..115s, 2..5min.
_PROGRAMMING_BUCKETS: Sequence[float] = (
    [0.25, 0.5]
    + [float(s) for s in range(1, 60)]
    + [float(s) for s in range(60, 120, 5)]
    + [float(s) for s in range(120, 301, 30)]
)


class _PortCollector(Collector):
    """Builds the kube_userspace_proxy_* families from a capture at scrape time."""

    def __init__(self, owner: ProxyMetrics) -> None:
        self._owner = owner

    def describe(self) -> Iterable[Metric]:
        return self._families(Capture({}, 0))

    def collect(self) -> Iterable[Metric]:
        captured = _CAPTURED.get()
        return self._families(captured if captured is not None else self._owner.capture())

    @staticmethod
    def _families(captured: Capture) -> list[Metric]:
        port = ["service_port", "protocol"]
        active = GaugeMetricFamily(
            PREFIX + "connections_active", "Open proxied TCP connections.", labels=port
        )
        conns = CounterMetricFamily(
            PREFIX + "connections",
            "TCP connections by result: accepted (all), completed (ended after reaching a "
            "backend), refused (no endpoints), failed (every dial failed).",
            labels=[*port, "result"],
        )
        dials = CounterMetricFamily(
            PREFIX + "dial_failures",
            "Failed dials to an endpoint (each try counts).",
            labels=port,
        )
        spliced = CounterMetricFamily(
            PREFIX + "spliced",
            "TCP connection directions that switched to zero-copy splice.",
            labels=port,
        )
        traffic = CounterMetricFamily(
            PREFIX + "bytes",
            "Bytes proxied, by direction (client_to_backend, backend_to_client).",
            labels=[*port, "direction"],
        )
        udp_active = GaugeMetricFamily(
            PREFIX + "udp_sessions_active", "Open UDP client sessions.", labels=port
        )
        udp_total = CounterMetricFamily(
            PREFIX + "udp_sessions", "UDP client sessions opened.", labels=port
        )
        datagrams = CounterMetricFamily(
            PREFIX + "udp_datagrams",
            "UDP datagrams proxied, by direction (client_to_backend, backend_to_client).",
            labels=[*port, "direction"],
        )
        dropped = CounterMetricFamily(
            PREFIX + "udp_dropped",
            "UDP datagrams dropped by the proxy (session table full, send error).",
            labels=port,
        )
        udp_refused = CounterMetricFamily(
            PREFIX + "udp_refused",
            "UDP datagrams turned away for lack of endpoints.",
            labels=port,
        )
        for name, r in captured.rows.items():
            sp = str(name)
            proto = name.protocol.value
            if name.protocol is L4Protocol.UDP:
                udp_active.add_metric([sp, proto], r.udp_sessions_active)
                udp_total.add_metric([sp, proto], r.udp_sessions_total)
                datagrams.add_metric([sp, proto, "client_to_backend"], r.udp_datagrams_in)
                datagrams.add_metric([sp, proto, "backend_to_client"], r.udp_datagrams_out)
                dropped.add_metric([sp, proto], r.udp_dropped)
                udp_refused.add_metric([sp, proto], r.refused_no_endpoints)
            else:
                active.add_metric([sp, proto], r.active)
                conns.add_metric([sp, proto, "accepted"], r.accepted)
                conns.add_metric([sp, proto, "completed"], r.completed)
                conns.add_metric([sp, proto, "refused"], r.refused_no_endpoints)
                conns.add_metric([sp, proto, "failed"], r.failed)
                spliced.add_metric([sp, proto], r.spliced)
            dials.add_metric([sp, proto], r.dial_failures)
            traffic.add_metric([sp, proto, "client_to_backend"], r.bytes_in)
            traffic.add_metric([sp, proto, "backend_to_client"], r.bytes_out)
        ports = GaugeMetricFamily(
            PREFIX + "proxy_ports", "Local proxy ports open (one per service port and path)."
        )
        ports.add_metric([], captured.proxy_ports)
        return [
            active,
            conns,
            dials,
            spliced,
            traffic,
            udp_active,
            udp_total,
            datagrams,
            dropped,
            udp_refused,
            ports,
        ]


class ProxyMetrics:
    """The proxy's metric registry; the sync runner and proxier report through its methods."""

    def __init__(
        self,
        port_stats: PortStatsSource,
        proxy_ports: Callable[[], int] | None = None,
        *,
        clock: Callable[[], float] = time.time,
        process_metrics: bool = True,
    ) -> None:
        self._port_stats = port_stats
        self._proxy_ports = proxy_ports
        self._clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if process_metrics:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
        self._sync_duration = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            buckets=_exponential(0.001, 2, 15),
            registry=r,
        )
        self._last_sync = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            registry=r,
        )
        self._last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            registry=r,
        )
        self._programming = Histogram(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            buckets=_PROGRAMMING_BUCKETS,
            registry=r,
        )
        self._endpoints_pending = Gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            registry=r,
        )
        self._endpoints_total = Counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "Cumulative proxy rules Endpoint changes",
            registry=r,
        )
        self._services_pending = Gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            registry=r,
        )
        self._services_total = Counter(
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "Cumulative proxy rules Service changes",
            registry=r,
        )
        self._restore_failures = Counter(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
            "Cumulative proxy iptables restore failures",
            registry=r,
        )
        self._healthz = Counter(
            "kubeproxy_proxy_healthz_total",
            "Cumulative proxy healthz HTTP status",
            ["code"],
            registry=r,
        )
        self._livez = Counter(
            "kubeproxy_proxy_livez_total",
            "Cumulative proxy livez HTTP status",
            ["code"],
            registry=r,
        )
        r.register(_PortCollector(self))

    # -- sync runner / proxier ------------------------------------------------------------

    def sync_done(self, duration_seconds: float) -> None:
        """A sync succeeded after `duration_seconds`."""
        self._sync_duration.observe(duration_seconds)
        self._last_sync.set(self._clock())

    def sync_queued(self) -> None:
        """A change asked for a sync."""
        self._last_queued.set(self._clock())

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

    def network_programming(self, seconds: float) -> None:
        """Time from an endpoint change (its trigger time) to the sync that applied it."""
        self._programming.observe(max(seconds, 0.0))

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
        rows: dict[ServicePortName, Row] = {}
        for name, stats in self._port_stats():
            row = _read(stats)
            previous = rows.get(name)
            # Two listeners (cluster and external path) may serve one service port: one series.
            rows[name] = (
                row if previous is None else Row(*map(sum, zip(previous, row, strict=True)))
            )
        count = self._proxy_ports() if self._proxy_ports is not None else len(rows)
        return Capture(rows, count)

    def render(self, captured: Capture | None = None, accept: str = "") -> tuple[bytes, str]:
        """The exposition body and its content type; safe to run in a worker thread."""
        encoder, content_type = choose_encoder(accept)
        token = _CAPTURED.set(captured)
        try:
            return encoder(self.registry), content_type
        finally:
            _CAPTURED.reset(token)


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
