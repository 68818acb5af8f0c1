"""The per-service-port metrics: this project's own series, one set per Service port.

They are not stored in prometheus-client objects: the data plane bumps plain ints in its
`ConnStats`, and they are read when `/metrics` is scraped. So a connection costs nothing
extra, and a Service's series vanish with its stats.

`PORT_FAMILIES` declares each family once; `PortMetrics` captures the counters and writes the
text with a small formatter of its own (`_Layout`, which keeps only each port's label text):
prometheus-client's generic one takes ~40x longer (about 180 ms for 1,000 service ports on a
2-core machine). `PortCollector` offers the
same families to a prometheus-client registry.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kube_userspace_proxy.dataplane import ConnStats
from kube_userspace_proxy.model import Protocol, ServicePortName

PREFIX = "kube_userspace_proxy_"
"""The prefix of this project's own metric names (kube-proxy's keep theirs)."""

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
    "core_picks",
)
"""The ConnStats fields metrics reads, in the order of a captured row."""

Row = tuple[int, ...]
_read_row: Callable[[ConnStats], Row] = operator.attrgetter(*FIELDS)

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
        PREFIX + "core_picks_total",
        "counter",
        "TCP connections the native data plane's core picked (round robin, from the pool's"
        " table) and dialed without a Python call; the others were picked in Python.",
        Protocol.TCP,
        "",
        (("", "core_picks"),),
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


class PortMetrics:
    """Every service port's counters: captured at scrape time, written as Prometheus text.

    `enabled` False leaves the families out (`--metrics-per-service-port`); the proxy port
    count stays. `transparent` (--preserve-source-ip) adds SOURCE_DIALS, summed over every port.
    """

    def __init__(
        self,
        port_stats: PortStatsSource,
        proxy_ports: Callable[[], int] | None = None,
        *,
        enabled: bool = True,
        transparent: bool = False,
    ) -> None:
        self.enabled = enabled
        self.transparent = transparent
        self._port_stats = port_stats
        self._proxy_ports = proxy_ports
        self._layout = _Layout(())

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

    def render(self, captured: Capture) -> Iterator[bytes]:
        """The families, one chunk each, so a caller on the loop can yield between."""
        if self.transparent:
            name = SOURCE_DIALS.removesuffix("_total")
            yield (
                f"# HELP {name} {_SOURCE_DIALS_HELP}\n# TYPE {name} counter\n"
                + "".join(
                    f'{SOURCE_DIALS}{{reason="{r}"}} {n}\n'
                    for r, n in source_dials(captured.rows.values())
                )
            ).encode()
        if not self.enabled:
            captured = Capture({}, captured.proxy_ports)
        names = tuple(captured.rows)
        layout = self._layout
        if layout.names != names:  # Services came or went: lay the text out again
            layout = self._layout = _Layout(names)
        rows = list(captured.rows.values())
        for fam in PORT_FAMILIES:
            yield layout.text(fam, rows).encode()
        yield (
            f"# HELP {PROXY_PORTS} {_PROXY_PORTS_HELP}\n# TYPE {PROXY_PORTS} gauge\n"
            f"{PROXY_PORTS} {captured.proxy_ports}\n"
        ).encode()


class PortCollector(Collector):
    """The same families as prometheus-client objects, for `generate_latest(registry)`."""

    def __init__(self, ports: PortMetrics) -> None:
        self._ports = ports

    def describe(self) -> Iterable[Metric]:
        return self._families(Capture({}, 0))

    def collect(self) -> Iterable[Metric]:
        captured = self._ports.capture()
        dials = source_dials(captured.rows.values()) if self._ports.transparent else []
        if not self._ports.enabled:
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


class _Layout:
    """The label text of each service port of one set of them, made at the first scrape and
    again only when the set changes; each scrape writes the families' lines from it.

    It once kept each family's whole text as a `str.format` template, with the (row, field)
    of every value: ~32 MiB at 10,000 service ports, held from the first scrape on (the
    control process's RSS rose by that much at the first /metrics), and slower to fill than
    writing the lines anew (~95 against ~50 ms a scrape at 10,000, `benchmarks/memory.py`).
    """

    __slots__ = ("_labels", "names")

    def __init__(self, names: tuple[ServicePortName, ...]) -> None:
        self.names = names
        self._labels: list[str] | None = None

    def text(self, fam: PortFamily, rows: list[Row]) -> str:
        """The family's HELP, TYPE and one line per series of each port it applies to."""
        if self._labels is None:
            self._labels = [_port_labels(name) for name in self.names]
        labels = self._labels
        head = fam.name + "{"
        series = [
            (f',{fam.extra_label}="{extra}"}} ' if extra else "} ", FIELDS.index(field))
            for extra, field in fam.series
        ]
        lines = [f"# HELP {fam.name} {fam.help}\n# TYPE {fam.name} {fam.kind}\n"]
        protocol = fam.protocol
        for i, name in enumerate(self.names):
            if protocol is not None and name.protocol is not protocol:
                continue
            row, label = rows[i], labels[i]
            for tail, field_index in series:
                lines.append(f"{head}{label}{tail}{row[field_index]}\n")
        return "".join(lines)
