"""The app's side of a handover (`restart.handover`): what the running proxy gives, and how
a new one takes it and serves from it at once.

`Proxy` is named here for types only: the code that runs a proxy (`lifecycle`) drives the
handover, so it imports this module, not the other way round.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Any

from kube_userspace_proxy import logs
from kube_userspace_proxy.errors import ProxyError
from kube_userspace_proxy.restart import handover, sockets, statefile

if TYPE_CHECKING:
    from kube_userspace_proxy.app.proxy import Proxy

log = logs.get(__name__)


class Giver:
    """The running proxy's side of a handover (`restart.handover.Giver`)."""

    def __init__(self, proxy: Proxy, stop: asyncio.Event) -> None:
        self._proxy = proxy
        self._stop = stop
        self.workers = proxy.workers.count if proxy.workers is not None else 1

    def handover_sockets(self) -> list[tuple[sockets.SocketDescription, int]]:
        proxy = self._proxy
        items = proxy.proxier.handover_sockets() + proxy.service_health.handover_sockets()
        if proxy.ops is not None:
            for (host, port), sock in proxy.ops.listening:
                if sock.fileno() >= 0:
                    items.append((sockets.OpsSocket(host, port), sock.fileno()))
        return items

    def state_lock_fd(self) -> int:
        lock = self._proxy.state_lock
        return lock.fileno() if lock is not None else -1

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
        await self._proxy.hold_changes()

    def resume(self) -> None:
        self._proxy.resume_changes()

    def handed_over(self) -> None:
        self._proxy.handed_over = True
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()


def ops_sockets(taken: handover.Taken | None) -> dict[tuple[str, int], socket.socket]:
    """The ops sites' sockets handed over, by (host, port); the caller owns them."""
    if taken is None:
        return {}
    return {(d.host, d.port): sock for d, sock in taken.claim(sockets.OpsSocket)}


async def adopt(proxy: Proxy, taken: handover.Taken) -> None:
    """Serve from what the process `proxy` replaces handed over, at once.

    Its sockets replace binding (proxy ports, NodePorts, health-check ports; the workers
    received theirs already), its applied state replaces the state file, and the worker
    pool starts from its reuseport groups' order.
    """
    try:
        snapshot, ports = statefile.decode(
            taken.state,
            node_name=proxy.state.node_name,
            loopback=proxy.config.allows_loopback_endpoints,
        )
    except statefile.StateFileError as exc:
        raise ProxyError(f"the handed-over state cannot be used: {exc}") from None
    claims = {d.claim: sock for d, sock in taken.claim(sockets.ProxyPortSocket)}
    node_ports = {d.key: sock for d, sock in taken.claim(sockets.NodePortSocket)}
    health = {(d.address, d.port): sock for d, sock in taken.claim(sockets.HealthSocket)}
    if proxy.workers is not None:
        proxy.workers.adopt_groups(taken.groups)
    proxy.proxier.adopt(claims, node_ports)
    proxy.service_health.adopt(health)
    await proxy.restore((snapshot, ports), source=f"what process {taken.peer} handed over")
    await proxy.service_health.sync(proxy.configured(snapshot))


async def take_over(proxy: Proxy, taken: handover.Taken) -> None:
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
    await adopt(proxy, taken)
    await taken.serving()
    taken.close()  # the handed-over sockets nothing took (e.g. ops ones on another address)


async def _no_workers() -> dict[int, str]:
    return {}


async def hand_over(proxy: Proxy, stop: asyncio.Event) -> None:
    """A new process serves: release every socket untouched, drain, and (with
    --after-handover=wait) stay until SIGTERM."""
    config = proxy.config
    log.info("handed over: no new connections here; open ones get %.1fs", config.shutdown_grace)
    if proxy.state_lock is not None:
        # The new process holds the same lock (its descriptor came with the state): closing
        # this one leaves the lock with it, never free in between.
        proxy.state_lock.release()
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
