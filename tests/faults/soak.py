"""A churn soak: steady traffic to stable Services while everything around them changes.

The proxy runs as its own process (the CLI, `--workers 1`, no iptables: traffic goes straight
to the proxy ports on loopback) against the fake API server in this process. While clients
send requests to two stable Services, Services and EndpointSlices churn (`churn_per_second`
creations and deletions), the API server is stopped, compacted (410 on resume) and started
again, and the stable Services' backends are killed and revived one at a time. The result
counts failed requests and samples the proxy's RSS and open descriptors five times a second.

Used by tests/faults/ (about 60 s) and benchmarks/soak.py (10 minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import itertools
import json
import os
import signal
import socket
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.control.conftest import endpoint_slice, service
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.rbac import Rbac, chart_rules

STABLE = ("stable-a", "stable-b")
BACKEND_IPS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
CLIENTS_PER_SERVICE = 4
CHURN_ALIVE = 20
"""Churned Services alive at any time: each new one deletes the oldest, so the load is flat."""


@dataclass
class Result:
    """What a soak saw: requests, failures, and the proxy's footprint five times a second."""

    requests: int = 0
    failures: list[str] = field(default_factory=list)
    churn_events: int = 0
    api_restarts: int = 0
    backend_kills: int = 0
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    """(seconds since measuring began, RSS in KiB, open descriptors)."""

    def window(self, first: bool, seconds: float = 10.0) -> tuple[float, float]:
        """Median RSS (KiB) and the fewest descriptors over the first or last `seconds` of
        samples.

        In-flight connections and API-server reconnects come and go between two samples:
        the descriptors swing between the footprint and the footprint plus the connections
        in flight (44 and 60 here), and on a busy machine more than half the samples can be
        the higher one, which moves a median without any leak. A leaked descriptor stays in
        every sample, so it raises the fewest; a burst does not. RSS does not swing so: its
        median.
        """
        end = self.samples[-1][0]
        rows = [s for s in self.samples if (s[0] < seconds if first else s[0] > end - seconds)]
        return statistics.median(r[1] for r in rows), min(r[2] for r in rows)

    def drift(self) -> tuple[float, float]:
        """Relative change of RSS and descriptors, last window against the first."""
        (rss0, fd0), (rss1, fd1) = self.window(True), self.window(False)
        return (rss1 - rss0) / rss0, (fd1 - fd0) / fd0

    def report(self) -> str:
        (rss0, fd0), (rss1, fd1) = self.window(True), self.window(False)
        rss_drift, fd_drift = self.drift()
        return (
            f"{self.requests} requests, {len(self.failures)} failed; {self.churn_events} churn"
            f" events, {self.api_restarts} API-server restarts (compacted), {self.backend_kills}"
            f" backend kills; RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB"
            f" ({rss_drift:+.1%}), descriptors {fd0:.1f} -> {fd1:.1f} ({fd_drift:+.1%})"
        )


class _Named(asyncio.Protocol):
    def __init__(self, name: bytes) -> None:
        self.name = name

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert isinstance(self.transport, asyncio.Transport)
        self.transport.write(self.name)
        self.transport.close()


class Backends:
    """One named TCP server per (ip, port); `kill` closes one, `revive` opens it again."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.servers: dict[str, asyncio.Server] = {}

    async def revive(self, ip: str) -> None:
        loop = asyncio.get_running_loop()
        self.servers[ip] = await loop.create_server(
            lambda: _Named(ip.encode()), ip, self.port, reuse_address=True
        )

    async def kill(self, ip: str) -> None:
        server = self.servers.pop(ip)
        server.close()
        await server.wait_closed()

    async def close(self) -> None:
        for ip in list(self.servers):
            await self.kill(ip)


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


async def _ask(port: int) -> str:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(b"hello\n")
        return (await asyncio.wait_for(reader.read(), 5)).decode()
    finally:
        writer.close()


def _footprint(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


async def run(
    tmp: Path,
    *,
    warmup: float,
    measure: float,
    churn_per_second: float = 12.0,
    api_restart_every: float = 20.0,
    backend_kill_every: float = 4.0,
    log: Path | None = None,
) -> Result:
    """Soak the proxy for `warmup` + `measure` seconds; footprint sampled during `measure`."""
    result = Result()
    apiserver = FakeApiServer()
    apiserver.rbac = Rbac(chart_rules())  # the chart's ClusterRole, enforced
    await apiserver.start()
    backend_port = _free_port()
    backends = Backends(backend_port)
    for ip in BACKEND_IPS:
        await backends.revive(ip)
    for i, name in enumerate(STABLE):
        apiserver.create(service(name, cluster_ip=f"10.96.0.{10 + i}"))
        apiserver.create(endpoint_slice(f"{name}-a", name, BACKEND_IPS, port=backend_port))
    kubeconfig = apiserver.write_kubeconfig(tmp / "kubeconfig")
    metrics_port = _free_port()
    args = [
        sys.executable, "-m", "kube_userspace_proxy", "run", "--kubeconfig", str(kubeconfig),
        "--iptables-backend", "none", "--bind-address", "127.0.0.1", "--hostname-override",
        "node-1", "--healthz-bind-address", "", "--metrics-bind-address",
        f"127.0.0.1:{metrics_port}", "--loopback-endpoints", "allow", "--workers", "1",
        "--iptables-min-sync-period", "100ms", "--state-dir", str(tmp / "state"),
    ]  # fmt: skip
    out = open(log or os.devnull, "ab")  # noqa: SIM115 - closed in the finally below
    proc = await asyncio.create_subprocess_exec(*args, stdout=out, stderr=out)
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    try:
        ports: dict[str, int] = {}
        deadline = time.monotonic() + 60
        while len(ports) < len(STABLE):
            assert proc.returncode is None, "the proxy exited"
            assert time.monotonic() < deadline, "the stable Services were never served"
            # HTTPException: on a shared machine another process may hold the port for a
            # moment before the proxy binds it (one answered "pod-b").
            with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
                state = await asyncio.to_thread(
                    _get_json, f"http://127.0.0.1:{metrics_port}/debug/state"
                )
                for name in STABLE:
                    entry = state.get(f"default/{name}:http") or {}
                    if entry.get("endpoints", {}).get("cluster"):
                        ports[name] = entry["proxyPorts"]["cluster"]
            await asyncio.sleep(0.2)

        async def client(port: int) -> None:
            while not stop.is_set():
                try:
                    answer = await _ask(port)
                except (OSError, TimeoutError) as exc:
                    answer = f"error: {exc!r}"
                result.requests += 1
                if answer not in BACKEND_IPS:
                    result.failures.append(answer or "empty answer")
                await asyncio.sleep(0.01)

        async def churn() -> None:
            alive: list[str] = []
            for n in itertools.count():
                if stop.is_set():
                    return
                name = f"churn-{n}"
                ip = f"10.97.{(n >> 8) & 255}.{n & 255}"
                if apiserver.running:
                    apiserver.create(service(name, cluster_ip=ip))
                    apiserver.create(endpoint_slice(f"{name}-a", name, ["127.0.0.9"]))
                    alive.append(name)
                    result.churn_events += 2
                    if len(alive) > CHURN_ALIVE:
                        gone = alive.pop(0)
                        apiserver.delete("EndpointSlice", f"{gone}-a")
                        apiserver.delete("Service", gone)
                        result.churn_events += 2
                await asyncio.sleep(4 / churn_per_second)

        async def restart_api() -> None:
            while not stop.is_set():
                await asyncio.sleep(api_restart_every)
                await apiserver.stop()
                await asyncio.sleep(1.0)
                apiserver.compact()  # watches resume from a version now too old: 410
                await apiserver.start()
                result.api_restarts += 1

        def publish(ips: tuple[str, ...]) -> None:
            for name in STABLE:
                apiserver.apply(endpoint_slice(f"{name}-a", name, ips, port=backend_port))

        async def dropped(ip: str, timeout: float = 30.0) -> bool:
            """True once no stable Service lists `ip` in the proxy's /debug/state."""
            deadline = time.monotonic() + timeout
            while not stop.is_set() and time.monotonic() < deadline:
                with contextlib.suppress(OSError, ValueError):
                    state = await asyncio.to_thread(
                        _get_json, f"http://127.0.0.1:{metrics_port}/debug/state"
                    )
                    listed = [
                        address
                        for name in STABLE
                        for address in (state.get(f"default/{name}:http") or {})
                        .get("endpoints", {})
                        .get("cluster", [])
                    ]
                    if not any(address.startswith(f"{ip}:") for address in listed):
                        return True
                await asyncio.sleep(0.1)
            return False

        async def kill_backends() -> None:
            # As Kubernetes deletes a pod: its endpoint leaves the slices first, then the
            # process dies (SIGKILL: its listening socket is simply gone), later a new one
            # comes up and its endpoint returns. A kill with the endpoint still listed would
            # reset the connections queued in the dead listener's backlog, in any proxy.
            for ip in itertools.cycle(BACKEND_IPS):
                await asyncio.sleep(backend_kill_every)
                if stop.is_set():
                    return
                if not apiserver.running:
                    continue
                publish(tuple(i for i in BACKEND_IPS if i != ip))
                # Killed only once the proxy has dropped it (a watch cut by an API-server
                # restart may deliver the change seconds later, after a relist).
                if not await dropped(ip):
                    continue
                await backends.kill(ip)
                result.backend_kills += 1
                await asyncio.sleep(backend_kill_every / 2)
                await backends.revive(ip)
                while not apiserver.running and not stop.is_set():
                    await asyncio.sleep(0.1)
                publish(BACKEND_IPS)

        tasks = [
            asyncio.create_task(client(ports[name]))
            for name in STABLE
            for _ in range(CLIENTS_PER_SERVICE)
        ]
        tasks += [
            asyncio.create_task(churn()),
            asyncio.create_task(restart_api()),
            asyncio.create_task(kill_backends()),
        ]
        await asyncio.sleep(warmup)
        began = time.monotonic()
        while (elapsed := time.monotonic() - began) < measure:
            assert proc.returncode is None, "the proxy exited"
            rss, fds = _footprint(proc.pid)
            result.samples.append((elapsed, rss, fds))
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
        out.close()
        await backends.close()
        await apiserver.stop()
    return result
