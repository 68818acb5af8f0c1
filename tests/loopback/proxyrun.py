"""Run the whole proxy in-process on loopback from manifests the test writes; named backends."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any, cast

import yaml

from kube_userspace_proxy import app
from kube_userspace_proxy.config.settings import ProxyConfig
from tests import polling


class NamedBackend(asyncio.Protocol):
    """Answers each connection's first bytes with its name, then closes (like `GET /`)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.transport.write(self.name.encode())
        self.transport.close()


async def start_named_backends(names: Iterable[str]) -> list[tuple[str, int, asyncio.Server]]:
    """One TCP server per name on 127.0.0.1:<ephemeral>; returns (name, port, server)."""
    loop = asyncio.get_running_loop()
    out = []
    for name in names:
        server = await loop.create_server(functools.partial(NamedBackend, name), "127.0.0.1", 0)
        out.append((name, server.sockets[0].getsockname()[1], server))
    return out


async def ask(port: int, host: str = "127.0.0.1") -> str:
    """Connect, send a line, return what the backend answered (its name)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"hello\n")
    data = await reader.read()
    writer.close()
    return data.decode()


def service(
    name: str,
    ports: list[dict[str, Any]],
    *,
    namespace: str = "default",
    cluster_ip: str = "10.96.0.10",
    **spec: Any,
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterIP": cluster_ip, "ports": ports, **spec},
    }


def endpoint_slice(
    service_name: str,
    port_name: str,
    targets: Iterable[tuple[str, int]],
    *,
    namespace: str = "default",
    protocol: str = "TCP",
    suffix: str = "abc",
) -> list[dict[str, Any]]:
    """One slice per distinct target port (slices share a port list), all for `service_name`."""
    by_port: dict[int, list[str]] = {}
    for ip, port in targets:
        by_port.setdefault(port, []).append(ip)
    return [
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{service_name}-{suffix}{i}",
                "namespace": namespace,
                "labels": {"kubernetes.io/service-name": service_name},
            },
            "addressType": "IPv4",
            "ports": [{"name": port_name, "port": port, "protocol": protocol}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ips],
        }
        for i, (port, ips) in enumerate(sorted(by_port.items()))
    ]


def write_manifests(path: Path, objects: Iterable[dict[str, Any]]) -> None:
    """Write atomically so the watcher never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(list(objects)))
    tmp.replace(path)


async def wait_for(predicate: Callable[[], Any], seconds: float = 30.0, what: str = "") -> Any:
    """Poll `predicate` until it returns something truthy or the deadline passes (never
    sooner than the suite's floor: tests/polling.py)."""
    return await polling.eventually(predicate, what or repr(predicate), seconds, interval=0.02)


def served_ports(state_dir: Path) -> dict[str, int]:
    """Service port name -> proxy port, from `state_dir`'s state file (empty until written)."""
    try:
        document = json.loads((state_dir / "served.json").read_text())
    except (OSError, ValueError):
        return {}
    return {name: port for name, _, _, port in document["proxyPorts"]}


LOOPBACK_RUN_FLAGS = (
    "--bind-address",
    "127.0.0.1",
    "--iptables-backend",
    "none",
    "--healthz-bind-address",
    "127.0.0.1:0",
    "--metrics-bind-address",
    "127.0.0.1:0",
)
"""`kube-userspace-proxy run` flags for a proxy on loopback: no rules, ephemeral ops ports."""


def loopback_config(manifests: Path, **overrides: Any) -> ProxyConfig:
    values: dict[str, Any] = {
        "bind_address": "127.0.0.1",
        "manifests": (str(manifests),),
        "iptables_backend": "none",
        "healthz_bind_address": "127.0.0.1:0",
        "metrics_bind_address": "127.0.0.1:0",
        "hostname_override": "node-1",
        "nodeport_addresses": ("127.0.0.1/32",),
        "min_sync_period": 0.05,
        "shutdown_grace": 1.0,
        # In-process tests look inside the data plane; tests/workers run the default.
        "workers": "1",
        "state_dir": "",  # tests that restart from a state file pass their own directory
    }
    values.update(overrides)
    return ProxyConfig(**values)


@contextlib.asynccontextmanager
async def running_proxy(
    config: ProxyConfig, start: float = 10, sync: float = 10, stop_within: float = 15
) -> AsyncIterator[app.Proxy]:
    """Serve `config` in this event loop until the block ends; yields the running Proxy.
    The waits for its start, first sync and stop are never shorter than the suite's floor
    (tests/polling.py)."""
    stop = asyncio.Event()
    ready: asyncio.Future[app.Proxy] = asyncio.get_running_loop().create_future()

    def started(proxy: app.Proxy) -> None:
        ready.set_result(proxy)

    task = asyncio.create_task(app.serve(config, stop=stop, started=started))
    try:
        proxy = await asyncio.wait_for(asyncio.shield(ready), polling.bound(start))
        assert proxy.synced_once is not None
        await asyncio.wait_for(proxy.synced_once.wait(), polling.bound(sync))
        yield proxy
    finally:
        stop.set()
        code = await asyncio.wait_for(task, polling.bound(stop_within))
        assert code == 0


def printed_by(script: str) -> Any:
    """What `script`, run in a fresh interpreter, printed as JSON (what it imported, say)."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout)
