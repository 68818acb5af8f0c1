"""Portals: the iptables rules that send Service traffic to the proxy ports.

The package, one concept per module: `rules` renders one service port's rules (with an
explanation each) into its shard of each chain, `desired` keeps the whole desired set and
re-renders only the ports that changed, `plan` turns desired rules and what a table holds
into operations, `restore` and `iptc` are the two backends that read and commit them,
`reconcile` holds `Portals` (applies the difference each sync, checks cheaply for tampering,
verifies in full now and then, reads back an earlier run's proxy ports), `flows` deletes the
conntrack entries of UDP flows a commit made stale (ctnetlink), `returnpath` keeps the mark
rule, `ip rule` and local route that bring replies back to transparent dials
(--preserve-source-ip), `prerequisites` checks what that mode needs before anything is
installed, and `backends` picks a backend for the host and removes our rules everywhere
(`cleanup_all`).
"""

from kube_userspace_proxy.errors import PortalsError
from kube_userspace_proxy.portals.backends import (
    cleanup_all,
    host_mode,
    kernel_has_match,
    make_backend,
)
from kube_userspace_proxy.portals.desired import explain
from kube_userspace_proxy.portals.flows import StaleFlows
from kube_userspace_proxy.portals.plan import Backend
from kube_userspace_proxy.portals.prerequisites import check_transparent
from kube_userspace_proxy.portals.reconcile import VERIFY_PERIOD, Portals
from kube_userspace_proxy.portals.rules import Rule
from kube_userspace_proxy.portals.settings import served_families

__all__ = [
    "VERIFY_PERIOD",
    "Backend",
    "Portals",
    "PortalsError",
    "Rule",
    "StaleFlows",
    "check_transparent",
    "cleanup_all",
    "explain",
    "host_mode",
    "kernel_has_match",
    "make_backend",
    "served_families",
]
