"""Immutable values that cross module boundaries: service ports, endpoints, snapshots.

Everything here is frozen. Mutable state (cursors, affinity tables, sockets) stays private to
the module that owns it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

DEFAULT_AFFINITY_TIMEOUT_SECONDS = 10800
"""kube-apiserver's default for `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours)."""


Address = tuple[str, int]
"""(host, port) of a socket address."""
SocketKey = tuple[str, str, int]
"""(protocol "TCP"/"UDP", address, port) of a proxy-port or NodePort socket."""
ClaimKey = tuple[str, str, str]
"""(service port `ns/name:port`, protocol "TCP"/"UDP", path "cluster"/"external"): how
installed rules name the proxy port they target."""


class Protocol(enum.StrEnum):
    """Service port protocols the proxy serves (SCTP is skipped by the state builder)."""

    TCP = "TCP"
    UDP = "UDP"


class DialOutcome(enum.IntEnum):
    """How one dial to an endpoint ended, as a data plane reports it to the balancer (which
    decides what follows: a penalty, an ejection, the next endpoint). Plain ints on the wire
    from native code: the values are fixed."""

    CONNECTED = 0
    REFUSED = 1
    """The endpoint answered the SYN with a RST (nothing listens on its port)."""
    TIMED_OUT = 2
    """No answer within the dial ladder's step: a blackholed or overloaded endpoint."""
    UNREACHABLE = 3
    """ICMP host/network unreachable, or any other error of the dial itself."""


SCHEDULERS = ("rr", "lc", "sh")
"""The schedulers the balancer implements: round robin (the default), least connections
node-wide, source hashing (Maglev-style consistent hashing of the client address)."""
SCHEDULER_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "wrr": "rr",  # every endpoint weighs the same in Kubernetes: weighted rr is rr
        "wlc": "lc",  # likewise weighted least-connection
        "sed": "lc",  # shortest expected delay: fewest connections, weights all 1
        "nq": "lc",  # never queue: an idle endpoint first, else the shortest expected delay
        "lblc": "lc",  # locality-based least-connection: one destination (the VIP) per port
        "lblcr": "lc",
        "dh": "sh",  # destination hashing: the nearest stateless hash here is the source's
        "mh": "sh",  # Maglev hashing of the source: what `sh` is here
    }
)
"""IPVS scheduler names kube-proxy accepted, each mapped to the nearest of `SCHEDULERS`."""


def scheduler_named(value: str) -> tuple[str, str | None]:
    """The scheduler `value` names and a problem to warn about once (None: none): an IPVS
    name mapped to the nearest one implemented, or an unknown value (then `rr`)."""
    name = value.strip().lower()
    if name in SCHEDULERS:
        return name, None
    if name == "":
        return "rr", None
    mapped = SCHEDULER_ALIASES.get(name)
    if mapped is not None:
        return mapped, f"IPVS scheduler {value!r} is served as {mapped!r}, the nearest one here"
    return "rr", f"unknown scheduler {value!r} (rr, lc, sh or an IPVS name); using rr"


@dataclass(frozen=True, slots=True)
class Balancing:
    """How one service port's endpoints are chosen (`scheduler`) and passively ejected: after
    `outlier_failures` consecutive failed dials (0: never) for `outlier_base_ejection` seconds
    times the ejections so far (at most `MAX_EJECTION_SECONDS`)."""

    scheduler: str = "rr"
    outlier_failures: int = 5
    outlier_base_ejection: float = 30.0


DEFAULT_BALANCING = Balancing()
MAX_OUTLIER_FAILURES = 1000
"""The largest consecutive-failure threshold taken (a larger one is a mistake, not a wish)."""
MAX_EJECTION_SECONDS = 300.0
"""The longest an endpoint stays ejected, however often it was ejected before (Envoy's)."""


@dataclass(frozen=True, slots=True)
class BalancingOverrides:
    """What a Service's annotations set of its `Balancing` (None: the proxy's default)."""

    scheduler: str | None = None
    outlier_failures: int | None = None
    outlier_base_ejection: float | None = None

    def over(self, defaults: Balancing) -> Balancing:
        """`defaults` with these overrides applied."""
        if self == NO_OVERRIDES:
            return defaults
        return Balancing(
            defaults.scheduler if self.scheduler is None else self.scheduler,
            defaults.outlier_failures if self.outlier_failures is None else self.outlier_failures,
            defaults.outlier_base_ejection
            if self.outlier_base_ejection is None
            else self.outlier_base_ejection,
        )


NO_OVERRIDES = BalancingOverrides()


class Path(enum.StrEnum):
    """Which traffic a proxy port serves; traffic policies are per path.

    `CLUSTER` is ClusterIP traffic (`internalTrafficPolicy`); `EXTERNAL` is NodePort, externalIP
    and LoadBalancer-ingress traffic (`externalTrafficPolicy`).
    """

    CLUSTER = "cluster"
    EXTERNAL = "external"


@dataclass(frozen=True, slots=True, order=True)
class ServicePortName:
    """Identity of one port of one Service; prints as `ns/name:port` (`ns/name` when unnamed)."""

    namespace: str
    name: str
    port: str = ""
    protocol: Protocol = Protocol.TCP

    def __str__(self) -> str:
        base = f"{self.namespace}/{self.name}"
        return f"{base}:{self.port}" if self.port else base


@dataclass(frozen=True, slots=True)
class ServicePortInfo:
    """What the Service says about one of its ports (no endpoints: those come from slices)."""

    name: ServicePortName
    port: int
    cluster_ips: tuple[str, ...]
    node_port: int = 0
    external_ips: tuple[str, ...] = ()
    load_balancer_ips: tuple[str, ...] = ()
    client_ip_affinity: bool = False
    affinity_timeout_seconds: int = DEFAULT_AFFINITY_TIMEOUT_SECONDS
    internal_traffic_local: bool = False
    external_traffic_local: bool = False
    health_check_node_port: int = 0
    """spec.healthCheckNodePort of a LoadBalancer Service with externalTrafficPolicy Local."""
    proxy_protocol: int = 0
    """PROXY protocol header version sent to the backend first (1 or 2); 0: none (TCP only)."""
    balancing: BalancingOverrides = NO_OVERRIDES
    """The scheduler and outlier-ejection settings the Service's annotations set."""

    @property
    def protocol(self) -> Protocol:
        return self.name.protocol

    @property
    def has_external_paths(self) -> bool:
        """True when NodePort, externalIP or LoadBalancer traffic reaches this port."""
        return bool(self.node_port or self.external_ips or self.load_balancer_ips)

    @property
    def paths_differ(self) -> bool:
        """True when cluster and external traffic must use different endpoint sets."""
        return self.has_external_paths and (
            self.internal_traffic_local != self.external_traffic_local
        )


@dataclass(frozen=True, slots=True)
class SourcePolicy:
    """Transparent dialing is on (--preserve-source-ip): the node's local-client CIDRs.

    A client in one of `client_cidrs` is a pod of this node (the Node's spec.podCIDRs, or the
    cluster CIDR when kube-proxy's detectLocalMode says ClusterCIDR); its replies come back
    through this node from any endpoint. An endpoint on this node (`local` in the pool) keeps
    every client's address. Pools carry None while the mode is off.
    """

    client_cidrs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    """One backend address of a service port, with its EndpointSlice conditions."""

    ip: str
    port: int
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    node_name: str | None = None
    node_hints: tuple[str, ...] = ()
    """`hints.forNodes` names: the nodes this endpoint should serve (PreferSameNode)."""
    zone_hints: tuple[str, ...] = ()
    """`hints.forZones` names: the zones this endpoint should serve (PreferClose/SameZone)."""

    @property
    def address(self) -> tuple[str, int]:
        return (self.ip, self.port)

    def __str__(self) -> str:
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"


_EMPTY: Mapping[ServicePortName, object] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Desired:
    """Service ports and their endpoints as the cluster wants them served on this node: the
    whole state (`Snapshot`) or what changed since the previous one (`Change`).

    `endpoints` holds every known endpoint (all conditions, all nodes); choosing the usable
    ones for a path is the balancer's job. `trigger_times` are the
    `endpoints.kubernetes.io/last-change-trigger-time` values (epoch seconds) of the
    EndpointSlice changes folded into it since the previous one. `node_ips` are the
    addresses the node's own traffic is DNATed to (the flag's, else the Node object's).
    """

    services: Mapping[ServicePortName, ServicePortInfo] = field(
        default_factory=lambda: MappingProxyType({})
    )
    endpoints: Mapping[ServicePortName, tuple[Endpoint, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    node_name: str | None = None
    node_ips: tuple[str, ...] = ()
    node_zone: str = ""
    """The `topology.kubernetes.io/zone` label of the own Node ("": none), for zone hints."""
    trigger_times: tuple[float, ...] = ()
    service_changes: int = 0
    """Service changes folded in since the previous one."""
    endpoint_changes: int = 0
    """EndpointSlice changes folded in since the previous one."""
    pod_cidrs: tuple[str, ...] = ()
    """The own Node's spec.podCIDRs (empty: unknown or none)."""
    source: SourcePolicy | None = None
    """Transparent dialing (--preserve-source-ip) with the node's local-client CIDRs; None
    while the mode is off. Set by the app from the configuration and `pod_cidrs`."""

    def endpoints_of(self, name: ServicePortName) -> tuple[Endpoint, ...]:
        return self.endpoints.get(name, ())


@dataclass(frozen=True, slots=True)
class Snapshot(Desired):
    """The complete desired state at one moment: every service port and all its endpoints."""


@dataclass(frozen=True, slots=True)
class Change(Desired):
    """What changed since the previous Snapshot or Change (kube-proxy's change tracker).

    `changed` names the service ports added, changed or removed; `services` and `endpoints`
    hold only those of them that exist now (a name in `changed` but not in `services` was
    removed). Applied to the state it follows, it gives the state now.
    """

    changed: frozenset[ServicePortName] = frozenset()


@dataclass(frozen=True, slots=True)
class ProxiedPort:
    """A service port as the proxier serves it: which local proxy port takes which traffic.

    `external_port` equals `cluster_port` unless the two paths need different endpoint sets.
    Both are 0 when no port could be allocated (the error was logged; no rules are wanted).
    """

    info: ServicePortInfo
    cluster_port: int
    external_port: int
