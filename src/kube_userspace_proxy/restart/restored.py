"""The entries of a restored state (the state file, or what a handover passed), checked as
the API's objects are (`cluster.objects`' checks): a restored endpoint gets the same address
policy as one from an EndpointSlice, and every field the same type and range.

A file is written by this proxy, but read back from a directory that outlives it: whatever
is in it is taken for untrusted input. A bad entry is dropped alone, with one warning naming
it and the field; the rest of the state is served.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

from kube_userspace_proxy import logs
from kube_userspace_proxy.cluster.objects import (
    MAX_AFFINITY_TIMEOUT,
    Malformed,
    dns_label,
    forbidden_kind,
    ip_address,
    port_number,
)
from kube_userspace_proxy.model import (
    SCHEDULERS,
    BalancingOverrides,
    Endpoint,
    Protocol,
    ServicePortInfo,
    ServicePortName,
)

log = logs.get(__name__)

OBJECT_KIND = "StateFile"
"""The object kind restored addresses of a forbidden kind are counted under
(`forbidden_addresses_total{kind="StateFile"}`)."""

ServicePortKey = tuple[str, str, str]
"""(`ns/name:port`, protocol, path): a proxy port's line."""


def dropped(what: str, exc: Exception) -> None:
    """The one warning for an entry left out."""
    log.warning("state: dropping %s: %s", what, exc)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise Malformed(f"{where}: expected a boolean, got {value!r}")
    return value


def _optional_port(value: Any, where: str) -> int:
    return 0 if value == 0 and not isinstance(value, bool) else port_number(value, where)


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise Malformed(f"{where}: expected a list, got {value!r}")
    return value


def _cluster_ips(value: Any, where: str) -> tuple[str, ...]:
    ips = tuple(ip_address(ip, f"{where}[{i}]") for i, ip in enumerate(_list(value, where)))
    if not ips:
        raise Malformed(f"{where}: empty")
    for i, ip in enumerate(ips):  # as for a Service: such a ClusterIP skips it whole
        if (bad := forbidden_kind(ip, OBJECT_KIND, "clusterIP")) is not None:
            raise Malformed(f"{where}[{i}]: {ip} is a {bad} address")
    return ips


def _address_list(field: str) -> Callable[[Any, str, str], tuple[str, ...]]:
    def check(value: Any, where: str, name: str) -> tuple[str, ...]:
        kept = []
        for i, raw in enumerate(_list(value, where)):
            ip = ip_address(raw, f"{where}[{i}]")
            if (bad := forbidden_kind(ip, OBJECT_KIND, field)) is not None:
                dropped(f"{name} {where}[{i}] {ip}", Malformed(f"a {bad} address"))
                continue
            kept.append(ip)
        return tuple(kept)

    return check


def _timeout(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Malformed(f"{where}: expected an integer, got {value!r}")
    if not 0 < value <= MAX_AFFINITY_TIMEOUT:
        raise Malformed(f"{where}: {value} is not in 1-{MAX_AFFINITY_TIMEOUT}")
    return value


def _proxy_protocol(value: Any, where: str) -> int:
    if isinstance(value, bool) or value not in (0, 1, 2):
        raise Malformed(f"{where}: {value!r} is not 0, 1 or 2")
    return int(value)


def _balancing(value: Any, where: str) -> BalancingOverrides:
    """[scheduler, outlier failures, base ejection seconds], each null for the default."""
    if not isinstance(value, list) or len(value) != 3:
        raise Malformed(f"{where}: expected [scheduler, failures, seconds], got {value!r}")
    scheduler, failures, seconds = value
    if scheduler is not None and scheduler not in SCHEDULERS:
        raise Malformed(f"{where}[0]: {scheduler!r} is not one of {', '.join(SCHEDULERS)}")
    if failures is not None and (
        isinstance(failures, bool) or not isinstance(failures, int) or failures < 0
    ):
        raise Malformed(f"{where}[1]: {failures!r} is not a whole number >= 0")
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0
    ):
        raise Malformed(f"{where}[2]: {seconds!r} is not a number of seconds > 0")
    return BalancingOverrides(scheduler, failures, None if seconds is None else float(seconds))


def _plain(check: Callable[[Any, str], Any]) -> Callable[[Any, str, str], Any]:
    return lambda value, where, _: check(value, where)


INFO_CHECKS: dict[str, Callable[[Any, str, str], Any]] = {
    "port": _plain(port_number),
    "cluster_ips": _plain(_cluster_ips),
    "node_port": _plain(_optional_port),
    "external_ips": _address_list("externalIP"),
    "load_balancer_ips": _address_list("loadBalancerIP"),
    "client_ip_affinity": _plain(_bool),
    "affinity_timeout_seconds": _plain(_timeout),
    "internal_traffic_local": _plain(_bool),
    "external_traffic_local": _plain(_bool),
    "health_check_node_port": _plain(_optional_port),
    "proxy_protocol": _plain(_proxy_protocol),
    "balancing": _plain(_balancing),
}
"""One check per field of ServicePortInfo but its name (`port` and `cluster_ips` required;
any other missing keeps its default: a field the file predates)."""
MAX_NAME = 253
"""The longest node or zone name kept (a DNS subdomain's limit)."""
_REQUIRED = frozenset({"port", "cluster_ips"})


def service_port_name(raw: Any) -> ServicePortName:
    """A service port's name ([namespace, name, port name, protocol]) as the API allows it."""
    if not isinstance(raw, list) or len(raw) != 4:
        raise Malformed(f"name: expected [namespace, name, port, protocol], got {raw!r}")
    namespace, name, port, protocol = raw
    if protocol not in ("TCP", "UDP"):  # SCTP is never served
        raise Malformed(f"name[3]: {protocol!r} is not TCP or UDP")
    if port != "":
        dns_label(port, "name[2]")
    return ServicePortName(
        dns_label(namespace, "name[0]"), dns_label(name, "name[1]"), port, Protocol(protocol)
    )


def service_port_info(name: ServicePortName, raw: Any) -> ServicePortInfo:
    """The info of the service port `name`, every field checked; Malformed naming the first
    bad one."""
    if not isinstance(raw, dict):
        raise Malformed(f"info: expected an object, got {raw!r}")
    values: dict[str, Any] = {"name": name}
    for field, check in INFO_CHECKS.items():
        if field in raw:
            values[field] = check(raw[field], f"info.{field}", str(name))
        elif field in _REQUIRED:
            raise Malformed(f"info.{field} is missing")
    if name.protocol is not Protocol.TCP:
        values["proxy_protocol"] = 0
    return ServicePortInfo(**values)


def endpoints(name: ServicePortName, raw: Any, *, loopback: bool) -> tuple[Endpoint, ...]:
    """The service port's endpoints; one of a forbidden address kind (loopback unless
    `loopback`) or malformed is dropped alone, with a warning."""
    kept = []
    for i, item in enumerate(_list(raw, "endpoints")):
        where = f"endpoints[{i}]"
        try:
            endpoint = _endpoint(item, where)
            bad = forbidden_kind(endpoint.ip, OBJECT_KIND, "endpoint", loopback=loopback)
            if bad is not None:
                raise Malformed(f"{where}[0]: {endpoint.ip} is a {bad} address, never proxied")
        except Malformed as exc:
            dropped(f"an endpoint of {name}", exc)
            continue
        kept.append(endpoint)
    return tuple(kept)


def _endpoint(raw: Any, where: str) -> Endpoint:
    if not isinstance(raw, list) or len(raw) not in (6, 8):
        raise Malformed(
            f"{where}: expected [ip, port, ready, serving, terminating, node(, node hints,"
            " zone hints)]"
        )
    ip, port, ready, serving, terminating, node, *hints = raw
    if node is not None and not isinstance(node, str):
        raise Malformed(f"{where}[5]: expected a node name, got {node!r}")
    node_hints, zone_hints = hints or ([], [])
    return Endpoint(
        ip_address(ip, f"{where}[0]"),
        port_number(port, f"{where}[1]"),
        _bool(ready, f"{where}[2]"),
        _bool(serving, f"{where}[3]"),
        _bool(terminating, f"{where}[4]"),
        node,
        _names(node_hints, f"{where}[6]"),
        _names(zone_hints, f"{where}[7]"),
    )


def _names(value: Any, where: str) -> tuple[str, ...]:
    """Topology hints: a list of node or zone names."""
    items = _list(value, where)
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item or len(item) > MAX_NAME:
            raise Malformed(f"{where}[{i}]: expected a node or zone name, got {item!r}")
    return tuple(items)


def pod_cidrs(raw: Any) -> tuple[str, ...]:
    """The own Node's podCIDRs, canonical (absent: none, a file that predates them); one that
    is not a CIDR is dropped alone, with a warning."""
    if raw is None:
        return ()
    try:
        items = _list(raw, "podCIDRs")
    except Malformed as exc:
        dropped("the podCIDRs", exc)
        return ()
    kept = []
    for i, item in enumerate(items):
        try:
            kept.append(_cidr(item, f"podCIDRs[{i}]"))
        except Malformed as exc:
            dropped("a podCIDR", exc)
    return tuple(kept)


def _cidr(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise Malformed(f"{where}: expected a CIDR, got {value!r:.80}")
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError:
        raise Malformed(f"{where}: {value!r:.80} is not a CIDR") from None


def proxy_port(raw: Any) -> tuple[ServicePortKey, int]:
    """One proxy port's line: ((`ns/name:port`, protocol, path), port)."""
    if not isinstance(raw, list) or len(raw) != 4:
        raise Malformed(f"expected [service port, protocol, path, port], got {raw!r}")
    name, protocol, path, port = raw
    if not all(isinstance(part, str) for part in (name, protocol, path)):
        raise Malformed(f"{raw!r}: the service port, protocol and path are strings")
    return (name, protocol, path), port_number(port, "port")
