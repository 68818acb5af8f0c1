"""Which iptables backend to use (the host's mode), and removing our rules from every table.

`make_backend` maps `--iptables-backend` to a backend: python-iptables (libiptc) on the legacy
tables, or iptables-restore in the host's mode. `cleanup_all` removes our chains and the jumps
into them from the legacy and the nft tables alike, and the transparent return path
(`returnpath`), and nothing else.
"""

from __future__ import annotations

import os
import subprocess

from kube_userspace_proxy import logs
from kube_userspace_proxy.addresses import Family
from kube_userspace_proxy.errors import PortalsError
from kube_userspace_proxy.portals import plan
from kube_userspace_proxy.portals.plan import Backend, Delete, DropChain
from kube_userspace_proxy.portals.restore import RestoreBackend, binary
from kube_userspace_proxy.portals.returnpath import remove_all
from kube_userspace_proxy.portals.rules import (
    TABLES,
)

log = logs.get(__name__)


def kernel_has_match(name: str, family: Family = 4) -> bool:
    """True when the kernel has the xtables match `name` (registered, built in, or a module)."""
    path = f"/proc/net/ip{'6' if family == 6 else ''}_tables_matches"
    try:
        with open(path, encoding="ascii") as matches:
            if name in matches.read().split():
                return True
    except OSError:
        pass
    release = os.uname().release
    for index in ("modules.builtin", "modules.dep"):
        try:
            with open(f"/lib/modules/{release}/{index}", encoding="utf-8") as modules:
                if f"/xt_{name}.ko" in modules.read():
                    return True
        except OSError:
            continue
    return False


def _rule_count(family: Family, mode: str) -> int:
    exe = binary(family, mode, "save")
    if exe is None:
        return 0
    try:
        done = subprocess.run([exe], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.startswith("-A "))


def host_mode() -> str:
    """The iptables mode this host already uses: "legacy" if its tables hold more rules."""
    legacy = sum(_rule_count(f, "legacy") for f in (4, 6))
    nft = sum(_rule_count(f, "nft") for f in (4, 6))
    if legacy > nft or binary(4, "nft", "restore") is None:
        return "legacy"
    return "nft"


def make_backend(kind: str) -> Backend | None:
    """`--iptables-backend`: auto (the host's mode), iptc, restore, or none (no rules)."""
    if kind == "none":
        return None
    if kind == "restore":
        return RestoreBackend()
    if kind == "iptc":
        return _iptc()
    if kind != "auto":
        raise PortalsError(f"unknown iptables backend {kind!r} (auto, iptc, restore, none)")
    mode = host_mode()
    if binary(4, mode, "restore") is None:
        # Neither legacy nor nft tools: python-iptables would fail too (it needs libiptc and
        # libxtables from the same package); one line, no traceback.
        raise PortalsError(NO_IPTABLES)
    if mode == "legacy":
        try:
            return _iptc()
        except PortalsError as exc:
            log.warning("%s; using iptables-legacy-restore instead", exc)
    return RestoreBackend(mode)


NO_IPTABLES = (
    "no usable iptables on this host (iptables-legacy-restore and iptables-nft-restore are not"
    " installed): install the iptables package (Debian: apt-get install iptables), or run"
    " with --iptables-backend none to proxy without rules"
)


def _iptc() -> Backend:
    try:
        # Imported on demand: python-iptables loads libiptc and libxtables when imported, and
        # fails with its own XTablesError (not an OSError) when it cannot find them.
        from kube_userspace_proxy.portals.iptc import IptcBackend  # noqa: PLC0415
    except Exception as exc:  # ImportError, OSError, python-iptables' own XTablesError
        raise PortalsError(
            f"--iptables-backend iptc: python-iptables cannot load libiptc/libxtables ({exc});"
            " install the iptables package, or choose --iptables-backend restore or none"
        ) from None
    return IptcBackend()


def cleanup_all() -> int:
    """Remove our chains and the jumps into them from legacy and nft tables; count removals.

    Leaves every other rule alone; a chain that someone else's rule still jumps to is flushed
    but kept. Raises PortalsError after trying everything if any table could not be cleaned.
    """
    removed = 0
    failures: list[str] = []
    for mode in ("legacy", "nft"):
        backend = _cleanup_backend(mode)
        if backend is None:
            continue
        for family in (4, 6):
            try:
                tables = backend.tables(family)
            except PortalsError as exc:
                log.debug("skipping %s IPv%d: %s", mode, family, exc)
                continue
            for table in TABLES:
                if table not in tables:
                    continue
                try:
                    with backend.locked(family):
                        ops = plan.cleanup(table, backend.read(family, table))
                        if ops:
                            backend.commit(family, table, ops)
                except PortalsError as exc:
                    failures.append(f"{mode} IPv{family} {table}: {exc}")
                    continue
                removed += sum(1 for op in ops if isinstance(op, (Delete, DropChain)))
                if ops:
                    log.info("removed our rules from the %s %s table (IPv%d)", mode, table, family)
    try:
        gone = remove_all()  # the transparent return path (--preserve-source-ip)
    except PortalsError as exc:
        failures.append(str(exc))
    else:
        removed += gone
        if gone:
            log.info("removed the transparent return path (%d pieces)", gone)
    if failures:
        raise PortalsError("cleanup incomplete: " + "; ".join(failures))
    return removed


def _cleanup_backend(mode: str) -> Backend | None:
    if binary(4, mode, "restore") is not None:
        return RestoreBackend(mode)
    if mode == "legacy":
        try:
            return _iptc()
        except PortalsError:
            return None
    return None
