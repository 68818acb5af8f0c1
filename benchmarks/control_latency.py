"""Control-plane latency: EndpointSlice change on the API server -> state -> traffic.

The fake kube-apiserver runs in its own process (`python -m tests.fakes.apiserver`); each
change is an HTTP PUT of the slice, timed from just before the PUT is sent.

- `state`: until the ClusterState fed by KubeSource holds the new endpoint (detected in its
  on_change callback, so no polling delay).
- `traffic`: until a connection through the running proxy's port (loopback, no iptables)
  reaches the new endpoint, a named backend on 127.0.0.1 (a client asks continuously).

Usage: `python benchmarks/control_latency.py [--changes 20] [--level state|traffic|both]
[--min-sync-period 1.0] [--interval 1.2]`. Changes are spaced by `--interval` (more than the
proxy's min_sync_period, so each one is measured from an idle runner, as a lone change is).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kube_userspace_proxy.cluster.sources.kube import KubeSource  # noqa: E402
from kube_userspace_proxy.cluster.state import ClusterState  # noqa: E402
from kube_userspace_proxy.model import ServicePortName  # noqa: E402

NODE = "bench-node"
WEB = ServicePortName("default", "web", "http")
SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"


def service() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}]},
    }


def web_slice(ip: str, port: int) -> dict[str, Any]:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-a",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": "web"},
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": now},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
    }


@contextlib.asynccontextmanager
async def fake_apiserver(workdir: Path) -> AsyncIterator[tuple[str, str]]:
    """The fake in a child process; yields (server URL, kubeconfig path)."""
    kubeconfig = workdir / "kubeconfig"
    seed = workdir / "seed.yaml"
    seed.write_text(yaml.safe_dump_all([service(), web_slice("127.0.0.1", 1)]))
    process = await asyncio.create_subprocess_exec(
        *[
            sys.executable,
            "-m",
            "tests.fakes.apiserver",
            "--kubeconfig",
            str(kubeconfig),
            "--seed",
            str(seed),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not kubeconfig.exists():
            if time.monotonic() > deadline or process.returncode is not None:
                raise RuntimeError("the fake API server did not start")
            await asyncio.sleep(0.05)
        url = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        yield url, str(kubeconfig)
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 10)


async def put_slice(http: aiohttp.ClientSession, url: str, ip: str, port: int) -> None:
    async with http.put(f"{url}{SLICES}/web-a", json=web_slice(ip, port)) as response:
        response.raise_for_status()


async def measure_state(url: str, kubeconfig: str, changes: int, interval: float) -> list[float]:
    """Seconds from PUT to the ClusterState holding the new endpoint, per change."""
    listed = asyncio.Event()
    wanted: list[Callable[[], None]] = []

    def on_change() -> None:
        if state.listed:
            listed.set()
        for check in wanted:
            check()

    state = ClusterState(node_name=NODE, on_change=on_change)
    source = KubeSource(state, kubeconfig=kubeconfig, node_name=NODE)
    task = asyncio.create_task(source.run())
    samples = []
    try:
        await asyncio.wait_for(listed.wait(), 10)
        async with aiohttp.ClientSession() as http:
            for i in range(changes):
                ip = f"10.244.{i // 250}.{i % 250 + 1}"
                seen = asyncio.get_running_loop().create_future()

                def check(ip: str = ip, seen: asyncio.Future[float] = seen) -> None:
                    endpoints = state.snapshot().endpoints_of(WEB)
                    if not seen.done() and any(e.ip == ip for e in endpoints):
                        seen.set_result(time.perf_counter())

                wanted[:] = [check]
                started = time.perf_counter()
                await put_slice(http, url, ip, 8080)
                samples.append(await asyncio.wait_for(seen, 10) - started)
                await asyncio.sleep(interval)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return samples


async def measure_traffic(
    kubeconfig: str, url: str, changes: int, interval: float, min_sync_period: float
) -> list[float]:
    """Seconds from PUT to a connection through the proxy reaching the new endpoint."""
    from kube_userspace_proxy.config.settings import ProxyConfig
    from tests.loopback.proxyrun import ask, running_proxy, start_named_backends

    backends = await start_named_backends([f"pod-{i}" for i in range(changes + 1)])
    config = ProxyConfig(
        state_dir="",  # a benchmark leaves no state file on the node
        kubeconfig=kubeconfig,
        bind_address="127.0.0.1",
        iptables_backend="none",
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
        hostname_override=NODE,
        min_sync_period=min_sync_period,
        shutdown_grace=1.0,
    )
    samples = []
    async with aiohttp.ClientSession() as http:
        await put_slice(http, url, "127.0.0.1", backends[0][1])
        async with running_proxy(config) as proxy:
            port = 0
            while not port or await ask(port) != backends[0][0]:
                port = proxy.proxier.port_of(WEB)
                await asyncio.sleep(0.01)
            for name, backend_port, _ in backends[1:]:
                await asyncio.sleep(interval)  # let the runner's min_sync_period pass
                started = time.perf_counter()
                await put_slice(http, url, "127.0.0.1", backend_port)
                while await ask(port) != name:
                    pass
                samples.append(time.perf_counter() - started)
    for _, _, server in backends:
        server.close()
    return samples


def summary(label: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[max(0, -(-99 * len(ordered) // 100) - 1)]  # nearest rank
    return (
        f"{label:8} n={len(samples)} all={[round(x * 1000, 1) for x in samples]}\n{'':8} "
        f"n={len(samples)} median={statistics.median(samples) * 1000:.1f} ms "
        f"p99={p99 * 1000:.1f} ms min={ordered[0] * 1000:.1f} ms max={ordered[-1] * 1000:.1f} ms"
    )


async def main(args: argparse.Namespace) -> None:
    machine = f"{platform.node()} {platform.machine()} cpus={os.cpu_count()}"
    print(f"# {machine} python={platform.python_version()}")
    print(f"# {args.changes} EndpointSlice changes, {args.interval}s apart,", end=" ")
    print(f"min_sync_period={args.min_sync_period}s")
    with tempfile.TemporaryDirectory() as tmp:
        async with fake_apiserver(Path(tmp)) as (url, kubeconfig):
            if args.level in {"state", "both"}:
                samples = await measure_state(url, kubeconfig, args.changes, args.interval)
                print(summary("state", samples))
            if args.level in {"traffic", "both"}:
                samples = await measure_traffic(
                    kubeconfig, url, args.changes, args.interval, args.min_sync_period
                )
                print(summary("traffic", samples))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--interval", type=float, default=1.2, help="seconds between changes")
    parser.add_argument("--min-sync-period", type=float, default=1.0, help="proxy's, seconds")
    parser.add_argument("--level", choices=["state", "traffic", "both"], default="both")
    asyncio.run(main(parser.parse_args()))
