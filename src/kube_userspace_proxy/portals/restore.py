"""iptables-restore backend: `iptables-save` to read, `iptables-restore --noflush` to write.

Works with either iptables mode (nft or legacy) by running that mode's binaries. Each commit
is one `iptables-restore` run, which the kernel applies atomically per table; `-w` makes it
wait for the xtables lock (legacy mode; nft does not need it).

`iptables-nft-save` costs time in proportion to every rule of every table (about 10-70 us a
rule), so only `read` (the first sync, the full verify, a repair) runs it. The cheap check,
`glance`, reads the built-in chains and our fixed chains one by one with `iptables -S CHAIN`
(iptables-nft fetches that chain alone: ~3 ms each), and in nft mode not even that while the
ruleset's generation number (bumped by the kernel on every nftables commit, by anyone) is the
one seen then. After our own commit the table is predicted from the ops, not read again.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import struct
import subprocess
from collections.abc import Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from kube_userspace_proxy import logs
from kube_userspace_proxy.addresses import Family
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
from kube_userspace_proxy.portals.rules import CHAINS, is_ours, jumps

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
    """`view` after `ops` (fingerprints are the chains' rule texts); None when an op does not
    fit `view` (a delete of a rule it lacks, an append to a chain it lacks): read instead."""
    chains = dict(view.chains)
    edited: dict[str, list[str]] = {}
    jumps = list(view.jumps)
    for op in ops:
        if isinstance(op, ResetChain):
            edited[op.chain] = []
            chains[op.chain] = ()
        elif isinstance(op, DropChain):
            edited.pop(op.chain, None)
            chains.pop(op.chain, None)
        elif isinstance(op, (Append, Prepend)) and op.rule.is_jump:
            found = Found(op.rule.chain, op.rule.target, 0, op.rule.spec)
            jumps.insert(0 if isinstance(op, Prepend) else len(jumps), found)
        elif isinstance(op, Append) and op.rule.chain in chains:
            edited.setdefault(op.rule.chain, list(chains[op.rule.chain])).append(op.rule.spec)  # type: ignore[call-overload]
        elif isinstance(op, Prepend) and op.rule.chain in chains:
            edited.setdefault(op.rule.chain, list(chains[op.rule.chain])).insert(0, op.rule.spec)  # type: ignore[call-overload]
        elif isinstance(op, Delete) and op.chain in chains:
            specs = edited.setdefault(op.chain, list(chains[op.chain]))  # type: ignore[call-overload]
            if op.spec not in specs:
                return None
            specs.remove(op.spec)
        elif isinstance(op, Delete):
            at = next(
                (i for i, f in enumerate(jumps) if (f.chain, f.spec) == (op.chain, op.spec)), -1
            )
            if at < 0:
                return None
            del jumps[at]
        else:
            return None
    for chain, specs in edited.items():
        chains[chain] = tuple(specs)
    counts: dict[str, int] = {}
    numbered = []
    for f in jumps:  # positions among our jumps: restore deletes by text, so order is enough
        numbered.append(Found(f.chain, f.target, counts.get(f.chain, 0), f.spec))
        counts[f.chain] = counts.get(f.chain, 0) + 1
    return TableView(chains, tuple(numbered), view.referenced)


def binary(family: Family, mode: str | None, tool: str) -> str | None:
    """Path of e.g. `ip6tables-nft-restore` (`tool` "": `ip6tables-nft`); `mode` None means
    the system default."""
    base = "ip6tables" if family == 6 else "iptables"
    tail = f"-{tool}" if tool else ""
    names = [f"{base}-{mode}{tail}"] if mode else [f"{base}{tail}"]
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
        raise PortalsError(
            "--iptables-backend restore: iptables is not installed; install the iptables"
            " package, or run with --iptables-backend none"
        )
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
    chains: dict[str, Hashable] = {c: tuple(rules[c]) for c in rules if is_ours(table, c)}
    jumps: list[Found] = []
    referenced: set[str] = set()
    for chain, specs in rules.items():
        if chain in chains:
            continue
        for index, spec in enumerate(specs):
            targets = _TARGET.findall(spec)
            if targets and is_ours(table, targets[-1]):
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
        if type(op) is Append:  # most ops by far (a first sync: 25,000 in nat)
            body.append(f"-A {op.rule.chain} {op.rule.spec}")
        elif isinstance(op, ResetChain):
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


@contextlib.contextmanager
def _input(text: str | None) -> Iterator[int | None]:
    """A descriptor holding `text`, to be a process's stdin (None: no input).

    A file in memory rather than a pipe: a pipe is fed 512 bytes at a time by the thread
    that waits for the process, and each write needs the GIL, so a large input (a first
    commit: 3.5 MB) stalls while other threads run Python; from a file the process reads
    at its own pace."""
    if text is None:
        yield None
        return
    fd = os.memfd_create("iptables-restore-input", os.MFD_CLOEXEC)
    try:
        data = text.encode()
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


class RestoreBackend:
    """Reads with `iptables-save -t TABLE`, writes with `iptables-restore --noflush -w`."""

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode or default_mode()
        self.name = f"restore ({self.mode})"
        # nft: a commit costs what it changes, and one that deletes ~10 ms more than one that
        # inserts (the kernel frees the old rules before it answers), so a moved port goes
        # live without its deletes. Legacy replaces the whole table either way (see iptc).
        self.defers_deletes = self.mode == "nft"
        self._known: dict[tuple[Family, str], tuple[int, TableView]] = {}
        self._pool: ThreadPoolExecutor | None = None
        if binary(4, self.mode, "restore") is None:
            raise PortalsError(
                f"--iptables-backend restore: iptables-{self.mode}-restore is not installed;"
                " install the iptables package, or run with --iptables-backend none"
            )

    def locked(self, family: Family) -> contextlib.AbstractContextManager[None]:
        # iptables-restore takes the lock itself (-w); holding it here would deadlock.
        return contextlib.nullcontext()

    def _run(self, family: Family, tool: str, args: list[str], stdin: str | None = None) -> str:
        return run_tool(family, self.mode, tool, args, stdin)

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
        view = view_of(self._run(family, "save", ["-t", table]), table)
        self._remember(family, table, generation, view)
        return view

    def glance(self, family: Family, table: str, believed: TableView) -> TableView:
        if self.mode == "legacy" and table not in legacy_tables(family):
            return TableView()
        generation = nft_generation() if self.mode == "nft" else None
        known = self._known.get((family, table))
        if generation is not None and known is not None and known[0] == generation:
            return known[1]  # nobody committed anything since
        chains = dict(believed.chains)
        for chain in CHAINS[table]:
            specs = self._chain(family, table, chain)
            if specs is None:
                chains.pop(chain, None)
            else:
                chains[chain] = specs
        found: list[Found] = []
        for builtin in sorted({j.chain for j in jumps(family) if j.table == table}):
            for index, spec in enumerate(self._chain(family, table, builtin) or ()):
                targets = _TARGET.findall(spec)
                if targets and is_ours(table, targets[-1]):
                    found.append(Found(builtin, targets[-1], index, spec))
        view = TableView(chains, tuple(found), believed.referenced)
        self._remember(family, table, generation, view)
        return view

    def _chain(self, family: Family, table: str, chain: str) -> tuple[str, ...] | None:
        """One chain's rules as `iptables -S` prints them (iptables-nft reads that chain
        alone); None when it does not exist or cannot be read."""
        try:
            out = self._run(family, "", ["-w", str(LOCK_WAIT_SECONDS), "-t", table, "-S", chain])
        except PortalsError:
            return None
        head = f"-A {chain} "
        return tuple(line[len(head) :] for line in out.splitlines() if line.startswith(head))

    def _remember(
        self, family: Family, table: str, generation: int | None, view: TableView
    ) -> None:
        if generation is not None:
            self._known[(family, table)] = (generation, view)

    def saved(self, family: Family, table: str) -> dict[str, tuple[str, ...]]:
        if binary(family, self.mode, "save") is None:
            return {}  # then no rules of that family can have been written in this mode
        if self.mode == "legacy" and table not in legacy_tables(family):
            return {}
        rules, _ = parse_save(self._run(family, "save", ["-t", table]), table)
        return {chain: tuple(specs) for chain, specs in rules.items() if is_ours(table, chain)}

    def commit(
        self, family: Family, table: str, ops: Sequence[Op], base: TableView | None = None
    ) -> TableView | None:
        (outcome,) = self.commit_many([(family, table, ops, base)])
        if isinstance(outcome, PortalsError):
            raise outcome
        return outcome

    def commit_many(
        self, batch: Sequence[tuple[Family, str, Sequence[Op], TableView | None]]
    ) -> list[TableView | PortalsError | None]:
        """`commit` for several tables, one `iptables-restore` run each, all at once: each
        table is its own transaction, and the runs' waits (a commit that deletes rules
        waits for the kernel to release them) overlap. Per table, its view or its error."""
        before = nft_generation() if self.mode == "nft" else None
        known = [self._known.pop((family, table), None) for family, table, _, _ in batch]
        args = ["--noflush", "-w", str(LOCK_WAIT_SECONDS)]

        def run(at: int, text: str) -> PortalsError | None:
            try:
                self._run(batch[at][0], "restore", args, text)
            except PortalsError as exc:
                return exc
            return None

        def text_of(at: int) -> str:
            text = restore_text(batch[at][1], batch[at][2])
            log.debug("%s restore input:\n%s", self.name, text)
            return text

        def after(at: int) -> TableView | None:
            seen, base = known[at], batch[at][3]
            planned = seen[1] if seen is not None and seen[0] == before else base
            return predict(planned, batch[at][2]) if planned is not None else None

        if len(batch) > 1:
            if self._pool is None:  # kept: starting threads costs more than a small commit
                self._pool = ThreadPoolExecutor(4, thread_name_prefix="iptables-restore")
            # Each run starts as soon as its input is written, the longest first (a first
            # sync: nat's); the outcomes are predicted while they run.
            longest = sorted(range(len(batch)), key=lambda at: -len(batch[at][2]))
            runs = {at: self._pool.submit(run, at, text_of(at)) for at in longest}
            predicted = [after(at) for at in range(len(batch))]
            failures = [runs[at].result() for at in range(len(batch))]
        else:
            failures = [run(0, text_of(0))] if batch else []
            predicted = [after(0) if failures[0] is None else None] if batch else []
        done = sum(failure is None for failure in failures)
        ours = before is not None and nft_generation() == before + done
        out: list[TableView | PortalsError | None] = []
        for (family, table, _, _), view, failure in zip(batch, predicted, failures, strict=True):
            if failure is not None:
                out.append(failure)
                continue
            if ours and view is not None:
                self._known[(family, table)] = (before + done, view)  # type: ignore[operator]
            out.append(view)
        if ours and done:
            for key, (generation, seen) in list(self._known.items()):
                if generation == before:  # only our commits happened since that read
                    self._known[key] = (generation + done, seen)
        return out


def run_tool(
    family: Family,
    mode: str,
    tool: str,
    args: list[str],
    stdin: str | None = None,
    *,
    timeout: float = TIMEOUT_SECONDS,
) -> str:
    """Run `ip(6)tables-MODE-TOOL ARGS` (stdin fed from a file); its output, or PortalsError."""
    exe = binary(family, mode, tool)
    if exe is None:
        name = f"{'ip6' if family == 6 else 'ip'}tables-{mode}{'-' if tool else ''}{tool}"
        raise PortalsError(f"{name} missing")
    try:
        with _input(stdin) as fd:
            done = subprocess.run(
                [exe, *args],
                stdin=fd,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PortalsError(f"{exe} failed: {exc}") from exc
    if done.returncode != 0:
        raise PortalsError(f"{exe} {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout
