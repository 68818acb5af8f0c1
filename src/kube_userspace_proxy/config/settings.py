"""ProxyConfig: built-in defaults < KubeProxyConfiguration file (`--config`) < command-line flags.

Durations are written Go-style (`250ms`, `1m30s`) in files and flags alike, as kube-proxy does.
"""

from __future__ import annotations

import copy
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from kube_userspace_proxy import logs
from kube_userspace_proxy.addresses import NODEPORT_PRIMARY
from kube_userspace_proxy.config import kubeproxy as kpc
from kube_userspace_proxy.config import validation
from kube_userspace_proxy.config.fields import APPLIED_PATHS, FILE_FIELDS
from kube_userspace_proxy.errors import ConfigError, InvalidConfigError
from kube_userspace_proxy.model import (
    MAX_EJECTION_SECONDS,
    MAX_OUTLIER_FAILURES,
    Balancing,
    SourcePolicy,
    scheduler_named,
)

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
TRANSPARENT_MARK = 0x1000
"""--transparent-mark's default: bit 12. kube-proxy uses 0x4000 and 0x8000, CNI portmap 0x2000,
Calico 0xffff0000 (iptablesMarkMask), Cilium 0x0f00 (magic marks) and identities above 16
bits, Weave 0x20000/0x40000, Istio 0x539 (1337) and 0x10-0x200, AWS VPC CNI 0x80."""
TRANSPARENT_TABLE = 4040
"""--transparent-table's default. Taken elsewhere: 1-250 (Calico's routeTableRange), 52
(Tailscale), 77-79 (kube-router), 100-103 and 133 (Istio), 2004-2006 and 2050+ (Cilium),
2..N (AWS VPC CNI, one per ENI); 253-255 are the kernel's default, main and local."""
_RESERVED_MARKS = 0xC000  # kube-proxy's masquerade and drop bits
UNSPECIFIED_BIND = "0.0.0.0"
"""A config file's `bindAddress` that leaves the bind address unspecified (kube-proxy's default;
kubeadm writes it): the proxy then serves the node's families. The flag keeps its literal
meaning."""
MAX_WORKERS = 64
AUTO_WORKERS_MAX = 4


class ProxyConfig(BaseModel):
    """Everything the proxy is configured with; frozen once built."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    bind_address: str = ""
    """IP the proxy ports listen on. Unset (also kubeadm's `bindAddress: 0.0.0.0` in --config):
    every family the node has addresses in, as kube-proxy. Set: literally; 0.0.0.0 IPv4 only,
    `::` both families, any other address only itself."""
    proxy_port_range: str = ""
    """Proxy ports: `begin-end`, `begin+offset`, one port, or empty/`0-0` (the ephemeral range)."""
    udp_idle_timeout: float = 0.25
    """Seconds a UDP client session lives after its last packet in either direction."""
    tcp_keepalive: float = 15.0
    """TCP keepalive on both sides of every proxied connection (default 15s, Go's): the
    first probe after this long idle, then one each as long; the kernel's probe count
    unanswered (or data unacknowledged as long: TCP_USER_TIMEOUT) ends it. 0 turns it off."""
    sync_period: float = 30.0
    """Seconds between full resyncs of listeners and rules."""
    verify_period: float = 3600.0
    """Seconds between full reads of our iptables chains, every shard compared with what was
    written (1h, as kube-proxy's full resync). Each sync in between
    checks cheaply: the canary chain, the jumps and the entry chains. 0: every sync reads all."""
    min_sync_period: float = 1.0
    """Minimum seconds between two syncs; changes arriving faster are coalesced."""
    config_sync_period: float = 900.0
    """Seconds between full relists of Services and EndpointSlices from the API server."""
    healthz_bind_address: str = "0.0.0.0:10256"
    """host:port of /healthz and /livez; empty disables."""
    metrics_bind_address: str = "127.0.0.1:10249"
    """host:port of /metrics, /proxyMode, /configz and /debug/state; empty disables."""
    metrics_allowed_hosts: tuple[str, ...] = ()
    """Host names the metrics site answers to besides IP literals and localhost (others get
    421, so a web page cannot read /debug/state through DNS rebinding)."""
    hostname_override: str = ""
    """This node's name; default: $NODE_NAME, then the hostname."""
    kubeconfig: str = ""
    """Path of a kubeconfig file; default: $KUBECONFIG, then in-cluster config."""
    master: str = ""
    """API server URL, overriding the kubeconfig's; unset: the kubeconfig's."""
    kube_api_qps: float = 5.0
    """Requests per second to the API server (client-side limit)."""
    kube_api_burst: int = 10
    """Burst of requests allowed above --kube-api-qps."""
    nodeport_addresses: tuple[str, ...] = ()
    """CIDRs whose local addresses answer NodePorts, or `primary` (the Node's IP of each
    family, followed); empty: every local address."""
    cluster_cidr: str = ""
    """The cluster's Pod CIDR, or a dual-stack pair (informational; shown in /configz)."""
    service_proxy_name: str = ""
    """Handle only Services labelled service.kubernetes.io/service-proxy-name=<this>; unset:
    only Services without that label, as kube-proxy."""
    iptables_backend: Backend = "auto"
    """auto (the host's mode), iptc (python-iptables, legacy), restore, or none (no rules)."""
    node_ips: tuple[str, ...] = ()
    """Node IPs for host-side DNAT; default: the Node object's addresses."""
    event_loop: Literal["auto", "native", "uvloop", "asyncio"] = "auto"
    """Event loop: auto (asyncio waiting in the native core in workers that serve the native
    data plane, uvloop in the control process), native (the core's loop in the control process
    too, when it serves with --workers 1), uvloop, or asyncio."""
    dataplane: Literal["auto", "native", "python"] = "auto"
    """Which TCP data plane moves the bytes: native (C, accept to close without a Python call
    per read or write), python (asyncio Protocols, the reference), or auto (native when the
    extension is built, else python, said once at start)."""
    log_format: Literal["text", "json"] = "text"
    """Log line format."""
    verbosity: int = 0
    """klog-style verbosity; 4 and above logs every connection."""
    shutdown_grace: float = 5.0
    """Seconds open connections may take to finish after SIGTERM/SIGINT."""
    manifests: tuple[str, ...] = ()
    """Manifest files or directories to serve instead of a cluster."""
    oom_score_adj: int | None = kpc.OOM_SCORE_ADJ
    """oom_score_adj written to /proc/self/oom_score_adj at start (-1000..1000); null in a
    --config file: leave it."""
    metrics_per_service_port: bool = True
    """Export per-service-port series (labels namespace, service, port); off for big clusters."""
    kube_proxy_config: dict[str, Any] = {}
    """The KubeProxyConfiguration document read with --config, kube-proxy's defaults filled in."""
    guard_proxy_ports: bool = True
    """REJECT connections made straight to a proxy port (not sent there by the nat rules)."""
    loopback_endpoints: Literal["auto", "allow", "deny"] = "auto"
    """Whether endpoints on loopback addresses are dialed: auto allows them with --manifests
    only (the demo's pods are on 127.0.0.x); a cluster's never are (they would reach the node)."""
    workers: str = "auto"
    """Data-plane worker processes: a count, or auto (one per CPU this process may use, at most
    4; on 2 CPUs measured against 1 = CPUs - 1: 1.38x the keep-alive requests/s, half the p99,
    docs/benchmarks.md); 1 serves from the control process itself."""
    state_dir: str = "/var/lib/kube-userspace-proxy"
    """Directory for the last applied state (served.json), served at start until the API server
    answers, and for handover.sock, through which a new process takes the sockets over;
    empty disables both."""
    after_handover: Literal["exit", "wait"] = "exit"
    """After handing every socket over to a new process and draining: exit (0), or wait for
    SIGTERM (in a DaemonSet, whose controller deletes the old pod once the new one is ready)."""

    preserve_source_ip: bool = False
    """Dial backends from the client's own address where the reply comes back through this
    node (clients that are this node's pods, endpoints on this node); needs CAP_NET_ADMIN."""
    transparent_mark: int = TRANSPARENT_MARK
    """The packet-mark bit that sends replies to transparent sockets to the local table."""
    transparent_table: int = TRANSPARENT_TABLE
    """The routing table that holds `local default dev lo` for marked replies."""
    scheduler: str = "rr"
    """How each Service port picks an endpoint unless its annotation
    kube-userspace-proxy.io/scheduler says otherwise: rr (round robin), lc (fewest open
    connections on the node), sh (consistent hashing of the client address); IPVS's other
    names map to the nearest of the three."""
    outlier_consecutive_failures: int = 5
    """Consecutive failed dials (refused, timed out, unreachable) after which an endpoint is
    ejected for a while, node-wide; 0 turns ejection off."""
    outlier_base_ejection_time: float = 30.0
    """How long an ejected endpoint stays out, times its ejections so far, at most 300s."""

    @field_validator("scheduler", mode="before")
    @classmethod
    def _check_scheduler(cls, value: Any) -> str:
        name, problem = scheduler_named(str(value))
        if problem is not None:
            log.warning("--ipvs-scheduler / ipvs.scheduler: %s", problem)
        return name

    @field_validator("outlier_consecutive_failures")
    @classmethod
    def _check_failures(cls, value: int) -> int:
        if not 0 <= value <= MAX_OUTLIER_FAILURES:
            raise ValueError(f"must be a whole number from 0 to {MAX_OUTLIER_FAILURES}")
        return value

    @field_validator("outlier_base_ejection_time")
    @classmethod
    def _check_ejection_time(cls, value: float) -> float:
        if not 0 < value <= MAX_EJECTION_SECONDS:
            raise ValueError(f"must be more than 0 and at most {MAX_EJECTION_SECONDS:g}s")
        return value

    @property
    def balancing(self) -> Balancing:
        """The scheduler and outlier ejection every Service port gets unless annotated."""
        return Balancing(
            self.scheduler, self.outlier_consecutive_failures, self.outlier_base_ejection_time
        )

    @field_validator("transparent_mark")
    @classmethod
    def _check_mark(cls, value: int) -> int:
        if value <= 0 or value >= 1 << 32 or value & (value - 1):
            raise ValueError("must be one bit (a power of two below 2^32), e.g. 0x1000")
        if value & _RESERVED_MARKS:
            raise ValueError("0x4000 and 0x8000 are kube-proxy's masquerade and drop marks")
        return value

    @field_validator("transparent_table")
    @classmethod
    def _check_table(cls, value: int) -> int:
        if not 1 <= value < 1 << 32 or value in {253, 254, 255}:
            raise ValueError("must be 1..2^32-1 and not 253-255 (default, main, local)")
        return value

    def source_policy(self, pod_cidrs: tuple[str, ...]) -> SourcePolicy | None:
        """The SourcePolicy in force with the Node's `pod_cidrs`; None without the flag.

        This node's pods are its podCIDRs. Without them, kube-proxy's detectLocalMode
        ClusterCIDR makes the cluster CIDR count (right only where every client of this node's
        proxy ports inside it is a pod of this node); other modes give no local clients, and
        only endpoints on this node keep the client's address.
        """
        if not self.preserve_source_ip:
            return None
        if pod_cidrs:
            return SourcePolicy(pod_cidrs)
        mode = str(self.kube_proxy_config.get("detectLocalMode") or "")
        if mode == "ClusterCIDR" and self.cluster_cidr:
            return SourcePolicy(tuple(filter(None, self.cluster_cidr.split(","))))
        return SourcePolicy()

    @field_validator("bind_address")
    @classmethod
    def _check_ip(cls, value: str) -> str:
        if value:
            ipaddress.ip_address(value)
        return value

    @field_validator("healthz_bind_address", "metrics_bind_address")
    @classmethod
    def _check_host_port(cls, value: str) -> str:
        if value and value != "0":
            split_host_port(value)
        return value

    @field_validator("nodeport_addresses", mode="before")
    @classmethod
    def _check_cidrs(cls, value: Any) -> tuple[str, ...]:
        cidrs = expand_nodeport_addresses(tuple(str(v) for v in value or ()))
        for cidr in cidrs if cidrs != (NODEPORT_PRIMARY,) else ():
            ipaddress.ip_network(cidr, strict=False)
        return cidrs

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
        parse_port_range(value)
        return value

    @field_validator(
        "udp_idle_timeout",
        "tcp_keepalive",
        "sync_period",
        "verify_period",
        "min_sync_period",
        "config_sync_period",
        "shutdown_grace",
        "outlier_base_ejection_time",
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
    def allows_loopback_endpoints(self) -> bool:
        """True when loopback endpoint addresses are dialed (see `loopback_endpoints`)."""
        if self.loopback_endpoints == "auto":
            return bool(self.manifests)
        return self.loopback_endpoints == "allow"

    @property
    def port_range(self) -> tuple[int, int] | None:
        """`proxy_port_range` parsed: (first, last), or None for the kernel's ephemeral range."""
        return parse_port_range(self.proxy_port_range)

    @property
    def worker_count(self) -> int:
        """`workers` resolved: `auto` is the CPUs this process may run on, at most 4."""
        if self.workers == "auto":
            return max(1, min(AUTO_WORKERS_MAX, len(os.sched_getaffinity(0))))
        return int(self.workers)

    @field_validator("oom_score_adj")
    @classmethod
    def _check_oom(cls, value: int | None) -> int | None:
        if value is not None and not -1000 <= value <= 1000:
            raise ValueError("must be within -1000..1000")
        return value

    @field_validator("sync_period")
    @classmethod
    def _positive(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be greater than 0")
        return value

    @field_validator("verify_period")
    @classmethod
    def _not_negative(cls, value: float) -> float:
        if value < 0:
            raise ValueError("must not be negative")
        return value


MAX_PORT = 65535


def _port(text: str, whole: str) -> int:
    text = text.strip()
    if not text.isdigit():
        raise ValueError(f"invalid port range {whole!r}: {text!r} is not a port number")
    value = int(text)
    if value > MAX_PORT:
        raise ValueError(f"invalid port range {whole!r}: {value} is above {MAX_PORT}")
    return value


def parse_port_range(text: str) -> tuple[int, int] | None:
    """Parse kube-proxy's `--proxy-port-range`: `begin-end`, `begin+offset` or `port`.

    Returns the inclusive (first, last) pair, or None for an empty value or `0-0`, which mean
    "any port of the kernel's ephemeral range". Raises ValueError naming a malformed value.
    """
    value = text.strip()
    if not value:
        return None
    if "-" in value:
        low_text, _, high_text = value.partition("-")
        low, high = _port(low_text, text), _port(high_text, text)
    elif "+" in value:
        low_text, _, offset_text = value.partition("+")
        low = _port(low_text, text)
        high = low + _port(offset_text, text)
        if high > MAX_PORT:
            raise ValueError(f"invalid port range {text!r}: ends at {high}, above {MAX_PORT}")
    else:
        low = high = _port(value, text)
    if low == high == 0:
        return None
    if high < low:
        raise ValueError(f"invalid port range {text!r}: end {high} is below begin {low}")
    if low == 0:
        raise ValueError(f"invalid port range {text!r}: port 0 cannot be part of a range")
    return (low, high)


def format_port_range(port_range: tuple[int, int] | None) -> str:
    """`first-last` as the flag takes it; `0-0` for the ephemeral range."""
    return "0-0" if port_range is None else f"{port_range[0]}-{port_range[1]}"


API_VERSION = kpc.API_VERSION


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
        doc = {}
    if not isinstance(doc, Mapping):
        raise ConfigError(f"--config {path}: expected a KubeProxyConfiguration object")
    return config_from_document(doc, source=f"--config {path}")


def config_from_document(doc: Mapping[str, Any], *, source: str = "config") -> dict[str, Any]:
    """Map a KubeProxyConfiguration document to ProxyConfig field values, as kube-proxy reads it.

    Zero values take kube-proxy's defaults; unknown fields and another `mode` are warnings;
    fields that mean nothing here are logged once. The defaulted document itself is kept under
    `kube_proxy_config` (what /configz and --write-config-to show).
    """

    def fail(field: str, reason: str) -> ConfigError:
        return ConfigError(f"{source}: field {field}: {reason}")

    kind = doc.get("kind") or kpc.KIND
    if kind != kpc.KIND:
        raise fail("kind", f"expected {kpc.KIND}, got {kind!r}")
    version = doc.get("apiVersion") or API_VERSION
    if version != API_VERSION:
        raise fail("apiVersion", f"expected {API_VERSION}, got {version!r}")
    for section, shape in kpc.SCHEMA.items():
        body = doc.get(section)
        if isinstance(shape, dict) and body is not None and not isinstance(body, Mapping):
            raise fail(section, "expected an object")
    known = kpc.strip_unknown(doc, source=source)
    mode = known.get("mode") or ""
    refused = validation.mode_problem(str(mode), "KubeProxyConfiguration.mode")
    if refused:
        raise InvalidConfigError(f"{source}: {refused}")
    if mode not in {"", "userspace"}:
        log.warning(
            "%s: mode %r ignored: this proxy implements kube-proxy's userspace mode (Services "
            "are proxied through local ports and iptables REDIRECT/DNAT rules, not %s rules)",
            source,
            mode,
            mode,
        )
    ignored = kpc.not_applicable(known, APPLIED_PATHS)
    if ignored:
        log.info("%s: not applicable in userspace mode, ignored: %s", source, ", ".join(ignored))
    effective = kpc.set_defaults(known)
    out: dict[str, Any] = {}
    for path, field in FILE_FIELDS.items():
        name = field.name
        value = kpc.get(effective, path)
        if value is None or value == "":
            continue
        if name == "bind_address" and value == UNSPECIFIED_BIND:
            continue  # kube-proxy's default, kubeadm's too: the node's families (see the field)
        if name == "log_format" and value not in {"text", "json"}:
            log.warning("%s: logging.format %r is not supported; using text", source, value)
            continue
        if name == "nodeport_addresses":
            if not isinstance(value, list):
                raise fail(path, "expected a list of CIDRs")
            value = tuple(str(v) for v in value)
        out[name] = value
    out["kube_proxy_config"] = effective
    return out


def expand_nodeport_addresses(values: Sequence[str]) -> tuple[str, ...]:
    """kube-proxy's nodePortAddresses keywords as CIDRs: `localhost`, `all`; empty means all.

    `primary` alone stays as it is: the Node's primary IPs, followed as they change (see
    `addresses.primary_cidrs`). Beside CIDRs, which kube-proxy refuses, it is dropped with a
    warning, leaving the other entries.
    """
    if tuple(values) == (NODEPORT_PRIMARY,):
        return (NODEPORT_PRIMARY,)
    out: list[str] = []
    for value in values:
        if value == "all":
            return ()
        if value == "localhost":
            out += ["127.0.0.0/8", "::1/128"]
        elif value == NODEPORT_PRIMARY:
            log.warning(
                "nodePortAddresses 'primary' beside CIDRs is ignored: it must be the only"
                " entry, as kube-proxy requires"
            )
        else:
            out.append(value)
    return tuple(out)


def effective_document(config: ProxyConfig) -> dict[str, Any]:
    """The KubeProxyConfiguration (camelCase, v1alpha1) in force: defaults < file < flags."""
    doc = copy.deepcopy(config.kube_proxy_config) or kpc.set_defaults({})
    for path, field in FILE_FIELDS.items():
        value = getattr(config, field.name)
        if field.kind == "duration":
            value = format_duration(value)
        elif field.kind == "csv":
            value = list(value) or None
        elif field.name == "bind_address" and not value:
            value = UNSPECIFIED_BIND
        *parents, leaf = path.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    doc["mode"] = "userspace"
    return doc


def build_config(
    file_values: Mapping[str, Any], flag_values: Mapping[str, Any], *, source: str = "config"
) -> ProxyConfig:
    """Merge file values under flag values and validate as kube-proxy does; InvalidConfigError
    names each field at fault as kube-proxy does (the flag, when a flag gave the value)."""
    flags = {k: v for k, v in flag_values.items() if v is not None}
    merged = {**file_values, **flags}

    def place(name: str) -> str:
        return validation.where(name, from_flag=name in flags)

    found = validation.problems(merged, place)
    if not found:
        try:
            config = ProxyConfig(**merged)
        except ValidationError as exc:
            for error in exc.errors():
                name = str(error["loc"][0]) if error["loc"] else "?"
                reason = error["msg"].removeprefix("Value error, ")
                found.append(validation.invalid(place(name), merged.get(name), reason))
        else:
            parsed = {name: getattr(config, name) for name in _PERIODS}
            shown = {  # a flag's duration arrives parsed: shown the Go way again
                name: format_duration(merged[name])
                if isinstance(merged[name], float)
                else merged[name]
                for name in _PERIODS
                if name in merged
            }
            found = validation.period_problems(parsed, shown, place)
            if not found:
                return config
    # A file's field says which file (a flag names itself).
    file_named = source.startswith("--config") and any(
        line.startswith("KubeProxyConfiguration.") for line in found
    )
    prefix = f"{source}: " if file_named else ""
    # One line, as Go's aggregate of field errors prints several: [a, b].
    raise InvalidConfigError(prefix + (found[0] if len(found) == 1 else f"[{', '.join(found)}]"))


_PERIODS = ("udp_idle_timeout", "config_sync_period", "sync_period", "min_sync_period")


def field_doc(name: str) -> str:
    """The docstring written under a ProxyConfig field (used by --help and the README)."""
    return ProxyConfig.model_fields[name].description or ""


DEFAULTS = ProxyConfig()
