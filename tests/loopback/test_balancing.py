"""Schedulers and outlier ejection with two worker processes on loopback: lc counts every
worker's connections, sh sends a client to one endpoint from either worker, a refusing
endpoint is ejected node-wide."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kube_userspace_proxy import app
from kube_userspace_proxy.dataplane.steering import worker_of
from kube_userspace_proxy.model import Path as TrafficPath
from kube_userspace_proxy.model import Protocol, ServicePortName
from kube_userspace_proxy.outliers import ejections
from kube_userspace_proxy.workers.pool import EndpointSet
from tests.loopback.proxyrun import (
    endpoint_slice,
    loopback_config,
    running_proxy,
    service,
    start_named_backends,
    wait_for,
    write_manifests,
)

# Every test here runs over both TCP data planes (tests/conftest.py `dataplane`).
pytestmark = pytest.mark.usefixtures("dataplane")

WORKERS = 2
CLIENTS = [f"127.0.{i}.{j}" for i in (1, 2) for j in range(2, 14)]
BY_WORKER = {w: [c for c in CLIENTS if worker_of(c, WORKERS) == w] for w in range(WORKERS)}
WEB = ServicePortName("default", "web", "http", Protocol.TCP)
EJECTED_NOW = "kube_userspace_proxy_endpoints_ejected "


class Holding(asyncio.Protocol):
    """Answers its name at once and keeps the connection open until the client closes it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.name.encode() + b"\n")


@contextlib.asynccontextmanager
async def holding_backends(names: list[str]) -> AsyncIterator[list[tuple[str, int]]]:
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(lambda n=n: Holding(n), "127.0.0.1", 0) for n in names]
    try:
        yield [(n, s.sockets[0].getsockname()[1]) for n, s in zip(names, servers, strict=True)]
    finally:
        for server in servers:
            server.close()


@contextlib.asynccontextmanager
async def proxy_for(
    tmp_path: Path, ports: list[int], annotations: dict[str, str]
) -> AsyncIterator[app.Proxy]:
    svc = service("web", [{"name": "http", "port": 80, "protocol": "TCP"}])
    svc["metadata"]["annotations"] = annotations
    manifest = tmp_path / "svc.yaml"
    write_manifests(
        manifest, [svc, *endpoint_slice("web", "http", [("127.0.0.1", p) for p in ports])]
    )
    config = loopback_config(manifest, workers=str(WORKERS))
    async with running_proxy(config) as proxy:
        await wait_for(lambda: proxy.workers is not None and proxy.workers.alive == WORKERS)
        yield proxy


def _endpoint_set(proxy: app.Proxy) -> EndpointSet:
    pool = proxy.proxier._served[WEB].pools[TrafficPath.CLUSTER]
    assert isinstance(pool, EndpointSet)
    return pool


async def _open(source: str, port: int) -> tuple[str, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    name = await asyncio.wait_for(reader.readline(), 5)
    return name.decode().strip(), writer


async def test_lc_sends_every_new_connection_to_a_least_loaded_endpoint_node_wide(
    tmp_path: Path,
) -> None:
    async with (
        holding_backends(["a", "b", "c"]) as backends,
        proxy_for(
            tmp_path, [p for _, p in backends], {"kube-userspace-proxy.io/scheduler": "lc"}
        ) as proxy,
    ):
        port = proxy.proxier.port_of(WEB)
        held: list[asyncio.StreamWriter] = []
        load: Counter[str] = Counter({n: 0 for n, _ in backends})
        # Workers take turns unevenly: each new connection must go where the node has fewest,
        # though the worker accepting it has opened few or none itself.
        order = [0, 0, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1]
        try:
            for step, worker in enumerate(order):
                client = BY_WORKER[worker][step % len(BY_WORKER[worker])]
                name, writer = await _open(client, port)
                held.append(writer)
                assert load[name] == min(load.values()), (step, name, dict(load))
                load[name] += 1
            assert set(load.values()) == {4}
        finally:
            for writer in held:
                writer.close()


async def test_sh_sends_a_client_to_one_endpoint_whichever_worker_serves_it(tmp_path: Path) -> None:
    started = await start_named_backends(["a", "b", "c"])
    try:
        async with proxy_for(
            tmp_path, [p for _, p, _ in started], {"kube-userspace-proxy.io/scheduler": "sh"}
        ) as proxy:
            port = proxy.proxier.port_of(WEB)
            seen: dict[str, set[str]] = {}
            for _ in range(3):
                for client in CLIENTS:
                    reader, writer = await asyncio.open_connection(
                        "127.0.0.1", port, local_addr=(client, 0)
                    )
                    writer.write(b"hi\n")
                    seen.setdefault(client, set()).add((await reader.read()).decode())
                    writer.close()
            assert all(len(names) == 1 for names in seen.values())
            assert len({next(iter(n)) for n in seen.values()}) == 3
            # The same hashing a single process would do (no table state, no steering).
            from kube_userspace_proxy.balancer import EndpointPool

            local = EndpointPool(WEB)
            local.set_scheduler("sh")
            local.take_addresses(_endpoint_set(proxy).addresses, affinity_timeout=None)
            names = {("127.0.0.1", p): n for n, p, _ in started}
            assert all(seen[c] == {names[local.pick(c)]} for c in CLIENTS)  # type: ignore[index]
    finally:
        for _, _, server in started:
            server.close()


def _refusing_port() -> int:
    """A loopback port nothing listens on (bound, then closed: it refuses)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_refusing_endpoint_is_ejected_after_failures_seen_by_both_workers(
    tmp_path: Path,
) -> None:
    dead = _refusing_port()
    async with holding_backends([f"live{i}" for i in range(9)]) as backends:
        ports = [p for _, p in backends] + [dead]
        annotations = {
            "kube-userspace-proxy.io/outlier-consecutive-failures": "2",
            "kube-userspace-proxy.io/outlier-base-ejection-time": "60s",
        }
        async with proxy_for(tmp_path, ports, annotations) as proxy:
            port = proxy.proxier.port_of(WEB)
            pool = _endpoint_set(proxy)
            address = ("127.0.0.1", dead)
            names: list[str] = []
            held = []

            async def ejected() -> bool:
                outliers = pool.outliers  # made at the first failed dial a worker reports
                return outliers is not None and any(a == address for a, _ in outliers.ejected())

            # Both workers keep dialing (every connection still succeeds: a refused dial
            # goes on to the next endpoint) until the control process ejects the dead one.
            for round_ in range(200):
                if await ejected():
                    break
                for worker in range(WORKERS):
                    client = BY_WORKER[worker][round_ % len(BY_WORKER[worker])]
                    name, writer = await _open(client, port)
                    names.append(name)
                    held.append(writer)
                await asyncio.sleep(0.05)
                for writer in held:
                    writer.close()
                held.clear()
            assert await ejected()
            assert all(n.startswith("live") for n in names)
            [(_, seconds)] = [(a, s) for a, s in pool.outliers.ejected() if a == address]  # type: ignore[union-attr]
            assert 30 < seconds <= 60  # the annotation's 60 s, not the default 30 s
            assert ejections.totals[(str(WEB), f"127.0.0.1:{dead}")] >= 1
            view = proxy.workers.balancer_view(pool)  # type: ignore[union-attr]
            assert view.scheduler == "rr" and view.ejected and view.ejected[0][0] == address


async def test_one_process_ejects_a_refusing_endpoint_and_shows_it(tmp_path: Path) -> None:
    dead = _refusing_port()
    async with holding_backends(["a", "b", "c"]) as backends:
        svc = service("web", [{"name": "http", "port": 80, "protocol": "TCP"}])
        svc["metadata"]["annotations"] = {"kube-userspace-proxy.io/scheduler": "lc"}
        targets = [("127.0.0.1", p) for _, p in backends] + [("127.0.0.1", dead)]
        manifest = tmp_path / "svc.yaml"
        write_manifests(manifest, [svc, *endpoint_slice("web", "http", targets)])
        config = loopback_config(
            manifest, outlier_consecutive_failures=1, outlier_base_ejection_time=45.0
        )
        async with running_proxy(config) as proxy:
            port = proxy.proxier.port_of(WEB)
            held = []
            for _ in range(4):  # lc: the idle dead endpoint is dialed among the first
                held.append((await _open("127.0.0.1", port))[1])
            state = proxy.proxier.debug_state()[str(WEB)]["balancer"]["cluster"]
            for writer in held:
                writer.close()
            assert state["scheduler"] == "lc"
            [ejected] = state["ejected"]
            assert ejected["endpoint"] == f"127.0.0.1:{dead}" and ejected["state"] == "ejected"
            assert 40 < ejected["secondsLeft"] <= 45
            [row] = [e for e in state["endpoints"] if e["endpoint"] == ejected["endpoint"]]
            assert row["state"] == "ejected"
            assert sorted(e["active"] for e in state["endpoints"]) == [0, 1, 1, 2]
            text = proxy.metrics.render().decode()
            assert (
                f'kube_userspace_proxy_endpoint_ejections_total{{endpoint="127.0.0.1:{dead}",'
                'service_port="default/web:http"} 1.0' in text
            )
            # The process's gauge (an earlier test's ejection may still run in this process).
            [gauge] = [line for line in text.splitlines() if line.startswith(EJECTED_NOW)]
            assert float(gauge.split()[1]) >= 1
