"""python-iptables backend: libiptc on the legacy tables, one atomic commit per table.

Building one rule through python-iptables costs about a millisecond (libxtables parses every
option, then python-iptables prints each match back through a pipe), so 10,000 rules would take
ten seconds. Instead, each rule *shape* (same matches and target; other addresses, ports and
comment) is built by python-iptables once with sample values, the byte positions of its
variable fields are found by building it again with other samples, and every rule of that
shape is stamped out of the template in microseconds. A template is trusted only after a
stamped copy equals a freshly built rule byte for byte; a shape that fails that check is built
rule by rule instead.

libiptc does not take the xtables lock, so `locked()` holds `/run/xtables.lock` (or
`$XTABLES_LOCKFILE`) from the read of a table to its commit, as `iptables -w` would.

IPv6 goes through `ip6tables-legacy-restore` (the same legacy tables): libxtables registers the
NAT targets (REDIRECT, DNAT) of one family per process only, the first one loaded, so
python-iptables cannot build IPv6 NAT rules once it has built IPv4 ones (fixed upstream in
2025: "libxtables: store all requested target types").
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import fcntl
import hashlib
import ipaddress
import os
import time
from collections.abc import Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import iptc

from kube_userspace_proxy import logs
from kube_userspace_proxy.addresses import Family, join_host_port
from kube_userspace_proxy.errors import PortalsError
from kube_userspace_proxy.portals.plan import (
    Append,
    Delete,
    DropChain,
    Found,
    Op,
    Prepend,
    ResetChain,
    TableView,
)
from kube_userspace_proxy.portals.restore import RestoreBackend, legacy_tables
from kube_userspace_proxy.portals.rules import CHAINS, Rule, is_ours

log = logs.get(__name__)

LOCK_FILE = "/run/xtables.lock"
LOCK_WAIT_SECONDS = 5.0
_NAME_LEN = 29  # XT_EXTENSION_MAXNAMELEN - 1, the name field of match and target headers
_COMMENT_LEN = 255
_ZEROS = bytes(_NAME_LEN)


def _align(n: int) -> int:
    return (n + 7) & ~7


_ENTRY: dict[Family, Any] = {4: iptc.ip4tc.ipt_entry, 6: iptc.ip6tc.ip6t_entry}
_HEADER = {f: _align(ct.sizeof(t)) for f, t in _ENTRY.items()}
_DST = {
    4: iptc.ip4tc.ipt_entry.ip.offset + iptc.ip4tc.ipt_ip.dst.offset,
    6: iptc.ip6tc.ip6t_entry.ipv6.offset + iptc.ip6tc.ip6t_ip6.dst.offset,
}
_TARGET_OFFSET = {f: t.target_offset.offset for f, t in _ENTRY.items()}
# comefrom (hook bits the kernel fills in) up to the end of the packet and byte counters
_VOLATILE = {f: (t.comefrom.offset, t.counters.offset + t.counters.size) for f, t in _ENTRY.items()}


def _tidy(buf: bytearray, family: Family) -> bytearray:
    """Zero the bytes after the NUL of every match and target name (left uninitialised)."""
    at = _TARGET_OFFSET[family]
    target = buf[at] | buf[at + 1] << 8
    pos = _HEADER[family]
    while True:
        name = pos + 2
        end = buf.find(0, name, name + _NAME_LEN)
        if end >= 0:
            buf[end : name + _NAME_LEN] = _ZEROS[: name + _NAME_LEN - end]
        if pos >= target:
            return buf
        pos += buf[pos] | buf[pos + 1] << 8


def _packed(address: str) -> bytes:
    return ipaddress.ip_address(address).packed


# Sample values: every byte differs between the first two, so a diff finds whole fields.
_SAMPLES: dict[Family, tuple[str, str, str]] = {
    4: ("1.2.3.4", "5.6.7.8", "9.10.11.12"),
    6: (
        "102:304:506:708:90a:b0c:d0e:f10",
        "1112:1314:1516:1718:191a:1b1c:1d1e:1f20",
        "2122:2324:2526:2728:292a:2b2c:2d2e:2f30",
    ),
}
_PORTS = (0x0102, 0x0304, 0x0506)
_HIGH_PORTS = (0x1112, 0x1314, 0x1516)
"""Samples for the top of a port range (the shard jumps' `--dport lo:hi`)."""
_COMMENTS = ("a" * _COMMENT_LEN, "b" * _COMMENT_LEN, "c" * 7)


def _shape(rule: Rule, i: int) -> Rule:
    """`rule` with sample value set `i` in every variable field it has."""
    ip = _SAMPLES[rule.family][i]
    dst = ""
    if rule.dst:
        mask = rule.dst.partition("/")[2]
        if mask.isdigit():
            dst = str(ipaddress.ip_network(f"{ip}/{mask}", strict=False))
        else:  # a netmask (the shard jumps' non-contiguous ones): the sample's bits under it
            bits = zip(_packed(ip), _packed(mask), strict=True)
            dst = f"{ipaddress.ip_address(bytes(a & m for a, m in bits))}/{mask}"
    return replace(
        rule,
        dst=dst,
        comment=_COMMENTS[i],
        dport=_PORTS[i] if rule.dport else 0,
        dport_hi=_HIGH_PORTS[i] if rule.dport_hi else 0,
        to_port=_PORTS[i] if rule.to_port else 0,
        to_addr=ip if rule.to_addr else "",
        why="",
    )


def _spans(a: bytes, b: bytes) -> list[tuple[int, int]]:
    """Runs of positions where `a` and `b` differ, as (start, end)."""
    runs: list[tuple[int, int]] = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
    return runs


_Order = Literal["big", "little"]


@dataclass(frozen=True, slots=True)
class _Template:
    """A rule shape's bytes and where its variable fields go."""

    buf: bytes
    dst: int | None
    ports: tuple[tuple[int, _Order], ...]  # (offset, byte order) of each copy of the dport
    high_ports: tuple[tuple[int, _Order], ...]  # the same for the top of a dport range
    to_ports: tuple[tuple[int, _Order], ...]
    to_addrs: tuple[int, ...]
    comment: int

    def stamp(self, rule: Rule) -> bytearray:
        buf = bytearray(self.buf)
        if self.dst is not None:
            addr = _packed(rule.dst.partition("/")[0])
            buf[self.dst : self.dst + len(addr)] = addr
        for off, order in self.ports:
            buf[off : off + 2] = rule.dport.to_bytes(2, order)
        for off, order in self.high_ports:
            buf[off : off + 2] = rule.dport_hi.to_bytes(2, order)
        for off, order in self.to_ports:
            buf[off : off + 2] = rule.to_port.to_bytes(2, order)
        if self.to_addrs:
            addr = _packed(rule.to_addr)
            for off in self.to_addrs:
                buf[off : off + len(addr)] = addr
        text = rule.comment.encode()
        buf[self.comment : self.comment + _COMMENT_LEN] = text.ljust(_COMMENT_LEN, b"\0")
        return buf


def _port_fields(
    base: bytes, other: bytes, sample: int = _PORTS[0]
) -> tuple[tuple[int, _Order], ...] | None:
    fields: list[tuple[int, _Order]] = []
    for start, end in _spans(base, other):
        for off in range(start, end, 2):
            chunk = base[off : off + 2]
            if chunk == sample.to_bytes(2, "big"):
                fields.append((off, "big"))
            elif chunk == sample.to_bytes(2, "little"):
                fields.append((off, "little"))
            else:
                return None
    return tuple(fields)


class Encoder:
    """Turns `Rule`s into libiptc entries: python-iptables builds, templates stamp."""

    def __init__(self) -> None:
        self._templates: dict[tuple[object, ...], _Template | None] = {}
        # python-iptables looks for a chain of the target's name in every table it can open,
        # creating the legacy mangle/raw/security tables on the way; targets here never are
        # chains (jumps are patched in below), so tell it there are no tables to look in.
        for table_class in (iptc.Table, iptc.Table6):
            table_class.existing_table_names.update(dict.fromkeys(table_class.ALL, False))

    def build(self, rule: Rule) -> bytearray:
        """The entry for `rule`, built by python-iptables (slow; the reference)."""
        r = iptc.Rule6() if rule.family == 6 else iptc.Rule()
        if rule.dst:
            r.dst = rule.dst
        if rule.protocol:
            r.protocol = rule.protocol
        r.create_match("comment").comment = rule.comment
        if rule.dport_hi:
            r.create_match(rule.protocol).dport = f"{rule.dport}:{rule.dport_hi}"
        elif rule.dport:
            r.create_match(rule.protocol).dport = str(rule.dport)
        if rule.physdev_not_in:
            r.create_match("physdev").physdev_is_in = "!"
        if rule.dst_local:
            r.create_match("addrtype").dst_type = "LOCAL"
        if rule.state_new:
            r.create_match("state").state = "NEW"
        if rule.ctstate:
            r.create_match("conntrack").ctstate = rule.ctstate  # "!DNAT": negated
        jump = rule.to_chain
        target = r.create_target("ACCEPT" if jump else rule.target)
        if rule.target == "REDIRECT":
            target.to_ports = str(rule.to_port)
        elif rule.target == "DNAT":
            target.to_destination = join_host_port(rule.to_addr, rule.to_port)
        elif rule.target == "REJECT":
            target.reject_with = rule.reject_with
        r.final_check()
        buf = bytearray(bytes(r.rule))
        if jump:
            _name_target(buf, rule)
        return _tidy(buf, rule.family)

    def encode(self, rule: Rule) -> bytearray:
        if len(rule.comment.encode()) > _COMMENT_LEN:
            raise PortalsError(f"comment longer than {_COMMENT_LEN} bytes: {rule.comment!r}")
        key = (
            rule.family,
            "" if rule.to_chain else rule.target,  # one template for the jumps to any chain
            rule.protocol,
            rule.dst.partition("/")[2] if rule.dst else "",
            bool(rule.dport),
            bool(rule.dport_hi),
            rule.physdev_not_in,
            rule.dst_local,
            rule.state_new,
            rule.ctstate,
            rule.reject_with,
            bool(rule.to_port),
            bool(rule.to_addr),
        )
        if key in self._templates:
            template = self._templates[key]
        else:
            template = self._templates[key] = self._learn(_shape(rule, 0))
        if template is None:
            return self.build(rule)
        buf = template.stamp(rule)
        if rule.to_chain:
            _name_target(buf, rule)
        return buf

    def _learn(self, shape: Rule) -> _Template | None:
        base = bytes(self.build(shape))
        second = _shape(shape, 1)

        def diff(**changes: Any) -> bytes:
            return bytes(self.build(replace(shape, **changes)))

        ports = _port_fields(base, diff(dport=second.dport)) if shape.dport else ()
        high_ports: tuple[tuple[int, _Order], ...] | None = ()
        if shape.dport_hi:
            high_ports = _port_fields(base, diff(dport_hi=second.dport_hi), _HIGH_PORTS[0])
        to_ports = _port_fields(base, diff(to_port=second.to_port)) if shape.to_port else ()
        to_addrs: tuple[int, ...] = ()
        if shape.to_addr:
            size = len(_packed(shape.to_addr))
            runs = _spans(base, diff(to_addr=second.to_addr))
            to_addrs = tuple(off for start, end in runs for off in range(start, end, size))
        comment = _spans(base, diff(comment=second.comment))
        if ports is None or high_ports is None or to_ports is None or len(comment) != 1:
            log.warning("cannot template rules shaped like %s; building each", shape.line)
            return None
        template = _Template(
            base,
            _DST[shape.family] if shape.dst else None,
            ports,
            high_ports,
            to_ports,
            to_addrs,
            comment[0][0],
        )
        check = _shape(shape, 2)
        if template.stamp(check) != self.build(check):
            log.warning("template for %s differs from python-iptables; building each", shape.line)
            return None
        return template


def _name_target(buf: bytearray, rule: Rule) -> None:
    """Name the chain the rule jumps to: libiptc turns a standard target named after a
    chain into a jump to it."""
    off = int.from_bytes(buf[_TARGET_OFFSET[rule.family] :][:2], "little") + 2
    buf[off : off + _NAME_LEN] = rule.target.encode().ljust(_NAME_LEN, b"\0")


def _entries(table: Any, chain: str) -> Iterator[Any]:
    entry = table.first_rule(chain)
    while entry:
        yield entry
        entry = table.next_rule(entry)


def _view(t: Any, family: Family, table: str, only: Collection[str] | None = None) -> TableView:
    """Fingerprints of our chains and the jumps into them, from a libiptc handle.

    With `only`, just those chains of ours and the built-in chains are looked at (no
    `referenced`): what a cheap check or a commit that touched only them needs."""
    start, end = _VOLATILE[family]
    chains: dict[str, Hashable] = {}
    jumps: list[Found] = []
    referenced: set[str] = set()
    for chain in t.chains:
        name = chain.name
        if is_ours(table, name):
            if only is not None and name not in only:
                continue
            entry_chain = name in CHAINS[table]
            digest = hashlib.blake2b(digest_size=16)
            for entry in _entries(t, name):
                raw = bytearray(ct.string_at(ct.addressof(entry), entry.next_offset))
                raw[start:end] = bytes(end - start)  # hook bits and counters
                # Name padding holds whatever the last writer's buffers held.
                raw = _tidy(raw, family)
                if entry_chain:
                    # A jump's verdict is a byte offset into the table (it moves whenever a
                    # chain before its target grows), so an entry chain's jumps are known by
                    # their target's name.
                    at = _TARGET_OFFSET[family]
                    del raw[raw[at] | raw[at + 1] << 8 :]
                    raw += t.get_target(entry) or b""
                digest.update(raw)
            chains[name] = digest.digest()
            continue
        builtin = t.builtin_chain(name)
        if only is not None and not builtin:
            continue
        for index, entry in enumerate(_entries(t, name)):
            target = (t.get_target(entry) or b"").decode()
            if is_ours(table, target):
                if builtin:
                    jumps.append(Found(name, target, index))
                else:
                    referenced.add(target)
    return TableView(chains, tuple(jumps), frozenset(referenced))


def _merged(base: TableView, seen: TableView, looked_at: Collection[str]) -> TableView:
    """`base` with the chains in `looked_at` and the jumps as `seen` found them."""
    chains = {c: fp for c, fp in base.chains.items() if c not in looked_at}
    chains.update(seen.chains)
    return TableView(chains, seen.jumps, base.referenced)


def _chain_of(op: Op) -> str:
    return op.rule.chain if isinstance(op, (Append, Prepend)) else op.chain


class IptcBackend:
    """Reads and writes the legacy tables through libiptc (python-iptables)."""

    mode = "legacy"
    name = "iptc (legacy)"
    defers_deletes = False
    """A legacy commit replaces the whole table (libiptc here, and iptables-legacy-restore for
    IPv6 alike): it costs the table's size whatever it changes, and a delete costs it nothing
    more. A second commit for the deletes would only pay the whole table again."""

    def __init__(self, lock_file: str | None = None) -> None:
        self._lock_file = lock_file or os.environ.get("XTABLES_LOCKFILE") or LOCK_FILE
        self._encoder = Encoder()
        self._legacy_restore: RestoreBackend | None = None

    def _restore(self) -> RestoreBackend:
        """The iptables-legacy-restore backend: all of IPv6, and text reads of IPv4."""
        if self._legacy_restore is None:
            self._legacy_restore = RestoreBackend("legacy")
        return self._legacy_restore

    def locked(self, family: Family) -> contextlib.AbstractContextManager[None]:
        return self._restore().locked(6) if family == 6 else self._flock()

    @contextlib.contextmanager
    def _flock(self) -> Iterator[None]:
        fd = os.open(self._lock_file, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            deadline = time.monotonic() + LOCK_WAIT_SECONDS
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise PortalsError(
                            f"another iptables user holds {self._lock_file} for over"
                            f" {LOCK_WAIT_SECONDS:.0f}s"
                        ) from None
                    time.sleep(0.01)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _table(self, family: Family, table: str) -> Any:
        try:
            return iptc.Table(table, autocommit=False)
        except iptc.IPTCError as exc:
            raise PortalsError(f"cannot open the {table} table (IPv{family}): {exc}") from exc

    def tables(self, family: Family) -> frozenset[str]:
        return legacy_tables(family)

    def read(self, family: Family, table: str) -> TableView:
        if family == 6:
            return self._restore().read(family, table)
        t = self._table(family, table)
        try:
            t.refresh()
            return _view(t, family, table)
        except iptc.IPTCError as exc:
            raise PortalsError(f"cannot read the {table} table (IPv{family}): {exc}") from exc

    def glance(self, family: Family, table: str, believed: TableView) -> TableView:
        """libiptc reads the whole table anyway; only the fixed chains are fingerprinted."""
        if family == 6:
            return self._restore().glance(family, table, believed)
        t = self._table(family, table)
        try:
            t.refresh()
            return _merged(believed, _view(t, family, table, CHAINS[table]), CHAINS[table])
        except iptc.IPTCError as exc:
            raise PortalsError(f"cannot read the {table} table (IPv{family}): {exc}") from exc

    def saved(self, family: Family, table: str) -> dict[str, tuple[str, ...]]:
        # iptables-legacy-save prints the same legacy tables as text; libiptc would need each
        # entry decoded by python-iptables (about a millisecond a rule).
        return self._restore().saved(family, table)

    def commit(
        self, family: Family, table: str, ops: Sequence[Op], base: TableView | None = None
    ) -> TableView | None:
        """Apply `ops` to the table as last read, then commit it in one replace."""
        if family == 6:
            return self._restore().commit(family, table, ops, base)
        t = self._table(family, table)
        try:
            for op in ops:
                self._do(t, op)
            # libiptc's copy now holds exactly what the commit installs, and the caller holds
            # the xtables lock, so this is the table right after the commit. Only the chains
            # the ops touched are fingerprinted again (hashing 36,000 entries takes ~0.2 s).
            if base is None:
                after = _view(t, family, table)
            else:
                touched = {_chain_of(op) for op in ops}
                after = _merged(base, _view(t, family, table, touched), touched)
            t.commit()
        except iptc.IPTCError as exc:
            raise PortalsError(f"cannot update the {table} table (IPv{family}): {exc}") from exc
        finally:
            t.refresh()  # drop anything uncommitted
        return after

    def _do(self, t: Any, op: Op) -> None:
        if isinstance(op, ResetChain):
            if t.is_chain(op.chain):
                t.flush_entries(op.chain)
            else:
                t.create_chain(op.chain)
        elif isinstance(op, DropChain):
            if t.is_chain(op.chain):
                t.flush_entries(op.chain)
                t.delete_chain(op.chain)
        elif isinstance(op, (Append, Prepend)):
            buf = self._encoder.encode(op.rule)
            entry = (ct.c_ubyte * len(buf)).from_buffer(buf)
            if isinstance(op, Append):
                t.append_entry(op.rule.chain, entry)
            else:
                t.insert_entry(op.rule.chain, entry, 0)
        elif (
            isinstance(op, Delete)
            and t._iptc.iptc_delete_num_entry(op.chain.encode(), op.index, t._handle) != 1
        ):
            raise iptc.IPTCError(f"can't delete rule {op.index} of {op.chain}: {t.strerror()}")
