"""The data plane in this process (`--workers 1`): listeners on this event loop."""

from __future__ import annotations

import socket

from kube_userspace_proxy.balancer import PINS_SHOWN, BalancerView, EndpointPool
from kube_userspace_proxy.dataplane import ConnStats, TcpListener, UdpListener, native
from kube_userspace_proxy.model import ServicePortName
from kube_userspace_proxy.proxier.contracts import DataPlane, Listener, Pins


class LocalDataPlane:
    """Listeners on this process's event loop (`--workers 1`); they pick from the pools."""

    shares_ports = False

    def __init__(self, *, udp_idle_timeout: float = 0.25, tcp_keepalive: float = 15.0) -> None:
        self.udp_idle_timeout = udp_idle_timeout
        self.tcp_keepalive = tcp_keepalive

    def new_pool(self, name: ServicePortName) -> EndpointPool:
        return EndpointPool(name)

    def listener(
        self,
        sock: socket.socket,
        pool: EndpointPool,
        stats: ConnStats,
        name: str,
        *,
        adopt: bool = False,
    ) -> Listener[EndpointPool]:
        if sock.type == socket.SOCK_STREAM:
            return TcpListener(
                sock, pool, stats, name=name, keepalive=self.tcp_keepalive, adopt=adopt
            )
        return UdpListener(sock, pool, stats, name=name, idle_timeout=self.udp_idle_timeout)

    async def publish(self) -> None:
        """Nothing to send: the listeners read their pools directly."""

    def affinity_summary(self, pool: EndpointPool) -> tuple[int, Pins]:
        return pool.affinity_count(), pool.affinity_entries(PINS_SHOWN)

    def balancer_view(self, pool: EndpointPool) -> BalancerView:
        native.count_bytes()
        ejected = pool.outliers.ejected() if pool.outliers is not None else []
        return BalancerView(
            pool.tallies(),
            [(None, pool.recent_picks())],
            pool.penalized(),
            scheduler=pool.scheduler,
            ejected=ejected,
        )


_local: DataPlane[EndpointPool] = LocalDataPlane()  # conformance: LocalDataPlane is a DataPlane
