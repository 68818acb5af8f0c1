"""What each handed-over socket is: one frozen type per kind, and its wire form.

The handover protocol sends each description as a JSON list whose first item names the kind:

    ["port", "ns/name:port", protocol, path]   a proxy port (`ProxyPortSocket`)
    ["nodeport", protocol, address, port]      a NodePort socket (`NodePortSocket`)
    ["health", address, port]                  a service health-check port (`HealthSocket`)
    ["ops", host, port]                        an ops site (`OpsSocket`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kube_userspace_proxy.model import ClaimKey, SocketKey


@dataclass(frozen=True, slots=True)
class ProxyPortSocket:
    """The proxy port of one path of one service port."""

    service_port: str
    """The service port's name as `ns/name:port`."""
    protocol: str
    path: str

    @property
    def claim(self) -> ClaimKey:
        """The key the proxier's port book holds it under."""
        return (self.service_port, self.protocol, self.path)


@dataclass(frozen=True, slots=True)
class NodePortSocket:
    """A NodePort held on one address."""

    protocol: str
    address: str
    port: int

    @property
    def key(self) -> SocketKey:
        return (self.protocol, self.address, self.port)


@dataclass(frozen=True, slots=True)
class HealthSocket:
    """A service health-check port (`healthCheckNodePort`) on one address."""

    address: str
    port: int


@dataclass(frozen=True, slots=True)
class OpsSocket:
    """An ops site (health or metrics server) on one address."""

    host: str
    port: int


SocketDescription = ProxyPortSocket | NodePortSocket | HealthSocket | OpsSocket


def encode(description: SocketDescription) -> list[Any]:
    """The wire form of `description` (a JSON-able list, its kind first)."""
    match description:
        case ProxyPortSocket(service_port, protocol, path):
            return ["port", service_port, protocol, path]
        case NodePortSocket(protocol, address, port):
            return ["nodeport", protocol, address, port]
        case HealthSocket(address, port):
            return ["health", address, port]
        case OpsSocket(host, port):
            return ["ops", host, port]


def decode(wire: Any) -> SocketDescription:
    """The description `encode` wrote; ValueError if `wire` is not one."""
    match wire:
        case ["port", service_port, protocol, path]:
            return ProxyPortSocket(str(service_port), str(protocol), str(path))
        case ["nodeport", protocol, address, port]:
            return NodePortSocket(str(protocol), str(address), int(port))
        case ["health", address, port]:
            return HealthSocket(str(address), int(port))
        case ["ops", host, port]:
            return OpsSocket(str(host), int(port))
    raise ValueError(f"not a handed-over socket's description: {wire!r}")
