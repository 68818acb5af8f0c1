"""KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) read the way kube-proxy reads it.

kubeadm writes every field of the type, unset ones as zero values (`qps: 0`, `syncPeriod: 0s`,
`oomScoreAdj: null`). kube-proxy fills those with its defaults before using them, so a zero here
means "the default" exactly where kube-proxy's defaulting gives one. Fields of releases 1.25 to
1.32 are all known; an unknown field is a warning (kube-proxy decodes strictly, then leniently
with a warning); a `mode` other than userspace is a warning too.

This module knows the document's shape; `fields.py` says which of its fields apply here and
`settings.py` maps them onto ProxyConfig fields.
"""

from __future__ import annotations

import copy
import ipaddress
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from kube_userspace_proxy import logs

log = logs.get(__name__)

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"
GROUP = "kubeproxy.config.k8s.io"
DEFAULT_HEALTHZ_PORT = 10256
DEFAULT_METRICS_PORT = 10249
OOM_SCORE_ADJ = -999
"""kube-proxy's default oom_score_adj (the kubelet's KubeProxyOOMScoreAdj)."""

_LEAF = None
# Every field of v1alpha1 from Kubernetes 1.25 to 1.32 (union of the releases): a nested
# mapping for objects, None for values. `featureGates` is a free-form map.
SCHEMA: dict[str, Any] = {
    "apiVersion": _LEAF,
    "kind": _LEAF,
    "featureGates": _LEAF,
    "clientConnection": dict.fromkeys(
        ("kubeconfig", "acceptContentTypes", "contentType", "qps", "burst")
    ),
    "logging": {
        "format": _LEAF,
        "flushFrequency": _LEAF,
        "verbosity": _LEAF,
        "vmodule": _LEAF,
        "options": {
            "json": dict.fromkeys(("splitStream", "infoBufferSize")),
            "text": dict.fromkeys(("splitStream", "infoBufferSize")),
        },
    },
    "hostnameOverride": _LEAF,
    "bindAddress": _LEAF,
    "healthzBindAddress": _LEAF,
    "metricsBindAddress": _LEAF,
    "bindAddressHardFail": _LEAF,
    "enableProfiling": _LEAF,
    "showHiddenMetricsForVersion": _LEAF,
    "mode": _LEAF,
    "iptables": dict.fromkeys(
        ("masqueradeBit", "masqueradeAll", "localhostNodePorts", "syncPeriod", "minSyncPeriod")
    ),
    "ipvs": dict.fromkeys(
        (
            "syncPeriod",
            "minSyncPeriod",
            "scheduler",
            "excludeCIDRs",
            "strictARP",
            "tcpTimeout",
            "tcpFinTimeout",
            "udpTimeout",
        )
    ),
    "nftables": dict.fromkeys(("masqueradeBit", "masqueradeAll", "syncPeriod", "minSyncPeriod")),
    "winkernel": dict.fromkeys(
        ("networkName", "sourceVip", "enableDSR", "rootHnsEndpointName", "forwardHealthCheckVip")
    ),
    "detectLocalMode": _LEAF,
    "detectLocal": dict.fromkeys(("bridgeInterface", "interfaceNamePrefix")),
    "clusterCIDR": _LEAF,
    "nodePortAddresses": _LEAF,
    "oomScoreAdj": _LEAF,
    "conntrack": dict.fromkeys(
        (
            "maxPerCore",
            "min",
            "tcpEstablishedTimeout",
            "tcpCloseWaitTimeout",
            "tcpBeLiberal",
            "udpTimeout",
            "udpStreamTimeout",
        )
    ),
    "configSyncPeriod": _LEAF,
    "portRange": _LEAF,
    "udpIdleTimeout": _LEAF,
    "windowsRunAsService": _LEAF,
}


def is_zero(value: Any) -> bool:
    """Go's zero value as YAML shows it: null, "", 0, false, "0s", an empty list or map."""
    if value is None or value is False or value == 0:
        return True
    if isinstance(value, str):
        return value.strip() in {"", "0", "0s"}
    return isinstance(value, list | dict) and not value


def with_port(address: str, port: int) -> str:
    """kube-proxy's AppendPortIfNeeded: a bare IP gets `port` (IPv6 in brackets)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address  # host:port already (or invalid: validation names it later)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _is_ipv6(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).version == 6
    except ValueError:
        return False


def _default(
    section: dict[str, Any], key: str, value: Any, *, when_none_only: bool = False
) -> None:
    current = section.get(key)
    if current is None if when_none_only else is_zero(current):
        section[key] = value


def set_defaults(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `doc` with kube-proxy's v1alpha1 defaults filled in where the value is zero.

    Pointer fields (`oomScoreAdj`, `masqueradeBit`, `conntrack.min`, ...) are defaulted only when
    null, as in Go, where an explicit 0 is a value.
    """
    out: dict[str, Any] = copy.deepcopy(dict(doc))
    for name, shape in SCHEMA.items():
        if isinstance(shape, dict) and not isinstance(out.get(name), dict):
            out[name] = {}
    out["apiVersion"], out["kind"] = API_VERSION, KIND
    _default(out, "bindAddress", "0.0.0.0")
    v6 = _is_ipv6(out["bindAddress"])
    for key, host, port in (
        ("healthzBindAddress", "[::]" if v6 else "0.0.0.0", DEFAULT_HEALTHZ_PORT),
        ("metricsBindAddress", "[::1]" if v6 else "127.0.0.1", DEFAULT_METRICS_PORT),
    ):
        value = out.get(key)
        out[key] = f"{host}:{port}" if is_zero(value) else with_port(str(value), port)
    _default(out, "oomScoreAdj", OOM_SCORE_ADJ, when_none_only=True)
    iptables, ipvs, nft = out["iptables"], out["ipvs"], out["nftables"]
    for section in (iptables, ipvs, nft):
        _default(section, "syncPeriod", "30s")
    for section in (iptables, nft):
        _default(section, "minSyncPeriod", "1s")
        _default(section, "masqueradeBit", 14, when_none_only=True)
    _default(iptables, "localhostNodePorts", True, when_none_only=True)
    _default(out, "udpIdleTimeout", "250ms")
    conntrack = out["conntrack"]
    _default(conntrack, "maxPerCore", 32 * 1024, when_none_only=True)
    _default(conntrack, "min", 128 * 1024, when_none_only=True)
    _default(conntrack, "tcpEstablishedTimeout", "24h0m0s", when_none_only=True)
    _default(conntrack, "tcpCloseWaitTimeout", "1h0m0s", when_none_only=True)
    _default(out, "configSyncPeriod", "15m0s")
    client = out["clientConnection"]
    _default(client, "contentType", "application/vnd.kubernetes.protobuf")
    _default(client, "qps", 5)
    _default(client, "burst", 10)
    if out.get("featureGates") is None:
        out["featureGates"] = {}
    logging = out["logging"]
    _default(logging, "format", "text")
    _default(logging, "flushFrequency", "5s")
    _default(logging, "verbosity", 0, when_none_only=True)
    return out


def _walk(
    doc: Mapping[str, Any], schema: Mapping[str, Any], prefix: str = ""
) -> Iterator[tuple[str, Any, bool]]:
    """(dotted path, value, known) for every leaf of `doc`; unknown keys are reported as leaves."""
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if key not in schema:
            yield path, value, False
        elif isinstance(schema[key], dict) and isinstance(value, Mapping):
            yield from _walk(value, schema[key], f"{path}.")
        else:
            yield path, value, True


def strip_unknown(doc: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """`doc` without unknown fields; one warning names them (kube-proxy's lenient decode)."""
    unknown = [path for path, _, known in _walk(doc, SCHEMA) if not known]
    if unknown:
        log.warning(
            "%s: unknown field(s) %s ignored (not part of %s up to Kubernetes 1.32)",
            source,
            ", ".join(sorted(unknown)),
            API_VERSION,
        )

    def keep(body: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in body.items():
            if key not in schema:
                continue
            sub = schema[key]
            out[key] = (
                keep(value, sub) if isinstance(sub, dict) and isinstance(value, Mapping) else value
            )
        return out

    return keep(doc, SCHEMA)


def not_applicable(doc: Mapping[str, Any], applied: Collection[str]) -> list[str]:
    """Known fields that carry a value (not zero) but are not `applied` (dotted paths, each
    with what is under it): they mean nothing to userspace mode."""
    found = []
    for path, value, known in _walk(doc, SCHEMA):
        applies = path in applied or any(path.startswith(f"{a}.") for a in applied)
        if known and not applies and not is_zero(value):
            found.append(path)
    return sorted(found)


def get(doc: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path, or None."""
    node: Any = doc
    for part in path.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node
