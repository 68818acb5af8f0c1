"""Portals: keep the kernel's rules equal to the desired ones for the service ports given.

`Portals.apply` takes the full desired state, renders only the service ports that changed
(`desired`), and commits only the difference, one atomic commit per table. Each apply first
checks cheaply for tampering (`Backend.glance`: the canary chain, the jumps into our chains
and the entry chains; in nft mode nothing at all while nobody committed): a missing canary
means the table was flushed or reloaded, and everything of ours in it is rewritten; any other
difference is read in full and repaired exactly. Every `verify_period` the tables are read in
full (fingerprints of every chain, shards included) and whatever differs is put back. The
first apply of a run replaces whatever an earlier run left; before it, `claimed_ports` tells
which proxy port those rules send each service port to, so a restart can take the same ports.

Deleting a rule costs a commit more than adding one (the kernel frees the old rules before it
answers), so where the backend says it pays (`Backend.defers_deletes`), `apply` commits what
makes the change live and leaves the deletes that change no packet's fate (a moved port's old
rules, shadowed by their replacements at the head of their chains; a released proxy port's
filter rules) to `commit_deferred`, which the caller runs next, off the latency path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

from kube_userspace_proxy import logs
from kube_userspace_proxy.addresses import Family, ip_family
from kube_userspace_proxy.errors import PortalsError
from kube_userspace_proxy.model import ClaimKey, ProxiedPort, ServicePortName
from kube_userspace_proxy.portals import plan
from kube_userspace_proxy.portals.backends import cleanup_all, kernel_has_match
from kube_userspace_proxy.portals.desired import Desired
from kube_userspace_proxy.portals.flows import StaleFlows
from kube_userspace_proxy.portals.plan import Backend, Found, TableView
from kube_userspace_proxy.portals.restore import counted
from kube_userspace_proxy.portals.returnpath import ReturnPath
from kube_userspace_proxy.portals.rules import (
    CANARY,
    CHAINS,
    CONTAINER_NODEPORTS,
    CONTAINER_PORTALS,
    NAT,
    TABLES,
    Rule,
    base_chain,
    claimed,
    is_ours,
)
from kube_userspace_proxy.portals.settings import Settings

VERIFY_PERIOD = 3600.0
"""Seconds between full reads of our tables (`--iptables-verify-period`): kube-proxy's
`FullSyncPeriod`, one hour."""

log = logs.get(__name__)


@dataclass(frozen=True, slots=True)
class _Applied:
    """What one table held of ours after our last commit."""

    chains: dict[str, tuple[Rule, ...]]
    fingerprints: dict[str, Hashable]
    jumps: tuple[Found, ...]
    referenced: frozenset[str]
    verified: float
    """When the table was last read in full (time.monotonic)."""

    def believed(self) -> TableView:
        """The table as our last commit left it."""
        return TableView(self.fingerprints, self.jumps, self.referenced)


@dataclass(slots=True)
class _Pending:
    """One table between its check and its commit."""

    family: Family
    table: str
    want: plan.TableRules
    applied: _Applied | None
    view: TableView
    step: plan.Plan
    verified: float


class Portals:
    """Keeps the kernel's rules equal to the desired ones for the service ports it is given."""

    def __init__(
        self,
        backend: Backend,
        *,
        node_ips: Sequence[str] = (),
        bind_address: str = "0.0.0.0",
        nodeport_addresses: Sequence[str] = (),
        physdev: bool | None = None,
        guard_proxy_ports: bool = True,
        node_families: frozenset[Family] | None = None,
        verify_period: float = VERIFY_PERIOD,
        clock: Callable[[], float] = time.monotonic,
        transparent: tuple[int, int] | None = None,
        flows: StaleFlows | None = None,
    ) -> None:
        if physdev is None:
            physdev = kernel_has_match("physdev")
            if not physdev:
                log.warning(
                    "the kernel has no physdev match: external IP rules will also capture"
                    " traffic from pods on a bridge"
                )
        self.backend = backend
        self._settings = Settings(
            tuple(node_ips),
            bind_address,
            tuple(nodeport_addresses),
            physdev,
            guard_proxy_ports,
            node_families,
        )
        self.verify_period = verify_period
        """Seconds between full reads of our tables; each apply in between checks cheaply."""
        self._clock = clock
        self.return_path = (
            ReturnPath(backend.mode, *transparent) if transparent is not None else None
        )
        """--preserve-source-ip's (mark, table): its return path, kept with every apply."""
        self.flows = flows
        """Deletes the UDP flows each commit makes stale (None: left to idle out)."""
        self._desired = Desired(self._settings)
        self._applied: dict[tuple[Family, str], _Applied] = {}
        self._defer = backend.defers_deletes
        # Tables whose last commit left deletes for `commit_deferred`, with what they want.
        self._deferred: dict[tuple[Family, str], plan.TableRules] = {}
        self._leftovers_found: set[tuple[Family, str]] = set()
        self._lock = threading.Lock()
        self._warned_no_node_ip: set[Family] = set()
        self._warned_unserved: set[ServicePortName] = set()
        self.commits = 0
        """Commits made (a sync with nothing to change makes none)."""
        self.repairs = 0
        """Tables found changed by someone else at a sync (and put back), counted per table."""
        self.verifies = 0
        """Full reads of a table at the verify period (not counting first syncs and repairs)."""

    def set_node_ips(self, node_ips: Sequence[str]) -> None:
        """The node's IPs changed (the node's own traffic is DNATed to them)."""
        if tuple(node_ips) != self._settings.node_ips:
            self._settings = replace(self._settings, node_ips=tuple(node_ips))
            self._desired.set_settings(self._settings)

    def _families(self) -> set[Family]:
        families = {f for ip in self._settings.node_ips if (f := ip_family(ip))}
        return families | {f for f, _ in self._applied} | {f for f, _ in self._leftovers_found}

    def _update(self, ports: Sequence[ProxiedPort]) -> None:
        self._desired.update(ports)
        self._warn_unserved(self._desired.skipped)

    def render(self, ports: Sequence[ProxiedPort]) -> list[Rule]:
        """The complete desired rule set for `ports` (what `apply` makes the kernel hold)."""
        with self._lock:
            self._update(ports)
            return self._desired.rules(self._families())

    def apply(self, ports: Sequence[ProxiedPort]) -> None:
        """Make `ports`' rules the ones that take packets; blocking; PortalsError on failure.

        Once it returns, every packet meets the rules for `ports`. The kernel may still hold
        rules no packet reaches or that change no packet's fate (`plan.update(defer=True)`):
        `commit_deferred` deletes them, and should follow at once.
        """
        with self._lock:
            if not self._applied:
                self._leftovers_found = self._leftovers()
            if self.return_path is not None:
                # Before the rules: replies to transparent dials must find their way first.
                self.return_path.ensure()
            self._update(ports)
            wanted = self._desired.tables(self._families())
            # Tables of a family no longer served are emptied (plan.empty), not left behind.
            keys = set(wanted) | set(self._applied) | self._leftovers_found
            self._warn_missing_node_ips({f for f, _ in wanted})
            errors: list[PortalsError] = []
            tables = [
                (family, table, wanted.get((family, table)) or plan.empty(family, table))
                for family, table in sorted(keys)
            ]
            self._sync_all(tables, errors, defer=self._defer)
            if errors:
                raise errors[0]
            if self.flows is not None:  # live now: flows the old rules made may go
                self.flows.committed(
                    rule
                    for want in wanted.values()
                    for rules in want.chains.values()
                    for rule in rules
                )

    def commit_deferred(self) -> None:
        """Commit the deletes the last `apply` left for later; blocking; PortalsError on failure.

        Each such table is planned again against the same desired rules, without deferring
        anything (so nothing waits for a second round), checked for tampering like any apply.
        A failed commit is retried as a replacement of our chains in that table, as an apply's
        is; if that fails too, the table is read in full at the next apply, which finds the
        stale rules and deletes them. No-op when nothing waits.
        """
        with self._lock:
            keys = sorted(k for k in self._deferred if k in self._applied)
            tables = [(family, table, self._deferred[(family, table)]) for family, table in keys]
            self._deferred.clear()
            errors: list[PortalsError] = []
            self._sync_all(tables, errors, defer=False)
            if errors:
                raise errors[0]

    def _sync_all(
        self,
        tables: list[tuple[Family, str, plan.TableRules]],
        errors: list[PortalsError],
        *,
        defer: bool,
    ) -> None:
        if hasattr(self.backend, "commit_many"):
            self._sync_together(tables, errors, defer=defer)
            return
        for family, table, want in tables:
            try:
                self._sync(family, table, want, defer=defer)
            except PortalsError as exc:
                log.error("iptables %s table (IPv%d): %s", table, family, exc)
                errors.append(exc)

    def rule_counts(self) -> dict[str, int]:
        """Rules in our chains after the last commit, per table (both families summed)."""
        counts: dict[str, int] = {}
        for (_, table), applied in self._applied.items():
            total = sum(len(rules) for rules in applied.chains.values())
            counts[table] = counts.get(table, 0) + total
        return counts

    def replace_all(self, ports: Sequence[ProxiedPort]) -> None:
        """Forget what was applied and replace our chains wholesale."""
        with self._lock:
            self._applied.clear()
            self._deferred.clear()
        self.apply(ports)

    def cleanup(self) -> int:
        """Remove our chains and jumps everywhere (see `cleanup_all`)."""
        with self._lock:
            self._applied.clear()
            self._deferred.clear()
            return cleanup_all()

    def _leftovers(self) -> set[tuple[Family, str]]:
        """Tables of another family that an earlier run left our chains in."""
        found: set[tuple[Family, str]] = set()
        for family in (4, 6):
            try:
                tables = self.backend.tables(family)
                found |= {
                    (family, t)
                    for t in TABLES
                    if t in tables and self.backend.read(family, t).chains
                }
            except PortalsError:
                continue
        return found

    def claimed_ports(self) -> dict[ClaimKey, int]:
        """The proxy ports the installed rules send traffic to, e.g. those of an earlier run.

        Keys are (`ns/name:port`, "TCP" or "UDP", "cluster" or "external"), read from both
        families' KUBE-PORTALS-CONTAINER and KUBE-NODEPORT-CONTAINER chains (see
        `rules.claimed`), shards included; read-only. {} when there are none, or (logged)
        when reading fails.
        """
        saved: list[tuple[str, str]] = []
        with self._lock:
            try:
                for family in (4, 6):
                    chains = self.backend.saved(family, NAT)
                    for chain, specs in chains.items():
                        if base_chain(chain) in (CONTAINER_PORTALS, CONTAINER_NODEPORTS):
                            saved += [(chain, spec) for spec in specs]
            except PortalsError as exc:
                log.warning(
                    "cannot read the proxy ports of the installed rules (%s): choosing new ones",
                    exc,
                )
                return {}
        return claimed(saved)

    def counted_rules(self) -> list[tuple[int, str, str, int, int]]:
        """Our nat rules, and the jumps to them, with their counters: (family, chain, spec,
        packets, bytes). Read-only, for /debug/ui; [] where they cannot be read (logged)."""
        out: list[tuple[int, str, str, int, int]] = []
        entries = CHAINS[NAT]
        for family in (4, 6):
            try:
                rules = counted(self.backend.mode, family, NAT)
            except PortalsError as exc:
                log.debug("cannot read the rules' counters: %s", exc)
                continue
            for chain, spec, packets, size in rules:
                # A shard's rules are shown under their entry chain; the jumps from an entry
                # chain to its shards are plumbing and left out.
                if is_ours(NAT, chain):
                    if chain not in entries:
                        out.append((family, base_chain(chain), spec, packets, size))
                elif any(spec.endswith(f"-j {c}") for c in entries):
                    out.append((family, chain, spec, packets, size))
        return out

    def _warn_unserved(self, skipped: list[tuple[ServicePortName, str]]) -> None:
        """Warn once per service port whose ClusterIPs of one family get no rules, saying why
        (`Settings.left_out`)."""
        if self._warned_unserved:  # forget ports that are gone, so the set stays small
            names = self._desired.names()
            self._warned_unserved = {n for n in self._warned_unserved if n in names}
        for name, ip in skipped:
            family = ip_family(ip)
            if name in self._warned_unserved or family is None:
                continue
            self._warned_unserved.add(name)
            log.warning(
                "%s: no rules for its IPv%d ClusterIP %s: %s",
                name,
                family,
                ip,
                self._settings.left_out(family),
            )

    def _warn_missing_node_ips(self, families: set[Family]) -> None:
        for family in families - self._warned_no_node_ip:
            if not self._settings.host_ip(family):
                self._warned_no_node_ip.add(family)
                log.warning(
                    "no IPv%d node IP known: the node's own connections to Services are not"
                    " captured (pass --node-ip)",
                    family,
                )

    def _sync(self, family: Family, table: str, want: plan.TableRules, *, defer: bool) -> None:
        """Check, plan, commit and record one table, under the backend's lock."""
        with self.backend.locked(family):
            pending = self._plan(family, table, want, defer=defer)
            after = self._commit(pending, None) if pending.step.ops else None
            self._record(pending, after)

    def _sync_together(
        self,
        wanted: list[tuple[Family, str, plan.TableRules]],
        errors: list[PortalsError],
        *,
        defer: bool,
    ) -> None:
        """`_sync` for backends that commit several tables at once (`commit_many`): the
        tables are independent, and one commit's wait overlaps the others'."""
        pending: list[_Pending] = []
        for family, table, want in wanted:
            try:
                pending.append(self._plan(family, table, want, defer=defer))
            except PortalsError as exc:
                log.error("iptables %s table (IPv%d): %s", table, family, exc)
                errors.append(exc)
        batch = [p for p in pending if p.step.ops]
        commit_many = self.backend.commit_many  # type: ignore[attr-defined]
        outcomes = commit_many([(p.family, p.table, p.step.ops, p.view) for p in batch])
        results = dict(zip(map(id, batch), outcomes, strict=True))
        for p in pending:
            try:
                outcome = results.get(id(p))
                after = self._commit(p, outcome) if id(p) in results else None
                self._record(p, after)
            except PortalsError as exc:
                log.error("iptables %s table (IPv%d): %s", p.table, p.family, exc)
                errors.append(exc)

    def _plan(self, family: Family, table: str, want: plan.TableRules, *, defer: bool) -> _Pending:
        backend = self.backend
        applied = self._applied.pop((family, table), None)
        self._deferred.pop((family, table), None)  # this plan deletes or defers them again
        verified = self._clock()
        if applied is None:
            view = backend.read(family, table)
            step = plan.replace_all(want, view)
            return _Pending(family, table, want, None, view, step, verified)
        view, full = self._check(family, table, applied)
        if CANARY not in view.chains:
            self.repairs += 1
            log.warning(
                "iptables %s (IPv%d): our canary chain %s is gone (the table was flushed"
                " or reloaded); rewriting all our rules in it",
                table,
                family,
                CANARY,
            )
            step = plan.replace_all(want, view)
        else:
            step = plan.update(want, view, applied.chains, applied.fingerprints, defer=defer)
            if step.repaired:
                self.repairs += 1
                log.warning(
                    "iptables %s (IPv%d) changed outside the proxy (%s); restoring",
                    table,
                    family,
                    ", ".join(step.repaired[:10]),
                )
        verified = verified if full else applied.verified
        return _Pending(family, table, want, applied, view, step, verified)

    def _commit(self, p: _Pending, outcome: TableView | PortalsError | None) -> TableView | None:
        """The table after `p`'s commit (`outcome`: its result, when already committed);
        a failed update is retried as a replacement of all our chains in the table."""
        backend = self.backend
        try:
            if isinstance(outcome, PortalsError):
                raise outcome
            after = outcome or backend.commit(p.family, p.table, p.step.ops, p.view)
        except PortalsError as exc:
            if p.applied is None:
                raise
            log.warning("%s; replacing our chains in %s instead", exc, p.table)
            p.view = backend.read(p.family, p.table)
            p.step = plan.replace_all(p.want, p.view)
            after = backend.commit(p.family, p.table, p.step.ops, p.view)
            p.verified = self._clock()
        self.commits += 1
        log.debug("iptables %s (IPv%d): %d change(s) committed", p.table, p.family, len(p.step.ops))
        return after or backend.read(p.family, p.table)

    def _record(self, p: _Pending, after: TableView | None) -> None:
        view = after or p.view
        self._applied[(p.family, p.table)] = _Applied(
            p.step.chains, dict(view.chains), view.jumps, view.referenced, p.verified
        )
        if p.step.deferred:
            self._deferred[(p.family, p.table)] = p.want

    def _check(self, family: Family, table: str, applied: _Applied) -> tuple[TableView, bool]:
        """The table as it is now, and whether it was read in full: at the verify period, or
        when the cheap check (`Backend.glance`) finds anything but what we left."""
        backend = self.backend
        if self._clock() - applied.verified >= self.verify_period:
            self.verifies += 1
            return backend.read(family, table), True
        believed = applied.believed()
        view = backend.glance(family, table, believed)
        if CANARY in view.chains and _same(view, believed, table):
            return view, False
        # Something differs: read all of it, so the repair is exact. Without the canary the
        # caller rewrites everything of ours in the table.
        return backend.read(family, table), True


def _same(seen: TableView, believed: TableView, table: str) -> bool:
    """True when the fixed chains and the jumps into our chains are as we left them."""
    for chain in CHAINS[table]:
        if seen.chains.get(chain) != believed.chains.get(chain):
            return False
    return _jumps(seen) == _jumps(believed)


def _jumps(view: TableView) -> list[tuple[str, str]]:
    """The jumps into our chains, in their order within each built-in chain."""
    return sorted(((f.chain, f.target) for f in view.jumps), key=lambda jump: jump[0])
