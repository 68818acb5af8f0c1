"""How long /debug/state stalls the event loop with many service ports and many ClientIP pins.

Runs the real proxy in this process on loopback (manifests, no iptables) with N service ports
(`--workers 1`: pins 65,536 clients on each of 5 ClientIP Services through the balancer's own
pick path; with more workers the data plane, and its pins, live in the worker processes), then
fetches /debug/state from a child process. Two meters run meanwhile:

- a 1 ms ticker on the proxy's (control) event loop records how late it wakes, and the CPU
  the loop's thread spent between two wake-ups (on a loaded machine lateness also counts the
  time the process waited for a CPU; the CPU figure is the work that held the loop);
- an external prober (another process) connects through one proxy port to a backend it
  serves itself, every 5 ms, and records each round trip: the data plane's view of a
  stall (the control loop with `--workers 1`, the workers' loops otherwise).

Both are started, and warmed up, before the fetcher is told to go, so neither measures the
fork of a child from the large proxy process (~35 ms at 10,000 ports). Side by side, in the
same run and the same loop: /proxyMode (the noise floor), the handler as served, and the
streaming handler as it was before the names were sorted a run at a time (the whole sort of
the 10,000 names in one step before the first entry).

    .venv/bin/python benchmarks/debug_state.py [--ports 10000] [--fetches 5] [--workers 1]
        [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvloop
import yaml
from aiohttp import web

from kube_userspace_proxy import app
from kube_userspace_proxy.balancer import DEFAULT_MAX_AFFINITY_ENTRIES
from kube_userspace_proxy.config.settings import ProxyConfig
from kube_userspace_proxy.model import Path as TrafficPath
from kube_userspace_proxy.model import ServicePortName
from kube_userspace_proxy.ops import server as ops
from kube_userspace_proxy.proxier.debugview import by_name

PINNED = 5
PROBE_EVERY = 0.005
"""Seconds between two probes: a stall over 20 ms is met by at least three of them."""
# Fetches argv[1] argv[2] times, and on until argv[3] seconds have passed (the noise floor's
# fetches are short: it lasts as long as the others).
_FETCH = """
import sys, time, urllib.request
url, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
began = time.perf_counter()
done = 0
while done < count or time.perf_counter() - began < seconds:
    done += 1
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as resp:
        size = len(resp.read())
    print(f"{time.perf_counter() - start:.4f} {size}", flush=True)
    time.sleep(0.05)
"""
# Serves a backend on the inherited listening socket (fd argv[1]) and probes the proxy port
# argv[2] every PROBE_EVERY until stdin closes: connect, read the backend's byte and its EOF.
# (A probe every millisecond was a third busy process on two CPUs: it measured the scheduler.)
_PROBE = """
import json, socket, sys, threading, time
backend = socket.socket(fileno=int(sys.argv[1]))
def serve():
    while True:
        conn, _ = backend.accept()
        conn.sendall(b"x")
        conn.close()
threading.Thread(target=serve, daemon=True).start()
port = int(sys.argv[2])
stopped = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stopped.set()), daemon=True).start()
def probe():
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        while s.recv(64):
            pass
    return time.perf_counter() - start
for _ in range(50):
    probe()
print("ready", flush=True)
times = []
while not stopped.is_set():
    times.append(probe())
    time.sleep(float(sys.argv[3]))
print(json.dumps(times), flush=True)
"""


def manifests(ports: int, probe_port: int) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for i in range(ports):
        name = f"svc-{i}"
        spec: dict[str, Any] = {
            "clusterIP": f"10.96.{i >> 8}.{i & 255}",
            "ports": [{"name": "http", "port": 80}],
        }
        if i < PINNED:
            spec["sessionAffinity"] = "ClientIP"
        # The last Service leads to the prober's own backend; the others to port 9 (discard).
        port = probe_port if i == ports - 1 else 9
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
                "ports": [{"name": "http", "port": port}],
                "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
            }
        )
    return objects


class LoopMeter:
    """A task that wakes every millisecond: how late each wake-up was (wall clock), and how
    much CPU this thread spent between two wake-ups (the work of the callbacks that held the
    loop; unlike lateness, it does not count the time the process waited for a CPU)."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self.cpu: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            before, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.001)
            self.cpu.append(time.thread_time() - cpu)
            self.late.append(time.perf_counter() - before - 0.001)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


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


def summary(seconds: list[float]) -> dict[str, float]:
    """p99 and max, in milliseconds."""
    ordered = sorted(seconds)
    return {
        "p99_ms": ordered[max(0, int(len(ordered) * 0.99) - 1)] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


async def fetch(
    url: str, count: int, probe: tuple[socket.socket, int], seconds: float = 0.0
) -> dict[str, Any]:
    """Fetch `url` `count` times (and for at least `seconds`) from a child process; the
    figures of both meters meanwhile."""
    fetcher = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _FETCH,
        url,
        str(count),
        str(seconds),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    backend, proxy_port = probe
    prober = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _PROBE,
        str(backend.fileno()),
        str(proxy_port),
        str(PROBE_EVERY),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        pass_fds=(backend.fileno(),),
    )
    assert fetcher.stdin and fetcher.stdout and prober.stdin and prober.stdout
    await fetcher.stdout.readline()  # "ready": started; the forks are behind us
    await prober.stdout.readline()
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    meter = LoopMeter()
    meter.start()
    fetcher.stdin.write(b"go\n")
    await fetcher.stdin.drain()
    out, _ = await fetcher.communicate()
    await meter.stop()
    gc.callbacks.remove(pauses)
    prober.stdin.close()
    probed, _ = await prober.communicate()
    rows = [line.split() for line in out.decode().splitlines() if line]
    seconds = [float(r[0]) for r in rows]
    return {
        "loop_lag": summary(meter.late),
        "loop_cpu_per_turn": summary(meter.cpu),
        "probe_round_trip": summary(json.loads(probed)),
        "longest_gc_pass_ms": pauses.longest * 1e3,
        "fetches": len(seconds),
        "fetch_median_ms": sorted(seconds)[len(seconds) // 2] * 1e3,
        "fetch_total_ms": sum(seconds) * 1e3,
        "body_mb": int(rows[-1][1]) / 1e6,
    }


def sorted_at_once(proxy: app.Proxy) -> Iterator[tuple[str, dict[str, Any]]]:
    """The entries in the order of one whole sort done before the first one (as before)."""
    proxier = proxy.proxier
    return proxier.debug_entries(sorted(proxier.debug_names(), key=by_name))


def before_handler(proxy: app.Proxy) -> web.Application:
    """The streaming handler as it was: the 10,000 names sorted in one step, then streamed."""

    async def state(request: web.Request) -> web.StreamResponse:
        await proxy.collect(debug=True)
        return await ops.stream_state(request, sorted_at_once(proxy))

    application = web.Application()
    application.router.add_get("/debug/state", state)
    return application


async def main(ports: int, fetches: int, workers: int) -> dict[str, Any]:
    backend = socket.socket()
    backend.bind(("127.0.0.1", 0))
    backend.listen(128)
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "services.yaml"
        manifest.write_text(yaml.safe_dump_all(manifests(ports, backend.getsockname()[1])))
        config = ProxyConfig(
            state_dir="",  # a benchmark leaves no state file on the node
            bind_address="127.0.0.1",
            manifests=(str(manifest),),
            iptables_backend="none",
            healthz_bind_address="",
            metrics_bind_address="127.0.0.1:0",
            hostname_override="bench",
            workers=str(workers),
        )
        stop = asyncio.Event()
        ready: asyncio.Future[app.Proxy] = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(app.serve(config, stop=stop, started=ready.set_result))
        proxy = await ready
        await asyncio.wait_for(proxy.synced_once.wait(), 600)
        last = ServicePortName("default", f"svc-{ports - 1}", "http")
        for _ in range(1200):  # at most 10 minutes
            if len(proxy.proxier.debug_names()) >= ports and last in proxy.proxier._served:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.0)  # the workers take the table
        if workers == 1:
            for i in range(PINNED):
                served = proxy.proxier._served[ServicePortName("default", f"svc-{i}", "http")]
                pool = served.pools[TrafficPath.CLUSTER]
                for n in range(DEFAULT_MAX_AFFINITY_ENTRIES):
                    pool.pick(f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}")
        proxy_port = proxy.proxier._served[last].listeners[TrafficPath.CLUSTER].port
        assert proxy.ops is not None and proxy.ops.metrics_port is not None
        base = f"http://127.0.0.1:{proxy.ops.metrics_port}"
        runner = web.AppRunner(before_handler(proxy))
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        old = f"http://127.0.0.1:{sock.getsockname()[1]}"
        setting = (
            f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()};"
            f" {ports} service ports, --workers {workers}"
            + (
                f", {PINNED} of them with {DEFAULT_MAX_AFFINITY_ENTRIES} ClientIP pins"
                if workers == 1
                else ""
            )
            + f"; {fetches} fetches each; load average {os.getloadavg()[0]:.2f} at the start"
        )
        print(setting)
        results: dict[str, Any] = {"setting": setting, "rows": {}}
        served_for = 0.0
        for label, url in (
            ("GET /debug/state as served", f"{base}/debug/state"),
            ("before: names sorted in one step", f"{old}/debug/state"),
            ("noise floor: GET /proxyMode", f"{base}/proxyMode"),
        ):
            # The noise floor's fetches are short: it lasts as long as the first row.
            seconds = served_for if "proxyMode" in url else 0.0
            row = await fetch(url, fetches, (backend, proxy_port), seconds=seconds)
            served_for = served_for or row["fetch_total_ms"] / 1e3
            results["rows"][label] = row
            lag, cpu, probe = row["loop_lag"], row["loop_cpu_per_turn"], row["probe_round_trip"]
            print(
                f"  {label:34s} loop lag p99 {lag['p99_ms']:5.2f} ms, max {lag['max_ms']:6.2f} ms"
                f" | CPU per turn p99 {cpu['p99_ms']:5.2f} ms, max {cpu['max_ms']:6.2f} ms"
                f" | probe p99 {probe['p99_ms']:5.2f} ms, max {probe['max_ms']:6.2f} ms"
                f" | GC pass max {row['longest_gc_pass_ms']:4.1f} ms"
                f" | {row['fetches']} fetches {row['fetch_total_ms']:7.1f} ms in all,"
                f" {row['body_mb']:5.2f} MB"
            )
        results["load_average_at_end"] = os.getloadavg()[0]
        print(f"  load average {results['load_average_at_end']:.2f} at the end")
        await runner.cleanup()
        stop.set()
        await serving
    backend.close()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", type=int, default=10000)
    parser.add_argument("--fetches", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write a JSON file of the figures")
    args = parser.parse_args()
    started = time.perf_counter()
    figures = uvloop.run(main(args.ports, args.fetches, args.workers))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"debug-state-workers{args.workers}.json"
        path.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"  -> {path}")
    print(f"(run took {time.perf_counter() - started:.0f} s)")
