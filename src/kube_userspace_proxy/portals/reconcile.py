"""Portals: keep the kernel's rules equal to the desired ones for the service ports given.

`Portals.apply` takes the full desired state, diffs it against what it applied before and
commits only the changes, one atomic commit per table. Each apply re-reads our chains (a
fingerprint per chain; the restore backend skips the read while the nft generation is the one
it saw) so that rules flushed or edited by someone else are put back. The first apply of a run
replaces whatever an earlier run left; before it, `claimed_ports` tells which proxy port those
rules send each service port to, so a restart can take the same ports.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

from kube_userspace_proxy import logs
from kube_userspace_proxy.errors import PortalsError
from kube_userspace_proxy.model import ProxiedPort, ServicePortName
from kube_userspace_proxy.netutil import Family, ip_family
from kube_userspace_proxy.portals import plan
from kube_userspace_proxy.portals.backends import cleanup_all, kernel_has_match
from kube_userspace_proxy.portals.plan import Backend
from kube_userspace_proxy.portals.restore import counted
from kube_userspace_proxy.portals.rules import (
    CHAINS,
    CONTAINER_NODEPORTS,
    CONTAINER_PORTALS,
    NAT,
    TABLES,
    ClaimKey,
    Rule,
    Settings,
    claimed,
    render,
    served_families,
)

log = logs.get(__name__)


@dataclass(frozen=True, slots=True)
class _Applied:
    """What one table held of ours after our last commit."""

    chains: dict[str, tuple[Rule, ...]]
    fingerprints: dict[str, Hashable]


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
            tuple(node_ips), bind_address, tuple(nodeport_addresses), physdev, guard_proxy_ports
        )
        self._applied: dict[tuple[Family, str], _Applied] = {}
        self._rendered: dict[ProxiedPort, list[Rule]] = {}
        self._leftovers_found: set[tuple[Family, str]] = set()
        self._lock = threading.Lock()
        self._warned_no_node_ip: set[Family] = set()
        self._warned_unserved: set[ServicePortName] = set()
        self.commits = 0
        """Commits made (a sync with nothing to change makes none)."""
        self.repairs = 0
        """Tables found changed by someone else at a sync (and put back), counted per table."""

    def set_node_ips(self, node_ips: Sequence[str]) -> None:
        """The node's IPs changed (the node's own traffic is DNATed to them)."""
        if tuple(node_ips) != self._settings.node_ips:
            self._settings = replace(self._settings, node_ips=tuple(node_ips))
            self._rendered = {}

    def render(self, ports: Sequence[ProxiedPort]) -> list[Rule]:
        """The complete desired rule set for `ports` (what `apply` makes the kernel hold)."""
        families = {f for ip in self._settings.node_ips if (f := ip_family(ip))}
        families |= {f for f, _ in self._applied} | {f for f, _ in self._leftovers_found}
        # Keep only this call's ports in the cache, so removed services do not pile up.
        cache: dict[ProxiedPort, list[Rule]] = {}
        previous = self._rendered
        for pp in ports:
            if pp in previous:
                cache[pp] = previous[pp]
        self._rendered = cache
        skipped: list[tuple[ServicePortName, str]] = []
        rules = render(ports, self._settings, families=families, cache=cache, skipped=skipped)
        self._warn_unserved(ports, skipped)
        return rules

    def apply(self, ports: Sequence[ProxiedPort]) -> None:
        """Make the kernel hold exactly the rules for `ports`; blocking; PortalsError on failure."""
        with self._lock:
            if not self._applied:
                self._leftovers_found = self._leftovers()
            rules = self.render(ports)
            # Tables of a family no longer served are emptied (plan.empty), not left behind.
            keys = {(r.family, r.table) for r in rules} | set(self._applied) | self._leftovers_found
            self._warn_missing_node_ips({r.family for r in rules})
            errors: list[PortalsError] = []
            grouped = plan.group(rules)
            for family, table in sorted(keys):
                want = grouped.get((family, table)) or plan.empty(family, table)
                try:
                    self._sync(family, table, want)
                except PortalsError as exc:
                    log.error("iptables %s table (IPv%d): %s", table, family, exc)
                    errors.append(exc)
            if errors:
                raise errors[0]

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
        self.apply(ports)

    def cleanup(self) -> int:
        """Remove our chains and jumps everywhere (see `cleanup_all`)."""
        with self._lock:
            self._applied.clear()
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
        `rules.claimed`); read-only. {} when there are none, or (logged) when reading fails.
        """
        saved: list[tuple[str, str]] = []
        with self._lock:
            try:
                for family in (4, 6):
                    chains = self.backend.saved(family, NAT)
                    for chain in (CONTAINER_PORTALS, CONTAINER_NODEPORTS):
                        saved += [(chain, spec) for spec in chains.get(chain, ())]
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
        ours = CHAINS[NAT]
        for family in (4, 6):
            try:
                rules = counted(self.backend.mode, family, NAT)
            except PortalsError as exc:
                log.debug("cannot read the rules' counters: %s", exc)
                continue
            out += [
                (family, chain, spec, packets, size)
                for chain, spec, packets, size in rules
                if chain in ours or any(spec.endswith(f"-j {c}") for c in ours)
            ]
        return out

    def _warn_unserved(
        self, ports: Sequence[ProxiedPort], skipped: list[tuple[ServicePortName, str]]
    ) -> None:
        """Warn once per service port whose ClusterIPs of one family get no rules."""
        if self._warned_unserved:  # forget ports that are gone, so the set stays small
            self._warned_unserved &= {pp.info.name for pp in ports}
        bind = self._settings.bind_address or "0.0.0.0"
        served = "/".join(f"IPv{f}" for f in sorted(served_families(bind))) or "no family"
        for name, ip in skipped:
            if name in self._warned_unserved:
                continue
            self._warned_unserved.add(name)
            log.warning(
                "%s: no rules for its IPv%d ClusterIP %s: the proxy ports listen on %s (%s only);"
                " use --bind-address :: for dual stack",
                name,
                ip_family(ip),
                ip,
                bind,
                served,
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

    def _sync(self, family: Family, table: str, want: plan.TableRules) -> None:
        backend = self.backend
        with backend.locked(family):
            view = backend.read(family, table)
            applied = self._applied.pop((family, table), None)
            if applied is None:
                step = plan.replace_all(want, view)
            else:
                step = plan.update(want, view, applied.chains, applied.fingerprints)
                if step.repaired:
                    self.repairs += 1
                    log.warning(
                        "iptables %s (IPv%d) changed outside the proxy (%s); restoring",
                        table,
                        family,
                        ", ".join(step.repaired),
                    )
            if step.ops:
                try:
                    after = backend.commit(family, table, step.ops)
                except PortalsError as exc:
                    if applied is None:
                        raise
                    log.warning("%s; replacing our chains in %s instead", exc, table)
                    step = plan.replace_all(want, backend.read(family, table))
                    after = backend.commit(family, table, step.ops)
                self.commits += 1
                view = after or backend.read(family, table)
                log.debug(
                    "iptables %s (IPv%d): %d change(s) committed", table, family, len(step.ops)
                )
            self._applied[(family, table)] = _Applied(step.chains, dict(view.chains))
