"""Proxier: one service port's failure is contained and retried; the others keep serving."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from types import MappingProxyType

import pytest

from kube_userspace_proxy.model import (
    Endpoint,
    Protocol,
    ServicePortInfo,
    ServicePortName,
    Snapshot,
)
from kube_userspace_proxy.ports import PortAllocator
from kube_userspace_proxy.proxier import Proxier
from tests.loopback.proxyrun import ask, start_named_backends

A = ServicePortName("default", "a", "http", Protocol.TCP)
B = ServicePortName("default", "b", "http", Protocol.TCP)


def _snapshot(backend_port: int, **node_ports: int) -> Snapshot:
    infos = {
        name: ServicePortInfo(
            name=name,
            port=80,
            cluster_ips=("10.96.0.10",),
            node_port=node_ports.get(name.name, 0),
        )
        for name in (A, B)
    }
    endpoints = {name: (Endpoint("127.0.0.1", backend_port),) for name in (A, B)}
    return Snapshot(services=MappingProxyType(infos), endpoints=MappingProxyType(endpoints))


@pytest.fixture
async def proxier() -> AsyncIterator[Proxier]:
    made = Proxier(PortAllocator(None, host="127.0.0.1"), node_port_addresses=lambda: ["127.0.0.1"])
    yield made
    await made.shutdown(0.5)


@pytest.fixture
async def backend_port() -> AsyncIterator[int]:
    [(_, port, server)] = await start_named_backends(["pod"])
    yield port
    server.close()
    await server.wait_closed()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_taken_node_port_is_reported_retried_and_held_once_free(
    proxier: Proxier, backend_port: int
) -> None:
    node_port = _free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", node_port))
    squatter.listen()
    try:
        await proxier.sync(_snapshot(backend_port, a=node_port))
        assert "can't hold NodePort" in proxier.errors()[A]
        # The service port itself, and the other Service, still serve.
        assert await ask(proxier.port_of(A)) == "pod"
        assert await ask(proxier.port_of(B)) == "pod"
    finally:
        squatter.close()
    await proxier.sync(_snapshot(backend_port, a=node_port))
    assert A not in proxier.errors()
    assert await ask(node_port) == "pod"  # the NodePort socket is ours now, and serves


async def test_an_unexpected_error_in_one_service_port_spares_the_others(
    proxier: Proxier, backend_port: int
) -> None:
    # Port 70000 cannot be bound (OverflowError, not OSError): an error nobody planned for.
    await proxier.sync(_snapshot(backend_port, a=70000))
    assert "OverflowError" in proxier.errors()[A]
    assert await ask(proxier.port_of(B)) == "pod"
    await proxier.sync(_snapshot(backend_port))
    assert A not in proxier.errors()
    assert await asyncio.wait_for(ask(proxier.port_of(A)), 2) == "pod"
