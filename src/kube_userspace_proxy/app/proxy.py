"""Wiring: sources -> state -> sync runner -> proxier, the ops server, signals and shutdown.

Every long-lived coroutine is a named root task owned here. A failure in one connection is
contained by the data plane; a failure in a root task stops the process loudly (exit 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import resource
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

import uvloop

from kube_userspace_proxy import addresses, collector, logs
from kube_userspace_proxy.app.runner import BoundedFrequencyRunner
from kube_userspace_proxy.cluster.sources import Source
from kube_userspace_proxy.cluster.sources.manifests import ManifestSource
from kube_userspace_proxy.cluster.state import ClusterState
from kube_userspace_proxy.config import kubeproxy as kpc
from kube_userspace_proxy.config.settings import ProxyConfig, effective_document
from kube_userspace_proxy.errors import PrerequisiteError, ProxyError
from kube_userspace_proxy.model import ClaimKey, ProxiedPort, Snapshot
from kube_userspace_proxy.ops.health import ProxyHealth, watch_lag
from kube_userspace_proxy.ops.metrics import ProxyMetrics, SourceCounters
from kube_userspace_proxy.ops.server import OpsServer, start_ops
from kube_userspace_proxy.ops.servicehealth import NoLocalEndpoints, ServiceHealthServers
from kube_userspace_proxy.portals import Portals, check_transparent, explain, make_backend
from kube_userspace_proxy.ports import PortAllocator
from kube_userspace_proxy.proxier.reconciler import (
    DataPlane,
    LocalDataPlane,
    Proxier,
    local_addresses_in,
)
from kube_userspace_proxy.restart import handover, statefile
from kube_userspace_proxy.workers.pool import WorkerPool

log = logs.get(__name__)
T = TypeVar("T")

STATE_FILE_INTERVAL = 5.0
"""Seconds between two writes of the state file while changes keep coming."""


def raise_nofile_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (each proxied connection needs two)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


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
    """The control process: state -> sync runner -> proxier (-> workers, rules), health, metrics.

    Built from a config with nothing opened or started; `serve()` runs it. Its parts are
    attributes, for the CLI, the demo and tests to inspect.
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.health = ProxyHealth(config.sync_period, families=_families(config.bind_address))
        self.node_ips: tuple[str, ...] = config.node_ips
        self.ops: OpsServer | None = None
        self.synced_once = asyncio.Event()
        self.serving = asyncio.Event()
        """Set once something is served (restored from a file or a handover, or synced)."""
        self.handed_over = False
        """True once a new process took every socket over (this one releases and drains)."""
        # Both held through a handover: nothing changes meanwhile. Syncs (rule commits
        # included) and applies each have their own, so an apply need not wait for a commit.
        self._sync_lock = asyncio.Lock()
        self._apply_lock = asyncio.Lock()
        self.syncs = 0
        """Syncs completed (listeners, workers and rules all updated)."""
        self._saved: Snapshot | None = None
        self._unsaved = False
        self._encoder = statefile.Encoder()  # the state file, kept encoded between saves
        self._saved_ports: tuple[int, statefile.Ports] | None = None
        """The rule generation and the proxy-port mapping of the last save."""
        self._saver: asyncio.Task[None] | None = None
        self._apply_wanted = asyncio.Event()
        self._applied_once = False
        # Trigger times of changes that wait for a rule commit, with the rule generation
        # that commit must reach.
        self._awaiting_rules: list[tuple[int, float]] = []
        self._no_local = NoLocalEndpoints()
        self.applies = 0
        """Changes applied to listeners and pools outside the sync runner (no rule commit)."""
        self._save_failed = False
        workers = config.worker_count
        self.workers: WorkerPool | None = None
        self.portals: Portals | None = None
        dataplane: DataPlane
        if workers > 1:
            dataplane = self.workers = WorkerPool(
                workers,
                udp_idle_timeout=config.udp_idle_timeout,
                tcp_keepalive=config.tcp_keepalive,
                verbosity=config.verbosity,
                log_format=config.log_format,
                event_loop=config.event_loop,
            )
        else:
            dataplane = LocalDataPlane(
                udp_idle_timeout=config.udp_idle_timeout, tcp_keepalive=config.tcp_keepalive
            )
        allocator = PortAllocator(
            config.port_range,
            host=config.bind_address,
            share_udp=dataplane.shares_ports,
        )
        self.proxier = Proxier(
            allocator, node_port_addresses=self._node_port_addresses, dataplane=dataplane
        )
        self.metrics = ProxyMetrics(
            self.proxier.port_stats,
            self.proxier.open_ports,
            per_service_port=config.metrics_per_service_port,
            transparent=config.preserve_source_ip,
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
                bind_address=config.bind_address,
                nodeport_addresses=config.nodeport_addresses,
                guard_proxy_ports=config.guard_proxy_ports,
                verify_period=config.verify_period,
                transparent=(config.transparent_mark, config.transparent_table)
                if config.preserve_source_ip
                else None,
            )
            self.proxier.set_rule_sink(_CountingRules(portals, self.metrics))
            self.portals = portals
        self.state = ClusterState(
            node_name=addresses.node_name(config.hostname_override or None),
            service_proxy_name=config.service_proxy_name or None,
            on_change=self._changed,
            loopback_endpoints=config.allows_loopback_endpoints,
        )
        self._frozen_at = 0  # service ports at the last gc.freeze()
        self.first_build = collector.Hold()
        """The collector is held off from the start until the first sync is done."""
        self.runner = BoundedFrequencyRunner(
            self.sync_once,
            min_interval=config.min_sync_period,
            max_interval=config.sync_period,
            name="sync",
        )

    def _freeze_long_lived(self, service_ports: int) -> None:
        """Keep the long-lived state out of the cyclic garbage collector's full passes.

        At 10,000 service ports a full pass over the state, listeners and pools takes
        ~600 ms, a stall of the event loop that allocation (an endpoint storm) triggers over
        and over. Freezing what is alive once the service ports have grown by half spares
        those passes; later garbage is collected as usual.
        """
        if service_ports > 1.5 * self._frozen_at + 100:
            gc.freeze()
            self._frozen_at = service_ports
            log.debug("%d objects kept out of garbage collection", gc.get_freeze_count())

    def _node_port_addresses(self) -> Sequence[str]:
        if not self.config.nodeport_addresses:
            return (self.config.bind_address,)
        return local_addresses_in(self.config.nodeport_addresses, addresses.local_addresses())

    def _changed(self) -> None:
        self.health.queued_update()
        self.metrics.sync_queued()
        self._apply_wanted.set()

    async def apply_loop(self) -> None:
        """Apply each change to listeners and pools at once (a root task); rules follow.

        An endpoint change that needs no rule change reaches the balancer pools (and the
        workers) here, without waiting for the sync runner's rate limit; a change that does
        (a new, changed or removed service port) is served here too, and the runner is asked
        for the rule commit, bounded by `--iptables-min-sync-period` as in kube-proxy.
        Changes that arrive while one batch is applied are coalesced into the next.
        """
        while True:
            await self._apply_wanted.wait()
            await asyncio.sleep(0)  # let the events of this turn in: one batch for them
            self._apply_wanted.clear()
            if not self.state.listed:
                continue
            if not self._applied_once:
                self.runner.request()  # the first sync is complete, and the runner's
                continue
            try:
                async with self._apply_lock:
                    await self.apply_changes()
            except Exception:
                # The changes taken are not applied: the runner's next sync takes the complete
                # state (and retries as any failed sync), and applies wait for it.
                log.exception("applying changes failed; a complete sync follows")
                self._applied_once = False
                self.runner.request()

    async def apply_changes(self) -> None:
        """Apply what changed since the last snapshot to listeners and pools (no rule commit)."""
        started = time.monotonic()
        snapshot = self._snapshot(self.state.changes())
        await self.proxier.sync(snapshot, full=False, rules=False)
        self.applies += 1
        await self._after(snapshot)
        if self.proxier.rules_pending:
            self.runner.request()
        else:  # nothing waits for a rule commit: this change is synced
            self.metrics.sync_done(time.monotonic() - started)
            self.health.synced()

    def _snapshot(self, snapshot: Snapshot) -> Snapshot:
        if self.config.node_ips:  # the flag wins over the Node object's addresses
            snapshot = replace(snapshot, node_ips=self.config.node_ips)
        if self.config.preserve_source_ip:
            snapshot = replace(snapshot, source=self.config.source_policy(snapshot.pod_cidrs))
        self.node_ips = snapshot.node_ips
        self.health.set_node_eligible(self.state.node_eligible)
        return snapshot

    async def _after(self, snapshot: Snapshot, *, live: float | None = None) -> None:
        """What follows each sync and each apply: health servers, metrics, latency, state file.

        `live`: when (time.time) a rule commit of this sync made its rules live; changes are
        measured to then (default: now)."""
        self._freeze_long_lived(self.proxier.served_count)
        await self.service_health.sync(snapshot)
        metrics = self.metrics
        metrics.set_no_local_endpoints(*self._no_local.update(snapshot))
        metrics.set_over_budget(self.proxier.over_budget())
        metrics.add_changes(snapshot.service_changes, snapshot.endpoint_changes)
        metrics.set_pending(self.state.pending_service_changes, self.state.pending_endpoint_changes)
        served_at = time.time() if live is None else live
        proxier = self.proxier
        if proxier.rules_pending:
            # Served only once the rules name the new ports: measured at that commit.
            generation = proxier.rules_generation
            self._awaiting_rules.extend((generation, t) for t in snapshot.trigger_times)
        else:
            for trigger in snapshot.trigger_times:
                metrics.network_programming(max(0.0, served_at - trigger))
        if self._awaiting_rules:
            committed = proxier.committed_generation
            waiting = []
            for generation, trigger in self._awaiting_rules:
                if generation <= committed:
                    metrics.network_programming(max(0.0, served_at - trigger))
                else:
                    waiting.append((generation, trigger))
            self._awaiting_rules = waiting
        if snapshot.changed is None or snapshot.changed:
            self._save_later()

    async def sync_once(self) -> bool:
        """One sync of listeners, workers and rules to the current state; False if not listed.

        The runner calls it for the rule commit the changes asked for (the changes since the
        last apply come with it), and periodically with the complete state (a full resync).
        """
        async with self._sync_lock:
            return await self._sync_once()

    async def _sync_once(self) -> bool:
        state = self.state
        if not state.listed:
            log.debug("sync skipped: waiting for the first complete list of Services and slices")
            return False
        started = time.monotonic()
        complete = self.runner.periodic or not self._applied_once
        snapshot = self._snapshot(state.snapshot() if complete else state.changes())
        commits = self.proxier.rule_applies
        await self.proxier.sync(snapshot, full=self.runner.periodic)
        self._applied_once = True
        # A commit went live before its deferred deletes, which the sync waited for too.
        live = self.proxier.rules_live_at if self.proxier.rule_applies != commits else None
        await self._after(snapshot, live=live)
        self.first_build.end()
        self.metrics.sync_done(time.monotonic() - started)
        self.health.synced()
        self.syncs += 1
        self.synced_once.set()
        self.serving.set()
        return True

    def counted_rules(self) -> list[tuple[int, str, str, int, int]] | None:
        """Our installed rules with their counters (blocking); None when this proxy has none."""
        return self.portals.counted_rules() if self.portals is not None else None

    def saved_state(self) -> tuple[Snapshot, statefile.Ports] | None:
        """What an earlier run saved in the state directory (None: nothing usable)."""
        if not self.config.state_dir:
            return None
        return statefile.load(self.config.state_dir, node_name=self.state.node_name)

    async def restore(self, saved: tuple[Snapshot, statefile.Ports], *, source: str = "") -> None:
        """Serve the state an earlier run saved, until the first complete list.

        The earlier run's rules may still point at its proxy ports: the same ports are taken
        again, so its Services answer while the API server is away.
        """
        snapshot, ports = saved
        if self.config.node_ips:
            snapshot = replace(snapshot, node_ips=self.config.node_ips)
        if self.config.preserve_source_ip:  # dial as the last run did, from the first connection
            snapshot = replace(snapshot, source=self.config.source_policy(snapshot.pod_cidrs))
        log.info(
            "serving %d service port(s) from %s until the first complete list",
            len(snapshot.services),
            source or f"the state file {statefile.path(self.config.state_dir)}",
        )
        self.proxier.prefer_ports(ports)
        await self.proxier.sync(snapshot)
        self._saved = snapshot
        self.serving.set()

    async def adopt(self, taken: handover.Taken) -> None:
        """Serve from what the process this one replaces handed over, at once.

        Its sockets replace binding (proxy ports, NodePorts, health-check ports; the workers
        received theirs already), its applied state replaces the state file, and the worker
        pool starts from its reuseport groups' order.
        """
        try:
            snapshot, ports = statefile.decode(taken.state, node_name=self.state.node_name)
        except statefile.StateFileError as exc:
            raise ProxyError(f"the handed-over state cannot be used: {exc}") from None
        claims = {}
        node_ports = {}
        health = {}
        for description, sock in [
            *taken.claim("port"),
            *taken.claim("nodeport"),
            *taken.claim("health"),
        ]:
            kind, *rest = description
            if kind == "port":
                claims[(str(rest[0]), str(rest[1]), str(rest[2]))] = sock
            elif kind == "nodeport":
                node_ports[(str(rest[0]), str(rest[1]), int(rest[2]))] = sock
            elif kind == "health":
                health[(str(rest[0]), int(rest[1]))] = sock
        if self.workers is not None:
            self.workers.adopt_groups(taken.groups)
        self.proxier.adopt(claims, node_ports)
        self.service_health.adopt(health)
        await self.restore((snapshot, ports), source=f"what process {taken.peer} handed over")
        if self.config.node_ips:
            snapshot = replace(snapshot, node_ips=self.config.node_ips)
        await self.service_health.sync(snapshot)

    def applied_state(self) -> Snapshot:
        """The state served now (before the first sync: what was restored or handed over)."""
        if not self._applied_once:
            return self._saved or Snapshot(node_name=self.state.node_name)
        snapshot = self.state.view()
        if self.config.node_ips:
            snapshot = replace(snapshot, node_ips=self.config.node_ips)
        return snapshot

    def _save_later(self) -> None:
        """Write the state file in the background (at most once a second) when it changed."""
        if not self.config.state_dir:
            return
        self._unsaved = True
        if self._saver is None or self._saver.done():
            self._saver = asyncio.create_task(self._save_loop(), name="state-file")

    async def _save_loop(self) -> None:
        # At most one write every STATE_FILE_INTERVAL: at 10,000 Services the file is
        # megabytes. It is encoded here, on the loop, a slice per turn (see
        # `statefile.encode_sliced`); only the write (file I/O) is left to a thread.
        while self._unsaved:
            self._unsaved = False
            snapshot = self.applied_state()
            saved = self._saved
            if (
                saved is not None
                and saved.services == snapshot.services
                and saved.endpoints == snapshot.endpoints
                and saved.node_ips == snapshot.node_ips
                and saved.pod_cidrs == snapshot.pod_cidrs
            ):
                continue
            self._saved = snapshot
            # The proxy ports change only with a rule target (never in an endpoint storm):
            # the same mapping is kept until then, so the encoder need not look through it.
            generation = self.proxier.rules_generation
            if self._saved_ports is None or self._saved_ports[0] != generation:
                ports = await _ports_sliced(self.proxier.proxied_ports())
                self._saved_ports = (generation, ports)
            ports = self._saved_ports[1]
            data = await statefile.encode_sliced(self._encoder, snapshot, ports)
            try:
                await asyncio.to_thread(statefile.write, self.config.state_dir, data)
                self._save_failed = False
            except OSError as exc:
                if not self._save_failed:
                    log.warning("cannot write the state file in %s: %s", self.config.state_dir, exc)
                self._save_failed = True
            await asyncio.sleep(STATE_FILE_INTERVAL)

    async def collect(self, *, debug: bool = False) -> None:
        """Bring the per-service-port counters up to date (summed from the workers)."""
        if self.workers is not None:
            await self.workers.collect(debug=debug)


PORTS_STEP = 500
"""Rule targets whose proxy ports are read in one turn of the loop (`_ports_sliced`)."""


async def _ports_sliced(targets: Sequence[ProxiedPort]) -> statefile.Ports:
    """`Proxier.ports_of(targets)`, PORTS_STEP targets per turn of the loop."""
    ports: statefile.Ports = {}
    for start in range(0, len(targets), PORTS_STEP):
        if start:
            await asyncio.sleep(0)
        ports.update(Proxier.ports_of(targets[start : start + PORTS_STEP]))
    return ports


class _Giver:
    """The running proxy's side of a handover (`handover.Giver`)."""

    def __init__(self, proxy: Proxy, stop: asyncio.Event) -> None:
        self._proxy = proxy
        self._stop = stop
        self.workers = proxy.workers.count if proxy.workers is not None else 1

    def handover_sockets(self) -> list[tuple[list[Any], int]]:
        proxy = self._proxy
        items = proxy.proxier.handover_sockets() + proxy.service_health.handover_sockets()
        if proxy.ops is not None:
            for (host, port), sock in proxy.ops.listening:
                if sock.fileno() >= 0:
                    items.append((["ops", host, port], sock.fileno()))
        return items

    def handover_state(self) -> tuple[bytes, list[Any]]:
        proxy = self._proxy
        state = statefile.encode(proxy.applied_state(), proxy.proxier.served_ports())
        pool = proxy.workers
        groups = [[*key, members] for key, members in pool.groups().items()] if pool else []
        return state, groups

    async def export_workers(self, paths: dict[int, str]) -> dict[int, int]:
        if self._proxy.workers is None:
            return {}
        return await self._proxy.workers.export(paths, handover.STEP_TIMEOUT)

    async def hold(self) -> None:
        await self._proxy._sync_lock.acquire()
        await self._proxy._apply_lock.acquire()

    def resume(self) -> None:
        self._proxy._apply_lock.release()
        self._proxy._sync_lock.release()

    def handed_over(self) -> None:
        self._proxy.handed_over = True
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()


def _families(bind_address: str) -> tuple[str, ...]:
    """The IP families the proxy ports serve, as kube-proxy names them in health bodies."""
    if bind_address == "::":
        return ("IPv4", "IPv6")  # dual stack (IPV6_V6ONLY off)
    return ("IPv6",) if addresses.ip_family(bind_address) == 6 else ("IPv4",)


def build(config: ProxyConfig) -> Proxy:
    """Create the parts of a proxy for `config` (nothing is opened or started yet)."""
    return Proxy(config)


def make_source(
    config: ProxyConfig, state: ClusterState, metrics: ProxyMetrics | None = None
) -> Source:
    """Manifests when `--manifests` is given, else the API server (counted in `metrics`)."""
    if config.manifests:
        return ManifestSource(list(config.manifests), state)
    # Imported here: kubernetes_asyncio takes a quarter of the start-up, which a restart from
    # the state file does not wait for.
    from kube_userspace_proxy.cluster.sources.kube import KubeSource  # noqa: PLC0415

    return KubeSource(
        state,
        kubeconfig=config.kubeconfig or None,
        master=config.master or None,
        node_name=state.node_name,
        service_proxy_name=config.service_proxy_name or None,
        qps=config.kube_api_qps,
        burst=config.kube_api_burst,
        relist_period=config.config_sync_period,
        on_request=metrics.api_request if metrics is not None else None,
    )


async def _start_ops(proxy: Proxy, taken: handover.Taken | None = None) -> None:
    config = proxy.config
    adopted = {(str(d[1]), int(d[2])): sock for d, sock in taken.claim("ops")} if taken else {}
    proxy.ops = await start_ops(
        healthz_bind=config.healthz_bind_address,
        metrics_bind=config.metrics_bind_address,
        health=proxy.health,
        metrics=proxy.metrics,
        debug_state=proxy.proxier.debug_items,
        configz=lambda: {kpc.GROUP: effective_document(config)},
        collect=proxy.collect,
        rules=proxy.counted_rules,
        adopted=adopted,
    )
    used = {id(sock) for _, sock in proxy.ops.listening}
    for sock in adopted.values():
        if id(sock) not in used:  # the old process's site on another address
            sock.close()


async def _check_client_configuration(config: ProxyConfig) -> None:
    """Raise ConfigError (exit 2) when the API server's client configuration is unusable."""
    if config.manifests:
        return
    from kube_userspace_proxy.cluster.sources.kube import load_client_configuration  # noqa: PLC0415

    await load_client_configuration(config.kubeconfig or None, config.master or None)


async def _first_done(tasks: Sequence[asyncio.Task[Any]], stop: asyncio.Event) -> str:
    waiter = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    for task in tasks:
        if task in done:
            exc = task.exception()
            if exc is not None:
                log.error("root task %s failed: %r", task.get_name(), exc, exc_info=exc)
                return "failed"
            log.error("root task %s ended unexpectedly", task.get_name())
            return "failed"
    return "stopped"


async def serve(
    config: ProxyConfig,
    *,
    stop: asyncio.Event | None = None,
    started: Callable[[Proxy], Awaitable[None] | None] | None = None,
) -> int:
    """Run the proxy until SIGTERM/SIGINT (or `stop`), then shut down gracefully; exit code."""
    limit = raise_nofile_limit()
    log.info(
        "kube-userspace-proxy starting (userspace mode, %d worker process(es), RLIMIT_NOFILE=%d)",
        config.worker_count if config.worker_count > 1 else 0,
        limit,
    )
    proxy = build(config)
    # Until the first sync, nearly all that is built lives on (see collector.py).
    proxy.first_build.begin()
    try:
        return await _serve(proxy, stop or asyncio.Event(), started)
    finally:
        proxy.first_build.abandon()  # ended before its first sync: the collector runs again


async def _serve(
    proxy: Proxy,
    stop: asyncio.Event,
    started: Callable[[Proxy], Awaitable[None] | None] | None,
) -> int:
    config = proxy.config
    taken = None
    if config.state_dir:
        try:
            taken = await handover.take(
                config.state_dir,
                proxy.workers.count if proxy.workers else 1,
                wait_exit=config.shutdown_grace + 30,
            )
        except ProxyError as exc:
            log.error("%s", exc)
            return 1
    saved = proxy.saved_state() if taken is None else None
    if saved is None:
        # A bad kubeconfig is a configuration error (exit 2), found before anything runs.
        await _check_client_configuration(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, _on_signal, sig, stop)
    try:
        await _start_ops(proxy, taken)
        if proxy.workers is not None:
            await proxy.workers.start()
        if taken is not None:
            await _take_over(proxy, taken)
        elif saved is not None:
            # Served from the file first (a restart during an API-server outage); a bad
            # kubeconfig still ends the process with exit code 2.
            await proxy.restore(saved)
            await _check_client_configuration(config)
    except ProxyError as exc:
        log.error("%s", exc)
        if taken is not None:
            # Nothing of what was handed over is closed or shut down here: the old process
            # serves on with it; killing the workers closes their descriptors only.
            taken.close()
            if proxy.workers is not None:
                proxy.workers.abandon()
            return 1
        if proxy.ops is not None:
            await proxy.ops.close()
        return 1
    source = make_source(config, proxy.state, proxy.metrics)
    if not config.manifests:  # the API source's relist, error and bad-data counters
        proxy.metrics.follow_source(cast(SourceCounters, source))
    tasks = [
        asyncio.create_task(source.run(), name="source"),
        asyncio.create_task(proxy.runner.loop(), name="sync"),
        asyncio.create_task(proxy.apply_loop(), name="apply"),
        asyncio.create_task(proxy.health.heartbeat(), name="heartbeat"),  # for /livez
        asyncio.create_task(watch_lag(proxy.metrics.loop_lag), name="loop-lag"),
    ]
    if config.state_dir:  # the next process takes over from this one
        giver = _Giver(proxy, stop)
        tasks.append(
            asyncio.create_task(
                handover.serve(config.state_dir, giver, proxy.serving.wait()), name="handover"
            )
        )
    if proxy.workers is not None:  # their loops count for /livez too
        proxy.health.watch_loops(proxy.workers.stalest_answer)
        tasks.append(asyncio.create_task(proxy.workers.heartbeat(), name="worker-heartbeat"))
    if started is not None:
        result = started(proxy)
        if asyncio.iscoroutine(result):
            await result
    outcome = await _first_done(tasks, stop)
    if proxy.handed_over:
        outcome = "stopped"
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if proxy.handed_over:
        await _hand_over(proxy, stop)
    else:
        log.info("stopping: no new connections; open ones get %.1fs", config.shutdown_grace)
        if proxy.workers is not None:
            await proxy.workers.shutdown(config.shutdown_grace)
        await proxy.service_health.close()
        await proxy.proxier.shutdown(config.shutdown_grace)
        if proxy.ops is not None:
            await proxy.ops.close()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(sig)
    log.info("stopped (rules left in place; `kube-userspace-proxy cleanup` removes them)")
    return 0 if outcome == "stopped" else 1


async def _take_over(proxy: Proxy, taken: handover.Taken) -> None:
    """Serve everything the running proxy handed over, then tell it so (it stops).

    Any failure is a ProxyError: the caller then kills the workers, so that nothing closes
    or shuts down the handed-over sockets the running proxy still serves.
    """
    try:
        await _adopt_everything(proxy, taken)
    except ProxyError:
        raise
    except Exception as exc:
        raise ProxyError(
            f"the handover from the running proxy (pid {taken.peer}) failed: {exc!r}; it serves on"
        ) from exc
    log.info("serving every port the earlier process served; it stops accepting and drains")


async def _adopt_everything(proxy: Proxy, taken: handover.Taken) -> None:
    config = proxy.config
    pool = proxy.workers
    if pool is None:
        await taken.workers(_no_workers)
    else:
        sent = await taken.workers(lambda: pool.prepare_adoption(config.state_dir))
        received = await pool.finish_adoption(handover.STEP_TIMEOUT)
        if sent != received:
            raise ProxyError(f"the workers received {received} socket(s), {sent} were sent")
        log.info("the workers received %d socket(s) from theirs", sum(received.values()))
    await proxy.adopt(taken)
    await taken.serving()
    taken.close()  # the handed-over sockets nothing took (e.g. ops ones on another address)


async def _no_workers() -> dict[int, str]:
    return {}


async def _hand_over(proxy: Proxy, stop: asyncio.Event) -> None:
    """A new process serves: release every socket untouched, drain, and (with
    --after-handover=wait) stay until SIGTERM."""
    config = proxy.config
    log.info("handed over: no new connections here; open ones get %.1fs", config.shutdown_grace)
    if proxy.ops is not None:
        await proxy.ops.close()
    await proxy.service_health.close()
    await asyncio.gather(
        *(
            [proxy.workers.shutdown(config.shutdown_grace, release=True)]
            if proxy.workers is not None
            else []
        ),
        proxy.proxier.shutdown(config.shutdown_grace, release=True),
    )
    if config.after_handover == "wait":
        log.info("drained; waiting for SIGTERM (--after-handover=wait)")
        stop.clear()
        await stop.wait()


async def rules_text(config: ProxyConfig) -> str:
    """The rules `run` would install for the current sources, each with its explanation.

    Proxy ports are picked when the proxy starts, so the ones shown are examples (numbered
    from the start of `--proxy-port-range`, or from 40000); /debug/state shows the live ones.
    """
    proxy = build(config.model_copy(update={"iptables_backend": "none", "workers": "1"}))
    source = make_source(config, proxy.state)
    await source.load_once()
    snapshot = proxy.state.snapshot()
    port_range = config.port_range
    next_port = port_range[0] if port_range else 40000
    ports = []
    for info in sorted(snapshot.services.values(), key=lambda i: i.name):
        cluster = next_port
        external = next_port + 1 if info.paths_differ else cluster
        next_port = external + 1
        ports.append(ProxiedPort(info, cluster, external))
    node_ips = config.node_ips or snapshot.node_ips
    lines = [
        f"# {len(ports)} service port(s); node IPs: "
        + (", ".join(node_ips) or "none known (pass --node-ip)"),
        "# proxy ports are examples: each run picks free ones (see /debug/state for live ones)",
    ]
    for rule, why in explain(
        ports,
        node_ips=node_ips,
        bind_address=config.bind_address,
        nodeport_addresses=config.nodeport_addresses,
    ):
        lines.append(f"{rule}\n    # {why}")
    return "\n".join(lines)


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    log.info("received %s", sig.name)
    stop.set()


def run_loop(main: Coroutine[Any, Any, T], event_loop: str = "uvloop") -> T:
    """Run `main` on uvloop (or plain asyncio) and return its result."""
    factory = uvloop.new_event_loop if event_loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
