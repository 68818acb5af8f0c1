"""kube-proxy's checks of a configuration (`pkg/proxy/apis/config/validation`), where they apply.

Each problem is one line as kube-proxy writes it, `<field>: Invalid value: <value>: <why>`,
naming the KubeProxyConfiguration path (`KubeProxyConfiguration.iptables.minSyncPeriod`) when
the value came from the `--config` file, and the flag when a flag gave it; never a Python
attribute. `settings.build_config` runs them and raises `InvalidConfigError` (exit code 1).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Mapping
from typing import Any

from kube_userspace_proxy.config.fields import FIELDS, Field

KNOWN_MODES = ("", "userspace", "iptables", "ipvs", "nftables", "kernelspace")
"""Modes kube-proxy has known (1.25 to 1.32, Linux and Windows): served here as userspace,
with a warning for the others. Any other value is refused, as kube-proxy refuses it."""

NODE_PORT_KEYWORDS = ("primary", "localhost", "all")

_BY_NAME: dict[str, Field] = {field.name: field for field in FIELDS}


def where(name: str, *, from_flag: bool) -> str:
    """How kube-proxy names the setting `name`: its file path, or the flag that gave it."""
    field = _BY_NAME.get(name)
    if field is None:
        return name.replace("_", "-")
    if from_flag or not field.path:
        return field.kube_proxy_flag or field.flag
    return f"KubeProxyConfiguration.{field.path}"


def invalid(place: str, value: Any, reason: str) -> str:
    """One problem as Go's `field.Invalid` prints it (strings quoted, numbers bare)."""
    if isinstance(value, str):
        shown = json.dumps(value)
    elif isinstance(value, float):
        shown = f"{value:g}"
    else:
        shown = str(value)
    return f"{place}: Invalid value: {shown}: {reason}"


def mode_problem(mode: str, place: str) -> str | None:
    """A mode kube-proxy does not know (a known one is served as userspace, with a warning)."""
    if mode in KNOWN_MODES:
        return None
    return invalid(
        place,
        mode,
        "must be iptables, ipvs, nftables, userspace or blank (this proxy serves every"
        " one of them as userspace)",
    )


def problems(values: Mapping[str, Any], place: Callable[[str], str]) -> list[str]:
    """kube-proxy's checks of the raw `values` (ProxyConfig field -> value as given)."""
    found: list[str] = []

    def value(name: str) -> Any:
        return values.get(name)

    bind = value("bind_address")
    if bind and not _is_ip(str(bind)):
        found.append(
            invalid(
                place("bind_address"), bind, "not a valid textual representation of an IP address"
            )
        )
    for name in ("healthz_bind_address", "metrics_bind_address"):
        text = value(name)
        if text not in (None, "", "0"):
            problem = _host_port(str(text))
            if problem:
                found.append(invalid(place(name), problem[0], problem[1]))
    addresses = value("nodeport_addresses")
    if addresses:
        found += _node_port_addresses([str(a) for a in addresses], place("nodeport_addresses"))
    cidr = value("cluster_cidr")
    if cidr:
        found += _cluster_cidr(str(cidr), place("cluster_cidr"))
    for name in ("kube_api_qps", "kube_api_burst"):
        number = value(name)
        if isinstance(number, int | float) and not isinstance(number, bool) and number < 0:
            found.append(invalid(place(name), number, "must be greater than or equal to 0"))
    oom = value("oom_score_adj")
    if isinstance(oom, int) and not -1000 <= oom <= 1000:
        found.append(invalid(place("oom_score_adj"), oom, "must be within the range [-1000, 1000]"))
    return found


def period_problems(
    parsed: Mapping[str, float], raw: Mapping[str, Any], place: Callable[[str], str]
) -> list[str]:
    """kube-proxy's checks of the periods, once parsed to seconds (`raw`: as shown)."""
    found = []
    for name in ("udp_idle_timeout", "config_sync_period", "sync_period"):
        if parsed[name] <= 0:
            found.append(invalid(place(name), raw.get(name, "0s"), "must be greater than 0"))
    if parsed["min_sync_period"] > parsed["sync_period"]:
        found.append(
            invalid(
                place("min_sync_period"),
                raw.get("min_sync_period"),
                f"must be less than or equal to {place('sync_period')}"
                f" ({raw.get('sync_period', '30s')})",
            )
        )
    return found


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _host_port(text: str) -> tuple[str, str] | None:
    """(the part at fault, why) for a bad `IP:port`, as kube-proxy's validateHostPort says.

    Port 0 (any free port) and an empty host (every address) are taken here."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
        if ":" in host:  # an IPv6 address without brackets
            sep = ""
    if not sep:
        return text, "must be IP:port"
    if host and not _is_ip(host):
        return host, "must be a valid IP"
    if not port.isdigit() or int(port) > 65535:
        return port, "must be a valid port"
    return None


def _is_cidr(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return "/" in text


def _node_port_addresses(addresses: list[str], place: str) -> list[str]:
    found = []
    for i, address in enumerate(addresses):
        if address == "primary":
            if len(addresses) != 1:
                found.append(
                    invalid(f"{place}[{i}]", address, "can't use both 'primary' and CIDRs")
                )
            break
        if address not in NODE_PORT_KEYWORDS and not _is_cidr(address):
            found.append(invalid(f"{place}[{i}]", address, "must be a valid CIDR"))
    return found


def _cluster_cidr(text: str, place: str) -> list[str]:
    cidrs = text.split(",")
    if len(cidrs) > 2:
        return [
            invalid(
                place,
                text,
                "only one CIDR allowed or a valid DualStack CIDR (e.g."
                " 10.100.0.0/16,fde4:8dba:82e1::/48)",
            )
        ]
    if not all(_is_cidr(c.strip()) for c in cidrs):
        return [
            invalid(
                place,
                text,
                "must be a valid CIDR block (e.g. 10.100.0.0/16 or fde4:8dba:82e1::/48)",
            )
        ]
    families = {ipaddress.ip_network(c.strip(), strict=False).version for c in cidrs}
    if len(cidrs) == 2 and len(families) != 2:
        return [
            invalid(
                place,
                text,
                "must be a valid DualStack CIDR (e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)",
            )
        ]
    return []
