"""No neighbour can block the probes (issue 22, items 2 and 3).

One address (127.0.0.2) keeps 200 idle connections open to a site, reopening whatever the
site closes; probes from another address (127.0.0.3) must be answered every time, 10 probes
over 10 s. The same for the health site, the metrics site and a healthCheckNodePort server,
whose connections get the ops sites' bounds (a header timeout and caps) too. All of 127/8 is
local, so two loopback addresses are two clients without any namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from kube_userspace_proxy.model import Endpoint, ServicePortInfo, ServicePortName, Snapshot
from kube_userspace_proxy.ops import httpguard
from kube_userspace_proxy.ops.health import ProxyHealth
from kube_userspace_proxy.ops.metrics import ProxyMetrics, sample_value
from kube_userspace_proxy.ops.server import start_ops
from kube_userspace_proxy.ops.servicehealth import ServiceHealthServers

NEIGHBOUR = "127.0.0.2"
PROBER = "127.0.0.3"
IDLE = 200
PROBES = 10
NODE = "node-1"


def _closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """The server closed (EOF) or reset this connection."""
    return reader.at_eof() or reader.exception() is not None or writer.is_closing()


class Neighbour:
    """Holds up to IDLE idle connections from NEIGHBOUR; `refill()` reopens closed ones."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def refill(self) -> None:
        kept = []
        for reader, writer in self.conns:
            if _closed(reader, writer):
                writer.close()
            else:
                kept.append((reader, writer))
        self.conns = kept
        opened = await asyncio.gather(
            *(
                asyncio.open_connection("127.0.0.1", self.port, local_addr=(NEIGHBOUR, 0))
                for _ in range(IDLE - len(self.conns))
            ),
            return_exceptions=True,
        )
        self.conns += [c for c in opened if isinstance(c, tuple)]

    async def close(self) -> None:
        for _, writer in self.conns:
            writer.close()
        for _, writer in self.conns:
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        self.conns = []


async def probes_answered(port: int, *paths: str) -> int:
    """PROBES probes from PROBER, one a second (to each of `paths` in turn), while the
    neighbour keeps its connections."""
    neighbour = Neighbour(port)
    answered = 0
    connector = aiohttp.TCPConnector(local_addr=(PROBER, 0), force_close=True)
    try:
        async with aiohttp.ClientSession(connector=connector) as http:
            for probe in range(PROBES):
                path = paths[probe % len(paths)]
                began = time.monotonic()
                await neighbour.refill()
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(
                        f"http://127.0.0.1:{port}{path}",
                        timeout=aiohttp.ClientTimeout(total=30),
                    ) as resp:
                        await resp.read()
                        answered += 1
                await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - began)))
    finally:
        await neighbour.close()
    return answered


@pytest.fixture
async def ops() -> AsyncIterator[tuple[int, int, ProxyMetrics]]:
    """(health port, metrics port, metrics) of real ops sites on 127.0.0.1."""
    metrics = ProxyMetrics(list, process_metrics=False)
    server = await start_ops(
        healthz_bind="127.0.0.1:0",
        metrics_bind="127.0.0.1:0",
        health=ProxyHealth(30.0),
        metrics=metrics,
        debug_state=dict,
        configz=dict,
    )
    try:
        assert server.healthz_port is not None and server.metrics_port is not None
        yield server.healthz_port, server.metrics_port, metrics
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def service_health_port() -> AsyncIterator[int]:
    """A healthCheckNodePort server on 127.0.0.1 for one Service with a local endpoint."""
    servers = ServiceHealthServers(ProxyHealth(30.0), lambda: ["127.0.0.1"])
    port = _free_port()
    name = ServicePortName("ns", "web", "http")
    info = ServicePortInfo(name, 80, ("10.96.0.1",), node_port=30080, health_check_node_port=port)
    snapshot = Snapshot(
        services={name: info},
        endpoints={name: (Endpoint("10.1.0.1", 8080, node_name=NODE),)},
        node_name=NODE,
    )
    await servers.sync(snapshot)
    try:
        assert servers.ports == {"ns/web": port}
        yield port
    finally:
        await servers.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_a_neighbour_never_blocks_the_health_probes(
    ops: tuple[int, int, ProxyMetrics],
) -> None:
    # One site serves the three paths: the probes take turns among them.
    assert await probes_answered(ops[0], "/healthz", "/livez", "/readyz") == PROBES


async def test_a_neighbour_never_blocks_the_metrics_scrape(
    ops: tuple[int, int, ProxyMetrics],
) -> None:
    assert await probes_answered(ops[1], "/metrics") == PROBES


async def test_a_neighbour_never_blocks_a_health_check_node_port() -> None:
    async with service_health_port() as port:
        assert await probes_answered(port, "/healthz") == PROBES


async def test_health_check_node_ports_close_idle_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(httpguard, "HEADER_TIMEOUT", 0.5)
    async with service_health_port() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by the server
        finally:
            writer.close()


async def test_health_check_node_ports_cap_the_connections_of_one_address() -> None:
    async with service_health_port() as port:
        neighbour = Neighbour(port)
        try:
            await neighbour.refill()

            async def settled() -> int:
                # Connections over the caps are closed at once: wait until they are seen.
                deadline = time.monotonic() + 30
                while True:
                    await asyncio.sleep(0.1)
                    alive = [w for r, w in neighbour.conns if not _closed(r, w)]
                    if len(alive) <= httpguard.MAX_CONNECTIONS or time.monotonic() > deadline:
                        return len(alive)

            assert await settled() <= httpguard.MAX_CONNECTIONS_PER_CLIENT
        finally:
            await neighbour.close()


async def test_every_bound_and_every_refusal_is_a_metric(
    ops: tuple[int, int, ProxyMetrics],
) -> None:
    health_port, metrics_port, metrics = ops
    neighbour = Neighbour(health_port)
    try:
        await neighbour.refill()
        await _until(lambda: _eof_count(neighbour) >= IDLE - httpguard.MAX_CONNECTIONS_PER_CLIENT)
    finally:
        await neighbour.close()
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp,
    ):
        text = await resp.text()
    prefix = "kube_userspace_proxy_ops_"
    labels = {"site": "healthz"}
    refused = sample_value(
        text, prefix + "connections_refused_total", {**labels, "reason": "client_limit"}
    )
    assert refused is not None and refused >= IDLE - httpguard.MAX_CONNECTIONS_PER_CLIENT
    for scope, bound in (
        ("site", httpguard.MAX_CONNECTIONS),
        ("client", httpguard.MAX_CONNECTIONS_PER_CLIENT),
    ):
        limit = sample_value(text, prefix + "connection_limit", {**labels, "scope": scope})
        assert limit == bound, scope
    timeout = sample_value(text, prefix + "header_timeout_seconds", labels)
    assert timeout == httpguard.HEADER_TIMEOUT
    for name in ("connections", "header_timeouts_total", "connections_evicted_total"):
        assert sample_value(text, prefix + name, labels) is not None, name
    assert metrics is not None


def _eof_count(neighbour: Neighbour) -> int:
    return sum(1 for r, w in neighbour.conns if _closed(r, w))


async def _until(check: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
