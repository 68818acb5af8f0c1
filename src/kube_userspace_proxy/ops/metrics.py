"""Prometheus metrics: kube-proxy's names where they apply, plus per-service-port counters.

The per-service-port series are not stored in prometheus-client objects: the data plane bumps
plain ints in its `ConnStats`, and they are read when `/metrics` is scraped. So a connection
costs nothing extra, and a Service's series vanish with its stats.

`/metrics` is always the Prometheus text format 0.0.4 (kube-proxy serves the same). The
per-port part is written by a small formatter of its own: prometheus-client's generic one
takes ~40x longer (about 180 ms for 1,000 service ports on a 2-core machine).
"""

from __future__ import annotations

import operator
import time
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

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
from kube_userspace_proxy.dataplane import ConnStats
from kube_userspace_proxy.model import Protocol, ServicePortName

PREFIX = "kube_userspace_proxy_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

PortStatsSource = Callable[[], Iterable[tuple[ServicePortName, ConnStats]]]

FIELDS = (
    "accepted",
    "active",
    "completed",
    "refused_no_endpoints",
    "dial_failures",
    "failed",
    "bytes_in",
    "bytes_out",
    "spliced",
    "udp_sessions_active",
    "udp_sessions_total",
    "udp_datagrams_in",
    "udp_datagrams_out",
    "udp_dropped_table_full",
    "udp_dropped_send_failed",
    "udp_dropped_no_descriptors",
    "no_descriptors",
    "udp_sessions_evicted",
    "source_node",
    "source_client_pod",
    "source_local_endpoint",
)
"""The ConnStats fields metrics reads, in the order of a captured row."""

SOURCE_DIALS = PREFIX + "source_address_dials_total"
_SOURCE_DIALS_HELP = (
    "--preserve-source-ip: dials (TCP connections, UDP sessions) by the source address they"
    " got: reason client-pod (the client's address: a pod of this node) and local-endpoint (the"
    " client's address: the endpoint runs on this node), node (the node's address: an external"
    " client and a remote endpoint, or the node itself). Only while the mode is on."
)
_SOURCE_REASONS = (
    ("client-pod", FIELDS.index("source_client_pod")),
    ("local-endpoint", FIELDS.index("source_local_endpoint")),
    ("node", FIELDS.index("source_node")),
)


def source_dials(captured_rows: Iterable[Row]) -> list[tuple[str, int]]:
    """(reason, dials) summed over every service port."""
    rows = list(captured_rows)
    return [(reason, sum(row[index] for row in rows)) for reason, index in _SOURCE_REASONS]


Row = tuple[int, ...]
_read_row: Callable[[ConnStats], Row] = operator.attrgetter(*FIELDS)


@dataclass(frozen=True, slots=True)
class PortFamily:
    """One kube_userspace_proxy_* family: which ports have it and which fields feed it."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    protocol: Protocol | None  # None: TCP and UDP ports alike
    extra_label: str  # "" or the name of the label that tells the series apart
    series: tuple[tuple[str, str], ...]  # (extra label value, ConnStats field)


PORT_FAMILIES: tuple[PortFamily, ...] = (
    PortFamily(
        PREFIX + "connections_active",
        "gauge",
        "Open proxied TCP connections.",
        Protocol.TCP,
        "",
        (("", "active"),),
    ),
    PortFamily(
        PREFIX + "connections_total",
        "counter",
        "TCP connections by result: accepted (all), completed (ended after reaching a "
        "backend), refused (no endpoints), failed (every dial failed).",
        Protocol.TCP,
        "result",
        (
            ("accepted", "accepted"),
            ("completed", "completed"),
            ("refused", "refused_no_endpoints"),
            ("failed", "failed"),
        ),
    ),
    PortFamily(
        PREFIX + "dial_failures_total",
        "counter",
        "Failed dials to an endpoint (each try counts).",
        None,
        "",
        (("", "dial_failures"),),
    ),
    PortFamily(
        PREFIX + "spliced_total",
        "counter",
        "TCP connection directions that switched to zero-copy splice.",
        Protocol.TCP,
        "",
        (("", "spliced"),),
    ),
    PortFamily(
        PREFIX + "bytes_total",
        "counter",
        "Bytes proxied, by direction (client_to_backend, backend_to_client).",
        None,
        "direction",
        (("client_to_backend", "bytes_in"), ("backend_to_client", "bytes_out")),
    ),
    PortFamily(
        PREFIX + "udp_sessions_active",
        "gauge",
        "Open UDP client sessions.",
        Protocol.UDP,
        "",
        (("", "udp_sessions_active"),),
    ),
    PortFamily(
        PREFIX + "udp_sessions_total",
        "counter",
        "UDP client sessions opened.",
        Protocol.UDP,
        "",
        (("", "udp_sessions_total"),),
    ),
    PortFamily(
        PREFIX + "udp_datagrams_total",
        "counter",
        "UDP datagrams proxied, by direction (client_to_backend, backend_to_client).",
        Protocol.UDP,
        "direction",
        (("client_to_backend", "udp_datagrams_in"), ("backend_to_client", "udp_datagrams_out")),
    ),
    PortFamily(
        PREFIX + "udp_dropped_total",
        "counter",
        "UDP datagrams dropped by the proxy, by reason: table_full (no room for a new"
        " client's session), send_failed (the backend socket refused it), no_descriptors.",
        Protocol.UDP,
        "reason",
        (
            ("table_full", "udp_dropped_table_full"),
            ("send_failed", "udp_dropped_send_failed"),
            ("no_descriptors", "udp_dropped_no_descriptors"),
        ),
    ),
    PortFamily(
        PREFIX + "udp_sessions_evicted_total",
        "counter",
        "Idle UDP sessions ended early to make room for a new client (session table full).",
        Protocol.UDP,
        "",
        (("", "udp_sessions_evicted"),),
    ),
    PortFamily(
        PREFIX + "no_descriptors_total",
        "counter",
        "Accepts, dials and UDP session sockets that failed because the process was out of"
        " file descriptors (EMFILE, ENFILE) or socket memory.",
        None,
        "",
        (("", "no_descriptors"),),
    ),
    PortFamily(
        PREFIX + "udp_refused_total",
        "counter",
        "UDP datagrams turned away for lack of endpoints.",
        Protocol.UDP,
        "",
        (("", "refused_no_endpoints"),),
    ),
)

PROXY_PORTS = PREFIX + "proxy_ports"
_PROXY_PORTS_HELP = "Local proxy ports open (one per service port and path)."


@dataclass(frozen=True, slots=True)
class Capture:
    """Every service port's counters and the proxy port count, copied at one instant."""

    rows: dict[ServicePortName, Row]
    proxy_ports: int


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


PORT_LABELS = ("namespace", "service", "port", "service_port", "protocol")
"""Labels of every per-service-port series: kube-state-metrics' namespace and service (for
joins), the port's name, and kube-proxy's `ns/name:port` with the protocol."""


def _port_label_values(name: ServicePortName) -> list[str]:
    return [name.namespace, name.name, name.port, str(name), name.protocol.value]


def _port_labels(name: ServicePortName) -> str:
    values = _port_label_values(name)
    return ",".join(f'{k}="{_escape(v)}"' for k, v in zip(PORT_LABELS, values, strict=True))


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


class _PortCollector(Collector):
    """The per-port families as prometheus-client objects, for `generate_latest(registry)`."""

    def __init__(self, owner: ProxyMetrics) -> None:
        self._owner = owner

    def describe(self) -> Iterable[Metric]:
        return self._families(Capture({}, 0))

    def collect(self) -> Iterable[Metric]:
        captured = self._owner.capture()
        dials = source_dials(captured.rows.values()) if self._owner.transparent else []
        if not self._owner.per_service_port:
            captured = Capture({}, captured.proxy_ports)
        families = self._families(captured)
        if dials:
            family = CounterMetricFamily(SOURCE_DIALS, _SOURCE_DIALS_HELP, labels=["reason"])
            for reason, count in dials:
                family.add_metric([reason], count)
            families.append(family)
        return families

    @staticmethod
    def _families(captured: Capture) -> list[Metric]:
        families: list[Metric] = []
        for fam in PORT_FAMILIES:
            labels = [*PORT_LABELS] + ([fam.extra_label] if fam.extra_label else [])
            metric: CounterMetricFamily | GaugeMetricFamily
            if fam.kind == "counter":
                metric = CounterMetricFamily(fam.name, fam.help, labels=labels)
            else:
                metric = GaugeMetricFamily(fam.name, fam.help, labels=labels)
            for name, row in captured.rows.items():
                if fam.protocol is not None and name.protocol is not fam.protocol:
                    continue
                for extra, field in fam.series:
                    values = _port_label_values(name) + ([extra] if extra else [])
                    metric.add_metric(values, row[FIELDS.index(field)])
            families.append(metric)
        ports = GaugeMetricFamily(PROXY_PORTS, _PROXY_PORTS_HELP)
        ports.add_metric([], captured.proxy_ports)
        families.append(ports)
        return families


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

    restarts: int

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
    ) -> None:
        self.per_service_port = per_service_port
        self.transparent = transparent
        """--preserve-source-ip is on: SOURCE_DIALS is exported."""
        """False: the per-service-port families are left out (`--metrics-per-service-port`)."""
        self._port_stats = port_stats
        self._proxy_ports = proxy_ports
        self._clock = clock
        self._layout = _Layout(())
        # Everything but the per-port families: small, formatted by prometheus-client.
        self._base = base = CollectorRegistry(auto_describe=True)
        if process_metrics:
            ProcessCollector(registry=base)
            PlatformCollector(registry=base)
        self._sync_duration = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            buckets=_exponential(0.001, 2, 15),
            registry=base,
        )
        self._last_sync = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            registry=base,
        )
        self._last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            registry=base,
        )
        self._programming = Histogram(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            buckets=_PROGRAMMING_BUCKETS,
            registry=base,
        )
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
            ["traffic_policy"],
            registry=base,
        )
        for policy in ("internal", "external"):
            self._no_local.labels(policy).set(0)
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
        base.register(_WorkerCollector(self))
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(base)
        self.registry.register(_PortCollector(self))

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

    def loop_lag(self, seconds: float) -> None:
        """One sample of the control loop's lag (`health.watch_lag`)."""
        self._loop_lag.observe(seconds)

    def network_programming(self, seconds: float) -> None:
        """Time from an endpoint change (its trigger time) to the sync that applied it."""
        self._programming.observe(max(seconds, 0.0))

    def api_request(self, code: str, method: str, host: str, seconds: float) -> None:
        """One request to the API server answered (or failed) after `seconds`."""
        self._api_requests.labels(code, method, host).inc()
        self._api_duration.labels(method, host).observe(seconds)

    def follow_source(self, source: SourceCounters) -> None:
        """Export the API source's own counters (read at scrape time)."""
        self._source = source

    def follow_workers(self, pool: WorkerCounters) -> None:
        """Export the worker pool's process counts (read at scrape time)."""
        self._workers = pool

    def set_no_local_endpoints(self, internal: int, external: int) -> None:
        """Service ports whose Local policy found endpoints, but none on this node."""
        self._no_local.labels("internal").set(internal)
        self._no_local.labels("external").set(external)

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
        rows: dict[ServicePortName, Row] = {}
        for name, stats in self._port_stats():
            row = _read_row(stats)
            previous = rows.get(name)
            # Two listeners (cluster and external path) may serve one service port: one series.
            rows[name] = row if previous is None else tuple(map(operator.add, previous, row))
        count = self._proxy_ports() if self._proxy_ports is not None else len(rows)
        return Capture(rows, count)

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
        if self.transparent:
            name = SOURCE_DIALS.removesuffix("_total")
            yield (
                f"# HELP {name} {_SOURCE_DIALS_HELP}\n# TYPE {name} counter\n"
                + "".join(
                    f'{SOURCE_DIALS}{{reason="{r}"}} {n}\n'
                    for r, n in source_dials(captured.rows.values())
                )
            ).encode()
        if not self.per_service_port:
            captured = Capture({}, captured.proxy_ports)
        names = tuple(captured.rows)
        layout = self._layout
        if layout.names != names:  # Services came or went: lay the text out again
            layout = self._layout = _Layout(names)
        rows = list(captured.rows.values())
        for index in range(len(PORT_FAMILIES)):
            template, picks = layout.family(index)
            yield template.format(*[rows[i][j] for i, j in picks]).encode()
        yield (
            f"# HELP {PROXY_PORTS} {_PROXY_PORTS_HELP}\n# TYPE {PROXY_PORTS} gauge\n"
            f"{PROXY_PORTS} {captured.proxy_ports}\n"
        ).encode()


def _braces(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


Template = tuple[str, tuple[tuple[int, int], ...]]
"""A family's text with `{}` for each value, and the (row, field index) of each value."""


class _Layout:
    """The per-port text for one set of service ports, built lazily a family at a time.

    Rebuilt only when the set of service ports changes; a scrape is then one `str.format`
    per family.
    """

    __slots__ = ("_families", "_labels", "names")

    def __init__(self, names: tuple[ServicePortName, ...]) -> None:
        self.names = names
        self._labels: list[str] | None = None
        self._families: list[Template | None] = [None] * len(PORT_FAMILIES)

    def family(self, index: int) -> Template:
        built = self._families[index]
        if built is None:
            built = self._families[index] = self._build(PORT_FAMILIES[index])
        return built

    def _build(self, fam: PortFamily) -> Template:
        if self._labels is None:
            self._labels = [_port_labels(name) for name in self.names]
        labels = self._labels
        parts = [_braces(f"# HELP {fam.name} {fam.help}\n# TYPE {fam.name} {fam.kind}\n")]
        picks: list[tuple[int, int]] = []
        series = [
            (f',{fam.extra_label}="{extra}"' if extra else "", FIELDS.index(field))
            for extra, field in fam.series
        ]
        for i, name in enumerate(self.names):
            if fam.protocol is not None and name.protocol is not fam.protocol:
                continue
            for extra, field_index in series:
                parts.append(_braces(f"{fam.name}{{{labels[i]}{extra}}} ") + "{}\n")
                picks.append((i, field_index))
        return "".join(parts), tuple(picks)


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
