"""The `Proxy` object: the control process's parts, wired together (nothing opened or started).

Sources write into the cluster state; the pipeline (`pipeline.py`) applies its changes through
the proxier to listeners, workers and rules; health, metrics and the ops sites report.
`lifecycle.py` runs the whole.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TypeVar

from kube_userspace_proxy import addresses, collector, logs
from kube_userspace_proxy.app.pipeline import Pipeline
from kube_userspace_proxy.app.saver import StateSaver
from kube_userspace_proxy.cluster.state import ClusterState
from kube_userspace_proxy.config.settings import ProxyConfig
from kube_userspace_proxy.dataplane import native, tcp
from kube_userspace_proxy.errors import PrerequisiteError
from kube_userspace_proxy.model import ClaimKey, Desired, ProxiedPort, Snapshot
from kube_userspace_proxy.ops.health import ProxyHealth
from kube_userspace_proxy.ops.metrics import ProxyMetrics
from kube_userspace_proxy.ops.server import OpsServer
from kube_userspace_proxy.ops.servicehealth import ServiceHealthServers
from kube_userspace_proxy.portals import (
    Portals,
    StaleFlows,
    check_transparent,
    explain,
    make_backend,
    served_families,
)
from kube_userspace_proxy.ports import PortAllocator
from kube_userspace_proxy.proxier.contracts import DataPlane
from kube_userspace_proxy.proxier.local import LocalDataPlane
from kube_userspace_proxy.proxier.nodeports import local_addresses_in
from kube_userspace_proxy.proxier.reconciler import Proxier
from kube_userspace_proxy.restart import statefile, statelock
from kube_userspace_proxy.workers.pool import WorkerPool

log = logs.get(__name__)

D = TypeVar("D", bound=Desired)


class _CountingRules:
    """Passes rule sets to the portals, counting failures."""

    def __init__(self, portals: Portals, metrics: ProxyMetrics):
        self._portals = portals
        self._metrics = metrics

    def claimed_ports(self) -> dict[ClaimKey, int]:
        return self._portals.claimed_ports()

    def apply(self, ports: Sequence[ProxiedPort], node_ips: Sequence[str]) -> None:
        try:
            self._portals.set_node_ips(node_ips)
            self._portals.apply(ports)
        except Exception:
            self._metrics.restore_failure()
            raise
        finally:
            self._metrics.set_iptables_rules(self._portals.rule_counts())

    def commit_deferred(self) -> None:
        try:
            self._portals.commit_deferred()
        except Exception:
            self._metrics.restore_failure()
            raise
        finally:
            self._metrics.set_iptables_rules(self._portals.rule_counts())


class Proxy:
    """The control process: state -> pipeline -> proxier (-> workers, rules), health, metrics.

    Built from a config with nothing opened or started; `serve()` runs it. Its parts are
    attributes, for the CLI, the demo and tests to inspect.
    """

    def __init__(self, config: ProxyConfig, *, listen_address: str | None = None) -> None:
        self.config = config
        self.listen_address, self.node_families = listening(config, listen_address)
        """Where the proxy ports are bound, and (the bind address left unspecified) the
        families the node has addresses in at start: see `listening`."""
        self.health = ProxyHealth(config.sync_period, families=_families(self.listen_address))
        self.ops: OpsServer | None = None
        self.handed_over = False
        self.state_lock: statelock.StateLock | None = None
        """This process's lock on --state-dir (restart/statelock.py), once it owns it."""
        """True once a new process took every socket over (this one releases and drains)."""
        # Both held through a handover: nothing changes meanwhile. Syncs (rule commits
        # included) and applies each have their own, so an apply need not wait for a commit.
        self._sync_lock = asyncio.Lock()
        self._apply_lock = asyncio.Lock()
        self.dataplane = choose_dataplane(config.dataplane)
        """`native` or `python`: the TCP data plane that serves (here and in the workers)."""
        workers = config.worker_count
        self.workers: WorkerPool | None = None
        self.portals: Portals | None = None
        # The workers pick with pools of their own; this process keeps what it sends them.
        self.proxier: Proxier[Any]
        if workers > 1:
            self.workers = WorkerPool(
                workers,
                udp_idle_timeout=config.udp_idle_timeout,
                tcp_keepalive=config.tcp_keepalive,
                verbosity=config.verbosity,
                log_format=config.log_format,
                event_loop=config.event_loop,
                dataplane=self.dataplane,
            )
            self.proxier = Proxier(
                self._allocator(self.workers),
                node_port_addresses=self._node_port_addresses,
                dataplane=self.workers,
            )
        else:
            local = LocalDataPlane(
                udp_idle_timeout=config.udp_idle_timeout, tcp_keepalive=config.tcp_keepalive
            )
            self.proxier = Proxier(
                self._allocator(local),
                node_port_addresses=self._node_port_addresses,
                dataplane=local,
            )
        self.proxier.balancing = config.balancing
        self.metrics = ProxyMetrics(
            self.proxier.port_stats,
            self.proxier.open_ports,
            per_service_port=config.metrics_per_service_port,
            transparent=config.preserve_source_ip,
            ip_families=_families(self.listen_address),
            dataplane=self.dataplane,
        )
        if self.workers is not None:
            self.metrics.follow_workers(self.workers)
        self.service_health = ServiceHealthServers(self.health, self._node_port_addresses)
        backend_kind = config.iptables_backend
        if config.preserve_source_ip:  # before anything is installed: all of it, or none
            check_transparent(config.transparent_mark, config.transparent_table)
            if backend_kind == "none":
                raise PrerequisiteError("--preserve-source-ip needs iptables rules, not none")
        if backend_kind == "auto" and os.geteuid() != 0:
            log.warning(
                "not running as root: serving proxy ports only, no iptables rules "
                "(ClusterIPs and NodePorts are not captured; use --iptables-backend none to"
                " silence)"
            )
            backend_kind = "none"
        backend = make_backend(backend_kind)
        if backend is not None:
            portals = Portals(
                backend,
                node_ips=config.node_ips,
                bind_address=self.listen_address,
                nodeport_addresses=config.nodeport_addresses,
                guard_proxy_ports=config.guard_proxy_ports,
                node_families=self.node_families,
                verify_period=config.verify_period,
                transparent=(config.transparent_mark, config.transparent_table)
                if config.preserve_source_ip
                else None,
                flows=StaleFlows(),
            )
            self.metrics.follow_flows(portals.flows)
            self.proxier.set_rule_sink(_CountingRules(portals, self.metrics))
            self.portals = portals
        self.state = ClusterState(
            node_name=addresses.node_name(config.hostname_override or None),
            service_proxy_name=config.service_proxy_name or None,
            on_change=self._changed,
            loopback_endpoints=config.allows_loopback_endpoints,
        )
        self.saver = StateSaver(config.state_dir, self.applied_state, self.proxier)
        self.first_build = collector.Hold()
        """The collector is held off from the start until the first sync is done."""
        self.pipeline = Pipeline(
            self.state,
            self.proxier,
            health=self.health,
            metrics=self.metrics,
            service_health=self.service_health,
            saver=self.saver,
            first_build=self.first_build,
            configured=self.configured,
            sync_lock=self._sync_lock,
            apply_lock=self._apply_lock,
            min_sync_period=config.min_sync_period,
            sync_period=config.sync_period,
        )
        self.runner = self.pipeline.runner
        self.synced_once = self.pipeline.synced_once
        self.serving = self.pipeline.serving
        """Set once something is served (restored from a file or a handover, or synced)."""

    def planned_rules(self, names: frozenset[str]) -> list[tuple[str, str]]:
        """The rules this proxy would install for the named service ports, with why: what
        /debug/ui shows when it installs none (the demo)."""
        ports = [port for port in self.proxier.proxied_ports() if str(port.info.name) in names]
        config = self.config
        return explain(
            ports,
            node_ips=config.node_ips or self.state.node_ips,
            bind_address=self.listen_address,
            nodeport_addresses=config.nodeport_addresses,
            node_families=self.node_families,
        )

    def configured(self, snapshot: D) -> D:
        """`snapshot` with what the configuration decides: the node IPs that apply
        (`--node-ip`'s when given, else the Node object's, which the snapshot carries) and the
        source policy (`--preserve-source-ip`, from the snapshot's podCIDRs; None while off)."""
        if self.config.node_ips:
            snapshot = replace(snapshot, node_ips=self.config.node_ips)
        if self.config.preserve_source_ip:
            snapshot = replace(snapshot, source=self.config.source_policy(snapshot.pod_cidrs))
        return snapshot

    def _allocator(self, dataplane: DataPlane[Any]) -> PortAllocator:
        return PortAllocator(
            self.config.port_range, host=self.listen_address, share_udp=dataplane.shares_ports
        )

    def _node_port_addresses(self) -> Sequence[str]:
        configured = self.config.nodeport_addresses
        if not configured:
            return (self.listen_address,)
        # `primary`: the node IPs of the sync under way.
        cidrs = addresses.nodeport_cidrs(configured, self.proxier.node_ips)
        return local_addresses_in(cidrs, addresses.local_addresses())

    def _changed(self) -> None:
        self.pipeline.changed()

    def counted_rules(self) -> list[tuple[int, str, str, int, int]] | None:
        """Our installed rules with their counters (blocking); None when this proxy has none."""
        return self.portals.counted_rules() if self.portals is not None else None

    def saved_state(self) -> tuple[Snapshot, statefile.Ports] | None:
        """What an earlier run saved in the state directory (None: nothing usable)."""
        if not self.config.state_dir:
            return None
        return statefile.load(
            self.config.state_dir,
            node_name=self.state.node_name,
            loopback=self.config.allows_loopback_endpoints,
        )

    async def restore(self, saved: tuple[Snapshot, statefile.Ports], *, source: str = "") -> None:
        """Serve the state an earlier run saved, until the first complete list.

        The earlier run's rules may still point at its proxy ports: the same ports are taken
        again, so its Services answer while the API server is away.
        """
        snapshot, ports = saved
        snapshot = self.configured(snapshot)  # --preserve-source-ip: dials as the last run's
        log.info(
            "serving %d service port(s) from %s until the first complete list",
            len(snapshot.services),
            source or f"the state file {statefile.path(self.config.state_dir)}",
        )
        self.proxier.prefer_ports(ports)
        await self.proxier.sync(snapshot)
        self.saver.saved = snapshot
        self.serving.set()

    async def hold_changes(self) -> None:
        """Change nothing that is served (no sync, commit or apply) until `resume_changes`:
        a handover is under way."""
        await self._sync_lock.acquire()
        await self._apply_lock.acquire()

    def resume_changes(self) -> None:
        """Change what is served again (the handover failed)."""
        self._apply_lock.release()
        self._sync_lock.release()

    def applied_state(self) -> Snapshot:
        """The state served now (before the first sync: what was restored or handed over)."""
        if not self.pipeline.applied_once:
            return self.saver.saved or Snapshot(node_name=self.state.node_name)
        return self.configured(self.state.view())

    async def collect(self, *, debug: bool = False) -> None:
        """Bring the per-service-port counters up to date (summed from the workers)."""
        if self.workers is not None:
            await self.workers.collect(debug=debug)


def listening(
    config: ProxyConfig, handed_over: str | None = None
) -> tuple[str, frozenset[addresses.Family] | None]:
    """The address the proxy ports bind to, and the node's families when they decide.

    An explicit --bind-address is used as it is (None: it alone decides the families). Left
    unspecified, the proxy serves the families the node has addresses in, as kube-proxy does:
    those of --node-ip, else of the host's own addresses (the Node's InternalIPs take over in
    the rules once known); the ports are dual-stack (`::`) when IPv6 is among them. A
    handover's ports keep the address the earlier process bound them to (`handed_over`).
    """
    families: frozenset[addresses.Family] | None = None
    if config.bind_address:
        address = config.bind_address
    else:
        families = (
            addresses.families_of(config.node_ips) or addresses.host_families() or frozenset({4})
        )
        address = addresses.unspecified_address(families)
    if handed_over and handed_over != address:
        log.warning(
            "the handed-over proxy ports listen on %s, not on %s: they keep doing so (a"
            " handover refuses nothing); restart the proxy without one (stop it, then start"
            " it) to listen on %s",
            handed_over,
            address,
            address,
        )
        address = handed_over
    return address, families


def _families(bind_address: str) -> tuple[str, ...]:
    """The IP families the proxy ports serve, as kube-proxy names them in health bodies."""
    return tuple(f"IPv{f}" for f in sorted(served_families(bind_address))) or ("IPv4",)


def choose_dataplane(name: str) -> str:
    """The TCP data plane for --dataplane `name`, made this process's default; `auto` without
    the extension is the Python data plane, said once; `native` without it is an error."""
    try:
        chosen = tcp.set_default(name)
    except ValueError as exc:
        raise PrerequisiteError(
            f"{exc}; build it with a C compiler and Python's headers (pip install .),"
            " or run with --dataplane python"
        ) from None
    if name == "auto" and chosen == "python":
        log.warning(
            "the native data plane cannot serve (%s): serving with the Python data plane",
            native.unavailable(),
        )
    return chosen
