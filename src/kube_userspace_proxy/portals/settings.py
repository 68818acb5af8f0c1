"""What the rules are rendered for besides the service ports: the node's IPs, the address the
proxy ports are bound to, and from both the address families that get rules (`Settings`).

The families served: those the proxy ports' sockets accept (`served_families`), and, with the
bind address left unspecified, only those the node has addresses in, as kube-proxy serves them
(`Settings.node_families`). A ClusterIP of a family left out gets no rules, and
`Settings.left_out` says why.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass

from kube_userspace_proxy.addresses import Family, families_of, ip_family, nodeport_cidrs

_WILDCARDS = frozenset({"0.0.0.0", "::", ""})
"""Bind addresses meaning every local address (of the families `served_families` gives)."""


@functools.lru_cache(maxsize=64)
def served_families(bind_address: str) -> frozenset[Family]:
    """The address families that proxy ports bound to `bind_address` accept connections of.

    0.0.0.0 (or empty) is IPv4 only; `::` is both, as the ports are dual-stack sockets
    (IPV6_V6ONLY off); any other address is its own family only.
    """
    if bind_address in ("", "0.0.0.0"):
        return frozenset({4})
    if bind_address == "::":
        return frozenset({4, 6})
    family = ip_family(bind_address)
    return frozenset({family}) if family else frozenset()


@functools.lru_cache(maxsize=64)
def _served(settings: Settings) -> frozenset[Family]:
    accepted = served_families(settings.bind_address)
    if settings.node_families is None:
        return accepted
    return accepted & _node_families(settings)


def _node_families(settings: Settings) -> frozenset[Family]:
    """The families the node has addresses in: its IPs', else those it had at start."""
    if settings.node_ips:
        return families_of(settings.node_ips)
    return settings.node_families or frozenset()


@dataclass(frozen=True, slots=True)
class Settings:
    """What the rendering needs to know about the node besides the service ports."""

    node_ips: tuple[str, ...] = ()
    bind_address: str = "0.0.0.0"
    """The address the proxy ports are bound to: which families their sockets accept."""
    nodeport_addresses: tuple[str, ...] = ()
    physdev: bool = True
    guard: bool = True
    """REJECT connections to proxy ports that no nat rule sent there (KUBE-PROXY-PORTS)."""
    node_families: frozenset[Family] | None = None
    """Set when the bind address was left unspecified: the families the node had addresses
    in at start, which apply while no node IP is known (the node IPs' families otherwise).
    None: an explicit bind address decides alone."""

    @property
    def served(self) -> frozenset[Family]:
        """The families that get rules: those the sockets accept, less (when following the
        node) those the node has no address in."""
        return _served(self)

    def serves(self, family: Family) -> bool:
        """True when the proxy serves `family` (see `served`)."""
        return family in _served(self)

    def left_out(self, family: Family) -> str:
        """Why `family` gets no rules, said to whoever set it up ("" when it is served)."""
        if family in _served(self):
            return ""
        bind = self.bind_address or "0.0.0.0"
        only = "/".join(f"IPv{f}" for f in sorted(served_families(bind))) or "no family"
        if self.node_families is None:
            return (
                f"the proxy ports listen on {bind} ({only} only); use --bind-address :: for"
                " dual stack"
            )
        if family not in _node_families(self):
            known = ", ".join(self.node_ips) or "none known, and the host has none"
            return f"the node has no IPv{family} address (node IPs: {known}; see --node-ip)"
        return (
            f"the proxy ports listen on {bind} ({only} only): the node had no IPv{family}"
            " address when the proxy started (or a handover kept the earlier listeners);"
            " restart it to serve both"
        )

    def host_ip(self, family: Family) -> str:
        """Where the node's own packets are DNATed: the bind address, else a node IP."""
        if not self.serves(family):
            return ""
        if self.bind_address not in _WILDCARDS:
            return self.bind_address
        return next((ip for ip in self.node_ips if ip_family(ip) == family), "")

    def nodeport_dsts(self, family: Family) -> list[str]:
        """`-d` values for NodePort rules: [""] (any local address) or the matching CIDRs."""
        if not self.nodeport_addresses:
            return [""]
        dsts: list[str] = []
        # `primary` follows the node IPs; none known in a family: no NodePort rules for it.
        for text in nodeport_cidrs(self.nodeport_addresses, self.node_ips):
            net = ipaddress.ip_network(text, strict=False)
            if net.version == family:
                dsts.append("" if net.prefixlen == 0 else str(net))
        return sorted(set(dsts), key=dsts.index)
