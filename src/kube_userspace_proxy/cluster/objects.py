"""Raw Services, EndpointSlices and Nodes -> the typed parts ClusterState keeps.

Raw objects are plain dicts shaped like the API's JSON (camelCase), from the kube watch and
from YAML manifests alike. Parsing here is pure: it checks every field it reads and raises
Malformed naming the first one that is wrong; what to do about it is the caller's business.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from kube_userspace_proxy import addresses, logs
from kube_userspace_proxy.model import (
    DEFAULT_AFFINITY_TIMEOUT_SECONDS,
    MAX_EJECTION_SECONDS,
    MAX_OUTLIER_FAILURES,
    NO_OVERRIDES,
    BalancingOverrides,
    Endpoint,
    Protocol,
    ServicePortInfo,
    ServicePortName,
    scheduler_named,
)

log = logs.get(__name__)

Key = tuple[str, str]  # (namespace, name)

LABEL_SERVICE_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
LABEL_HEADLESS = "service.kubernetes.io/headless"
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
ANNOTATION_TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"
ANNOTATION_PROXY_PROTOCOL = "kube-userspace-proxy.io/proxy-protocol"
PROXY_PROTOCOL_VERSIONS = {"v1": 1, "v2": 2}
ANNOTATION_SCHEDULER = "kube-userspace-proxy.io/scheduler"
ANNOTATION_OUTLIER_FAILURES = "kube-userspace-proxy.io/outlier-consecutive-failures"
ANNOTATION_OUTLIER_BASE_EJECTION = "kube-userspace-proxy.io/outlier-base-ejection-time"
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
TAINT_TO_BE_DELETED = "ToBeDeletedByClusterAutoscaler"
LABEL_TOPOLOGY_ZONE = "topology.kubernetes.io/zone"
_IP_MODES = frozenset({"VIP", "Proxy"})

NO_CLUSTER_IP = "no clusterIP"
"""ignore_reason's answer for a Service whose clusterIP nobody allocated (in manifests only)."""

MAX_AFFINITY_TIMEOUT = 86400  # kube-apiserver's validation limit
_EXTERNALLY_ACCESSIBLE_TYPES = frozenset({"NodePort", "LoadBalancer"})
_SERVICE_TYPES = frozenset({"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"})
PROTOCOLS = frozenset({"TCP", "UDP", "SCTP"})

T = TypeVar("T")

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_MAX_SUBDOMAIN = 253

forbidden_addresses: Counter[tuple[str, str, str]] = Counter()
"""Addresses dropped because of their kind, by (object kind, field, kind of address); the
metrics collector reads it at scrape time. Process-wide, like the default Prometheus registry."""


class Malformed(ValueError):
    """An object does not have the shape the API guarantees; the message says where."""


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What the proxy uses of its own Node object."""

    ips: tuple[str, ...]
    """Node IPs as Kubernetes' GetNodeHostIPs ranks them: the primary one per family."""
    eligible: bool
    """False while the Node is being deleted or tainted for scale-down."""
    zone: str = ""
    """Its `topology.kubernetes.io/zone` label ("": none)."""
    pod_cidrs: tuple[str, ...] = ()
    """Its spec.podCIDRs, canonical (transparent proxying's local clients)."""


@dataclass(frozen=True, slots=True)
class Slice:
    """The parts of one EndpointSlice the proxy uses."""

    service: Key
    ports: tuple[tuple[str, Protocol, int], ...]  # (port name, protocol, port)
    endpoints: tuple[Endpoint, ...]
    """Each endpoint's first address, conditions and node, with the slice's first port (0:
    none): the very objects the Snapshot then holds for that port (`state._merged`), where
    an endpoint of its own for the slice was ~2.5 MiB more at 30,000 endpoints."""
    dropped: tuple[tuple[str, str], ...] = ()
    """(address, why) of the endpoints left out because of their address (`rules` says so)."""


# -- typed field access ----------------------------------------------------------------------


def _field(obj: Mapping[str, Any], key: str, kind: type[T], where: str, default: T) -> T:
    """`obj[key]` checked against `kind`; `default` when missing or null."""
    value = obj.get(key)
    if value is None:
        return default
    # bool is an int subclass, but `port: true` is as malformed as `port: "80"`.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise Malformed(f"{where}{key}: expected {_type_name(kind)}, got {value!r}")
    return value


_TYPE_NAMES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    int: "an integer",
    bool: "a boolean",
}


def _type_name(kind: type[Any]) -> str:
    return _TYPE_NAMES.get(kind, kind.__name__)


def _mapping(obj: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise Malformed(f"{where}{key}: expected an object, got {value!r}")
    return value


def _items(obj: Mapping[str, Any], key: str, where: str) -> list[Any]:
    return _field(obj, key, list, where, [])


def port_number(value: Any, where: str) -> int:
    """`value` as a port number (1-65535, never a bool); Malformed naming `where` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 65535:
        raise Malformed(f"{where}: {value!r} is not a port number (1-65535)")
    return value


def ip_address(value: Any, where: str, version: int | None = None) -> str:
    """A valid IP address in canonical form (inet_pton: strict and ~7x faster than ipaddress)."""
    if not isinstance(value, str):
        raise Malformed(f"{where}: expected an IP address, got {value!r}")
    family = socket.AF_INET6 if ":" in value else socket.AF_INET
    try:
        canonical = socket.inet_ntop(family, socket.inet_pton(family, value))
    except (OSError, ValueError):  # ValueError: embedded NUL
        raise Malformed(f"{where}: {value!r} is not an IP address") from None
    if version is not None and (6 if family == socket.AF_INET6 else 4) != version:
        raise Malformed(f"{where}: {value!r} is not an IPv{version} address")
    return canonical


def forbidden_kind(ip: str, obj_kind: str, field: str, *, loopback: bool = False) -> str | None:
    """The kind of a canonical address that is never proxied (counted), or None."""
    packed = socket.inet_pton(_family(ip), ip)
    kind = addresses.forbidden_kind(packed)
    if kind == "loopback" and loopback:
        return None
    if kind is not None:
        forbidden_addresses[(obj_kind, field, kind)] += 1
    return kind


def _usable_ip(
    value: Any, where: str, obj_kind: str, key: Key, field: str, *, loopback: bool = False
) -> str | None:
    """`ip_address(value)`, or None (logged and counted) when it is loopback, link-local, etc."""
    ip = ip_address(value, where)
    kind = forbidden_kind(ip, obj_kind, field, loopback=loopback)
    if kind is None:
        return ip
    log.warning("%s %s/%s: ignoring %s %s: a %s address is never proxied", obj_kind, *key,
                where, ip, kind)  # fmt: skip
    return None


def dns_label(value: Any, where: str) -> str:
    """`value` when it is a DNS-1123 label (as Kubernetes checks names); Malformed otherwise."""
    if not isinstance(value, str) or not _DNS_LABEL.fullmatch(value):
        raise Malformed(
            f"{where}: {str(value)[:80]!r} is not a DNS-1123 label (at most 63 characters:"
            " lowercase letters, digits and '-', starting and ending alphanumeric)"
        )
    return value


def _labels(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    labels = _mapping(meta, "labels", "metadata.")
    for key, value in labels.items():
        if not isinstance(key, str) or not isinstance(value, str | None):
            raise Malformed(f"metadata.labels: {key!r}: {value!r} is not a string label")
    return labels


def object_key(obj: Any) -> Key:
    """(namespace, name) of a raw object; raises Malformed when either is missing."""
    if not isinstance(obj, Mapping):
        raise Malformed(f"expected an object, got {type(obj).__name__}")
    meta = _mapping(obj, "metadata", "")
    namespace = _field(meta, "namespace", str, "metadata.", "")
    name = _field(meta, "name", str, "metadata.", "")
    if not name:
        raise Malformed("metadata.name is missing")
    if not namespace:
        raise Malformed("metadata.namespace is missing")
    # The API server enforces these; manifests must too, as names reach iptables comments.
    dns_label(namespace, "metadata.namespace")
    if len(name) > _MAX_SUBDOMAIN or not _DNS_SUBDOMAIN.fullmatch(name):
        raise Malformed(f"metadata.name: {name[:80]!r} is not a DNS-1123 subdomain")
    # Interned, as the other names and addresses below: 10,000 objects repeat a few
    # namespaces, port names, node names and pod IPs, which the parser would otherwise keep
    # a copy of per object (and per watch event that replaces one).
    return (sys.intern(namespace), sys.intern(name))


def describe(obj: Any) -> str:
    """`ns/name` of a raw object for a log line, as far as it can be told."""
    if isinstance(obj, Mapping) and isinstance(obj.get("metadata"), Mapping):
        meta = obj["metadata"]
        return f"{meta.get('namespace') or '?'}/{meta.get('name') or '?'}"
    return "<unnamed>"


# -- Service --------------------------------------------------------------------------------


def ignore_reason(obj: Mapping[str, Any], service_proxy_name: str | None) -> str | None:
    """Why kube-proxy would not proxy this Service (None: it would)."""
    meta = _mapping(obj, "metadata", "")
    labels = _labels(meta)
    proxy_name = labels.get(LABEL_SERVICE_PROXY_NAME)
    if service_proxy_name is None and proxy_name is not None:
        return f"label {LABEL_SERVICE_PROXY_NAME}={proxy_name} hands it to another proxy"
    if service_proxy_name is not None and proxy_name != service_proxy_name:
        return f"label {LABEL_SERVICE_PROXY_NAME} is not {service_proxy_name!r}"
    if LABEL_HEADLESS in labels:
        return f"label {LABEL_HEADLESS} marks it headless"
    spec = _mapping(obj, "spec", "")
    kind = _field(spec, "type", str, "spec.", "ClusterIP")
    if kind not in _SERVICE_TYPES:
        raise Malformed(f"spec.type: unknown type {kind!r}")
    if kind == "ExternalName":
        return "type ExternalName"
    ips = _field(spec, "clusterIPs", list, "spec.", [])
    first = ips[0] if ips else _field(spec, "clusterIP", str, "spec.", "")
    if first == "None":
        return "headless (clusterIP None)"
    if not first:
        return NO_CLUSTER_IP
    return None


def parse_service(
    obj: Mapping[str, Any], key: Key
) -> tuple[tuple[ServicePortInfo, ...], tuple[ServicePortName, ...], tuple[str, ...]]:
    """The service ports of a proxied Service, the names of its skipped SCTP ports, and the
    problems that do not stop it being proxied (each worth one warning)."""
    namespace, name = key
    dns_label(name, "metadata.name")  # a Service name is a label, not a subdomain
    spec = _mapping(obj, "spec", "")
    proxy_protocol, problems = _proxy_protocol(_mapping(obj, "metadata", ""))
    balancing, balancing_problems = balancing_annotations(_mapping(obj, "metadata", ""))
    problems += balancing_problems
    kind = _field(spec, "type", str, "spec.", "ClusterIP")
    raw_ips = _field(spec, "clusterIPs", list, "spec.", [])
    if not raw_ips:
        raw_ips = [_field(spec, "clusterIP", str, "spec.", "")]
    cluster_ips = tuple(ip_address(ip, f"spec.clusterIPs[{i}]") for i, ip in enumerate(raw_ips))
    for i, ip in enumerate(cluster_ips):
        if (bad := forbidden_kind(ip, "Service", "clusterIP")) is not None:
            raise Malformed(f"spec.clusterIPs[{i}]: {ip} is a {bad} address")
    external_ips: list[str] = []
    for i, raw in enumerate(_items(spec, "externalIPs", "spec.")):
        usable = _usable_ip(raw, f"spec.externalIPs[{i}]", "Service", key, "externalIP")
        if usable is not None:
            external_ips.append(usable)
    ingress_ips: list[str] = []
    lb = _mapping(_mapping(obj, "status", ""), "loadBalancer", "status.")
    for i, ingress in enumerate(_items(lb, "ingress", "status.loadBalancer.")):
        where = f"status.loadBalancer.ingress[{i}]"
        if not isinstance(ingress, Mapping):
            raise Malformed(f"{where}: expected an object, got {ingress!r}")
        ip_mode = _field(ingress, "ipMode", str, f"{where}.", "VIP")
        if ip_mode not in _IP_MODES:
            raise Malformed(f"{where}.ipMode: unknown mode {ip_mode!r} (VIP or Proxy)")
        if ip_mode == "Proxy":
            # KEP-1860: the load balancer proxies to the NodePorts itself; capturing its IP
            # here would short-circuit it (its PROXY headers, TLS, health checks).
            continue
        if ingress.get("ip"):  # hostname-only ingresses are for the cloud's DNS, not us
            usable = _usable_ip(ingress["ip"], f"{where}.ip", "Service", key, "loadBalancerIP")
            if usable is not None:
                ingress_ips.append(usable)

    affinity = _field(spec, "sessionAffinity", str, "spec.", "None")
    if affinity not in {"None", "ClientIP"}:
        raise Malformed(f"spec.sessionAffinity: unknown value {affinity!r}")
    client_ip = _mapping(_mapping(spec, "sessionAffinityConfig", "spec."), "clientIP", "spec.")
    timeout = _field(
        client_ip,
        "timeoutSeconds",
        int,
        "spec.sessionAffinityConfig.clientIP.",
        DEFAULT_AFFINITY_TIMEOUT_SECONDS,
    )
    if affinity == "ClientIP" and not 0 < timeout <= MAX_AFFINITY_TIMEOUT:
        raise Malformed(
            f"spec.sessionAffinityConfig.clientIP.timeoutSeconds: {timeout} is not in"
            f" 1-{MAX_AFFINITY_TIMEOUT}"
        )
    internal_local = _policy(spec, "internalTrafficPolicy")
    external = kind in _EXTERNALLY_ACCESSIBLE_TYPES or bool(external_ips)
    # As kube-proxy: externalTrafficPolicy only means something for externally reachable ones.
    external_local = _policy(spec, "externalTrafficPolicy") and external
    # kube-proxy serves a health check only for LoadBalancer Services with the Local policy.
    health_port = 0
    if kind == "LoadBalancer" and external_local and spec.get("healthCheckNodePort"):
        health_port = port_number(spec["healthCheckNodePort"], "spec.healthCheckNodePort")

    infos: list[ServicePortInfo] = []
    sctp: list[ServicePortName] = []
    seen: set[str] = set()
    for i, port in enumerate(_items(spec, "ports", "spec.")):
        where = f"spec.ports[{i}]"
        if not isinstance(port, Mapping):
            raise Malformed(f"{where}: expected an object, got {port!r}")
        port_name = sys.intern(_field(port, "name", str, f"{where}.", ""))
        if port_name:
            dns_label(port_name, f"{where}.name")
        if port_name in seen:
            raise Malformed(f"{where}.name: duplicate port name {port_name!r}")
        seen.add(port_name)
        protocol = _field(port, "protocol", str, f"{where}.", "TCP")
        if protocol not in PROTOCOLS:
            raise Malformed(f"{where}.protocol: unknown protocol {protocol!r}")
        number = port_number(port.get("port"), f"{where}.port")
        node_port = port.get("nodePort") or 0
        if node_port:
            node_port = port_number(node_port, f"{where}.nodePort")
        if protocol == "SCTP":
            sctp.append(ServicePortName(namespace, name, port_name))
            continue
        infos.append(
            ServicePortInfo(
                name=ServicePortName(namespace, name, port_name, Protocol(protocol)),
                port=number,
                cluster_ips=cluster_ips,
                node_port=node_port if kind in _EXTERNALLY_ACCESSIBLE_TYPES else 0,
                external_ips=tuple(external_ips),
                load_balancer_ips=tuple(ingress_ips),
                client_ip_affinity=affinity == "ClientIP",
                affinity_timeout_seconds=timeout,
                internal_traffic_local=internal_local,
                external_traffic_local=external_local,
                health_check_node_port=health_port,
                proxy_protocol=proxy_protocol if protocol == "TCP" else 0,
                balancing=balancing,
            )
        )
    if proxy_protocol and any(i.protocol is Protocol.UDP for i in infos):
        problems += (f"{ANNOTATION_PROXY_PROTOCOL} applies to TCP ports only; UDP ports get none",)
    return tuple(infos), tuple(sctp), problems


def _proxy_protocol(meta: Mapping[str, Any]) -> tuple[int, tuple[str, ...]]:
    """The PROXY protocol version the Service's annotation asks for (0: none), and why not."""
    annotations = meta.get("annotations")
    if not isinstance(annotations, Mapping) or ANNOTATION_PROXY_PROTOCOL not in annotations:
        return 0, ()
    value = annotations[ANNOTATION_PROXY_PROTOCOL]
    version = PROXY_PROTOCOL_VERSIONS.get(value) if isinstance(value, str) else None
    if version is None:
        return 0, (
            f"annotation {ANNOTATION_PROXY_PROTOCOL}: {value!r} is not v1 or v2;"
            " proxying without a PROXY protocol header",
        )
    return version, ()


def balancing_annotations(meta: Mapping[str, Any]) -> tuple[BalancingOverrides, tuple[str, ...]]:
    """The scheduler and outlier settings a Service's annotations set, and the problems with
    them (each: the annotation, its value, and that the default is used)."""
    annotations = meta.get("annotations")
    if not isinstance(annotations, Mapping):
        return NO_OVERRIDES, ()
    problems: list[str] = []
    scheduler: str | None = None
    failures: int | None = None
    seconds: float | None = None
    if ANNOTATION_SCHEDULER in annotations:
        value = annotations[ANNOTATION_SCHEDULER]
        scheduler, problem = scheduler_named(value if isinstance(value, str) else repr(value))
        if problem is not None:
            problems.append(f"annotation {ANNOTATION_SCHEDULER}: {problem}")
    if ANNOTATION_OUTLIER_FAILURES in annotations:
        value = annotations[ANNOTATION_OUTLIER_FAILURES]
        text = value.strip() if isinstance(value, str) else ""
        if text.isdigit() and int(text) <= MAX_OUTLIER_FAILURES:
            failures = int(text)
        else:
            problems.append(
                f"annotation {ANNOTATION_OUTLIER_FAILURES}: {value!r} is not a whole number"
                f" from 0 to {MAX_OUTLIER_FAILURES}; using the proxy's default"
            )
    if ANNOTATION_OUTLIER_BASE_EJECTION in annotations:
        value = annotations[ANNOTATION_OUTLIER_BASE_EJECTION]
        seconds = _seconds(value)
        if seconds is None or not 0 < seconds <= MAX_EJECTION_SECONDS:
            problems.append(
                f"annotation {ANNOTATION_OUTLIER_BASE_EJECTION}: {value!r} is not a duration"
                f" from 1ms to {MAX_EJECTION_SECONDS:g}s (e.g. 30s); using the proxy's default"
            )
            seconds = None
    if scheduler is None and failures is None and seconds is None:
        return NO_OVERRIDES, tuple(problems)
    return BalancingOverrides(scheduler, failures, seconds), tuple(problems)


def _seconds(value: Any) -> float | None:
    """A Go duration (`30s`, `1m30s`, `500ms`) or a bare number of seconds; None if neither."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    total, pos = 0.0, 0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            return None
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    return total if pos and pos == len(text) else None


def _policy(spec: Mapping[str, Any], key: str) -> bool:
    value = _field(spec, key, str, "spec.", "Cluster")
    if value not in {"Cluster", "Local"}:
        raise Malformed(f"spec.{key}: unknown policy {value!r}")
    return value == "Local"


# -- EndpointSlice ----------------------------------------------------------------------------


class Skip(Exception):
    """A well-formed slice the proxy does not use (FQDN, or no owning Service)."""

    def __init__(self, reason: str, *, quiet: bool = False) -> None:
        super().__init__(reason)
        self.quiet = quiet


def parse_slice(obj: Mapping[str, Any], key: Key, *, loopback: bool = False) -> Slice:
    """The ports and endpoints of one EndpointSlice; raises Skip or Malformed.

    Endpoints on addresses that are never proxied (`addresses.forbidden_kind`) are dropped, each
    logged and counted; `loopback` lets loopback ones through (manifests for the demo, tests).
    """
    meta = _mapping(obj, "metadata", "")
    service = _labels(meta).get(LABEL_SERVICE_NAME)
    if not service:
        raise Skip(f"no {LABEL_SERVICE_NAME} label", quiet=True)
    service = sys.intern(service)
    address_type = _field(obj, "addressType", str, "", "")
    if address_type == "FQDN":
        raise Skip("addressType FQDN is not proxied")
    if address_type not in {"IPv4", "IPv6"}:
        raise Malformed(f"addressType: {address_type!r} is not IPv4, IPv6 or FQDN")
    version = 4 if address_type == "IPv4" else 6

    ports: list[tuple[str, Protocol, int]] = []
    for i, port in enumerate(_items(obj, "ports", "")):
        where = f"ports[{i}]"
        if not isinstance(port, Mapping):
            raise Malformed(f"{where}: expected an object, got {port!r}")
        port_name = sys.intern(_field(port, "name", str, f"{where}.", ""))
        if port_name:
            dns_label(port_name, f"{where}.name")
        protocol = _field(port, "protocol", str, f"{where}.", "TCP")
        if protocol not in PROTOCOLS:
            raise Malformed(f"{where}.protocol: unknown protocol {protocol!r}")
        if port.get("port") is None:
            continue  # "not restricted": kube-proxy has no port to send to either
        number = port_number(port["port"], f"{where}.port")
        if protocol != "SCTP":
            ports.append((port_name, Protocol(protocol), number))

    endpoints: list[Endpoint] = []
    first = ports[0][2] if ports else 0
    dropped: list[tuple[str, str]] = []
    for i, endpoint in enumerate(_items(obj, "endpoints", "")):
        where = f"endpoints[{i}]"
        if not isinstance(endpoint, Mapping):
            raise Malformed(f"{where}: expected an object, got {endpoint!r}")
        addresses = _items(endpoint, "addresses", f"{where}.")
        if not addresses:
            raise Malformed(f"{where}.addresses is empty")
        # kube-proxy uses the first address only; the others are the same pod.
        ip = sys.intern(ip_address(addresses[0], f"{where}.addresses[0]", version))
        usable = _usable_ip(
            ip, f"{where}.addresses[0]", "EndpointSlice", key, "endpoint", loopback=loopback
        )
        if usable is None:
            dropped.append((ip, f"a {_address_kind(ip)} address is never proxied"))
            continue
        conditions = _mapping(endpoint, "conditions", f"{where}.")
        cwhere = f"{where}.conditions."
        ready = _field(conditions, "ready", bool, cwhere, True)  # nil ready means ready
        serving = _field(conditions, "serving", bool, cwhere, ready)  # nil defers to ready
        terminating = _field(conditions, "terminating", bool, cwhere, False)
        node_name = sys.intern(_field(endpoint, "nodeName", str, f"{where}.", "")) or None
        hints = _mapping(endpoint, "hints", f"{where}.")
        endpoints.append(
            Endpoint(
                ip,
                first,
                ready,
                serving,
                terminating,
                node_name,
                _hint_names(hints, "forNodes", f"{where}.hints."),
                _hint_names(hints, "forZones", f"{where}.hints."),
            )
        )
    return Slice((key[0], service), tuple(ports), tuple(endpoints), tuple(dropped))


def _family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


def _address_kind(ip: str) -> str | None:
    """`addresses.forbidden_kind` of a canonical address, not counted."""
    return addresses.forbidden_kind(socket.inet_pton(_family(ip), ip))


def _hint_names(hints: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    """The names in `hints.forNodes` or `hints.forZones` (each item `{name: ...}`)."""
    names: list[str] = []
    for i, hint in enumerate(_items(hints, key, where)):
        if not isinstance(hint, Mapping):
            raise Malformed(f"{where}{key}[{i}]: expected an object, got {hint!r}")
        name = _field(hint, "name", str, f"{where}{key}[{i}].", "")
        if not name:
            raise Malformed(f"{where}{key}[{i}].name is missing")
        if name not in names:
            names.append(sys.intern(name))
    return tuple(names)


def trigger_time(obj: Mapping[str, Any]) -> float | None:
    """The slice's last-change-trigger-time annotation as epoch seconds, if valid."""
    meta = obj.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    value = annotations.get(ANNOTATION_TRIGGER_TIME) if isinstance(annotations, Mapping) else None
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        log.debug("EndpointSlice %s: bad %s %r", describe(obj), ANNOTATION_TRIGGER_TIME, value)
        return None


# -- Node -----------------------------------------------------------------------------------


def parse_node(node: Mapping[str, Any]) -> NodeFacts:
    """The own Node's IPs, eligibility, zone and podCIDRs; raises Malformed naming a bad field."""
    meta = _mapping(node, "metadata", "")
    zone = _labels(meta).get(LABEL_TOPOLOGY_ZONE) or ""
    eligible = not meta.get("deletionTimestamp")
    for i, taint in enumerate(_items(_mapping(node, "spec", ""), "taints", "spec.")):
        if not isinstance(taint, Mapping):
            raise Malformed(f"spec.taints[{i}]: expected an object, got {taint!r}")
        if taint.get("key") == TAINT_TO_BE_DELETED:
            eligible = False
    listed = _items(_mapping(node, "status", ""), "addresses", "status.")
    for i, address in enumerate(listed):
        where = f"status.addresses[{i}]"
        if not isinstance(address, Mapping):
            raise Malformed(f"{where}: expected an object, got {address!r}")
        if address.get("type") in {"InternalIP", "ExternalIP"}:
            ip_address(address.get("address"), f"{where}.address")
    return NodeFacts(addresses.node_ips(node), eligible, zone, _pod_cidrs(node))


def _pod_cidrs(node: Mapping[str, Any]) -> tuple[str, ...]:
    """The Node's spec.podCIDRs (spec.podCIDR when only that is set); malformed ones left out."""
    spec = node.get("spec")
    if not isinstance(spec, Mapping):
        return ()
    listed = spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    cidrs = []
    for cidr in listed if isinstance(listed, list) else []:
        try:
            cidrs.append(str(ipaddress.ip_network(str(cidr), strict=False)))
        except ValueError:
            log.debug("Node: bad podCIDR %r", cidr)
    return tuple(cidrs)
