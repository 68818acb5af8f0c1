"""iptables-restore backend: `iptables-save` to read, `iptables-restore --noflush` to write.

Works with either iptables mode (nft or legacy) by running that mode's binaries. Each commit
is one `iptables-restore` run, which the kernel applies atomically per table; `-w` makes it
wait for the xtables lock (legacy mode; nft does not need it).

`iptables-nft-save` costs time in proportion to every rule of every table (about 70 us a rule:
nearly 2 s at 26,000), so in nft mode a read is skipped while the ruleset's generation number
(bumped by the kernel on every nftables commit, by anyone) is the one seen at the last read;
after our own commit, when the generation moved by exactly one, the table is known without
reading it: the last read with our changes applied.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import socket
import struct
import subprocess
from collections.abc import Hashable, Sequence

from kube_userspace_proxy import logs
from kube_userspace_proxy.errors import PortalsError
from kube_userspace_proxy.netutil import Family
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
from kube_userspace_proxy.portals.rules import CHAINS

log = logs.get(__name__)

LOCK_WAIT_SECONDS = 5
TIMEOUT_SECONDS = 120.0
_TARGET = re.compile(r"(?:^| )-[jg] (\S+)")


def nft_generation() -> int | None:
    """The nftables ruleset generation of this network namespace, None if unavailable."""
    netlink_netfilter, nfnl_subsys_nftables, nft_msg_getgen, nfta_gen_id = 12, 10, 16, 1
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, netlink_netfilter) as sock:
            sock.settimeout(1.0)
            body = struct.pack("=BBH", socket.AF_UNSPEC, 0, 0)  # nfgenmsg
            kind = (nfnl_subsys_nftables << 8) | nft_msg_getgen
            sock.send(struct.pack("=IHHII", 16 + len(body), kind, 1, 1, 0) + body)
            data = sock.recv(4096)
    except OSError:
        return None
    length, kind = struct.unpack_from("=IH", data)
    offset = 20  # nlmsghdr + nfgenmsg
    while kind != 2 and offset + 4 <= min(length, len(data)):  # 2: NLMSG_ERROR
        size, attr = struct.unpack_from("=HH", data, offset)
        if attr & 0x3FFF == nfta_gen_id:
            return int(struct.unpack_from("!I", data, offset + 4)[0])
        offset += max(4, (size + 3) & ~3)
    return None


def predict(view: TableView, ops: Sequence[Op]) -> TableView | None:
    """`view` after `ops`, when they only change rules of our chains (else None)."""
    chains = {chain: list(specs) for chain, specs in view.chains.items()}  # type: ignore[call-overload]
    for op in ops:
        if isinstance(op, ResetChain):
            chains[op.chain] = []
        elif isinstance(op, Append) and op.rule.chain in chains:
            chains[op.rule.chain].append(op.rule.spec)
        elif isinstance(op, Delete) and op.spec in chains.get(op.chain, ()):
            chains[op.chain].remove(op.spec)
        else:
            return None  # jumps or chains come and go: read the table again
    fingerprints: dict[str, Hashable] = {chain: tuple(specs) for chain, specs in chains.items()}
    return TableView(fingerprints, view.jumps, view.referenced)


def binary(family: Family, mode: str | None, tool: str) -> str | None:
    """Path of e.g. `ip6tables-nft-restore`; `mode` None means the system default."""
    base = "ip6tables" if family == 6 else "iptables"
    names = [f"{base}-{mode}-{tool}"] if mode else [f"{base}-{tool}"]
    for name in names:
        found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
        if found:
            return found
    return None


def legacy_tables(family: Family) -> frozenset[str]:
    """The legacy tables that exist in this network namespace (listing creates none)."""
    path = f"/proc/net/ip{'6' if family == 6 else ''}_tables_names"
    try:
        with open(path, encoding="ascii") as names:
            return frozenset(names.read().split())
    except OSError:
        return frozenset()


def default_mode() -> str:
    """The mode of the system's plain `iptables` command: "nft" or "legacy"."""
    exe = shutil.which("iptables") or shutil.which("iptables", path="/usr/sbin:/sbin")
    if exe is None:
        raise PortalsError("iptables is not installed (install the iptables package)")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout
    return "nft" if "nf_tables" in out else "legacy"


def parse_save(text: str, table: str) -> tuple[dict[str, list[str]], set[str]]:
    """Rules (specs without `-A CHAIN`) per chain of `table`, and its built-in chains."""
    rules: dict[str, list[str]] = {}
    builtin: set[str] = set()
    current = ""
    for line in text.splitlines():
        if line.startswith("*"):
            current = line[1:].strip()
        elif current != table:
            continue
        elif line.startswith(":"):
            name, policy = [*line[1:].split(), "-"][:2]
            rules.setdefault(name, [])
            if policy != "-":
                builtin.add(name)
        elif line.startswith("-A "):
            chain, _, spec = line[3:].partition(" ")
            rules.setdefault(chain, []).append(spec)
    return rules, builtin


def counted(mode: str, family: Family, table: str) -> list[tuple[str, str, int, int]]:
    """Every rule of `table` with its counters, `iptables-save -c` read-only.

    (chain, spec after `-A CHAIN`, packets, bytes); [] when the tools or the table are missing.
    """
    exe = binary(family, mode, "save")
    if exe is None or (mode == "legacy" and table not in legacy_tables(family)):
        return []
    try:
        done = subprocess.run(
            [exe, "-c", "-t", table],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PortalsError(f"{exe} -c failed: {exc}") from exc
    rules = []
    for line in done.stdout.splitlines():
        counters, _, rule = line.partition("] ")
        if not counters.startswith("[") or not rule.startswith("-A "):
            continue
        packets, _, size = counters[1:].partition(":")
        chain, _, spec = rule[3:].partition(" ")
        if packets.isdigit() and size.isdigit():
            rules.append((chain, spec, int(packets), int(size)))
    return rules


def view_of(text: str, table: str) -> TableView:
    """Our chains' fingerprints (their exact rule text) and the jumps into them."""
    rules, builtin = parse_save(text, table)
    ours = CHAINS[table]
    chains: dict[str, Hashable] = {c: tuple(rules[c]) for c in ours if c in rules}
    jumps: list[Found] = []
    referenced: set[str] = set()
    for chain, specs in rules.items():
        if chain in ours:
            continue
        for index, spec in enumerate(specs):
            targets = _TARGET.findall(spec)
            if targets and targets[-1] in ours:
                if chain in builtin:
                    jumps.append(Found(chain, targets[-1], index, spec))
                else:
                    referenced.add(targets[-1])
    return TableView(chains, tuple(jumps), frozenset(referenced))


def restore_text(table: str, ops: Sequence[Op]) -> str:
    """`iptables-restore --noflush` input doing `ops` in one transaction."""
    head = [f"*{table}"]
    body: list[str] = []
    for op in ops:
        if isinstance(op, ResetChain):
            head.append(f":{op.chain} - [0:0]")  # declares, or flushes when it exists
        elif isinstance(op, DropChain):
            body += [f"-F {op.chain}", f"-X {op.chain}"]
        elif isinstance(op, Delete):
            body.append(f"-D {op.chain} {op.spec}")
        elif isinstance(op, Append):
            body.append(op.rule.line)
        elif isinstance(op, Prepend):
            body.append(f"-I {op.rule.chain} 1 {op.rule.spec}")
    return "\n".join([*head, *body, "COMMIT", ""])


class RestoreBackend:
    """Reads with `iptables-save -t TABLE`, writes with `iptables-restore --noflush -w`."""

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode or default_mode()
        self.name = f"restore ({self.mode})"
        self._known: dict[tuple[Family, str], tuple[int, TableView]] = {}
        if binary(4, self.mode, "restore") is None:
            raise PortalsError(f"iptables-{self.mode}-restore is not installed")

    def locked(self, family: Family) -> contextlib.AbstractContextManager[None]:
        # iptables-restore takes the lock itself (-w); holding it here would deadlock.
        return contextlib.nullcontext()

    def _run(self, family: Family, tool: str, args: list[str], stdin: str | None = None) -> str:
        exe = binary(family, self.mode, tool)
        if exe is None:
            raise PortalsError(f"{'ip6' if family == 6 else 'ip'}tables-{self.mode}-{tool} missing")
        try:
            done = subprocess.run(
                [exe, *args],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_SECONDS,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PortalsError(f"{exe} failed: {exc}") from exc
        if done.returncode != 0:
            raise PortalsError(f"{exe} {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def tables(self, family: Family) -> frozenset[str]:
        if self.mode == "legacy":
            return legacy_tables(family)
        out = self._run(family, "save", [])
        return frozenset(line[1:].strip() for line in out.splitlines() if line.startswith("*"))

    def read(self, family: Family, table: str) -> TableView:
        # Legacy `save -t` would create a missing table; nft's prints an empty one.
        if self.mode == "legacy" and table not in legacy_tables(family):
            return TableView()
        generation = nft_generation() if self.mode == "nft" else None
        known = self._known.get((family, table))
        if generation is not None and known is not None and known[0] == generation:
            return known[1]
        view = view_of(self._run(family, "save", ["-t", table]), table)
        if generation is not None:
            self._known[(family, table)] = (generation, view)
        return view

    def saved(self, family: Family, table: str) -> dict[str, tuple[str, ...]]:
        if binary(family, self.mode, "save") is None:
            return {}  # then no rules of that family can have been written in this mode
        if self.mode == "legacy" and table not in legacy_tables(family):
            return {}
        rules, _ = parse_save(self._run(family, "save", ["-t", table]), table)
        return {chain: tuple(rules[chain]) for chain in CHAINS[table] if chain in rules}

    def commit(self, family: Family, table: str, ops: Sequence[Op]) -> TableView | None:
        text = restore_text(table, ops)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s restore input:\n%s", self.name, text)
        before = nft_generation() if self.mode == "nft" else None
        known = self._known.pop((family, table), None)
        self._run(family, "restore", ["--noflush", "-w", str(LOCK_WAIT_SECONDS)], text)
        if before is None or nft_generation() != before + 1:
            return None  # someone else committed too: read again
        for key, (generation, view) in list(self._known.items()):
            if generation == before:  # only our commit happened since that read
                self._known[key] = (before + 1, view)
        if known is None or known[0] != before:
            return None
        after = predict(known[1], ops)
        if after is not None:
            self._known[(family, table)] = (before + 1, after)
        return after
