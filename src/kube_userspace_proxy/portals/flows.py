"""Stale UDP flows: conntrack entries that still send a Service's datagrams to a proxy port
the rules no longer name (or past a proxy port they now name).

The kernel consults the nat rules only for a flow's first packet; a UDP client that keeps
sending keeps its conntrack entry, and with it the old redirect, alive forever. So after
every commit the UDP destinations the rules capture (`captures`) are compared with those of
the commit before: for each destination whose proxy ports changed (removed, moved, added),
the entries of that protocol, address and port whose replies do not come from one of its
current proxy ports are deleted, as kube-proxy's `ClearEntriesForIP`/`ForPort` do. Nothing
else is touched. Errors are logged and counted, never raised.

The mechanism reads the rules the portals rendered, not a backend, and talks to the kernel
through `FlowTable` (`NetlinkFlows`: ctnetlink via pyroute2).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kube_userspace_proxy import logs
from kube_userspace_proxy.addresses import Family
from kube_userspace_proxy.portals.rules import NAT, Rule

log = logs.get(__name__)


@dataclass(frozen=True, slots=True)
class Capture:
    """A UDP destination that nat rules send to a proxy port."""

    family: Family
    dst: str
    """The destination network of the rule (`10.96.0.10/32`); "": any (a NodePort)."""
    port: int


@dataclass(frozen=True, slots=True)
class Flow:
    """One UDP conntrack entry: where its first packet went, and where replies come from."""

    family: Family
    src: str
    sport: int
    dst: str
    dport: int
    reply_src: str
    reply_sport: int


class FlowTable(Protocol):
    """The kernel's conntrack table, as far as stale flows need it."""

    def udp_flows(self, family: Family) -> Iterable[Flow]:
        """Every UDP entry of that family."""
        ...

    def delete(self, flows: Sequence[Flow]) -> tuple[int, list[str]]:
        """Delete these entries (of one family): how many went, and an error for each that
        could not (one gone meanwhile is neither)."""
        ...


def captures(rules: Iterable[Rule]) -> dict[Capture, frozenset[int]]:
    """The UDP destinations that `rules` (nat REDIRECT/DNAT) send to proxy ports."""
    found: dict[Capture, set[int]] = {}
    for rule in rules:
        if rule.table == NAT and rule.protocol == "udp" and rule.to_port and rule.dport:
            found.setdefault(Capture(rule.family, rule.dst, rule.dport), set()).add(rule.to_port)
    return {capture: frozenset(ports) for capture, ports in found.items()}


def changed(
    before: Mapping[Capture, frozenset[int]], after: Mapping[Capture, frozenset[int]]
) -> dict[Capture, frozenset[int]]:
    """Destinations whose proxy ports differ between two commits -> the ports they have now."""
    return {
        capture: after.get(capture, frozenset())
        for capture in before.keys() | after.keys()
        if before.get(capture) != after.get(capture)
    }


def stale(flows: Iterable[Flow], wanted: Mapping[Capture, frozenset[int]]) -> Iterator[Flow]:
    """The flows to a changed destination whose replies do not come from a port it has now."""
    by_port: dict[int, list[tuple[Any, frozenset[int]]]] = {}
    for capture, ports in wanted.items():
        network = ipaddress.ip_network(capture.dst, strict=False) if capture.dst else None
        by_port.setdefault(capture.port, []).append((network, ports))
    for flow in flows:
        for network, ports in by_port.get(flow.dport, ()):
            if network is not None and ipaddress.ip_address(flow.dst) not in network:
                continue
            if flow.reply_sport not in ports:
                yield flow
                break


class StaleFlows:
    """Deletes the stale UDP flows after each commit; counts what it did (read by /metrics)."""

    def __init__(self, table: FlowTable | None = None) -> None:
        self._table = table if table is not None else NetlinkFlows()
        self._before: dict[Capture, frozenset[int]] = {}
        self.deleted: dict[int, int] = {4: 0, 6: 0}
        """Entries deleted, per family."""
        self.errors = 0
        """Failed dumps and deletes (each logged)."""

    def committed(self, rules: Iterable[Rule]) -> int:
        """The rules now live are `rules`: delete the flows they made stale; the count."""
        after = captures(rules)
        wanted = changed(self._before, after)
        self._before = after
        total = 0
        for family in sorted({capture.family for capture in wanted}):
            total += self._clear(family, {c: p for c, p in wanted.items() if c.family == family})
        return total

    def _clear(self, family: Family, wanted: Mapping[Capture, frozenset[int]]) -> int:
        try:
            found = list(stale(self._table.udp_flows(family), wanted))
        except Exception as exc:  # never fatal: the flows stay until they idle out
            self.errors += 1
            log.error(
                "cannot read the IPv%d conntrack table to clear stale UDP flows: %s", family, exc
            )
            return 0
        if not found:
            return 0
        try:
            deleted, errors = self._table.delete(found)
        except Exception as exc:
            deleted, errors = 0, [str(exc)]
        for error in errors:
            self.errors += 1
            log.error("cannot delete a stale IPv%d UDP flow: %s", family, error)
        if deleted:
            log.info("deleted %d stale IPv%d UDP flow(s)", deleted, family)
        self.deleted[family] += deleted
        return deleted


def _socket_family(family: Family) -> socket.AddressFamily:
    return socket.AF_INET if family == 4 else socket.AF_INET6


class NetlinkFlows:
    """The conntrack table through ctnetlink (pyroute2), in this network namespace."""

    def udp_flows(self, family: Family) -> list[Flow]:
        from pyroute2 import Conntrack  # noqa: PLC0415 (imported where used: control only)
        from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple  # noqa: PLC0415

        af = _socket_family(family)
        out = []
        ct = Conntrack(nfgen_family=af)
        try:
            udp = NFCTAttrTuple(family=af, proto=socket.IPPROTO_UDP)
            for entry in ct.dump_entries(tuple_orig=udp):
                orig, reply = entry.tuple_orig, entry.tuple_reply
                if orig.proto == socket.IPPROTO_UDP:
                    out.append(
                        Flow(
                            family,
                            orig.saddr,
                            orig.sport,
                            orig.daddr,
                            orig.dport,
                            reply.saddr,
                            reply.sport,
                        )
                    )
        finally:
            ct.close()
        return out

    def delete(self, flows: Sequence[Flow]) -> tuple[int, list[str]]:
        from pyroute2 import Conntrack  # noqa: PLC0415
        from pyroute2.netlink.exceptions import NetlinkError  # noqa: PLC0415
        from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple  # noqa: PLC0415

        if not flows:
            return 0, []
        af = _socket_family(flows[0].family)
        deleted, errors = 0, []
        ct = Conntrack(nfgen_family=af)
        try:
            for flow in flows:
                orig = NFCTAttrTuple(
                    family=af,
                    saddr=flow.src,
                    daddr=flow.dst,
                    proto=socket.IPPROTO_UDP,
                    sport=flow.sport,
                    dport=flow.dport,
                )
                try:
                    ct.entry("del", tuple_orig=orig)
                    deleted += 1
                except NetlinkError as exc:
                    if exc.code != errno.ENOENT:  # gone meanwhile (idled out): not an error
                        errors.append(f"{flow.src}:{flow.sport} -> {flow.dst}:{flow.dport}: {exc}")
        finally:
            ct.close()
        return deleted, errors
