"""The desired iptables rules of the userspace mode, rendered as `iptables-save` prints them.

Five chains, laid out as kube-proxy's userspace mode had them:

- nat `KUBE-PORTALS-CONTAINER` (jump prepended to PREROUTING): packets arriving from pods or the
  network for a ClusterIP, externalIP or LoadBalancer ingress IP. Target: `REDIRECT --to-ports
  P`. REDIRECT rewrites the destination to the primary address of the interface the packet came
  in on, so the reply leaves from the address the client's conntrack entry expects; that
  matters for UDP, which has no connection to fix things up. (DNAT to the node IP would send
  replies out from a different address than the bridge the request came from.) When
  `--bind-address` names one address, the proxy listens only there, so DNAT to it instead.
- nat `KUBE-PORTALS-HOST` (jump prepended to OUTPUT): packets the node sends itself. Locally
  generated packets cannot be REDIRECTed usefully: REDIRECT sends them to 127.0.0.1, and the
  reply then comes from the node address, which clients (resolvers in particular) reject. So
  they are DNATed to `NODEIP:P` (or to the bind address when one is set).
- nat `KUBE-NODEPORT-CONTAINER` / `KUBE-NODEPORT-HOST` (jumps appended to PREROUTING / OUTPUT,
  only for `-m addrtype --dst-type LOCAL`): NodePorts on any local address (or only the local
  addresses inside `--nodeport-addresses`). They come after the portal chains because they
  match broadly (any local address, one port); a ClusterIP must never be captured by them.
- filter `KUBE-NODEPORT-NON-LOCAL` (jump prepended to INPUT): ACCEPT new connections to the
  proxy port behind a NodePort, so a default-deny INPUT policy does not drop NodePort traffic.
  Only connections the nat rules sent there (`--ctstate DNAT`; REDIRECT is a DNAT too).
- filter `KUBE-PROXY-PORTS` (jump prepended to INPUT for new connections that no nat rule
  rewrote: `-m state --state NEW -m conntrack ! --ctstate DNAT`): REJECT each proxy port, so a
  proxy port answers only what the portal and NodePort rules sent there. Without it, anyone who
  can reach the node could connect to `node-ip:proxy-port` and reach a ClusterIP Service from
  outside the cluster. Only the first packet of a connection the nat rules did not touch walks
  this chain. `--guard-proxy-ports=false` leaves it empty.

Every rule carries `-m comment --comment ns/name:port`. External IPs get three rules, as the Go
proxier had them: from outside the node's bridges (`-m physdev ! --physdev-is-in`), from pods
when the IP is one of the node's own addresses (`-m addrtype --dst-type LOCAL`), and from the
node itself only when the IP is local. Without the physdev match in the kernel the first rule
drops that condition (pods then reach external IPs through the proxy too, as with kube-proxy's
iptables mode). LoadBalancer ingress IPs are treated like ClusterIPs. Cluster traffic goes to
`ProxiedPort.cluster_port`; NodePort, externalIP and LoadBalancer traffic to `external_port`.

Rules are rendered only for the address families the proxy ports accept: `--bind-address`
0.0.0.0 is IPv4 only, `::` is both (the proxy's sockets are dual-stack), any other address is
its own family only. A ClusterIP of another family gets no rules: redirected there, its
clients would be refused.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kube_userspace_proxy import logs
from kube_userspace_proxy.model import Path, ProxiedPort, ServicePortName
from kube_userspace_proxy.netutil import Family, ip_family, join_host_port

CONTAINER_PORTALS = "KUBE-PORTALS-CONTAINER"
HOST_PORTALS = "KUBE-PORTALS-HOST"
CONTAINER_NODEPORTS = "KUBE-NODEPORT-CONTAINER"
HOST_NODEPORTS = "KUBE-NODEPORT-HOST"
NON_LOCAL_NODEPORTS = "KUBE-NODEPORT-NON-LOCAL"
PROXY_PORTS = "KUBE-PROXY-PORTS"

CANARY = "KUBE-PORTALS-CANARY"
"""An empty chain of ours in each table: gone means the table was flushed or reloaded."""

NAT = "nat"
FILTER = "filter"
TABLES = (NAT, FILTER)
CHAINS: dict[str, tuple[str, ...]] = {
    NAT: (CONTAINER_PORTALS, HOST_PORTALS, CONTAINER_NODEPORTS, HOST_NODEPORTS, CANARY),
    FILTER: (NON_LOCAL_NODEPORTS, PROXY_PORTS, CANARY),
}
"""Our fixed chains per table, in the order they are declared: the entry chains that the
built-in chains jump to (each holds only jumps to its shards), and the canary."""
OUR_CHAINS = frozenset(c for chains in CHAINS.values() for c in chains)
SHARDED = (
    CONTAINER_PORTALS,
    HOST_PORTALS,
    CONTAINER_NODEPORTS,
    HOST_NODEPORTS,
    NON_LOCAL_NODEPORTS,
    PROXY_PORTS,
)
SHARDS = 256
"""Each entry chain jumps to up to 256 shards, e.g. KUBE-PORTALS-HOST-0A, and each jump matches
only the packets of its shard: a new connection walks the jumps and one shard (~N/256 rules),
never all N rules, and a change edits a chain of ~N/256 rules (`iptables-nft-restore` loads a
chain whole to delete a rule from it)."""
DST_SHARDED = frozenset({CONTAINER_PORTALS, HOST_PORTALS})
"""Entry chains whose rules each name one destination address (a ClusterIP, LoadBalancer or
external IP): shard N holds the rules for addresses whose last byte is N, and the jump to it
is `-d 0.0.0.N/0.0.0.255` (IPv6: `-d ::N/::ff`), a non-contiguous mask."""
PORTS_PER_SHARD = 256
"""The other entry chains' rules each match one destination port (a NodePort, a proxy port):
shard N holds ports 256N to 256N+255 and the jump to it is `-p P --dport LO:HI`, one per
protocol that the shard's rules use."""
_TABLE_OF = {chain: table for table in TABLES for chain in CHAINS[table] if chain != CANARY}
_SHARD = re.compile(r"(.+)-([0-9A-F]{2})")
_TARGETS = frozenset({"REDIRECT", "DNAT", "REJECT", "ACCEPT"})
"""The iptables targets our rules use (any other target is a jump to one of our chains)."""


def shard_for(base: str, dst: str, dport: int) -> int:
    """The shard of entry chain `base` that a rule for `dst` (`-d` text) and `dport` goes to."""
    if base in DST_SHARDED:
        addr = dst.partition("/")[0]
        if ":" in addr:
            return socket.inet_pton(socket.AF_INET6, addr)[-1]
        return int(addr.rpartition(".")[2])
    return dport // PORTS_PER_SHARD


def shard_ports(shard: int) -> tuple[int, int]:
    """The destination ports of a port shard, lowest and highest (port 0 is never one)."""
    return max(1, shard * PORTS_PER_SHARD), shard * PORTS_PER_SHARD + PORTS_PER_SHARD - 1


def shard_chain(base: str, shard: int) -> str:
    """The chain of `shard` under the entry chain `base`, e.g. KUBE-PORTALS-HOST-0A."""
    return f"{base}-{shard:02X}"


def base_chain(chain: str) -> str:
    """The entry chain a shard belongs to; any other name is returned as it is."""
    m = _SHARD.fullmatch(chain)
    return m[1] if m is not None and m[1] in SHARDED else chain


def is_ours(table: str, chain: str) -> bool:
    """True for our chains of `table`: the fixed ones and every shard."""
    return chain in CHAINS[table] or _TABLE_OF.get(base_chain(chain)) == table


log = logs.get(__name__)

_SAFE_COMMENT = re.compile(r"[ !#-&(-\[\]-~]{1,255}")
"""Printable ASCII without quotes or backslashes, at most 255 bytes (the kernel's comment
limit is 256 with its NUL): nothing in a comment can end the quoted argument or the line of
the `iptables-restore` input. The parser already holds names to DNS-1123; this is the last
line of defence for whatever reaches a rule."""

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


@dataclass(frozen=True, slots=True, eq=False)
class Rule:
    """One iptables rule; `line` is exactly what `iptables-save` prints for it.

    Built-in chain jumps (`chain` PREROUTING/OUTPUT/INPUT, `target` one of ours) set `prepend`
    when they must come before anything else in that chain. Two rules are equal when they are
    the same text in the same chain of the same table and family.
    """

    family: Family
    table: str
    chain: str
    target: str
    comment: str
    protocol: str = ""
    dst: str = ""
    dport: int = 0
    dport_hi: int = 0
    """With `dport`, a range: `--dport dport:dport_hi`."""
    physdev_not_in: bool = False
    dst_local: bool = False
    state_new: bool = False
    ctstate: str = ""
    """`-m conntrack --ctstate X`; a leading `!` negates it."""
    to_port: int = 0
    to_addr: str = ""
    reject_with: str = ""
    prepend: bool = False
    why: str = ""
    spec: str = field(init=False, repr=False)
    """The rule without `-A CHAIN`, in iptables-save's order of fields."""
    _hash: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not _SAFE_COMMENT.fullmatch(self.comment):
            raise ValueError(f"unsafe rule comment {self.comment[:80]!r}")
        # Rendered once: a sync compares tens of thousands of rules by their text.
        parts: list[str] = []
        if self.dst:
            parts += ["-d", self.dst]
        if self.protocol:
            parts += ["-p", self.protocol]
        parts += ["-m", "comment", "--comment", f'"{self.comment}"']
        if self.dport_hi:
            parts += ["-m", self.protocol, "--dport", f"{self.dport}:{self.dport_hi}"]
        elif self.dport:
            parts += ["-m", self.protocol, "--dport", str(self.dport)]
        if self.physdev_not_in:
            parts += ["-m", "physdev", "!", "--physdev-is-in"]
        if self.dst_local:
            parts += ["-m", "addrtype", "--dst-type", "LOCAL"]
        if self.state_new:
            parts += ["-m", "state", "--state", "NEW"]
        if self.ctstate:
            negated = self.ctstate.startswith("!")
            parts += ["-m", "conntrack", *(["!"] if negated else []), "--ctstate"]
            parts.append(self.ctstate.removeprefix("!"))
        parts += ["-j", self.target]
        if self.target == "REDIRECT":
            parts += ["--to-ports", str(self.to_port)]
        elif self.target == "REJECT":
            parts += ["--reject-with", self.reject_with]
        elif self.target == "DNAT":
            parts += ["--to-destination", join_host_port(self.to_addr, self.to_port)]
        spec = " ".join(parts)
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "_hash", hash((self.family, self.table, self.chain, spec)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Rule):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.spec == other.spec
            and self.chain == other.chain
            and self.table == other.table
            and self.family == other.family
        )

    @property
    def line(self) -> str:
        """The rule as `iptables-save` prints it: `-A CHAIN spec`."""
        return f"-A {self.chain} {self.spec}"

    @property
    def to_chain(self) -> bool:
        """True when the target is one of our chains (a jump), not an iptables target."""
        return self.target not in _TARGETS and is_ours(self.table, self.target)

    @property
    def is_jump(self) -> bool:
        """True for the built-in chain rules that send packets into our chains."""
        return self.to_chain and not is_ours(self.table, self.chain)


def shard_jumps(
    family: Family, table: str, base: str, shard: int, protocols: Iterable[str] = ()
) -> tuple[Rule, ...]:
    """The rules of an entry chain that send its packets on to one of its shards: one with the
    destination mask (a `DST_SHARDED` chain), else one per protocol with the port range."""
    chain = shard_chain(base, shard)
    if base in DST_SHARDED:
        if family == 6:
            dst = socket.inet_ntop(socket.AF_INET6, bytes(15) + bytes([shard])) + "/::ff"
        else:
            dst = f"0.0.0.{shard}/0.0.0.255"
        return (Rule(family, table, base, chain, f"shard {shard:02X}: destinations ending in"
                     f" {shard:02X}", dst=dst,
                     why=f"on to {chain}: the rules for the addresses whose last byte is"
                     f" {shard} (0x{shard:02X})"),)  # fmt: skip
    lo, hi = shard_ports(shard)
    return tuple(
        Rule(family, table, base, chain, f"shard {shard:02X}: ports {lo}-{hi}", protocol=p,
             dport=lo, dport_hi=hi,
             why=f"on to {chain}: the rules for {p.upper()} ports {lo} to {hi}")
        for p in protocols
    )  # fmt: skip


def jumps(family: Family) -> list[Rule]:
    """The rules in built-in chains that lead into our chains (the same for every sync)."""
    portals = "handle ClusterIPs; NOTE: this must be before the NodePort rules"
    nodeports = "handle service NodePorts; NOTE: this must be the last rule in the chain"
    nonlocal_ = "Ensure that non-local NodePort traffic can flow"
    return [
        Rule(family, NAT, "PREROUTING", CONTAINER_PORTALS, portals, prepend=True,
             why="first thing for every packet arriving at the node (from pods or the network):"
             " check it against the Service portals"),
        Rule(family, NAT, "OUTPUT", HOST_PORTALS, portals, prepend=True,
             why="first thing for every packet this node sends: check it against the Service"
             " portals"),
        Rule(family, NAT, "PREROUTING", CONTAINER_NODEPORTS, nodeports, dst_local=True,
             why="after everything else, arriving packets for one of the node's own addresses"
             " are checked against the NodePorts"),
        Rule(family, NAT, "OUTPUT", HOST_NODEPORTS, nodeports, dst_local=True,
             why="after everything else, packets the node sends to its own addresses are"
             " checked against the NodePorts"),
        Rule(family, FILTER, "INPUT", NON_LOCAL_NODEPORTS, nonlocal_, prepend=True,
             why="before any firewall rule of the node, let NodePort connections reach the"
             " proxy ports"),
        Rule(family, FILTER, "INPUT", PROXY_PORTS, "refuse proxy ports not reached via nat",
             state_new=True, ctstate="!DNAT", prepend=True,
             why="new connections no nat rule rewrote are checked against the proxy ports"),
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Settings:
    """What the rendering needs to know about the node besides the service ports."""

    node_ips: tuple[str, ...] = ()
    bind_address: str = "0.0.0.0"
    nodeport_addresses: tuple[str, ...] = ()
    physdev: bool = True
    guard: bool = True
    """REJECT connections to proxy ports that no nat rule sent there (KUBE-PROXY-PORTS)."""

    def serves(self, family: Family) -> bool:
        """True when the proxy ports accept connections of `family` (see `served_families`)."""
        return family in served_families(self.bind_address)

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
        for text in self.nodeport_addresses:
            net = ipaddress.ip_network(text, strict=False)
            if net.version == family:
                dsts.append("" if net.prefixlen == 0 else str(net))
        return sorted(set(dsts), key=dsts.index)


def _destination(ip: str) -> tuple[Family, str] | None:
    """(family, `-d` value as iptables-save prints it) of an IP address; None if invalid.

    inet_pton/inet_ntop: the same canonical text as `ipaddress`, at a tenth of its cost
    (10,000 ClusterIPs are parsed from scratch)."""
    for family, af, bits in ((4, socket.AF_INET, 32), (6, socket.AF_INET6, 128)):
        try:
            return family, f"{socket.inet_ntop(af, socket.inet_pton(af, ip))}/{bits}"  # type: ignore[return-value]
        except (OSError, ValueError):
            continue
    return None


_Match = dict[str, Any]
"""The fields of a portal rule's match part (family, table, comment, protocol, dst, dport,
and perhaps physdev_not_in or dst_local), to build its rules from."""


@functools.lru_cache(maxsize=64)
def _host_ip(settings: Settings, family: Family) -> str:
    return settings.host_ip(family)


class _Renderer:
    """Accumulates the rules of one service port after another, skipping duplicates."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.rules: list[Rule] = []
        self.skipped: list[tuple[ServicePortName, str]] = []
        """ClusterIPs left without rules because the proxy ports do not serve their family."""
        self._seen: set[Rule] = set()

    @staticmethod
    def ch(base: str, dst: str, dport: int) -> str:
        """The shard of entry chain `base` that a rule for `dst` and `dport` goes to."""
        return shard_chain(base, shard_for(base, dst, dport))

    def add(self, rule: Rule) -> None:
        if rule not in self._seen:
            self._seen.add(rule)
            self.rules.append(rule)

    def container(self, match: _Match, chain: str, to_port: int, why: str) -> None:
        """A rule for arriving packets: REDIRECT, or DNAT to a specific bind address."""
        bind, chain = self.s.bind_address, self.ch(chain, match["dst"], match["dport"])
        if bind in _WILDCARDS:
            self.add(Rule(chain=chain, target="REDIRECT", to_port=to_port, why=why, **match))
        else:
            self.add(
                Rule(chain=chain, target="DNAT", to_port=to_port, to_addr=bind, why=why, **match)
            )

    def host(self, match: _Match, chain: str, to_port: int, why: str) -> None:
        """A rule for the node's own packets: DNAT to the node IP (or the bind address)."""
        to_addr = _host_ip(self.s, match["family"])
        chain = self.ch(chain, match["dst"], match["dport"])
        if to_addr:
            why = f"{why} via {to_addr}"
            self.add(
                Rule(chain=chain, target="DNAT", to_port=to_port, to_addr=to_addr, why=why, **match)
            )

    def match(self, ip: str, pp: ProxiedPort) -> _Match | None:
        """The match part of a portal rule for `ip`, or None if this proxy cannot serve it."""
        dst = _destination(ip)
        if dst is None or dst[0] not in served_families(self.s.bind_address):
            return None
        info = pp.info
        return {
            "family": dst[0],
            "table": NAT,
            "comment": str(info.name),
            "protocol": info.protocol.lower(),
            "dst": dst[1],
            "dport": info.port,
        }

    def port(self, pp: ProxiedPort) -> None:
        info, name, cport, ext = pp.info, str(pp.info.name), pp.cluster_port, pp.external_port
        if cport == 0:
            return
        proto = info.protocol.upper()
        if self.s.guard:
            for family in sorted(served_families(self.s.bind_address)):
                for port in sorted({cport, ext} - {0}):
                    self.guard(family, pp, port)
        families: set[Family] = set()
        for ip in info.cluster_ips:
            if (m := self.match(ip, pp)) is None:
                if ip_family(ip) is not None:
                    self.skipped.append((info.name, ip))
                continue
            families.add(m["family"])
            at = f"{proto} to ClusterIP {join_host_port(ip, info.port)} ({name})"
            self.container(m, CONTAINER_PORTALS, cport, f"from pods: {at} -> proxy port {cport}")
            self.host(m, HOST_PORTALS, cport, f"from this node: {at} -> proxy port {cport}")
        if ext == 0:
            return
        for ip in info.load_balancer_ips:
            if (m := self.match(ip, pp)) is None or m["family"] not in families:
                continue
            at = f"{proto} to LoadBalancer IP {join_host_port(ip, info.port)} ({name})"
            self.container(
                m, CONTAINER_PORTALS, ext, f"from pods and the network: {at} -> proxy port {ext}"
            )
            self.host(m, HOST_PORTALS, ext, f"from this node: {at} -> proxy port {ext}")
        for ip in info.external_ips:
            if (m := self.match(ip, pp)) is None or m["family"] not in families:
                continue
            at = f"{proto} to external IP {join_host_port(ip, info.port)} ({name})"
            if self.s.physdev:
                self.container(
                    {**m, "physdev_not_in": True},
                    CONTAINER_PORTALS,
                    ext,
                    f"from the network (not via a bridge port): {at} -> proxy port {ext}",
                )
            else:
                self.container(
                    m,
                    CONTAINER_PORTALS,
                    ext,
                    f"from pods and the network: {at} -> proxy port {ext}",
                )
            local: _Match = {**m, "dst_local": True}
            self.container(
                local,
                CONTAINER_PORTALS,
                ext,
                f"from pods, when the IP is this node's: {at} -> proxy port {ext}",
            )
            self.host(
                local,
                HOST_PORTALS,
                ext,
                f"from this node, when the IP is its own: {at} -> proxy port {ext}",
            )
        if info.node_port:
            for family in sorted(families):
                self.node_port(family, pp)

    def guard(self, family: Family, pp: ProxiedPort, port: int) -> None:
        proto = pp.info.protocol.lower()
        if proto == "tcp":
            reject = "tcp-reset"
        else:
            reject = "icmp6-port-unreachable" if family == 6 else "icmp-port-unreachable"
        self.add(
            Rule(family, FILTER, self.ch(PROXY_PORTS, "", port), "REJECT", str(pp.info.name),
                 protocol=proto, dport=port, reject_with=reject,
                 why=f"refuse {proto.upper()} connections made straight to proxy port {port}"
                 f" ({pp.info.name}): only the nat rules may send traffic there")
        )  # fmt: skip

    def node_port(self, family: Family, pp: ProxiedPort) -> None:
        np, ext, name = pp.info.node_port, pp.external_port, str(pp.info.name)
        proto = pp.info.protocol.lower()
        dsts = self.s.nodeport_dsts(family)
        for dst in dsts:
            where = f"local addresses in {dst}" if dst else "any local address"
            at = f"{proto.upper()} to NodePort {np} on {where} ({name})"
            m: _Match = {
                "family": family,
                "table": NAT,
                "comment": name,
                "protocol": proto,
                "dst": dst,
                "dport": np,
            }
            self.container(
                m, CONTAINER_NODEPORTS, ext, f"from pods and the network: {at} -> proxy port {ext}"
            )
            self.host(m, HOST_NODEPORTS, ext, f"from this node: {at} -> proxy port {ext}")
        if dsts:
            self.add(
                Rule(
                    family,
                    FILTER,
                    self.ch(NON_LOCAL_NODEPORTS, "", ext),
                    "ACCEPT",
                    name,
                    protocol=proto,
                    dport=ext,
                    state_new=True,
                    ctstate="DNAT",
                    why=f"accept new {proto.upper()} connections to proxy port {ext}"
                    f" (NodePort {np} of {name}) even under a default-deny INPUT policy",
                )
            )


def render_port(
    pp: ProxiedPort, settings: Settings
) -> tuple[tuple[Rule, ...], list[tuple[ServicePortName, str]]]:
    """One service port's rules, each in its shard (`shard_for`), without duplicates; and
    (service port, ClusterIP) for each ClusterIP of a family the proxy ports do not serve."""
    r = _Renderer(settings)
    try:
        r.port(pp)
    except ValueError as exc:  # one bad port never fails the whole table's commit
        log.error("no rules for service port %r: %s", str(pp.info.name)[:300], exc)
        r.rules = []
    return tuple(r.rules), r.skipped


ClaimKey = tuple[str, str, str]
"""(service port `ns/name:port`, protocol "TCP"/"UDP", path "cluster"/"external")."""

_COMMENT = re.compile(r'--comment (?:"((?:[^"\\]|\\.)*)"|(\S+))')
_PROTOCOL = re.compile(r"(?:^| )-p (\S+)")
_TO_PORT = re.compile(r" (?:--to-ports |--to-destination \S*:)(\d+)(?: |$)")


def claimed(saved: Iterable[tuple[str, str]]) -> dict[ClaimKey, int]:
    """The proxy port of each service port's path, from (chain, spec) pairs as saved.

    Reads the portal and NodePort rules of the container chains' shards (or of the chains
    themselves, as releases before the shards wrote them; `spec` as `iptables-save` prints it
    after `-A CHAIN`), in kernel order. NodePort rules and the physdev/LOCAL external
    IP variants point at the external port. A plain portal rule is a ClusterIP's or, just the
    same, a LoadBalancer IP's (or an external IP's without physdev): its port is the cluster
    port unless it is the external one; with two such ports and no other external rule (a
    LoadBalancer without NodePort), the first in kernel order is taken as the cluster port.
    Nothing in the rules tells which is which: the ClusterIP's and the LoadBalancer IP's sit
    in the shards of their addresses, so a LoadBalancer IP in a lower shard swaps the two
    until the first sync rewrites them.
    """
    plain: dict[tuple[str, str], list[int]] = {}
    external: dict[tuple[str, str], int] = {}
    for saved_chain, spec in saved:
        chain = base_chain(saved_chain)
        if chain not in (CONTAINER_PORTALS, CONTAINER_NODEPORTS):
            continue
        comment, protocol, port = (
            _COMMENT.search(spec),
            _PROTOCOL.search(spec),
            _TO_PORT.search(spec),
        )
        if comment is None or protocol is None or port is None:
            continue  # not one of our rules' shapes
        name = comment[1].replace('\\"', '"') if comment[1] is not None else comment[2]
        key = (name, protocol[1].upper())
        if chain == CONTAINER_NODEPORTS or "--physdev-is-in" in spec or "--dst-type LOCAL" in spec:
            external.setdefault(key, int(port[1]))
        else:
            ports = plain.setdefault(key, [])
            if int(port[1]) not in ports:
                ports.append(int(port[1]))
    out: dict[ClaimKey, int] = {}
    for key in sorted(plain.keys() | external.keys()):
        ports = plain.get(key, [])
        ext = external.get(key)
        if ext is None and len(ports) > 1:
            ext = ports[1]
        others = [p for p in ports if p != ext]
        cluster = others[0] if others else (ports[0] if ports else None)
        if cluster is not None:
            out[(*key, Path.CLUSTER.value)] = cluster
        if ext is not None:
            out[(*key, Path.EXTERNAL.value)] = ext
    return out
