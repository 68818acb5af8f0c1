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
  this chain. Consecutive proxy ports share one rule with a port range
  (`desired.guard_rules`).
  `--guard-proxy-ports=false` leaves it empty.

Every rule carries `-m comment --comment ns/name:port`. External IPs get three rules, as the Go
proxier had them: from outside the node's bridges (`-m physdev ! --physdev-is-in`), from pods
when the IP is one of the node's own addresses (`-m addrtype --dst-type LOCAL`), and from the
node itself only when the IP is local. Without the physdev match in the kernel the first rule
drops that condition (pods then reach external IPs through the proxy too, as with kube-proxy's
iptables mode). LoadBalancer ingress IPs are treated like ClusterIPs. Cluster traffic goes to
`ProxiedPort.cluster_port`; NodePort, externalIP and LoadBalancer traffic to `external_port`.

Rules are rendered only for the address families the proxy serves. With the bind address
left unspecified (the default, and kubeadm's `bindAddress: 0.0.0.0`), those are the families
the node has addresses in (its node IPs; before any is known, the host's own addresses), as
kube-proxy serves them, and the proxy ports are dual-stack sockets (`::`, IPV6_V6ONLY off)
when IPv6 is among them. An explicit `--bind-address` decides alone: 0.0.0.0 is IPv4 only,
`::` is both, any other address is its own family only. A ClusterIP of another family gets no
rules (redirected there, its clients would be refused) and is reported (`left_out`).
"""

from __future__ import annotations

import functools
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar, dataclass_transform

from kube_userspace_proxy import logs
from kube_userspace_proxy.addresses import Family, ip_family, join_host_port
from kube_userspace_proxy.model import ClaimKey, Path, ProxiedPort, ServicePortName
from kube_userspace_proxy.portals.settings import _WILDCARDS, Settings, served_families

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

_T = TypeVar("_T")


@dataclass_transform(frozen_default=True)
def _frozen(cls: type[_T]) -> type[_T]:
    """A slots dataclass that is frozen for the type checker (mypy refuses any assignment to
    a field) but not at run time: a frozen dataclass's `__init__` sets each field through
    `object.__setattr__`, 2 us of a rule's 3 (tens of thousands are built from scratch)."""
    return dataclass(slots=True, eq=False)(cls)


@functools.lru_cache(maxsize=1024)
def _safe_comment(comment: str) -> bool:
    # Cached: the 3-6 rules of a service port share their comment.
    return _SAFE_COMMENT.fullmatch(comment) is not None


_set = object.__setattr__


@_frozen
class Rule:
    """One iptables rule; `line` is exactly what `iptables-save` prints for it.

    Built-in chain jumps (`chain` PREROUTING/OUTPUT/INPUT, `target` one of ours) set `prepend`
    when they must come before anything else in that chain. Two rules are equal when they are
    the same text in the same chain of the same table and family. Immutable (see `_frozen`):
    its text is computed once, at construction, which also refuses an unsafe
    comment (`_SAFE_COMMENT`), so no rule can carry one.
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
    """What it is for (`explain`); "" in the rules a sync keeps (`render_port`)."""
    spec: str = field(init=False, repr=False)
    """The rule without `-A CHAIN`, in iptables-save's order of fields."""

    def __post_init__(self) -> None:
        comment = self.comment
        if len(comment) > 255 or not _safe_comment(comment):
            raise ValueError(f"unsafe rule comment {comment[:80]!r}")
        # Rendered once: a sync compares tens of thousands of rules by their text.
        protocol, target = self.protocol, self.target
        spec = f"-d {self.dst} " if self.dst else ""
        if protocol:
            spec += f"-p {protocol} "
        spec += f'-m comment --comment "{comment}"'
        if self.dport_hi:
            spec += f" -m {protocol} --dport {self.dport}:{self.dport_hi}"
        elif self.dport:
            spec += f" -m {protocol} --dport {self.dport}"
        if self.physdev_not_in:
            spec += " -m physdev ! --physdev-is-in"
        if self.dst_local:
            spec += " -m addrtype --dst-type LOCAL"
        if self.state_new:
            spec += " -m state --state NEW"
        if ctstate := self.ctstate:
            negated = ctstate.startswith("!")
            spec += f" -m conntrack {'! ' if negated else ''}--ctstate {ctstate.removeprefix('!')}"
        spec += f" -j {target}"
        if target == "REDIRECT":
            spec += f" --to-ports {self.to_port}"
        elif target == "REJECT":
            spec += f" --reject-with {self.reject_with}"
        elif target == "DNAT":
            spec += f" --to-destination {join_host_port(self.to_addr, self.to_port)}"
        _set(self, "spec", spec)

    def __hash__(self) -> int:
        # The text's own hash, which the str caches: a hash of its own was an int object
        # and a slot more per rule (tens of thousands are kept). Rules of one chain (what
        # the planner puts in one set) differ in their text.
        return hash(self.spec)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Rule):
            return NotImplemented
        return (
            self.spec == other.spec
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


_SHARD_CHAINS = {base: tuple(shard_chain(base, i) for i in range(SHARDS)) for base in SHARDED}
"""Every shard's chain name, formatted once (`shard_chain`)."""


@functools.lru_cache(maxsize=64)
def _host_ips(settings: Settings) -> dict[Family, str]:
    return {4: settings.host_ip(4), 6: settings.host_ip(6)}


class _Renderer:
    """Accumulates the rules of one service port, skipping duplicates."""

    def __init__(self, settings: Settings, pp: ProxiedPort, explained: bool) -> None:
        self.s = settings
        self.explained = explained
        """Whether the rules say what they are for (`Rule.why`): only `explain` reads it,
        and a sync keeps every rule (a text each was ~2.5 MiB at 10,000 Services)."""
        self.served = settings.served
        self.rules: list[Rule] = []
        self.guards: list[Guard] = []
        """The proxy ports to refuse (`desired.guard_rules` makes the rules of a shard's ports)."""
        self.skipped: list[tuple[ServicePortName, str]] = []
        """ClusterIPs left without rules because the proxy ports do not serve their family."""
        self._seen: set[Rule] = set()
        info = pp.info
        self.name = str(info.name)
        """The comment of every rule of the port (`Rule` refuses an unsafe one)."""
        self.proto = _LOWER[info.protocol]
        self.dport = info.port

    def add(self, rule: Rule) -> None:
        if rule not in self._seen:
            self._seen.add(rule)
            self.rules.append(rule)

    def container(
        self,
        base: str,
        to: tuple[Family, str],
        dport: int,
        to_port: int,
        why: str,
        *,
        physdev_not_in: bool = False,
        dst_local: bool = False,
    ) -> None:
        """A rule for arriving packets to `to` (family, `-d` text): REDIRECT, or DNAT to a
        specific bind address."""
        family, dst = to
        chain = _SHARD_CHAINS[base][shard_for(base, dst, dport)]
        bind = self.s.bind_address
        target, to_addr = ("REDIRECT", "") if bind in _WILDCARDS else ("DNAT", bind)
        self.add(
            Rule(family, NAT, chain, target, self.name, self.proto, dst, dport, 0,
                 physdev_not_in, dst_local, to_port=to_port, to_addr=to_addr, why=why)
        )  # fmt: skip

    def host(
        self, base: str, to: tuple[Family, str], dport: int, to_port: int, why: str, *,
        dst_local: bool = False,
    ) -> None:  # fmt: skip
        """A rule for the node's own packets: DNAT to the node IP (or the bind address)."""
        family, dst = to
        to_addr = _host_ips(self.s)[family]
        if to_addr:
            chain = _SHARD_CHAINS[base][shard_for(base, dst, dport)]
            self.add(
                Rule(family, NAT, chain, "DNAT", self.name, self.proto, dst, dport, 0, False,
                     dst_local, to_port=to_port, to_addr=to_addr,
                     why=why and f"{why} via {to_addr}")
            )  # fmt: skip

    def destination(self, ip: str) -> tuple[Family, str] | None:
        """(family, `-d` text) of a portal address, or None if this proxy cannot serve it."""
        dst = _destination(ip)
        return dst if dst is not None and dst[0] in self.served else None

    def at(self, kind: str, ip: str) -> str:
        """What a `why` says of a portal address; "" unless `explained` (so is the `why`)."""
        if not self.explained:
            return ""
        return f"{self.proto.upper()} to {kind} {join_host_port(ip, self.dport)} ({self.name})"

    def port(self, pp: ProxiedPort) -> None:
        info, cport, ext = pp.info, pp.cluster_port, pp.external_port
        if cport == 0:
            return
        self.guards = port_guards(pp, self.s)
        families: set[Family] = set()
        for ip in info.cluster_ips:
            if (d := self.destination(ip)) is None:
                if ip_family(ip) is not None:
                    self.skipped.append((info.name, ip))
                continue
            families.add(d[0])
            at = self.at("ClusterIP", ip)
            self.container(CONTAINER_PORTALS, d, info.port, cport,
                           at and f"from pods: {at} -> proxy port {cport}")  # fmt: skip
            self.host(HOST_PORTALS, d, info.port, cport,
                      at and f"from this node: {at} -> proxy port {cport}")  # fmt: skip
        if ext == 0:
            return
        for ip in info.load_balancer_ips:
            if (d := self.destination(ip)) is None or d[0] not in families:
                continue
            at = self.at("LoadBalancer IP", ip)
            why = at and f"from pods and the network: {at} -> proxy port {ext}"
            self.container(CONTAINER_PORTALS, d, info.port, ext, why)
            self.host(HOST_PORTALS, d, info.port, ext,
                      at and f"from this node: {at} -> proxy port {ext}")  # fmt: skip
        for ip in info.external_ips:
            if (d := self.destination(ip)) is None or d[0] not in families:
                continue
            at = self.at("external IP", ip)
            if self.s.physdev:
                self.container(CONTAINER_PORTALS, d, info.port, ext,
                               at and f"from the network (not via a bridge port): {at} -> proxy"
                               f" port {ext}", physdev_not_in=True)  # fmt: skip
            else:
                self.container(CONTAINER_PORTALS, d, info.port, ext,
                               at and f"from pods and the network: {at} -> proxy port"
                               f" {ext}")  # fmt: skip
            self.container(CONTAINER_PORTALS, d, info.port, ext,
                           at and f"from pods, when the IP is this node's: {at} -> proxy port"
                           f" {ext}", dst_local=True)  # fmt: skip
            self.host(HOST_PORTALS, d, info.port, ext,
                      at and f"from this node, when the IP is its own: {at} -> proxy port {ext}",
                      dst_local=True)  # fmt: skip
        if info.node_port:
            for family in sorted(families):
                self.node_port(family, pp)

    def node_port(self, family: Family, pp: ProxiedPort) -> None:
        np, ext, name, proto = pp.info.node_port, pp.external_port, self.name, self.proto
        dsts = self.s.nodeport_dsts(family)
        explained = self.explained
        for dst in dsts:
            where = f"local addresses in {dst}" if dst else "any local address"
            at = f"{proto.upper()} to NodePort {np} on {where} ({name})" if explained else ""
            why = at and f"from pods and the network: {at} -> proxy port {ext}"
            self.container(CONTAINER_NODEPORTS, (family, dst), np, ext, why)
            self.host(HOST_NODEPORTS, (family, dst), np, ext,
                      at and f"from this node: {at} -> proxy port {ext}")  # fmt: skip
        if dsts:
            chain = _SHARD_CHAINS[NON_LOCAL_NODEPORTS][ext // PORTS_PER_SHARD]
            self.add(
                Rule(family, FILTER, chain, "ACCEPT", name, proto, dport=ext, state_new=True,
                     ctstate="DNAT",
                     why=f"accept new {proto.upper()} connections to proxy port {ext} (NodePort"
                     f" {np} of {name}) even under a default-deny INPUT policy" if explained
                     else "")
            )  # fmt: skip


Guard = tuple[Family, str, str, int]
"""A proxy port to refuse: (family, its `KUBE-PROXY-PORTS` shard, protocol, port)."""

_LOWER = {"TCP": "tcp", "UDP": "udp", "SCTP": "sctp"}
"""A protocol's name in the rules: one string each, not one per rule."""


def port_guards(pp: ProxiedPort, settings: Settings) -> list[Guard]:
    """The proxy ports of `pp` to refuse, in each family they are served in (none without
    `Settings.guard`, or a cluster port): cheap, so computed again to forget them."""
    cport, ext = pp.cluster_port, pp.external_port
    if not settings.guard or cport == 0:
        return []
    proto = _LOWER[pp.info.protocol]
    chains = _SHARD_CHAINS[PROXY_PORTS]
    return [
        (family, chains[port // PORTS_PER_SHARD], proto, port)
        for family in sorted(served_families(settings.bind_address))
        for port in sorted({cport, ext} - {0})
    ]


def render_port(
    pp: ProxiedPort, settings: Settings, *, explained: bool = False
) -> tuple[tuple[Rule, ...], tuple[Guard, ...], list[tuple[ServicePortName, str]]]:
    """One service port's rules, each in its shard (`shard_for`), without duplicates; its
    proxy ports to guard (`desired.guard_rules` makes their rules, shard by shard); and
    (service port, ClusterIP) for each ClusterIP of a family the proxy ports do not serve.
    The rules say what they are for (`Rule.why`) only when `explained`."""
    r = _Renderer(settings, pp, explained)
    try:
        r.port(pp)
    except ValueError as exc:  # one bad port never fails the whole table's commit
        log.error("no rules for service port %r: %s", str(pp.info.name)[:300], exc)
        r.rules, r.guards = [], []
    return tuple(r.rules), tuple(r.guards), r.skipped


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
