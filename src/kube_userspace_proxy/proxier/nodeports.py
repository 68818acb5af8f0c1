"""NodePort sockets: a real socket per NodePort and address, so nothing else can take it.

Traffic to a NodePort is redirected by the rules to the proxy port; the socket only holds
the port (and serves what reaches it directly), as kube-proxy's port openers do.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Generic

from kube_userspace_proxy.errors import PortInUseError
from kube_userspace_proxy.model import Path, Protocol, SocketKey
from kube_userspace_proxy.ports import DescriptorBudget
from kube_userspace_proxy.proxier.contracts import DataPlane, PoolT
from kube_userspace_proxy.proxier.served import Retired, Served


class NodePorts(Generic[PoolT]):
    """Opens, repoints and closes the NodePort sockets of served service ports."""

    def __init__(
        self,
        dataplane: DataPlane[PoolT],
        budget: DescriptorBudget,
        addresses: Callable[[], Sequence[str]],
        retired: Retired[PoolT],
    ) -> None:
        self._dataplane = dataplane
        self._budget = budget
        self._addresses = addresses
        self._retired = retired
        # Sockets an earlier process handed over (`adopt`), used instead of binding anew.
        self._adopted: dict[SocketKey, socket.socket] = {}

    def adopt(self, node_ports: dict[SocketKey, socket.socket]) -> None:
        """Before the first sync: serve on these handed-over sockets instead of binding."""
        self._adopted = dict(node_ports)

    async def open(self, served: Served[PoolT]) -> None:
        """Hold `served`'s NodePort on every NodePort address, all or none."""
        info = served.info
        pool = served.pools.get(Path.EXTERNAL) or served.pools[Path.CLUSTER]
        kind = socket.SOCK_STREAM if info.protocol is Protocol.TCP else socket.SOCK_DGRAM
        failures = []
        addresses = self._addresses()
        self._budget.take(f"its NodePort {info.protocol}/{info.node_port}", len(addresses))
        name = str(info.name)
        for address in addresses:
            adopted = self._adopted.pop((str(info.protocol), address, info.node_port), None)
            if adopted is not None:
                listener = self._dataplane.listener(adopted, pool, served.stats, name, adopt=True)
                served.node_port_listeners.append((address, listener))
                await listener.start()
                continue
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, kind)
            try:
                if kind == socket.SOCK_STREAM:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                elif self._dataplane.shares_ports:  # workers join it (UDP: set before bind)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                sock.bind((address, info.node_port))
                sock.setblocking(False)
            except OSError as exc:
                sock.close()
                failures.append(f"{address}:{info.node_port}: {exc.strerror}")
                continue
            except BaseException:
                sock.close()
                self.close(served)
                raise
            listener = self._dataplane.listener(sock, pool, served.stats, name)
            served.node_port_listeners.append((address, listener))
            await listener.start()
        served.node_port = info.node_port
        if failures:
            # Hold all or none, so that the next sync tries the whole NodePort again.
            self.close(served)
            raise PortInUseError(
                f"can't hold NodePort {info.protocol}/{info.node_port} ({'; '.join(failures)});"
                " traffic captured by the NodePort rules is still served"
            )

    def addresses_now(self) -> tuple[str, ...]:
        """The addresses NodePort sockets belong on now (they may follow the node's IPs)."""
        return tuple(self._addresses())

    async def follow(self, served: Served[PoolT], addresses: Sequence[str]) -> None:
        """Bind `served`'s NodePort sockets again when the addresses they belong on moved."""
        if [address for address, _ in served.node_port_listeners] == list(addresses):
            return
        listeners = [listener for _, listener in served.node_port_listeners]
        served.node_port_listeners.clear()
        served.node_port = 0
        for listener in listeners:  # closed before binding: an address may stay in the list
            await listener.close()
        await self.open(served)

    @staticmethod
    def point(served: Served[PoolT]) -> None:
        """NodePort sockets serve external traffic: give them that path's pool."""
        pool = served.pools.get(Path.EXTERNAL) or served.pools[Path.CLUSTER]
        for _, listener in served.node_port_listeners:
            if listener.picker is not pool:
                listener.set_picker(pool)

    def close(self, served: Served[PoolT]) -> None:
        """Close `served`'s NodePort sockets (open connections finish)."""
        for _, listener in served.node_port_listeners:
            self._retired.close_later(listener)
        served.node_port_listeners.clear()
        served.node_port = 0

    def close_unused(self) -> None:
        """At shutdown: close handed-over sockets never used (this process's descriptors)."""
        for sock in self._adopted.values():
            sock.close()


def local_addresses_in(cidrs: Sequence[str], addresses: Iterable[str]) -> list[str]:
    """The addresses that fall inside any of `cidrs` (for `--nodeport-addresses`)."""
    networks = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    return [a for a in addresses if any(ipaddress.ip_address(a) in n for n in networks)]
