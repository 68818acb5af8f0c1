"""The whole desired rule set, kept per service port and per shard, updated for changed ports.

Every sync hands over all service ports, but `Desired.update` renders only those whose
`ProxiedPort` changed (the proxier keeps an unchanged Service's `info` object, so most are
passed over by identity; equal copies by comparison), and rebuilds only the shard chains
those ports' rules live in (one port's rules may span several shards: each rule goes to the
shard of its destination address or port), plus an entry chain's jumps when one of its shards
appears or empties (or, for a port shard, gains or loses a protocol).
A `KUBE-PROXY-PORTS` shard holds its proxy ports' guards, merged into port ranges
(`guard_rules`).
One changed Service among 10,000 costs a few shards' work; the chains of every other shard
stay the very same tuples, which the planner then compares by identity.

`render` and `explain` give the same rules as one list (the `rules` subcommand, tests).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import chain as chain_of

from kube_userspace_proxy.addresses import Family, ip_family
from kube_userspace_proxy.model import ProxiedPort, ServicePortName
from kube_userspace_proxy.portals.plan import TableRules
from kube_userspace_proxy.portals.rules import (
    CHAINS,
    DST_SHARDED,
    FILTER,
    PROXY_PORTS,
    TABLES,
    Rule,
    base_chain,
    jumps,
    port_guards,
    render_port,
    shard_jumps,
)
from kube_userspace_proxy.portals.settings import Settings

_ChainKey = tuple[Family, str, str]
"""(family, table, chain)."""


_Order = tuple[str, str, str, str]
"""A service port name as a plain tuple of strings: it sorts, and hashes, in C (a
`ServicePortName`'s hash is a Python call), and its order is the rules' order in a shard."""


def _order(name: ServicePortName) -> _Order:
    return (name.namespace, name.name, name.port, name.protocol)


class Desired:
    """The rules wanted for the service ports last given, grouped by table and chain."""

    def __init__(self, settings: Settings, *, explained: bool = False) -> None:
        self.settings = settings
        self.explained = explained
        """Whether the rules say what they are for (`Rule.why`, for `explain`)."""
        self.skipped: list[tuple[ServicePortName, str]] = []
        """ClusterIPs of unserved families, from the ports rendered by the last update."""
        self._reset()

    def _reset(self) -> None:
        self._ports: dict[ServicePortName, ProxiedPort] = {}
        self._rules: dict[ServicePortName, tuple[Rule, ...]] = {}
        self._guarded: dict[_ChainKey, dict[tuple[str, int], str]] = {}
        """Per `KUBE-PROXY-PORTS` shard, its proxy ports ((protocol, port) -> service port).
        A port's guards are not kept: `port_guards` gives them again to forget them."""
        self._members: dict[_ChainKey, dict[_Order, Rule | tuple[Rule, ...]]] = {}
        """Per shard chain, the rules of each service port in it: most have one there, kept
        as it is (a tuple of one each was 1 MiB at 10,000 Services)."""
        self._shards: dict[tuple[Family, str], dict[str, tuple[Rule, ...]]] = {}
        self._entries: dict[_ChainKey, dict[int, tuple[tuple[str, ...], tuple[Rule, ...]]]] = {}
        """Per entry chain, the jumps to each of its shards in use (and the protocols of a port
        shard's jumps)."""
        self._entry_rules: dict[_ChainKey, tuple[Rule, ...]] = {}
        self._builtin: dict[Family, list[Rule]] = {}

    def set_settings(self, settings: Settings) -> None:
        """New node facts: every port is rendered again by the next update."""
        if settings != self.settings:
            self.settings = settings
            self._reset()

    def names(self) -> Iterable[ServicePortName]:
        """The service ports of the last update."""
        return self._ports.keys()

    def update(self, ports: Iterable[ProxiedPort]) -> int:
        """Bring the desired rules to `ports` (all of them); how many ports changed."""
        self.skipped = []
        old = self._ports
        new: dict[ServicePortName, ProxiedPort] = {}
        changed: list[ProxiedPort] = []
        kept = 0
        for pp in ports:
            new[pp.info.name] = pp
            prev = old.get(pp.info.name)
            if prev is pp:  # the proxier keeps an unchanged target's very object
                kept += 1
                continue
            if prev is not None:
                kept += 1
            if (
                prev is None
                or prev.cluster_port != pp.cluster_port
                or prev.external_port != pp.external_port
                or (prev.info is not pp.info and prev.info != pp.info)
            ):
                changed.append(pp)
        removed = old.keys() - new.keys() if kept < len(old) else set()
        self._ports = new
        dirty: set[_ChainKey] = set()
        for name in removed:
            self._forget(old[name], dirty)
        members = self._members
        rendered: dict[ServicePortName, ProxiedPort] = {}  # a name given twice: the first
        for pp in changed:
            name = pp.info.name
            if name in self._rules:
                self._forget(rendered.get(name) or old[name], dirty)
            rendered[name] = pp
            rules, guards, skipped = render_port(pp, self.settings, explained=self.explained)
            if skipped:
                self.skipped += skipped
            self._rules[name] = rules
            if guards:
                text = rules[0].comment if rules else str(name)  # the same string
                for family, shard, protocol, port in guards:
                    key = (family, FILTER, shard)
                    if (guarded := self._guarded.get(key)) is None:
                        guarded = self._guarded[key] = {}
                    guarded.setdefault((protocol, port), text)
                    dirty.add(key)
            order = _order(name)
            for rule in rules:
                key = (rule.family, rule.table, rule.chain)
                if (chain := members.get(key)) is None:
                    chain = members[key] = {}
                have = chain.get(order)
                if have is None:
                    chain[order] = rule
                else:
                    chain[order] = (have, rule) if isinstance(have, Rule) else (*have, rule)
                dirty.add(key)
        entries: set[_ChainKey] = set()
        for key in dirty:
            self._rebuild(key, entries)
        for key in entries:  # once each, however many of its shards changed
            entry = self._entries[key]
            self._entry_rules[key] = tuple(
                chain_of.from_iterable(entry[i][1] for i in sorted(entry))
            )
        return len(changed) + len(removed)

    def _forget(self, pp: ProxiedPort, dirty: set[_ChainKey]) -> None:
        """Take out the rules and guards of `pp`, as the last update had it."""
        name = pp.info.name
        order = _order(name)
        for rule in self._rules.pop(name, ()):
            key = (rule.family, rule.table, rule.chain)
            if self._members.get(key, {}).pop(order, None) is not None:
                dirty.add(key)
        # Only the guards it holds: a port that failed to render added none (nor were they
        # another's: a proxy port serves one service port).
        text = str(name)
        for family, shard, protocol, port in port_guards(pp, self.settings):
            key = (family, FILTER, shard)
            ports = self._guarded.get(key, {})
            if ports.get((protocol, port)) == text:
                del ports[(protocol, port)]
                dirty.add(key)

    def _rebuild(self, key: _ChainKey, entries: set[_ChainKey]) -> None:
        """Rebuild a shard chain from its members; add its entry chain to `entries` when
        that chain's jumps to its shards must be rebuilt too."""
        family, table, chain = key
        shards = self._shards.setdefault((family, table), {})
        base = base_chain(chain)
        if base == PROXY_PORTS:
            guarded = self._guarded.get(key)
            rules = guard_rules(family, chain, guarded) if guarded else ()
        else:
            members = self._members.get(key)
            rules = _in_order(members) if members else ()
        entry = self._entries.setdefault((family, table, base), {})
        index = int(chain[-2:], 16)
        if rules:
            shards[chain] = rules
            protocols = () if base in DST_SHARDED else tuple(sorted({r.protocol for r in rules}))
            have = entry.get(index)
            if have is not None and have[0] == protocols:
                return
            entry[index] = (protocols, shard_jumps(family, table, base, index, protocols))
        else:
            self._members.pop(key, None)
            self._guarded.pop(key, None)
            shards.pop(chain, None)
            if entry.pop(index, None) is None:
                return
        entries.add((family, table, base))

    def families(self, wanted: Iterable[Family]) -> list[Family]:
        """The families to hold rules: those served among `wanted`, and any a rule needs."""
        served = self.settings.served
        used = {f for f in wanted if f in served}
        used |= {f for (f, _), shards in self._shards.items() if shards}
        return sorted(used or set(sorted(served)[:1]))

    def tables(self, families: Iterable[Family]) -> dict[tuple[Family, str], TableRules]:
        """The desired content of each table of the families in use (see `families`)."""
        out: dict[tuple[Family, str], TableRules] = {}
        for family in self.families(families):
            builtin = self._builtin.get(family)
            if builtin is None:
                builtin = self._builtin[family] = jumps(family)
            for table in TABLES:
                chains: dict[str, tuple[Rule, ...]] = {
                    c: self._entry_rules.get((family, table, c), ()) for c in CHAINS[table]
                }
                chains.update(self._shards.get((family, table), {}))
                table_jumps = tuple(j for j in builtin if j.table == table)
                out[(family, table)] = TableRules(family, table, chains, table_jumps)
        return out

    def rules(self, families: Iterable[Family]) -> list[Rule]:
        """Every desired rule as one list: per family and table, the built-in chains' jumps,
        the entry chains' jumps to their shards, then the shards in name order."""
        out: list[Rule] = []
        for want in self.tables(families).values():
            out += want.jumps
            for chain in CHAINS[want.table]:
                out += want.chains[chain]
            shards = sorted(c for c in want.chains if c not in CHAINS[want.table])
            for chain in shards:
                out += want.chains[chain]
        return out


def guard_rules(
    family: Family, chain: str, ports: Mapping[tuple[str, int], str]
) -> tuple[Rule, ...]:
    """The guard rules of a `KUBE-PROXY-PORTS` shard, from its proxy ports ((protocol, port)
    -> the service port's name): each run of consecutive ports of one protocol is one rule with
    a port range (`--dport LO:HI`), ordered by protocol and port.

    The allocator hands out ports in sequence, so 10,000 service ports' guards become a few
    dozen rules, where each rule costs the kernel about as much to commit (and a new
    connection to walk) as a NodePort or portal rule. A range covers only ports that are
    proxy ports now. A port alone keeps its own rule, named after its service port; a range
    is named by its ports (`proxy ports LO-HI`): no single Service owns it.
    """
    out: list[Rule] = []
    keys = sorted(ports)
    start = 0
    for i in range(1, len(keys) + 1):
        if i < len(keys) and keys[i] == (keys[i - 1][0], keys[i - 1][1] + 1):
            continue
        (proto, lo), hi = keys[start], keys[i - 1][1]
        if proto == "tcp":
            reject = "tcp-reset"
        else:
            reject = "icmp6-port-unreachable" if family == 6 else "icmp-port-unreachable"
        if lo == hi:
            name = ports[keys[start]]
            why = (f"refuse {proto.upper()} connections made straight to proxy port {lo}"
                   f" ({name}): only the nat rules may send traffic there")  # fmt: skip
        else:
            name = f"proxy ports {lo}-{hi}"
            why = (f"refuse {proto.upper()} connections made straight to proxy ports {lo} to"
                   f" {hi} ({i - start} proxy ports in a row): only the nat rules may send"
                   " traffic there")  # fmt: skip
        out.append(Rule(family, FILTER, chain, "REJECT", name, proto, dport=lo,
                        dport_hi=hi if hi != lo else 0, reject_with=reject, why=why))  # fmt: skip
        start = i
    return tuple(out)


def _in_order(members: dict[_Order, Rule | tuple[Rule, ...]]) -> tuple[Rule, ...]:
    """A shard's rules: its service ports' in name order."""
    out: list[Rule] = []
    for key in sorted(members):
        rules = members[key]
        if isinstance(rules, Rule):
            out.append(rules)
        else:
            out += rules
    return tuple(out)


def render(
    ports: Iterable[ProxiedPort],
    settings: Settings,
    *,
    families: Iterable[Family] = (),
    skipped: list[tuple[ServicePortName, str]] | None = None,
    explained: bool = False,
) -> list[Rule]:
    """Every rule for `ports` (see `Desired.rules`). A family is in use when a rule needs it
    or it is listed in `families` and served (else the first family served). `skipped`
    receives (service port, ClusterIP) for each ClusterIP of an unserved family. The rules
    say what they are for (`Rule.why`) only when `explained`."""
    desired = Desired(settings, explained=explained)
    desired.update(ports)
    if skipped is not None:
        skipped.extend(desired.skipped)
    return desired.rules(families)


def explain(
    ports: Iterable[ProxiedPort],
    *,
    node_ips: Sequence[str] = (),
    bind_address: str = "0.0.0.0",
    nodeport_addresses: Sequence[str] = (),
    physdev: bool = True,
    guard: bool = True,
    node_families: frozenset[Family] | None = None,
    left_out: list[tuple[str, str, str]] | None = None,
) -> list[tuple[str, str]]:
    """(iptables-save line, one-line explanation) for every rule, for `rules` and the demo.

    The explanation names the table when it is not nat and the family when it is IPv6.
    `left_out` receives (service port, ClusterIP, why) for each ClusterIP that gets no rules
    (see `Settings.left_out`).
    """
    settings = Settings(
        tuple(node_ips), bind_address, tuple(nodeport_addresses), physdev, guard, node_families
    )
    out = []
    families = {ip_family(ip) or 4 for ip in node_ips}
    skipped: list[tuple[ServicePortName, str]] = []
    rules = render(ports, settings, families=families, skipped=skipped, explained=True)
    if left_out is not None:
        left_out += [
            (str(name), ip, settings.left_out(family))
            for name, ip in skipped
            if (family := ip_family(ip)) is not None
        ]
    for rule in rules:
        tags = ["IPv6"] if rule.family == 6 else []
        tags += ["filter table"] if rule.table == FILTER else []
        out.append((rule.line, (" ".join(tags) + ": " if tags else "") + rule.why))
    return out
