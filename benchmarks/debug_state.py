"""How long /debug/state stalls the event loop with many service ports and many ClientIP pins.

Runs the real proxy in this process on loopback (manifests, no iptables, --workers 1) with N
service ports, pins 65,536 clients on each of 5 ClientIP Services through the balancer's own
pick path, then fetches /debug/state from a child process while a 1 ms ticker on the proxy's
event loop records how late it wakes. Side by side, in the same run and the same loop:
/proxyMode (the noise floor) and the previous handler (the whole table built and encoded in
one go on the loop, pins listed in full).

    .venv/bin/python benchmarks/debug_state.py [--ports 10000] [--fetches 5]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
import yaml
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from metrics_scrape import StallMeter

from kube_userspace_proxy import app
from kube_userspace_proxy.balancer import DEFAULT_MAX_AFFINITY_ENTRIES
from kube_userspace_proxy.config import ProxyConfig
from kube_userspace_proxy.model import Path as TrafficPath
from kube_userspace_proxy.model import ServicePortName

PINNED = 5
_FETCH = """
import sys, time, urllib.request
url, count = sys.argv[1], int(sys.argv[2])
sizes = []
for _ in range(count):
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as resp:
        sizes.append(len(resp.read()))
    print(f"{time.perf_counter() - start:.4f} {sizes[-1]}", flush=True)
    time.sleep(0.05)
"""


def manifests(ports: int) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for i in range(ports):
        name = f"svc-{i}"
        spec: dict[str, Any] = {
            "clusterIP": f"10.96.{i >> 8}.{i & 255}",
            "ports": [{"name": "http", "port": 80}],
        }
        if i < PINNED:
            spec["sessionAffinity"] = "ClientIP"
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": "default"},
                "spec": spec,
            }
        )
        objects.append(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{name}-a",
                    "namespace": "default",
                    "labels": {"kubernetes.io/service-name": name},
                },
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 9}],
                "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
            }
        )
    return objects


class GcPauses:
    """The longest garbage-collector pass (any generation) while it is installed."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.longest = max(self.longest, time.perf_counter() - self._began)


async def fetch(url: str, count: int, meter: StallMeter) -> tuple[str, list[str]]:
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    meter.start()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FETCH, url, str(count), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await child.communicate()
    gc.callbacks.remove(pauses)
    stalls = await meter.stop()
    return f"{stalls} (longest GC pass {pauses.longest * 1e3:5.1f} ms)", out.decode().split("\n")


def previous_handler(proxy: app.Proxy) -> web.Application:
    """What /debug/state did before: everything in one dict, pins in full, one json.dumps."""
    pretty = functools.partial(json.dumps, indent=2, sort_keys=True, default=str)

    async def state(_: web.Request) -> web.Response:
        out = {}
        for name, entry in proxy.proxier.debug_items():
            served = proxy.proxier._served.get(ServicePortName("default", name[8:-5], "http"))
            if served is not None:
                pool = served.pools[TrafficPath.CLUSTER]
                entry["affinity"] = [
                    {"clientIP": c, "endpoint": f"{ep[0]}:{ep[1]}", "expiresIn": round(left, 1)}
                    for c, ep, left in pool.affinity_entries()
                ]
            out[name] = entry
        return web.json_response(out, dumps=pretty)

    application = web.Application()
    application.router.add_get("/debug/state", state)
    return application


async def main(ports: int, fetches: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "services.yaml"
        manifest.write_text(yaml.safe_dump_all(manifests(ports)))
        config = ProxyConfig(
            state_dir="",  # a benchmark leaves no state file on the node
            bind_address="127.0.0.1",
            manifests=(str(manifest),),
            iptables_backend="none",
            healthz_bind_address="",
            metrics_bind_address="127.0.0.1:0",
            hostname_override="bench",
            workers="1",
        )
        stop = asyncio.Event()
        ready: asyncio.Future[app.Proxy] = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(app.serve(config, stop=stop, started=ready.set_result))
        proxy = await ready
        await asyncio.wait_for(proxy.synced_once.wait(), 600)
        for _ in range(1200):  # at most 10 minutes
            if len(proxy.proxier.debug_state()) >= ports:
                break
            await asyncio.sleep(0.5)
        for i in range(PINNED):
            served = proxy.proxier._served[ServicePortName("default", f"svc-{i}", "http")]
            pool = served.pools[TrafficPath.CLUSTER]
            for n in range(DEFAULT_MAX_AFFINITY_ENTRIES):
                pool.pick(f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}")
        assert proxy.ops is not None and proxy.ops.metrics_port is not None
        base = f"http://127.0.0.1:{proxy.ops.metrics_port}"
        runner = web.AppRunner(previous_handler(proxy))
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        old = f"http://127.0.0.1:{sock.getsockname()[1]}"
        meter = StallMeter()
        print(
            f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()};"
            f" {ports} service ports, {PINNED} of them with {DEFAULT_MAX_AFFINITY_ENTRIES}"
            f" ClientIP pins; {fetches} fetches each; 1 ms ticker on the proxy's loop"
        )
        for label, url in (
            ("noise floor: GET /proxyMode", f"{base}/proxyMode"),
            ("GET /debug/state as served", f"{base}/debug/state"),
            ("previous handler (one dict, full pins)", f"{old}/debug/state"),
        ):
            stalls, lines = await fetch(url, fetches, meter)
            rows = [line.split() for line in lines if line]
            seconds = sorted(float(r[0]) for r in rows)
            size = int(rows[-1][1])
            print(
                f"  {label:40s} lateness {stalls}; fetch median"
                f" {seconds[len(seconds) // 2] * 1e3:7.1f} ms; body {size / 1e6:6.2f} MB"
            )
        await runner.cleanup()
        stop.set()
        await serving


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", type=int, default=10000)
    parser.add_argument("--fetches", type=int, default=5)
    args = parser.parse_args()
    started = time.perf_counter()
    uvloop.run(main(args.ports, args.fetches))
    print(f"(run took {time.perf_counter() - started:.0f} s)")
