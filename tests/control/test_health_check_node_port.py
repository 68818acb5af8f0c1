"""healthCheckNodePort: kube-proxy's per-Service health server, over real HTTP.

A LoadBalancer Service with externalTrafficPolicy Local gets a server on its health-check
port (here on 127.0.0.1, the proxy's bind address); it answers 200 while this node has ready
endpoints of the Service, 503 otherwise, and goes away with the Service or the policy.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import aiohttp

from kube_userspace_proxy.model import Endpoint, ServicePortInfo, ServicePortName, Snapshot
from kube_userspace_proxy.ops.health import ProxyHealth
from kube_userspace_proxy.ops.servicehealth import ServiceHealthServers
from tests.control.conftest import NODE, endpoint_slice, service
from tests.control.test_kube_end_to_end import kube_config
from tests.fakes.apiserver import FakeApiServer
from tests.loopback.proxyrun import running_proxy


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def lb_service(name: str, health_port: int, policy: str = "Local") -> dict[str, Any]:
    svc = service(
        name,
        type="LoadBalancer",
        externalTrafficPolicy=policy,
        healthCheckNodePort=health_port,
    )
    svc["spec"]["ports"][0]["nodePort"] = 30080
    return svc


async def probe(port: int) -> tuple[int, Any] | None:
    """(status, JSON body) of GET /healthz on the port, or None when nothing listens."""
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/healthz") as resp,
        ):
            return resp.status, await resp.json()
    except aiohttp.ClientConnectorError:
        return None


async def test_health_check_node_port_follows_local_endpoints_and_the_service(
    apiserver: FakeApiServer, kubeconfig: str
) -> None:
    port = free_port()
    async with running_proxy(kube_config(kubeconfig, workers="1")) as proxy:
        apiserver.create(lb_service("lb", port))
        apiserver.create(endpoint_slice("lb-a", "lb", ["10.1.0.1"], node_name=NODE))
        expected = {
            "service": {"namespace": "default", "name": "lb"},
            "localEndpoints": 1,
            "serviceProxyHealthy": True,
        }
        answer = await _poll(port, lambda a: a == (200, expected), "200 with one endpoint")
        assert answer == (200, expected)
        assert proxy.service_health.ports == {"default/lb": port}

        # The only endpoint moves to another node: this node has none, so 503.
        apiserver.update(endpoint_slice("lb-a", "lb", ["10.1.0.1"], node_name="node-2"))
        answer = await _poll(port, lambda a: a is not None and a[0] == 503, "503")
        assert answer is not None and answer[1]["localEndpoints"] == 0

        # The policy changes to Cluster: the server closes.
        apiserver.update(lb_service("lb", port, policy="Cluster"))
        await _poll(port, lambda a: a is None, "the server to close")
        assert proxy.service_health.ports == {}

        # Back to Local, then the Service goes away: the server opens, then closes.
        apiserver.update(lb_service("lb", port))
        await _poll(port, lambda a: a is not None, "the server to open again")
        apiserver.delete("Service", "lb")
        await _poll(port, lambda a: a is None, "the server to close with the Service")


async def _poll(port: int, good: Any, what: str) -> Any:
    last: list[Any] = [None]

    async def check() -> bool:
        last[0] = await probe(port)
        return bool(good(last[0]))

    end = time.monotonic() + 10.0
    while not await check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}; last answer {last[0]!r}")
        await asyncio.sleep(0.02)
    return last[0]


async def test_an_unhealthy_proxy_answers_503_even_with_local_endpoints() -> None:
    now = [1000.0]
    health = ProxyHealth(sync_period=30.0, clock=lambda: now[0])
    servers = ServiceHealthServers(health, lambda: ["127.0.0.1"])
    port = free_port()
    name = ServicePortName("ns", "web", "http")
    info = ServicePortInfo(name, 80, ("10.96.0.1",), node_port=30080, health_check_node_port=port)
    snapshot = Snapshot(
        services={name: info},
        endpoints={name: (Endpoint("10.1.0.1", 8080, node_name=NODE),)},
        node_name=NODE,
    )
    await servers.sync(snapshot)
    try:
        assert await probe(port) == (
            200,
            {
                "service": {"namespace": "ns", "name": "web"},
                "localEndpoints": 1,
                "serviceProxyHealthy": True,
            },
        )
        health.queued_update()
        now[0] += 61.0  # a change waited more than 2 x syncPeriod
        answer = await probe(port)
        assert answer is not None
        assert answer[0] == 503
        assert answer[1]["serviceProxyHealthy"] is False
        assert answer[1]["localEndpoints"] == 1
    finally:
        await servers.close()
    assert await probe(port) is None


async def test_a_taken_health_port_is_logged_and_retried_at_the_next_sync() -> None:
    health = ProxyHealth(sync_period=30.0)
    servers = ServiceHealthServers(health, lambda: ["127.0.0.1"])
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    name = ServicePortName("ns", "web", "http")
    info = ServicePortInfo(name, 80, ("10.96.0.1",), node_port=30080, health_check_node_port=port)
    snapshot = Snapshot(services={name: info}, node_name=NODE)
    try:
        await servers.sync(snapshot)
        assert servers.ports == {}
        blocker.close()
        await servers.sync(snapshot)
        assert servers.ports == {"ns/web": port}
        answer = await probe(port)
        assert answer is not None and answer[0] == 503
    finally:
        blocker.close()
        await servers.close()


def test_only_load_balancers_with_the_local_policy_get_a_health_check_port() -> None:
    from kube_userspace_proxy.cluster.objects import parse_service

    def health_port(**spec: Any) -> int:
        svc = service("s", healthCheckNodePort=31000, **spec)
        svc["spec"]["ports"][0]["nodePort"] = 30080
        infos = parse_service(svc, ("default", "s"))[0]
        return infos[0].health_check_node_port

    assert health_port(type="LoadBalancer", externalTrafficPolicy="Local") == 31000
    assert health_port(type="LoadBalancer", externalTrafficPolicy="Cluster") == 0
    assert health_port(type="NodePort", externalTrafficPolicy="Local") == 0
