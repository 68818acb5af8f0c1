"""Control-plane fixtures: the fake API server, a running KubeSource, object builders, polling.

Every test here drives the real kubernetes-asyncio client against tests/fakes/apiserver.py and
asserts on ClusterState snapshots, polling with deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kube_userspace_proxy.cluster.sources.kube import KubeSource
from kube_userspace_proxy.cluster.state import ClusterState
from kube_userspace_proxy.model import Endpoint, ServicePortName, Snapshot
from tests import polling
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.rbac import Rbac, chart_rules

NODE = "node-1"
PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
TRIGGER_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"


def service(
    name: str,
    *,
    port: int = 80,
    port_name: str = "http",
    cluster_ip: str = "10.96.0.10",
    namespace: str = "default",
    labels: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A ClusterIP Service with one TCP port."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
        "spec": {
            "clusterIP": cluster_ip,
            "ports": [{"name": port_name, "port": port, "targetPort": 8080, "protocol": "TCP"}],
            **spec,
        },
    }


def endpoint_slice(
    name: str,
    service_name: str,
    ips: Iterable[str],
    *,
    port: int = 8080,
    port_name: str = "http",
    namespace: str = "default",
    ready: bool = True,
    node_name: str | None = None,
    labels: dict[str, str] | None = None,
    trigger_time: str | None = None,
) -> dict[str, Any]:
    """An IPv4 EndpointSlice of `service_name` with one port."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"kubernetes.io/service-name": service_name, **(labels or {})},
    }
    if trigger_time is not None:
        meta["annotations"] = {TRIGGER_ANNOTATION: trigger_time}
    endpoints = []
    for ip in ips:
        endpoint: dict[str, Any] = {"addresses": [ip], "conditions": {"ready": ready}}
        if node_name:
            endpoint["nodeName"] = node_name
        endpoints.append(endpoint)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": meta,
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def node(
    name: str = NODE,
    *,
    addresses: Iterable[tuple[str, str]] = (("InternalIP", "10.0.0.5"),),
    taints: Iterable[dict[str, Any]] = (),
    deleting: bool = False,
) -> dict[str, Any]:
    """A Node with the given (type, address) pairs."""
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2024-05-01T10:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": meta,
        "spec": {"taints": list(taints)},
        "status": {"addresses": [{"type": t, "address": a} for t, a in addresses]},
    }


def port_name(name: str, namespace: str = "default", port: str = "http") -> ServicePortName:
    return ServicePortName(namespace, name, port)


def ips_of(snapshot: Snapshot, name: str, namespace: str = "default") -> set[str]:
    """The endpoint IPs of a Service's `http` port in a snapshot."""
    endpoints: tuple[Endpoint, ...] = snapshot.endpoints_of(port_name(name, namespace))
    return {e.ip for e in endpoints}


async def eventually(
    check: Callable[[], Any], *, timeout: float = 30.0, what: str = "condition"
) -> Any:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds (never
    less than the suite's floor: tests/polling.py)."""
    return await polling.eventually(check, what, timeout)


@dataclass
class Watching:
    """A KubeSource running against the fake, with the state it feeds."""

    state: ClusterState
    source: KubeSource
    task: asyncio.Task[None]
    changes: list[float]  # time.monotonic() of each on_change call

    def snapshot(self) -> Snapshot:
        return self.state.snapshot()

    def services(self) -> set[str]:
        return {name.name for name in self.state.snapshot().services}


StartSource = Callable[..., Awaitable[Watching]]


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Records of the package logger at INFO and above, even when it does not propagate."""
    logger = logging.getLogger("kube_userspace_proxy")
    logger.addHandler(caplog.handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(old_level)


@pytest.fixture
async def apiserver() -> AsyncIterator[FakeApiServer]:
    """A fake kube-apiserver on 127.0.0.1 (ephemeral port), stopped at the end. It enforces
    the chart's ClusterRole (tests/fakes/rbac.py): the proxy gets 403 for anything else."""
    server = FakeApiServer()
    server.rbac = Rbac(chart_rules())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def kubeconfig(apiserver: FakeApiServer, tmp_path: Path) -> str:
    """A kubeconfig file pointing at the fake."""
    return str(apiserver.write_kubeconfig(tmp_path / "kubeconfig"))


@pytest.fixture
async def start_source(kubeconfig: str) -> AsyncIterator[StartSource]:
    """`await start_source(**KubeSource kwargs, wait_listed=True, on_change=None)` -> Watching.

    Defaults suit tests: short backoff (0.05 s up to 0.5 s), 2 s request timeout, no rate
    limit. `on_change` is also called on every state change. Every source is cancelled at
    the end and must stop cleanly.
    """
    running: list[Watching] = []

    async def start(
        *,
        wait_listed: bool = True,
        on_change: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> Watching:
        changes: list[float] = []

        def changed() -> None:
            changes.append(time.monotonic())
            if on_change is not None:
                on_change()

        state = ClusterState(
            node_name=kwargs.get("node_name", NODE),
            service_proxy_name=kwargs.get("service_proxy_name"),
            on_change=changed,
        )
        options: dict[str, Any] = {
            "kubeconfig": kubeconfig,
            "node_name": NODE,
            "qps": 0,
            "backoff_initial": 0.05,
            "backoff_max": 0.5,
            "request_timeout": 2.0,
        }
        options.update(kwargs)
        source = KubeSource(state, **options)
        task = asyncio.create_task(source.run(), name="test-kube-source")
        watching = Watching(state, source, task, changes)
        running.append(watching)
        if wait_listed:
            # Generous: a list of thousands of objects (under tracemalloc, on a busy machine)
            # takes a while; this waits for progress, it bounds nothing.
            await eventually(lambda: state.listed, timeout=120, what="both lists")
        return watching

    yield start
    for watching in running:
        watching.task.cancel()
    for watching in running:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(watching.task, 30)
        assert watching.task.cancelled(), "KubeSource.run() ended on its own"
