"""The ops sites are bounded: a request-header timeout and a connection cap."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path as FilePath
from typing import Any

import aiohttp
import pytest

from kube_userspace_proxy.balancer import DEFAULT_MAX_AFFINITY_ENTRIES, PINS_SHOWN
from kube_userspace_proxy.model import Path, ServicePortName
from kube_userspace_proxy.ops import httpguard
from kube_userspace_proxy.ops.health import ProxyHealth
from kube_userspace_proxy.ops.metrics import ProxyMetrics
from kube_userspace_proxy.ops.server import STATE_CHUNK, OpsServer, start_ops
from tests.loopback.proxyrun import (
    endpoint_slice,
    loopback_config,
    running_proxy,
    service,
    wait_for,
    write_manifests,
)
from tests.turns import Turns

HEADER_TIMEOUT = 0.5
CAP = 8


@pytest.fixture
async def server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[OpsServer]:
    monkeypatch.setattr(httpguard, "HEADER_TIMEOUT", HEADER_TIMEOUT)
    monkeypatch.setattr(httpguard, "MAX_CONNECTIONS", CAP)
    ops = await start_ops(
        healthz_bind="127.0.0.1:0",
        metrics_bind="127.0.0.1:0",
        health=ProxyHealth(30.0),
        metrics=ProxyMetrics(list, process_metrics=False),
        debug_state=dict,
        configz=dict,
    )
    try:
        yield ops
    finally:
        await ops.close()


async def closed_by_peer(reader: asyncio.StreamReader, within: float) -> bool:
    """True when the server ends the connection (EOF or reset) within `within` seconds."""
    try:
        return await asyncio.wait_for(reader.read(1024), within) == b""
    except ConnectionError:  # reset, or a broken pipe seen by the last write
        return True
    except TimeoutError:
        return False


async def test_idle_connections_are_closed_after_the_header_timeout(server: OpsServer) -> None:
    port = server.healthz_port
    assert port is not None
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(CAP)]
    began = time.monotonic()
    results = await asyncio.gather(*(closed_by_peer(r, 10 * HEADER_TIMEOUT) for r, _ in conns))
    assert all(results)
    assert time.monotonic() - began < 10 * HEADER_TIMEOUT
    for _, writer in conns:
        writer.close()


async def test_a_header_sent_a_byte_at_a_time_is_cut_off(server: OpsServer) -> None:
    port = server.healthz_port
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    began = time.monotonic()
    try:
        for byte in request[:-4]:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(HEADER_TIMEOUT / 5)
            if time.monotonic() - began > 4 * HEADER_TIMEOUT:
                break
    except ConnectionError:
        pass
    assert await closed_by_peer(reader, 2 * HEADER_TIMEOUT)
    writer.close()


async def test_connections_past_the_cap_are_closed_and_service_resumes(server: OpsServer) -> None:
    port = server.healthz_port
    assert port is not None
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(CAP)]
    extra_reader, extra_writer = await asyncio.open_connection("127.0.0.1", port)
    assert await closed_by_peer(extra_reader, HEADER_TIMEOUT / 2)  # before any header timeout
    extra_writer.close()
    for _, writer in held:
        writer.close()
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 10
        while True:
            try:
                async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                    assert resp.status == 200
                    break
            except aiohttp.ClientError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
    assert sum(site.refused for site in server.sites) >= 1


async def test_keep_alive_requests_keep_working(server: OpsServer) -> None:
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1, force_close=False)
    ) as http:
        for _ in range(20):
            async with http.get(f"http://127.0.0.1:{server.metrics_port}/metrics") as resp:
                assert resp.status == 200
                await resp.read()
        await asyncio.sleep(HEADER_TIMEOUT / 2)
        async with http.get(f"http://127.0.0.1:{server.healthz_port}/livez") as resp:
            assert resp.status == 200


async def test_debug_state_summarizes_pins(tmp_path: FilePath) -> None:
    """5 Services with 65,536 ClientIP pins each made a 39 MB /debug/state body."""
    names = [f"web{i}" for i in range(5)]
    objects: list[dict[str, Any]] = []
    for i, name in enumerate(names):
        objects.append(
            service(
                name,
                [{"name": "http", "port": 80}],
                cluster_ip=f"10.96.0.{10 + i}",
                sessionAffinity="ClientIP",
            )
        )
        objects += endpoint_slice(name, "http", [("127.0.0.1", 9)])
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, objects)
    async with running_proxy(loopback_config(manifest)) as proxy:
        await wait_for(lambda: len(proxy.proxier.debug_state()) == len(names), what="5 ports")
        for name in names:
            # The real pinning path: every new client of a ClientIP Service gets a pin.
            pool = proxy.proxier._served[ServicePortName("default", name, "http")].pools[
                Path.CLUSTER
            ]
            for n in range(DEFAULT_MAX_AFFINITY_ENTRIES):
                pool.pick(f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}")
        assert proxy.ops is not None
        url = f"http://127.0.0.1:{proxy.ops.metrics_port}/debug/state"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            body = await resp.read()
    state = json.loads(body)
    assert len(body) < 100_000
    for name in names:
        affinity = state[f"default/{name}:http"]["affinity"]
        assert affinity["pins"] == DEFAULT_MAX_AFFINITY_ENTRIES
        assert len(affinity["shown"]) == PINS_SHOWN


async def test_debug_state_is_written_a_chunk_per_loop_turn() -> None:
    """A view that yields to the loop (as the proxier's does while it sorts) is streamed
    STATE_CHUNK entries at a time, with a turn of the loop between two chunks."""
    turns = Turns()
    pulled_in_turn: Counter[int] = Counter()
    count = 20 * STATE_CHUNK + 3

    async def view() -> AsyncIterator[tuple[str, Any]]:
        for i in range(count):
            if i % 50 == 0:
                await asyncio.sleep(0)
            pulled_in_turn[turns.count] += 1
            yield f"default/svc-{i:04d}:http", {"port": i}

    ops = await start_ops(
        healthz_bind="",
        metrics_bind="127.0.0.1:0",
        health=ProxyHealth(30.0),
        metrics=ProxyMetrics(list, process_metrics=False),
        debug_state=view,
        configz=dict,
    )
    witness = asyncio.create_task(turns.run())
    try:
        url = f"http://127.0.0.1:{ops.metrics_port}/debug/state"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            assert resp.status == 200
            state = json.loads(await resp.read())
    finally:
        witness.cancel()
        await ops.close()
    assert list(state) == [f"default/svc-{i:04d}:http" for i in range(count)]
    assert [entry["port"] for entry in state.values()] == list(range(count))
    assert sum(pulled_in_turn.values()) == count
    assert max(pulled_in_turn.values()) <= STATE_CHUNK
