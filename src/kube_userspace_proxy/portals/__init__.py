"""Portals: the iptables rules that send Service traffic to the proxy ports.

The package, one concept per module: `rules` renders the desired rules (with an explanation
each), `plan` turns desired rules and what a table holds into operations, `restore` and `iptc`
are the two backends that read and commit them, `reconcile` holds `Portals` (applies the
difference each sync, repairs tampering, reads back an earlier run's proxy ports), and
`backends` picks a backend for the host and removes our rules everywhere (`cleanup_all`).
"""

from kube_userspace_proxy.errors import PortalsError
from kube_userspace_proxy.portals.backends import (
    cleanup_all,
    host_mode,
    kernel_has_match,
    make_backend,
)
from kube_userspace_proxy.portals.plan import Backend
from kube_userspace_proxy.portals.reconcile import Portals
from kube_userspace_proxy.portals.rules import ClaimKey, Rule, explain, served_families

__all__ = [
    "Backend",
    "ClaimKey",
    "Portals",
    "PortalsError",
    "Rule",
    "cleanup_all",
    "explain",
    "host_mode",
    "kernel_has_match",
    "make_backend",
    "served_families",
]
