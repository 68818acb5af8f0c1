"""The control process's life: serve -> startup -> main loop -> shutdown, read top to bottom.

Every long-lived coroutine is a named root task started here. A failure in one connection is
contained by the data plane; a failure in a root task stops the process loudly (exit 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

from kube_userspace_proxy import logs
from kube_userspace_proxy.app.handover import Giver, hand_over, ops_sockets, take_over
from kube_userspace_proxy.app.proxy import Proxy
from kube_userspace_proxy.cluster.sources import Source
from kube_userspace_proxy.cluster.sources.manifests import ManifestSource
from kube_userspace_proxy.cluster.state import ClusterState
from kube_userspace_proxy.config import kubeproxy as kpc
from kube_userspace_proxy.config.settings import ProxyConfig, effective_document
from kube_userspace_proxy.dataplane import coreloop, tcp
from kube_userspace_proxy.errors import ProxyError
from kube_userspace_proxy.model import Snapshot
from kube_userspace_proxy.ops.health import watch_lag
from kube_userspace_proxy.ops.metrics import ProxyMetrics, SourceCounters
from kube_userspace_proxy.ops.server import start_ops
from kube_userspace_proxy.restart import handover, statefile, statelock

log = logs.get(__name__)
T = TypeVar("T")

Started = Callable[[Proxy], Awaitable[None] | None]
"""Called once the root tasks run (the CLI's demo and tests inspect the proxy then)."""


async def serve(
    config: ProxyConfig,
    *,
    stop: asyncio.Event | None = None,
    started: Started | None = None,
) -> int:
    """Run the proxy until SIGTERM/SIGINT (or `stop`), then shut down gracefully; exit code."""
    limit = raise_nofile_limit()
    log.info(
        "kube-userspace-proxy starting (userspace mode, %d worker process(es), RLIMIT_NOFILE=%d)",
        config.worker_count if config.worker_count > 1 else 0,
        limit,
    )
    try:
        lock, taken = await _own_state_dir(config)
    except ProxyError as exc:
        log.error("%s", exc)
        return 1
    try:
        # Handed-over proxy ports keep their address: the new process listens as they do.
        proxy = build(config, listen_address=taken.listen_address() if taken else None)
    except BaseException:
        if taken is not None:
            taken.close()  # the old process serves on
        if lock is not None:
            lock.release()
        raise
    proxy.state_lock = lock
    serving = coreloop.choose(
        config.event_loop,
        serves_native=proxy.dataplane == "native",
        control=config.worker_count <= 1,  # --workers 1: this process serves
    )
    log.info(
        "TCP data plane: %s (event loop where it serves: %s)",
        proxy.dataplane,
        coreloop.DESCRIPTIONS[serving],
    )
    # Until the first sync, nearly all that is built lives on (see collector.py).
    proxy.first_build.begin()
    try:
        return await _serve(proxy, taken, stop or asyncio.Event(), started)
    finally:
        proxy.first_build.abandon()  # ended before its first sync: the collector runs again
        if proxy.state_lock is not None:
            # Exiting would release it; a serve() that returns (tests, embedding) must too.
            proxy.state_lock.release()


async def _own_state_dir(
    config: ProxyConfig,
) -> tuple[statelock.StateLock | None, handover.Taken | None]:
    """This process's lock on --state-dir and what a running proxy handed over (each None
    when there is none); ProxyError when the directory is another's or unusable."""
    if not config.state_dir:
        return None, None
    # Before anything in it is read or listened to: others must not write there.
    statefile.check_directory(config.state_dir)
    lock = _lock_state_dir(config.state_dir)
    try:
        taken = await handover.take(
            config.state_dir,
            max(config.worker_count, 1),
            wait_exit=config.shutdown_grace + 30,
        )
    except ProxyError as exc:
        if lock is not None:
            raise
        # Its holder serves on without handing over to this process: for example, it is
        # handing over to another one started at the same moment.
        raise ProxyError(_in_use(config.state_dir, f" ({exc})")) from None
    if lock is None and taken is not None and taken.lock_fd >= 0:
        lock = statelock.StateLock.handed_over(config.state_dir, taken.lock_fd)
        taken.lock_fd = -1
    if lock is None and taken is None:
        # Held, and its holder did not hand over (or it has just exited).
        lock = _lock_state_dir(config.state_dir, required=True)
    return lock, taken


async def _serve(
    proxy: Proxy, taken: handover.Taken | None, stop: asyncio.Event, started: Started | None
) -> int:
    """Take over from a running proxy (or find the saved state), then startup -> main loop ->
    shutdown; signals set `stop` meanwhile."""
    config = proxy.config
    saved = proxy.saved_state() if taken is None else None
    if saved is None:
        # A bad kubeconfig is a configuration error (exit 2), found before anything runs.
        await _check_client_configuration(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, _on_signal, sig, stop)
    if not await _startup(proxy, taken, saved):
        return 1
    if config.state_dir and proxy.state_lock is None:
        # Taken over from a process that held no lock (an older version): once it has gone.
        proxy.state_lock = await statelock.acquire(config.state_dir, config.shutdown_grace + 30)
        if proxy.state_lock is None:
            log.warning(
                "the state directory %s is still locked by pid %s after the handover",
                config.state_dir,
                statelock.holder(config.state_dir),
            )
    outcome = await _main_loop(proxy, stop, started)
    await _shutdown(proxy, stop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(sig)
    if proxy.portals is not None and proxy.portals.rule_counts():
        # Left so that traffic waits for the next process (or a handover) instead of failing.
        log.info("stopped (rules left in place; `kube-userspace-proxy cleanup` removes them)")
    else:
        log.info("stopped (this process installed no iptables rules)")
    return 0 if outcome == "stopped" else 1


def _lock_state_dir(directory: str, *, required: bool = False) -> statelock.StateLock | None:
    """This process's lock on the state directory; None while another proxy holds it (a
    ProxyError naming it and its PID when `required`)."""
    try:
        lock = statelock.try_acquire(directory)
    except OSError as exc:
        raise ProxyError(
            f"--state-dir {directory}: cannot lock {statelock.lock_path(directory)}: {exc}"
        ) from None
    if lock is None and required:
        raise ProxyError(_in_use(directory))
    return lock


def _in_use(directory: str, detail: str = "") -> str:
    """The error of a process that finds `directory` another's; `detail`: why, if known."""
    return (
        f"--state-dir {directory} is in use by another proxy process (pid"
        f" {statelock.holder(directory) or 'unknown'}), which did not hand over{detail}: one"
        " process a state directory; stop that one, or give this one another --state-dir"
    )


async def _startup(
    proxy: Proxy,
    taken: handover.Taken | None,
    saved: tuple[Snapshot, statefile.Ports] | None,
) -> bool:
    """Open the ops sites and the workers; serve what was handed over or saved. False: failed
    (logged; what was opened is closed, what was handed over left to the old process)."""
    config = proxy.config
    try:
        await _start_ops(proxy, taken)
        if proxy.workers is not None:
            await proxy.workers.start()
        if taken is not None:
            await take_over(proxy, taken)
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
            return False
        if proxy.ops is not None:
            await proxy.ops.close()
        return False
    return True


async def _main_loop(proxy: Proxy, stop: asyncio.Event, started: Started | None) -> str:
    """Run the root tasks until `stop` is set or one ends; "stopped" or "failed"."""
    config = proxy.config
    source = make_source(config, proxy.state, proxy.metrics)
    if not config.manifests:  # the API source's relist, error and bad-data counters
        proxy.metrics.follow_source(cast(SourceCounters, source))
    tasks = [
        asyncio.create_task(source.run(), name="source"),
        asyncio.create_task(proxy.runner.loop(), name="sync"),
        asyncio.create_task(proxy.pipeline.apply_loop(), name="apply"),
        asyncio.create_task(proxy.health.heartbeat(), name="heartbeat"),  # for /livez
        asyncio.create_task(watch_lag(proxy.metrics.loop_lag), name="loop-lag"),
    ]
    if config.state_dir:  # the next process takes over from this one
        giver = Giver(proxy, stop)
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
    return outcome


async def _shutdown(proxy: Proxy, stop: asyncio.Event) -> None:
    """Stop serving: drain (open connections get --shutdown-grace), or hand over and drain."""
    config = proxy.config
    if proxy.handed_over:
        await hand_over(proxy, stop)
    else:
        log.info("stopping: no new connections; open ones get %.1fs", config.shutdown_grace)
        if proxy.workers is not None:
            await proxy.workers.shutdown(config.shutdown_grace)
        await proxy.service_health.close()
        await proxy.proxier.shutdown(config.shutdown_grace)
        if proxy.ops is not None:
            await proxy.ops.close()


def build(config: ProxyConfig, *, listen_address: str | None = None) -> Proxy:
    """Create the parts of a proxy for `config` (nothing is opened or started yet); its proxy
    ports bound to `listen_address` when given (those handed over are)."""
    return Proxy(config, listen_address=listen_address)


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
    adopted = ops_sockets(taken)
    proxy.ops = await start_ops(
        healthz_bind=config.healthz_bind_address,
        metrics_bind=config.metrics_bind_address,
        health=proxy.health,
        metrics=proxy.metrics,
        debug_state=proxy.proxier.debug_items,
        configz=lambda: {kpc.GROUP: effective_document(config)},
        collect=proxy.collect,
        rules=proxy.counted_rules,
        planned=proxy.planned_rules,
        adopted=adopted,
        allowed_hosts=config.metrics_allowed_hosts,
    )
    used = {id(sock) for _, sock in proxy.ops.listening}
    for sock in adopted.values():
        if id(sock) not in used:  # the old process's site on another address
            sock.close()


async def _check_client_configuration(config: ProxyConfig) -> None:
    """Raise ConfigError (exit 2) when the API server's client configuration is unusable."""
    if config.manifests:
        return
    from kube_userspace_proxy.cluster.sources.client import (  # noqa: PLC0415
        load_client_configuration,
    )

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


def raise_nofile_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (each proxied connection needs two)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    log.info("received %s", sig.name)
    stop.set()


def serves_native(config: ProxyConfig) -> bool:
    """Whether this process will serve the native data plane (one process, no workers)."""
    if config.worker_count > 1:
        return False
    try:
        return tcp.resolve(config.dataplane) == "native"
    except ValueError:  # not built: serve() says so
        return False


def run_loop(
    main: Coroutine[Any, Any, T], event_loop: str = "auto", *, serves_native: bool = False
) -> T:
    """Run `main` on the loop --event-loop `event_loop` gives this process; its result."""
    chosen = coreloop.choose(event_loop, serves_native=serves_native, control=True)
    log.debug("event loop: %s", coreloop.DESCRIPTIONS[chosen])
    with asyncio.Runner(loop_factory=coreloop.factory(chosen)) as runner:
        return runner.run(main)
