"""What --preserve-source-ip needs from the node, checked before anything is installed.

Each check names the missing piece in one PrerequisiteError, so the proxy exits 1 with one
clear line and nothing half-installed. rp_filter is read and logged but never refused: the
reverse-path check looks up the *source* of a reply (the endpoint), whose route is the
ordinary one, so 0, 1 and 2 all let the replies through (measured in the two-node model).
"""

from __future__ import annotations

import contextlib
import socket

from kube_userspace_proxy import logs
from kube_userspace_proxy.errors import PortalsError, PrerequisiteError
from kube_userspace_proxy.portals.backends import kernel_has_match
from kube_userspace_proxy.portals.returnpath import (
    RULE_PRIORITY,
    netlink,
    off_loop,
    our_table_routes,
)

log = logs.get(__name__)

CAP_NET_ADMIN = 12
_TEST_ADDRESS = "192.0.2.1"  # TEST-NET-1: never local, so binding it needs IP_TRANSPARENT


def effective_capabilities(path: str = "/proc/self/status") -> int:
    """This process's effective capability set (CapEff) as a bit mask; 0 if unreadable."""
    with contextlib.suppress(OSError), open(path, encoding="ascii") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def check_transparent(mark: int, table: int) -> None:
    """Raise PrerequisiteError naming the first thing the transparent mode lacks here."""
    if not effective_capabilities() >> CAP_NET_ADMIN & 1:
        raise PrerequisiteError(
            "--preserve-source-ip needs CAP_NET_ADMIN (IP_TRANSPARENT, ip rule, routes):"
            " run as root or add the capability"
        )
    for family in (4, 6):
        if not kernel_has_match("socket", family):
            raise PrerequisiteError(
                f"--preserve-source-ip needs the kernel's iptables `socket` match (xt_socket,"
                f" IPv{family}): load the xt_socket module"
            )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_TRANSPARENT", 19), 1)
        sock.bind((_TEST_ADDRESS, 0))
    except OSError as exc:
        raise PrerequisiteError(
            f"--preserve-source-ip: the kernel refuses IP_TRANSPARENT sockets ({exc.strerror})"
        ) from exc
    finally:
        sock.close()
    try:
        foreign = off_loop(lambda: _policy_routing(table))
    except (OSError, PortalsError) as exc:
        raise PrerequisiteError(
            f"--preserve-source-ip needs policy routing (ip rule, CONFIG_IP_MULTIPLE_TABLES): {exc}"
        ) from exc
    if foreign:
        raise PrerequisiteError(
            f"--preserve-source-ip: routing table {table} already holds routes that are not"
            f" ours ({foreign[0]}); choose another with --transparent-table"
        )
    log.info(
        "transparent proxying: mark %#x, ip rule priority %d, table %d; rp_filter all=%s",
        mark,
        RULE_PRIORITY,
        table,
        _read("/proc/sys/net/ipv4/conf/all/rp_filter"),
    )


def _policy_routing(table: int) -> list[str]:
    """Dump the rules of both families (fails without policy routing); `table`'s foreign
    routes."""
    with netlink() as ipr:
        for family in (socket.AF_INET, socket.AF_INET6):
            ipr.get_rules(family=family)
        return our_table_routes(ipr, table, foreign=True)


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return "?"
