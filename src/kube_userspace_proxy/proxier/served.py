"""What the proxier serves now: one `Served` per service port, the listeners it retired, and
the descriptions of its sockets for a handover."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kube_userspace_proxy.dataplane import ConnStats
from kube_userspace_proxy.model import (
    DEFAULT_BALANCING,
    Balancing,
    Desired,
    Endpoint,
    Path,
    ProxiedPort,
    ServicePortInfo,
    ServicePortName,
)
from kube_userspace_proxy.proxier.contracts import Listener, PoolT
from kube_userspace_proxy.restart.sockets import NodePortSocket, ProxyPortSocket, SocketDescription
from kube_userspace_proxy.topology import on_node, topology_mode, usable_endpoints

V = TypeVar("V")
_NONE: Any = object()  # an empty path's slot


class ByPath(MutableMapping[Path, V]):
    """A mapping with at most the two paths as keys, in two slots: 56 bytes where a dict
    takes 232, and a `Served` holds two of them (10,000 at scale). CLUSTER comes first."""

    __slots__ = ("_cluster", "_external")

    def __init__(self) -> None:
        self._cluster: V = _NONE
        self._external: V = _NONE

    def __getitem__(self, path: Path) -> V:
        value = self._cluster if path is Path.CLUSTER else self._external
        if value is _NONE:
            raise KeyError(path)
        return value

    def __setitem__(self, path: Path, value: V) -> None:
        if path is Path.CLUSTER:
            self._cluster = value
        else:
            self._external = value

    def __delitem__(self, path: Path) -> None:
        if path not in self:
            raise KeyError(path)
        self[path] = _NONE

    def __iter__(self) -> Iterator[Path]:
        if self._cluster is not _NONE:
            yield Path.CLUSTER
        if self._external is not _NONE:
            yield Path.EXTERNAL

    def __len__(self) -> int:
        return (self._cluster is not _NONE) + (self._external is not _NONE)


@dataclass(slots=True)
class Served(Generic[PoolT]):
    """One service port as it is served now. Mutable; private to the proxier package."""

    info: ServicePortInfo
    stats: ConnStats
    pools: ByPath[PoolT] = field(default_factory=ByPath)
    listeners: ByPath[Listener[PoolT]] = field(default_factory=ByPath)
    node_port_listeners: list[tuple[str, Listener[PoolT]]] = field(default_factory=list)
    node_port: int = 0
    all_endpoints: int = 0
    topology: str = ""
    """Which endpoints its Cluster-policy path uses (a Topology mode); "Local": no such path."""
    endpoints: tuple[Endpoint, ...] | None = None
    """The snapshot's endpoint tuple last applied (the state keeps it while it is unchanged)."""
    target: ProxiedPort | None = None
    """The rule target last built for it; None once its info or listeners changed."""

    def port_of(self, path: Path) -> int:
        listener = self.listeners.get(path) or self.listeners.get(Path.CLUSTER)
        return listener.port if listener is not None else 0

    def every_listener(self) -> Iterable[Listener[PoolT]]:
        yield from self.listeners.values()
        for _, listener in self.node_port_listeners:
            yield listener

    def rule_target(self) -> ProxiedPort:
        """The rule target of this service port (built once per change of info or ports)."""
        if self.target is None:
            self.target = ProxiedPort(
                info=self.info,
                cluster_port=self.port_of(Path.CLUSTER),
                external_port=self.port_of(Path.EXTERNAL),
            )
        return self.target

    def take_endpoints(self, desired: Desired, balancing: Balancing = DEFAULT_BALANCING) -> None:
        """Choose each path's usable endpoints from `desired` (traffic policy, topology) into
        its pool, with the source policy and the scheduler and ejection (`balancing`, the
        proxy's default, under the Service's annotations), and let the listeners see them."""
        info = self.info
        balanced = info.balancing.over(balancing)
        endpoints = desired.endpoints_of(info.name)
        self.endpoints = endpoints
        self.all_endpoints = len(endpoints)
        timeout = float(info.affinity_timeout_seconds) if info.client_ip_affinity else None
        node_name, zone = desired.node_name, desired.node_zone
        mode = topology_mode(endpoints, node_name, zone)
        self.topology = "Local"
        for path, pool in self.pools.items():
            local = (
                info.external_traffic_local
                if path is Path.EXTERNAL
                else info.internal_traffic_local
            )
            if not local:
                self.topology = mode
            usable = usable_endpoints(
                endpoints, local_only=local, node_name=node_name, topology=mode, zone=zone
            )
            pool.source = desired.source  # --preserve-source-ip
            pool.update(usable, affinity_timeout=timeout, local=on_node(usable, node_name))
            pool.proxy_protocol = info.proxy_protocol
            pool.balance(balanced)
        for listener in self.every_listener():
            listener.refresh()


class Retired(Generic[PoolT]):
    """Listeners closed (no new connections) whose open connections may still run."""

    def __init__(self) -> None:
        self._closing: set[asyncio.Task[None]] = set()
        self._listeners: list[Listener[PoolT]] = []

    def close_later(self, listener: Listener[PoolT]) -> None:
        """Stop accepting now; the connections already open finish on their own."""
        task = asyncio.get_running_loop().create_task(listener.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        self._listeners = [old for old in self._listeners if old.active_connections]
        self._listeners.append(listener)

    async def closed(self) -> list[Listener[PoolT]]:
        """Wait for the closes under way; the retired listeners (to drain at shutdown)."""
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        return list(self._listeners)

    def clear(self) -> None:
        self._listeners.clear()


def handover_sockets(
    served_ports: Mapping[ServicePortName, Served[Any]],
) -> list[tuple[SocketDescription, int]]:
    """(description, descriptor) of every open socket of `served_ports`, to hand over."""
    out: list[tuple[SocketDescription, int]] = []
    for name, served in served_ports.items():
        protocol = str(name.protocol)
        for path, listener in served.listeners.items():
            if listener.fileno() >= 0:
                port = ProxyPortSocket(str(name), protocol, str(path))
                out.append((port, listener.fileno()))
        for address, listener in served.node_port_listeners:
            if listener.fileno() >= 0:
                node_port = NodePortSocket(protocol, address, served.node_port)
                out.append((node_port, listener.fileno()))
    return out
