"""ProxyConfig: built-in defaults < KubeProxyConfiguration file (`--config`) < command-line flags.

Durations are written Go-style (`250ms`, `1m30s`) in files and flags alike, as kube-proxy does.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from kube_userspace_proxy import logs
from kube_userspace_proxy.errors import ConfigError

log = logs.get(__name__)

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def parse_duration(text: str | float | int) -> float:
    """Parse a Go duration (`1h2m3.5s`, `250ms`, `0`) into seconds; numbers are seconds."""
    if isinstance(text, bool):
        raise ValueError(f"invalid duration {text!r}")
    if isinstance(text, int | float):
        if text < 0:
            raise ValueError(f"invalid duration {text!r}: negative")
        return float(text)
    s = text.strip()
    if s in {"0", ""}:
        return 0.0
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(s):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    if pos != len(s) or pos == 0:
        raise ValueError(f"invalid duration {text!r} (expected e.g. 250ms, 30s, 1m30s)")
    return total


def format_duration(seconds: float) -> str:
    """Render seconds the way Go prints short durations (`250ms`, `30s`, `15m0s`)."""
    if seconds < 1 and seconds != 0:
        return f"{seconds * 1000:g}ms"
    minutes, secs = divmod(seconds, 60)
    if minutes >= 1:
        hours, minutes = divmod(minutes, 60)
        head = f"{int(hours)}h" if hours else ""
        return f"{head}{int(minutes)}m{secs:g}s"
    return f"{secs:g}s"


def split_host_port(text: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); raises ValueError."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"invalid address {text!r}: expected [host]:port")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError(f"invalid address {text!r}: expected host:port")
    if host:
        ipaddress.ip_address(host)
    number = int(port)
    if not 0 <= number <= 65535:
        raise ValueError(f"invalid port in {text!r}")
    return host or "0.0.0.0", number


Backend = Literal["auto", "iptc", "restore", "none"]
MAX_WORKERS = 64
AUTO_WORKERS_MAX = 4


class ProxyConfig(BaseModel):
    """Everything the proxy is configured with; frozen once built."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    bind_address: str = "0.0.0.0"
    """IP the proxy ports listen on; 0.0.0.0: all IPv4 addresses, `::`: both families."""
    proxy_port_range: str = ""
    """Proxy ports: `begin-end`, `begin+offset`, one port, or empty/`0-0` (kernel-chosen)."""
    udp_idle_timeout: float = 0.25
    """Seconds a UDP client session lives after its last packet in either direction."""
    sync_period: float = 30.0
    """Seconds between full resyncs of listeners and rules (`--iptables-sync-period`)."""
    min_sync_period: float = 1.0
    """Minimum seconds between two syncs; changes arriving faster are coalesced."""
    config_sync_period: float = 900.0
    """Seconds between full relists of Services and EndpointSlices from the API server."""
    healthz_bind_address: str = "0.0.0.0:10256"
    """host:port of /healthz and /livez; empty disables."""
    metrics_bind_address: str = "127.0.0.1:10249"
    """host:port of /metrics, /proxyMode, /configz and /debug/state; empty disables."""
    hostname_override: str = ""
    """This node's name; default: $NODE_NAME, then the hostname."""
    kubeconfig: str = ""
    """Path of a kubeconfig file; default: $KUBECONFIG, then in-cluster config."""
    master: str = ""
    """API server URL, overriding the kubeconfig's."""
    kube_api_qps: float = 5.0
    """Requests per second to the API server (client-side limit)."""
    kube_api_burst: int = 10
    """Burst of requests allowed above kube_api_qps."""
    nodeport_addresses: tuple[str, ...] = ()
    """CIDRs whose local addresses answer NodePorts; empty: every local address."""
    cluster_cidr: str = ""
    """The cluster's Pod CIDR (informational; shown in /configz)."""
    service_proxy_name: str = ""
    """Handle only Services labelled service.kubernetes.io/service-proxy-name=<this>."""
    iptables_backend: Backend = "auto"
    """auto (the host's mode), iptc (python-iptables, legacy), restore, or none (no rules)."""
    node_ips: tuple[str, ...] = ()
    """Node IPs for host-side DNAT; default: the Node object's addresses."""
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    """Event loop implementation."""
    log_format: Literal["text", "json"] = "text"
    """Log line format."""
    verbosity: int = 0
    """klog-style verbosity; 4 and above logs every connection."""
    shutdown_grace: float = 5.0
    """Seconds open connections may take to finish after SIGTERM/SIGINT."""
    manifests: tuple[str, ...] = ()
    """Manifest files or directories to serve instead of a cluster."""
    workers: str = "auto"
    """Data-plane worker processes: a count, or auto (the CPUs this process may use, at most 4);
    1 serves from the control process itself."""

    @field_validator("bind_address")
    @classmethod
    def _check_ip(cls, value: str) -> str:
        ipaddress.ip_address(value)
        return value

    @field_validator("healthz_bind_address", "metrics_bind_address")
    @classmethod
    def _check_host_port(cls, value: str) -> str:
        if value and value != "0":
            split_host_port(value)
        return value

    @field_validator("nodeport_addresses")
    @classmethod
    def _check_cidrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for cidr in value:
            ipaddress.ip_network(cidr, strict=False)
        return value

    @field_validator("node_ips")
    @classmethod
    def _check_ips(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for ip in value:
            ipaddress.ip_address(ip)
        return value

    @field_validator("cluster_cidr")
    @classmethod
    def _check_cluster_cidr(cls, value: str) -> str:
        for cidr in filter(None, value.split(",")):
            ipaddress.ip_network(cidr, strict=False)
        return value

    @field_validator("proxy_port_range")
    @classmethod
    def _check_range(cls, value: str) -> str:
        check_port_range(value)
        return value

    @field_validator(
        "udp_idle_timeout",
        "sync_period",
        "min_sync_period",
        "config_sync_period",
        "shutdown_grace",
        mode="before",
    )
    @classmethod
    def _duration(cls, value: Any) -> float:
        return parse_duration(value)

    @field_validator("workers", mode="before")
    @classmethod
    def _check_workers(cls, value: Any) -> str:
        text = str(value).strip().lower()
        if text != "auto" and not (text.isdigit() and 1 <= int(text) <= MAX_WORKERS):
            raise ValueError(f"must be 'auto' or a whole number from 1 to {MAX_WORKERS}")
        return text

    @property
    def worker_count(self) -> int:
        """`workers` resolved: `auto` is the CPUs this process may run on, at most 4."""
        if self.workers == "auto":
            return max(1, min(AUTO_WORKERS_MAX, len(os.sched_getaffinity(0))))
        return int(self.workers)

    @field_validator("sync_period")
    @classmethod
    def _positive(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be greater than 0")
        return value


def check_port_range(text: str) -> None:
    """Validate kube-proxy's port-range syntax (the allocator parses it again)."""
    s = text.strip()
    if s in {"", "0-0"}:
        return
    match = re.fullmatch(r"(\d+)(?:([-+])(\d+))?", s)
    if not match:
        raise ValueError(f"invalid port range {text!r}: expected begin-end, begin+offset or a port")
    begin = int(match.group(1))
    end = begin
    if match.group(2) == "-":
        end = int(match.group(3))
    elif match.group(2) == "+":
        end = begin + int(match.group(3))
    if not (1 <= begin <= end <= 65535):
        raise ValueError(
            f"invalid port range {text!r}: ports must satisfy 1 <= begin <= end <= 65535"
        )


# KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1): the fields we map, and the fields
# a kube-proxy ConfigMap may carry that mean nothing to userspace mode (accepted, ignored).
_FILE_FIELDS: dict[str, str] = {
    "bindAddress": "bind_address",
    "healthzBindAddress": "healthz_bind_address",
    "metricsBindAddress": "metrics_bind_address",
    "portRange": "proxy_port_range",
    "udpIdleTimeout": "udp_idle_timeout",
    "configSyncPeriod": "config_sync_period",
    "hostnameOverride": "hostname_override",
    "nodePortAddresses": "nodeport_addresses",
    "clusterCIDR": "cluster_cidr",
}
_IGNORED_TOP = {
    "apiVersion",
    "kind",
    "featureGates",
    "bindAddressHardFail",
    "enableProfiling",
    "showHiddenMetricsForVersion",
    "ipvs",
    "nftables",
    "winkernel",
    "detectLocalMode",
    "detectLocal",
    "oomScoreAdj",
    "conntrack",
    "logging",
    "windowsRunAsService",
    "linux",
    "mode",
    "iptables",
    "clientConnection",
}
_IPTABLES_FIELDS = {"syncPeriod", "minSyncPeriod", "masqueradeAll", "masqueradeBit"}
_IPTABLES_FIELDS |= {"localhostNodePorts"}
_CLIENT_FIELDS = {"kubeconfig", "qps", "burst", "acceptContentTypes", "contentType"}
API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a KubeProxyConfiguration file into ProxyConfig values; ConfigError names the field."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror}") from exc
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"--config {path}:{where}: not valid YAML") from exc
    if doc is None:
        return {}
    if not isinstance(doc, Mapping):
        raise ConfigError(f"--config {path}: expected a KubeProxyConfiguration object")
    return config_from_document(doc, source=str(path))


def config_from_document(doc: Mapping[str, Any], *, source: str = "config") -> dict[str, Any]:
    """Map a KubeProxyConfiguration document to ProxyConfig field values."""

    def fail(field: str, reason: str) -> ConfigError:
        return ConfigError(f"{source}: field {field}: {reason}")

    kind = doc.get("kind", "KubeProxyConfiguration")
    if kind != "KubeProxyConfiguration":
        raise fail("kind", f"expected KubeProxyConfiguration, got {kind!r}")
    version = doc.get("apiVersion", API_VERSION)
    if version != API_VERSION:
        raise fail("apiVersion", f"expected {API_VERSION}, got {version!r}")
    mode = doc.get("mode") or ""
    if mode not in {"", "userspace"}:
        raise fail(
            "mode", f"{mode!r} is not supported: this proxy is userspace mode (use '' or userspace)"
        )
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in _FILE_FIELDS:
            if value in (None, ""):
                continue
            name = _FILE_FIELDS[key]
            if name == "nodeport_addresses":
                if not isinstance(value, list):
                    raise fail(key, "expected a list of CIDRs")
                # kube-proxy >= 1.29 accepts "primary" (the node IPs); here CIDRs only.
                if "primary" in value:
                    log.warning(
                        "%s: nodePortAddresses 'primary' is not supported; give the node's "
                        "CIDRs instead (NodePorts answer on every local address otherwise)",
                        source,
                    )
                out[name] = tuple(str(v) for v in value if v != "primary")
            else:
                out[name] = value
        elif key not in _IGNORED_TOP:
            raise fail(key, "unknown field")
    for section, known, mapping in (
        (
            "iptables",
            _IPTABLES_FIELDS,
            {"syncPeriod": "sync_period", "minSyncPeriod": "min_sync_period"},
        ),
        (
            "clientConnection",
            _CLIENT_FIELDS,
            {"kubeconfig": "kubeconfig", "qps": "kube_api_qps", "burst": "kube_api_burst"},
        ),
    ):
        body = doc.get(section) or {}
        if not isinstance(body, Mapping):
            raise fail(section, "expected an object")
        for key, value in body.items():
            if key not in known:
                raise fail(f"{section}.{key}", "unknown field")
            if key in mapping and value not in (None, ""):
                out[mapping[key]] = value
    return out


def build_config(
    file_values: Mapping[str, Any], flag_values: Mapping[str, Any], *, source: str = "config"
) -> ProxyConfig:
    """Merge file values under flag values and validate; ConfigError names the field at fault."""
    merged = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    try:
        return ProxyConfig(**merged)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "?"
        reason = first["msg"].removeprefix("Value error, ")
        value = merged.get(str(first["loc"][0])) if first["loc"] else None
        raise ConfigError(f"{source}: {field}={value!r}: {reason}") from None


def field_doc(name: str) -> str:
    """The docstring written under a ProxyConfig field (used by --help and the README)."""
    return ProxyConfig.model_fields[name].description or ""


DEFAULTS = ProxyConfig()
