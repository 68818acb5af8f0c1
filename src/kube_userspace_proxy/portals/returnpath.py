"""The return path of transparent dials (--preserve-source-ip), IPv4 and IPv6.

A backend socket bound to a client's address sends from an address that is not the node's.
Its replies are addressed to that client, so routing would forward them on instead of
delivering them here. Three pieces take them back, as HAProxy's `usesrc clientip` and Envoy's
`original_src` need them:

- mangle `KUBE-PORTALS-TPROXY` (jump prepended to PREROUTING): `-m socket --transparent -j
  MARK --set-xmark BIT/BIT`: a packet that belongs to a transparent socket on this node gets
  the mark bit (only that bit changes; other marks are kept);
- `ip rule` priority RULE_PRIORITY: `fwmark BIT/BIT lookup TABLE`;
- routing table TABLE: `local default dev lo`: everything looked up there is delivered locally.

The mangle chain is written with `iptables-restore --noflush` in the portals' mode (legacy or
nft; the iptc backend's tables are the legacy ones). Rules and routes are netlink (pyroute2).
`ensure` installs what is missing and says what it put back; `remove` takes away only what is
ours: our chain and its jump, the `ip rule`s with our priority and a fwmark equal to its mask,
and the `local default dev lo` route of the tables those rules name.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from kube_userspace_proxy import logs
from kube_userspace_proxy.addresses import Family
from kube_userspace_proxy.errors import PortalsError
from kube_userspace_proxy.portals.restore import RestoreBackend, binary, legacy_tables, run_tool

log = logs.get(__name__)
_T = TypeVar("_T")

CHAIN = "KUBE-PORTALS-TPROXY"
MANGLE = "mangle"
RULE_PRIORITY = 1500
"""Before the main table (32766) and the local table's rule (0 comes first and does not
match: the client's address is not local); Cilium's proxy rules use 9-10, Calico 99-100."""
_AF = {4: socket.AF_INET, 6: socket.AF_INET6}
_FAMILIES: tuple[Family, ...] = (4, 6)
_DEFAULT = {4: "0.0.0.0/0", 6: "::/0"}
_RTN_LOCAL = 2
_SCOPE_HOST = 254
_TIMEOUT = 30


def mark_rule(mark: int) -> str:
    """Our one mangle rule, as `iptables-save` prints it."""
    return (
        f'-A {CHAIN} -m socket --transparent -m comment --comment "transparent proxy replies"'
        f" -j MARK --set-xmark {mark:#x}/{mark:#x}"
    )


def jump_rule() -> str:
    """The jump from PREROUTING into our chain, as `iptables-save` prints it."""
    return f"-A PREROUTING -j {CHAIN}"


def restore_text(mark: int, *, jump: bool) -> str:
    """`iptables-restore --noflush` input that (re)writes our chain; `jump`: and its jump."""
    lines = [f"*{MANGLE}", f":{CHAIN} - [0:0]", f"-F {CHAIN}", mark_rule(mark)]
    if jump:
        lines.append(f"-I PREROUTING 1 -j {CHAIN}")
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def removal_text(jumps: int) -> str:
    """`iptables-restore --noflush` input that removes our chain and `jumps` jumps into it."""
    lines = [f"*{MANGLE}"] + [f"-D PREROUTING -j {CHAIN}"] * jumps
    lines += [f"-F {CHAIN}", f"-X {CHAIN}", "COMMIT"]
    return "\n".join(lines) + "\n"


def off_loop(call: Callable[[], _T]) -> _T:
    """`call()`, in a thread of its own when this thread runs an event loop: pyroute2's
    synchronous IPRoute drives an asyncio loop of its own, which cannot run inside another."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return call()
    with ThreadPoolExecutor(1, thread_name_prefix="netlink") as pool:
        return pool.submit(call).result()


@contextmanager
def netlink() -> Iterator[Any]:
    try:
        from pyroute2 import IPRoute  # noqa: PLC0415 - the control process's only netlink user
    except ImportError as exc:  # pragma: no cover - a dependency
        raise PortalsError(f"pyroute2 is not installed ({exc})") from exc
    from pyroute2.netlink.exceptions import NetlinkError  # noqa: PLC0415

    ipr = IPRoute()
    try:
        yield ipr
    except NetlinkError as exc:  # not an OSError: it carries the errno as `code`
        raise OSError(exc.code, str(exc)) from exc
    finally:
        ipr.close()


def our_table_routes(ipr: Any, table: int, *, foreign: bool = False) -> list[str]:
    """The routes of `table` in both families (`foreign`: only those not ours), described."""
    found = []
    for af in _AF.values():
        for route in ipr.get_routes(family=af, table=table):
            if int(_attr(route, "RTA_TABLE") or route["table"]) != table:
                continue
            ours = route["type"] == _RTN_LOCAL and route["dst_len"] == 0
            if not foreign or not ours:
                dst = _attr(route, "RTA_DST") or "default"
                found.append(f"{dst}/{route['dst_len']} type {route['type']}")
    return found


def _attr(message: Any, name: str) -> Any:
    return message.get_attr(name)


class ReturnPath:
    """Keeps the mark rule, the `ip rule` and the local route of transparent dials in place."""

    def __init__(self, mode: str, mark: int, table: int) -> None:
        self.mode = mode
        self.mark = mark
        self.table = table
        self.repairs = 0
        """Pieces found missing or changed after the first install, and put back."""
        self._installed = False

    # -- iptables -------------------------------------------------------------------------------

    def _run(self, family: Family, tool: str, args: list[str], stdin: str | None = None) -> str:
        return run_tool(family, self.mode, tool, args, stdin, timeout=_TIMEOUT)

    def _mangle(self, family: Family) -> tuple[list[str], int, bool]:
        """Our chain's rules, how many jumps PREROUTING has into it, and whether it exists."""
        saved = self._run(family, "save", ["-t", MANGLE]).splitlines()
        ours = [line for line in saved if line.startswith(f"-A {CHAIN} ")]
        jumps = sum(1 for line in saved if line == jump_rule())
        return ours, jumps, any(line.startswith(f":{CHAIN} ") for line in saved)

    def _ensure_mangle(self, family: Family) -> list[str]:
        ours, jumps, _ = self._mangle(family)
        fixed = []
        if ours != [mark_rule(self.mark)]:
            fixed.append(f"IPv{family} mangle {CHAIN}")
        if jumps != 1:
            fixed.append(f"IPv{family} mangle PREROUTING jump")
        if fixed:
            text = restore_text(self.mark, jump=jumps == 0)
            if jumps > 1:  # a duplicate: keep one
                extra = f"-D PREROUTING -j {CHAIN}\n" * (jumps - 1)
                text = text.replace("COMMIT", extra + "COMMIT")
            self._run(family, "restore", ["--noflush", "-w"], text)
        return fixed

    # -- netlink --------------------------------------------------------------------------------

    def _our_rules(self, ipr: Any, family: Family) -> list[Any]:
        """`ip rule`s with our priority whose fwmark is its own mask (any bit, any table)."""
        found = []
        for rule in ipr.get_rules(family=_AF[family]):
            mark = _attr(rule, "FRA_FWMARK")
            if (
                _attr(rule, "FRA_PRIORITY") == RULE_PRIORITY
                and mark
                and mark == _attr(rule, "FRA_FWMASK")
            ):
                found.append(rule)
        return found

    def _rule_table(self, rule: Any) -> int:
        return int(_attr(rule, "FRA_TABLE") or rule["table"])

    def _local_routes(self, ipr: Any, family: Family, table: int) -> list[Any]:
        routes = ipr.get_routes(family=_AF[family], table=table)
        return [
            r
            for r in routes
            if r["type"] == _RTN_LOCAL
            and r["dst_len"] == 0
            and int(_attr(r, "RTA_TABLE") or r["table"]) == table
        ]

    def _ensure_routing(self, ipr: Any, family: Family) -> list[str]:
        fixed = []
        af = _AF[family]
        rules = self._our_rules(ipr, family)
        right = [
            r
            for r in rules
            if _attr(r, "FRA_FWMARK") == self.mark and self._rule_table(r) == self.table
        ]
        for stale in (r for r in rules if r not in right[:1]):
            ipr.rule(
                "del",
                family=af,
                priority=RULE_PRIORITY,
                fwmark=_attr(stale, "FRA_FWMARK"),
                fwmask=_attr(stale, "FRA_FWMASK"),
                table=self._rule_table(stale),
            )
        if not right:
            fixed.append(f"IPv{family} ip rule fwmark {self.mark:#x}/{self.mark:#x}")
            ipr.rule(
                "add",
                family=af,
                priority=RULE_PRIORITY,
                fwmark=self.mark,
                fwmask=self.mark,
                table=self.table,
            )
        lo = ipr.link_lookup(ifname="lo")[0]
        af_scope = _SCOPE_HOST if family == 4 else 0
        routes = self._local_routes(ipr, family, self.table)
        if not any(_attr(r, "RTA_OIF") == lo for r in routes):
            fixed.append(f"IPv{family} route local default dev lo table {self.table}")
            ipr.route(
                "replace",
                family=af,
                dst=_DEFAULT[family],
                type="local",
                scope=af_scope,  # as `ip route add local` sets it; IPv4 refuses others
                oif=lo,
                table=self.table,
            )
        return fixed

    def _ensure_all_routing(self) -> list[str]:
        fixed: list[str] = []
        with netlink() as ipr:
            for family in _FAMILIES:
                fixed += self._ensure_routing(ipr, family)
        return fixed

    # -- the whole ------------------------------------------------------------------------------

    def ensure(self) -> list[str]:
        """Install what is missing (routing first: inert until the mark exists); the pieces
        put back after the first install (counted in `repairs`). Raises PortalsError."""
        fixed: list[str] = []
        try:
            fixed += off_loop(self._ensure_all_routing)
        except OSError as exc:
            raise PortalsError(f"cannot install the transparent return path: {exc}") from exc
        for family in _FAMILIES:
            fixed += self._ensure_mangle(family)
        if self._installed and fixed:
            self.repairs += len(fixed)
            log.warning("transparent return path changed by someone else; put back: %s", fixed)
        elif fixed:
            log.info(
                "transparent return path installed: mark %#x, ip rule %d, table %d",
                self.mark,
                RULE_PRIORITY,
                self.table,
            )
        self._installed = True
        return fixed

    def remove(self) -> int:
        """Remove ours (see the module docstring) in this mode; the pieces removed."""
        return remove_all((self.mode,))


def _tables(mode: str, family: Family) -> frozenset[str]:
    """The tables that exist in `mode` (listing them creates none)."""
    if mode == "legacy":
        return legacy_tables(family)
    return RestoreBackend(mode).tables(family)


def remove_all(modes: tuple[str, ...] = ("legacy", "nft")) -> int:
    """Remove every piece of the return path (any mark, any table) from both families."""
    removed = 0
    path = ReturnPath("nft", 0, 0)
    for mode in modes:
        path = ReturnPath(mode, 0, 0)
        for family in _FAMILIES:
            if binary(family, mode, "restore") is None:
                continue
            try:
                if MANGLE not in _tables(mode, family):  # reading would create it
                    continue
                ours, jumps, exists = path._mangle(family)
            except PortalsError as exc:
                log.debug("%s IPv%d mangle: %s", mode, family, exc)
                continue
            if exists or jumps:
                path._run(family, "restore", ["--noflush", "-w"], removal_text(jumps))
                removed += len(ours) + jumps
    try:
        removed += off_loop(lambda: _remove_routing(path))
    except OSError as exc:
        raise PortalsError(f"cannot remove the transparent return path: {exc}") from exc
    return removed


def _remove_routing(path: ReturnPath) -> int:
    """Delete our `ip rule`s and the local default route of the tables they name."""
    removed = 0
    with netlink() as ipr:
        for family in _FAMILIES:
            for rule in path._our_rules(ipr, family):
                table = path._rule_table(rule)
                for route in path._local_routes(ipr, family, table):
                    ipr.route(
                        "del",
                        family=_AF[family],
                        dst=_DEFAULT[family],
                        type="local",
                        scope=route["scope"],
                        oif=_attr(route, "RTA_OIF"),
                        table=table,
                    )
                    removed += 1
                ipr.rule(
                    "del",
                    family=_AF[family],
                    priority=RULE_PRIORITY,
                    fwmark=_attr(rule, "FRA_FWMARK"),
                    fwmask=_attr(rule, "FRA_FWMASK"),
                    table=table,
                )
                removed += 1
    return removed
