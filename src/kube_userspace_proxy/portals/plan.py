"""From desired rules and what a table holds to the operations that make them equal.

The backends read a table into a `TableView` (a fingerprint of each of our chains, and every
rule of a built-in chain that jumps into one of them) and execute a list of `Op`s as one atomic
commit. The diff lives here, once, for both backends: a chain whose fingerprint is the one
recorded after our last commit still holds exactly what we believe, so only the difference is
applied; any other chain (flushed, edited, deleted by hand) is rewritten whole. A rule that
replaces one with the same match goes to the head of its chain, so that the deletes that no
packet's fate depends on can wait for a second commit (`update(defer=True)`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from kube_userspace_proxy.addresses import Family
from kube_userspace_proxy.portals.rules import CHAINS, FILTER, PROXY_PORTS, Rule, base_chain

REWRITE_MIN = 256
"""A chain losing more than this many rules (and half of them) is rewritten, not edited."""


@dataclass(frozen=True, slots=True)
class Found:
    """A rule in a built-in chain whose target is one of our chains, as the kernel holds it."""

    chain: str
    target: str
    index: int
    """Position in its chain, from 0."""
    spec: str = ""
    """Its iptables-save text without `-A CHAIN`, when the backend reads text."""


@dataclass(frozen=True, slots=True)
class TableView:
    """What one table holds of ours: a fingerprint per existing chain, and the jumps into them."""

    chains: Mapping[str, Hashable] = field(default_factory=dict)
    jumps: tuple[Found, ...] = ()
    referenced: frozenset[str] = frozenset()
    """Our chains that rules of someone else's chains jump to (they cannot be deleted)."""


@dataclass(frozen=True, slots=True)
class ResetChain:
    """Create the chain, or flush it if it exists."""

    chain: str


@dataclass(frozen=True, slots=True)
class DropChain:
    """Flush and delete the chain (cleanup)."""

    chain: str


@dataclass(frozen=True, slots=True)
class Append:
    """Append the rule to its chain."""

    rule: Rule


@dataclass(frozen=True, slots=True)
class Prepend:
    """Insert the rule at the head of its chain."""

    rule: Rule


@dataclass(frozen=True, slots=True)
class Delete:
    """Delete one rule: by position (libiptc) or by its text (iptables-restore)."""

    chain: str
    index: int
    spec: str


Op = ResetChain | DropChain | Append | Prepend | Delete


class Backend(Protocol):
    """Reads and writes the kernel's tables for one iptables mode (legacy or nft)."""

    name: str
    mode: str
    defers_deletes: bool
    """Whether `Portals.apply` should leave the deletes that can wait to a second commit
    (`update(defer=True)`): worth it where a commit costs in proportion to what it changes."""

    def locked(self, family: Family) -> AbstractContextManager[None]:
        """Hold the xtables lock from a read to its commit, where the backend needs it."""
        ...

    def tables(self, family: Family) -> frozenset[str]:
        """The tables that exist now (reading them must not create them)."""
        ...

    def read(self, family: Family, table: str) -> TableView:
        """Everything the table holds of ours, read from the kernel now."""
        ...

    def glance(self, family: Family, table: str, believed: TableView) -> TableView:
        """The cheap check: `believed` with the jumps into our chains and the fixed chains
        (`CHAINS[table]`: the entry chains and the canary) as the kernel holds them now.
        A backend that can tell nothing was committed since may answer from memory."""
        ...

    def saved(self, family: Family, table: str) -> Mapping[str, tuple[str, ...]]:
        """Our chains' rules as `iptables-save` prints them after `-A CHAIN`, in order.

        Read-only; empty when the table or the family's tools do not exist.
        """
        ...

    def commit(
        self, family: Family, table: str, ops: Sequence[Op], base: TableView | None = None
    ) -> TableView | None:
        """Apply `ops` in order as one atomic change of `table`; PortalsError on failure.

        `base` is the table the ops were planned against. Returns the table as the commit
        left it when the backend knows it without reading it again (None: call `read`).
        """
        ...


@dataclass(frozen=True, slots=True)
class TableRules:
    """The desired content of one table: our chains' rules and the jumps into them."""

    family: Family
    table: str
    chains: Mapping[str, tuple[Rule, ...]]
    jumps: tuple[Rule, ...]


def group(rules: Sequence[Rule]) -> dict[tuple[Family, str], TableRules]:
    """A rendered list split by family and table, every chain of ours present in each."""
    chains: dict[tuple[Family, str], dict[str, list[Rule]]] = {}
    jumps: dict[tuple[Family, str], list[Rule]] = {}
    for rule in rules:
        key = (rule.family, rule.table)
        if key not in chains:
            chains[key] = {c: [] for c in CHAINS[rule.table]}
            jumps[key] = []
        if rule.is_jump:
            jumps[key].append(rule)
        else:
            chains[key].setdefault(rule.chain, []).append(rule)
    return {
        key: TableRules(key[0], key[1], {c: tuple(r) for c, r in cs.items()}, tuple(jumps[key]))
        for key, cs in chains.items()
    }


def empty(family: Family, table: str) -> TableRules:
    """The desired content of a table that no rule needs (our chains stay, empty)."""
    return TableRules(family, table, dict.fromkeys(CHAINS[table], ()), ())


@dataclass(slots=True)
class Plan:
    """Operations for one commit and what our chains hold once it succeeds."""

    ops: list[Op]
    chains: dict[str, tuple[Rule, ...]]
    repaired: list[str] = field(default_factory=list)
    """Chains or jumps that differed from what was applied (changed by someone else)."""
    deferred: int = 0
    """Deletes left for a later commit (`update(defer=True)`): `chains` still holds their rules."""


def _jump_ops(want: TableRules, view: TableView, *, force: bool) -> tuple[list[Op], list[Op]]:
    """Deletions and additions that leave exactly one of each wanted jump, in order."""
    found: dict[tuple[str, str], list[Found]] = {}
    for f in view.jumps:
        found.setdefault((f.chain, f.target), []).append(f)
    wanted = {(j.chain, j.target) for j in want.jumps}
    broken = {key for key, fs in found.items() if key not in wanted or len(fs) != 1}
    broken |= {key for key in wanted if key not in found}
    if force:
        broken |= set(found) | wanted
    # The portal jump must come before the NodePort jump of the same built-in chain.
    for j in want.jumps:
        mine = [f for f in view.jumps if f.chain == j.chain]
        if (
            not j.prepend
            and any(f.target == j.target for f in mine)
            and mine[-1].target != j.target
        ):
            broken |= {(j.chain, f.target) for f in mine}
    deletes: list[Op] = [
        Delete(f.chain, f.index, f.spec) for key in broken for f in found.get(key, ())
    ]
    adds: list[Op] = []
    for j in want.jumps:
        if (j.chain, j.target) in broken:
            adds.append(Prepend(j) if j.prepend else Append(j))
    return deletes, adds


def _ordered(
    deletes: list[Op], resets: list[Op], drops: list[Op], adds: list[Op], jumps: list[Op]
) -> list[Op]:
    # Deleting by position stays correct only from the highest position down, per chain.
    deletes.sort(key=lambda op: (op.chain, -op.index) if isinstance(op, Delete) else ("", 0))
    # A chain is dropped once the entry chain's jump to it is gone (deleted or reset above).
    return [*deletes, *resets, *drops, *adds, *jumps]


def _drops(want: TableRules, view: TableView) -> list[Op]:
    """Our chains the table holds but no rule needs (a shard emptied, an earlier run's)."""
    return [
        ResetChain(c) if c in view.referenced else DropChain(c)
        for c in sorted(view.chains)
        if c not in want.chains
    ]


def replace_all(want: TableRules, view: TableView) -> Plan:
    """Replace whatever the table holds of ours (the first sync of a run, a full repair)."""
    deletes, jumps = _jump_ops(want, view, force=True)
    resets: list[Op] = [ResetChain(c) for c in want.chains]
    adds: list[Op] = [Append(r) for rules in want.chains.values() for r in rules]
    drops = _drops(want, view)
    return Plan(_ordered(deletes, resets, drops, adds, jumps), dict(want.chains))


def update(
    want: TableRules,
    view: TableView,
    applied: Mapping[str, tuple[Rule, ...]],
    fingerprints: Mapping[str, Hashable],
    *,
    defer: bool = False,
) -> Plan:
    """Only what differs from `applied`; chains that no longer match their fingerprint in full.

    A rule that replaces one with the very same match (a moved proxy port: the same
    `-d CIP -p tcp --dport 80` now REDIRECTs elsewhere) is inserted at the head of its chain,
    where it takes the old rule's packets at once. With `defer`, the deletes that can wait
    (`_can_wait`) are left out of this commit: `Plan.deferred` counts them, and `chains`
    keeps the rules they name, as the kernel then holds them. A later `update` of the same
    `want` without `defer` deletes them.
    """
    deletes, jumps = _jump_ops(want, view, force=False)
    repaired = [
        f"{op.rule.chain} -> {op.rule.target}" for op in jumps if isinstance(op, (Append, Prepend))
    ]
    resets: list[Op] = []
    adds: list[Op] = []
    chains: dict[str, tuple[Rule, ...]] = {}
    deferred = 0
    for chain, rules in want.chains.items():
        have = applied.get(chain)
        intact = chain in view.chains and view.chains[chain] == fingerprints.get(chain)
        if have is not None and not intact:
            repaired.append(chain)
        if have is not None and intact and have == rules:  # same objects: fast
            chains[chain] = rules
            continue
        if have is not None and intact:
            wanted = set(rules)
            gone = [i for i, r in enumerate(have) if r not in wanted]
            if not (len(gone) > REWRITE_MIN and 2 * len(gone) > len(have)):
                kept = set(have)
                new = [r for r in rules if r not in kept]
                ahead, shadowed = _shadowing(have, gone, new)
                stale = {i for i in gone if _can_wait(want.table, chain, i in shadowed)}
                stale = stale if defer else set()
                deferred += len(stale)
                deletes += [Delete(chain, i, have[i].spec) for i in gone if i not in stale]
                # Inserted last first, so that they lead the chain in their wanted order.
                adds += [Prepend(r) for r in reversed(ahead)]
                leading = set(ahead)
                behind = [r for r in new if r not in leading]
                left = set(gone) - stale
                staying = [r for i, r in enumerate(have) if i not in left]
                if defer and behind and base_chain(chain) == PROXY_PORTS:
                    waiting = _covered_guards(behind, staying)
                    if waiting:
                        deferred += len(waiting)
                        behind = [r for r in behind if r not in waiting]
                adds += [Append(r) for r in behind]
                after = (*ahead, *staying, *behind)
                chains[chain] = rules if after == rules else after  # keep `rules`: fast next time
                continue
        resets.append(ResetChain(chain))
        adds += [Append(r) for r in rules]
        chains[chain] = rules
    drops = _drops(want, view)
    return Plan(_ordered(deletes, resets, drops, adds, jumps), chains, repaired, deferred)


def _match(rule: Rule) -> str:
    """The rule's text before its target: which packets it takes."""
    return rule.spec.rpartition(" -j ")[0]


def _shadowing(
    have: tuple[Rule, ...], gone: list[int], new: list[Rule]
) -> tuple[list[Rule], set[int]]:
    """The new rules that take over a gone rule's match (its replacement: a moved proxy port),
    and the positions in `have` of the gone rules that no packet reaches after this commit.

    Put at the head of the chain, a replacement takes the old rule's packets the moment it is
    committed, whether the old rule is deleted in the same commit or later. Not where another
    service port's rule in the chain has the same destination and port (two Services claiming
    one address and port): at the head, the replacement would win over it, where it followed.
    A gone rule behind a kept one with its match (left by an earlier deferral) is unreachable
    already.
    """
    if not gone:
        return [], set()
    replaced: dict[str, list[int]] = {}
    for i in gone:
        replaced.setdefault(_match(have[i]), []).append(i)
    shadowed: set[int] = set()
    leaving = set(gone)
    for i, rule in enumerate(have):
        if i not in leaving:
            shadowed.update(j for j in replaced.get(_match(rule), ()) if j > i)
    pairs = [(r, replaced[m]) for r in new if (m := _match(r)) in replaced]
    if not pairs:
        return [], shadowed
    owners: dict[tuple[str, str, int], set[str]] = {}
    for r in (*have, *new):
        owners.setdefault((r.dst, r.protocol, r.dport), set()).add(r.comment)
    ahead: list[Rule] = []
    for rule, old in pairs:
        if len(owners[(rule.dst, rule.protocol, rule.dport)]) == 1:
            ahead.append(rule)
            shadowed.update(old)
    return ahead, shadowed


def _can_wait(table: str, chain: str, shadowed: bool) -> bool:
    """Whether deleting a rule that is no longer wanted can wait for a later commit.

    Deleting a rule costs a commit ~10 ms more than adding one (the kernel frees the old
    rules before it answers), so the deletes that change no packet's fate are left for a
    commit off the latency path:
    - a rule shadowed by its replacement at the head of the chain (`_shadowing`): no packet
      reaches it any more;
    - a filter shard's rule: a proxy port's guard (REJECT) or its NodePort ACCEPT. A stale
      guard refuses new connections that no nat rule rewrote, made straight to a port that
      no service port is served on now; a stale ACCEPT lets through only connections a nat
      rule sent to that port, and no nat rule names it after this commit. Neither port is
      handed out again before the deferred deletes are committed (the proxier releases
      retired ports only then).
    A guard range that a port leaving its run splits in two waits with the old range's
    delete: until then the old range refuses the ports of both halves (`_covered_guards`).
    Any other nat rule (a removed Service's) still takes packets: it goes at once. So do
    emptied shards and the jumps to them (a chain is deleted only once nothing jumps to it).
    """
    return shadowed or (table == FILTER and chain not in CHAINS[FILTER])


def _covered_guards(new: list[Rule], staying: list[Rule]) -> set[Rule]:
    """The new guard rules (`desired.guard_rules` ranges) whose every port a guard staying in the
    chain already refuses: adding them can wait for the commit of the deferred deletes.

    A port leaving a run of proxy ports splits the run's rule in two; until the old rule is
    deleted (later, `_can_wait`), it refuses the ports of both halves, so the halves change no
    packet's fate before then and go into that later commit with the delete.
    """
    spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for rule in staying:  # a guard shard holds guard rules only
        key = (rule.protocol, rule.reject_with)
        spans.setdefault(key, []).append((rule.dport, rule.dport_hi or rule.dport))
    waiting: set[Rule] = set()
    for rule in new:
        lo, hi = rule.dport, rule.dport_hi or rule.dport
        have = spans.get((rule.protocol, rule.reject_with), ())
        if any(a <= lo and hi <= b for a, b in have):
            waiting.add(rule)
    return waiting


def cleanup(table: str, view: TableView) -> list[Op]:
    """Remove every jump into our chains from built-in chains, then the chains themselves:
    the entry chains first (their jumps to the shards go with them), then the shards."""
    deletes: list[Op] = [Delete(f.chain, f.index, f.spec) for f in view.jumps]
    order = [c for c in CHAINS[table] if c in view.chains]
    order += sorted(c for c in view.chains if c not in CHAINS[table])
    drops: list[Op] = [
        ResetChain(chain) if chain in view.referenced else DropChain(chain) for chain in order
    ]
    return _ordered(deletes, [], drops, [], [])


def ops_summary(ops: Sequence[Op]) -> Iterator[str]:
    """Short text of each op, for debug logs."""
    for op in ops:
        if isinstance(op, (Append, Prepend)):
            yield f"{type(op).__name__.lower()} {op.rule.line}"
        else:
            yield repr(op)
