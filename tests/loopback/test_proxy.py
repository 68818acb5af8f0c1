"""The whole proxy on loopback: manifests -> state -> sync -> proxier -> data plane -> ops."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import cast

import aiohttp
import pytest

from kube_userspace_proxy.model import Protocol, ServicePortName
from kube_userspace_proxy.ops.metrics import sample_value
from tests.loopback.proxyrun import (
    ask,
    endpoint_slice,
    loopback_config,
    running_proxy,
    service,
    start_named_backends,
    wait_for,
    write_manifests,
)

Backends = list[tuple[str, int, asyncio.Server]]


@pytest.fixture
async def backends() -> AsyncIterator[Callable[..., Awaitable[Backends]]]:
    """Factory of named backends on 127.0.0.1; every server is closed after the test."""
    made: list[asyncio.Server] = []

    async def start(*names: str) -> Backends:
        started = await start_named_backends(names)
        made.extend(server for _, _, server in started)
        return started

    yield start
    for server in made:
        server.close()
        await server.wait_closed()


WEB = ServicePortName("default", "web", "http", Protocol.TCP)
API = ServicePortName("default", "api", "http", Protocol.TCP)


def _web(
    backends: list[tuple[str, int, asyncio.Server]], **spec: object
) -> list[dict[str, object]]:
    return [
        service("web", [{"name": "http", "port": 80, "protocol": "TCP"}], **spec),
        *endpoint_slice("web", "http", [("127.0.0.1", port) for _, port, _ in backends]),
    ]


def _refused(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


async def test_round_robin_spreads_evenly_over_three_backends(
    tmp_path: Path, backends: Backends
) -> None:
    started = await backends("pod-a", "pod-b", "pod-c")
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, _web(started))
    async with running_proxy(loopback_config(manifest)) as proxy:
        port = proxy.proxier.port_of(WEB)
        answers = Counter([await ask(port) for _ in range(30)])
    assert answers == {"pod-a": 10, "pod-b": 10, "pod-c": 10}


async def test_client_ip_affinity_sends_one_client_to_one_backend(
    tmp_path: Path, backends: Backends
) -> None:
    started = await backends("pod-a", "pod-b", "pod-c")
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, _web(started, sessionAffinity="ClientIP"))
    async with running_proxy(loopback_config(manifest)) as proxy:
        port = proxy.proxier.port_of(WEB)
        answers = Counter([await ask(port) for _ in range(12)])
    assert len(answers) == 1 and sum(answers.values()) == 12


async def test_a_manifest_edit_adds_and_removes_a_service_within_2s(
    tmp_path: Path, backends: Backends
) -> None:
    started = await backends("pod-a", "api-1")
    manifest = tmp_path / "svc.yaml"
    web = _web(started[:1])
    write_manifests(manifest, web)
    async with running_proxy(loopback_config(manifest)) as proxy:
        api = [
            service("api", [{"name": "http", "port": 8080}], cluster_ip="10.96.0.11"),
            *endpoint_slice("api", "http", [("127.0.0.1", started[1][1])]),
        ]
        write_manifests(manifest, web + api)
        api_port = await wait_for(lambda: proxy.proxier.port_of(API), 2.0, "api served")
        assert await ask(api_port) == "api-1"
        write_manifests(manifest, web)
        await wait_for(lambda: not proxy.proxier.port_of(API), 2.0, "api removed")
        await wait_for(lambda: _refused(api_port), 2.0, "api port closed")
        assert await ask(proxy.proxier.port_of(WEB)) == "pod-a"


async def test_a_service_without_endpoints_refuses_connections(tmp_path: Path) -> None:
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, [service("web", [{"name": "http", "port": 80}])])
    async with running_proxy(loopback_config(manifest)) as proxy:
        port = proxy.proxier.port_of(WEB)
        assert port
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)


async def test_debug_state_shows_the_proxy_ports_in_use(tmp_path: Path, backends: Backends) -> None:
    started = await backends("pod-a", "pod-b")
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, _web(started))
    async with running_proxy(loopback_config(manifest)) as proxy:
        assert proxy.ops is not None
        url = f"http://127.0.0.1:{proxy.ops.metrics_port}/debug/state"
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            assert response.status == 200
            state = json.loads(await response.text())
        in_use = proxy.proxier.port_of(WEB)
    entry = state["default/web:http"]
    assert entry["proxyPorts"] == {"cluster": in_use}
    assert sorted(entry["endpoints"]["cluster"]) == sorted(f"127.0.0.1:{p}" for _, p, _ in started)


async def _scrape(port: int) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
        assert r.status == 200
        return await r.text()


async def test_connection_counters_move_with_traffic_and_vanish_with_the_service(
    tmp_path: Path, backends: Backends
) -> None:
    started = await backends("pod-a")
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, _web(started))
    labels = {"service_port": "default/web:http"}
    async with running_proxy(loopback_config(manifest)) as proxy:
        assert proxy.ops is not None and proxy.ops.metrics_port
        port = proxy.ops.metrics_port
        name = "kube_userspace_proxy_connections_total"
        before = sample_value(await _scrape(port), name, {**labels, "result": "accepted"}) or 0
        for _ in range(10):
            await ask(proxy.proxier.port_of(WEB))
        after = sample_value(await _scrape(port), name, {**labels, "result": "accepted"})
        assert after == before + 10
        write_manifests(manifest, [])
        await wait_for(lambda: not proxy.proxier.port_of(WEB), 2.0, "web removed")
        assert "default/web:http" not in await _scrape(port)


async def test_the_control_loops_lag_is_a_histogram_that_sees_a_stall(tmp_path: Path) -> None:
    """`kube_userspace_proxy_event_loop_lag_seconds`: sampled on the control loop (every
    250 ms while it idles); a 600 ms stall of that loop lands above the 250 ms bucket."""
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, [])
    name = "kube_userspace_proxy_event_loop_lag_seconds_bucket"
    async with running_proxy(loopback_config(manifest)) as proxy:
        assert proxy.ops is not None and proxy.ops.metrics_port
        port = proxy.ops.metrics_port
        await wait_for(
            lambda: proxy.metrics.registry.get_sample_value(
                "kube_userspace_proxy_event_loop_lag_seconds_count"
            ),
            3.0,
            "lag samples",
        )
        text = await _scrape(port)
        under, total = (sample_value(text, name, {"le": le}) or 0 for le in ("0.25", "+Inf"))
        time.sleep(0.6)  # the stall under test
        await asyncio.sleep(0.4)
        text = await _scrape(port)
        under_after, total_after = (
            sample_value(text, name, {"le": le}) or 0 for le in ("0.25", "+Inf")
        )
    assert total_after - under_after >= total - under + 1


async def test_healthz_is_200_after_the_first_sync(tmp_path: Path) -> None:
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, [])
    async with running_proxy(loopback_config(manifest)) as proxy:
        assert proxy.ops is not None
        url = f"http://127.0.0.1:{proxy.ops.healthz_port}/healthz"
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            assert response.status == 200
            body = json.loads(await response.text())
    assert body["nodeEligible"] is True and body["lastUpdated"]


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


async def test_a_removed_service_lets_open_connections_finish_until_shutdown_grace(
    tmp_path: Path,
) -> None:
    echo = await asyncio.get_running_loop().create_server(_Echo, "127.0.0.1", 0)
    echo_port = echo.sockets[0].getsockname()[1]
    manifest = tmp_path / "svc.yaml"
    write_manifests(
        manifest,
        [
            service("web", [{"name": "http", "port": 80}]),
            *endpoint_slice("web", "http", [("127.0.0.1", echo_port)]),
        ],
    )
    try:
        async with running_proxy(loopback_config(manifest, shutdown_grace=0.5)) as proxy:
            port = proxy.proxier.port_of(WEB)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"one")
            assert await reader.readexactly(3) == b"one"
            write_manifests(manifest, [])
            await wait_for(lambda: _refused(port), 2.0, "listener closed")
            # The connection opened before the removal still works.
            writer.write(b"two")
            assert await reader.readexactly(3) == b"two"
        # Shutdown waited its grace, then ended the idle connection.
        assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()
    finally:
        echo.close()
        await echo.wait_closed()
