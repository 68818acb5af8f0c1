"""Scrape time of /metrics with many service ports, and how long a scrape stalls the event loop.

Starts the real ops sites on 127.0.0.1:0 with N service ports (90% TCP, 10% UDP) whose
ConnStats hold non-zero counters, scrapes /metrics over HTTP a fixed number of times, and
prints: the HTTP scrape time (the scraper is a child process), the on-loop capture time, the
render (formatting) time, the body size, and how late a 1 ms ticker on the server's event loop
woke up while scraping: against /proxyMode (the noise floor), /metrics as served, and a handler
that renders on the loop.

    .venv/bin/python benchmarks/metrics_scrape.py [--ports 1000] [--scrapes 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import time
import urllib.request
from typing import Any

from aiohttp import web

from kube_userspace_proxy.dataplane import ConnStats
from kube_userspace_proxy.health import ProxyHealth
from kube_userspace_proxy.metrics import ProxyMetrics
from kube_userspace_proxy.model import Protocol, ServicePortName
from kube_userspace_proxy.ops import start_ops


def make_stats(count: int) -> list[tuple[ServicePortName, ConnStats]]:
    rng = random.Random(1)
    rows = []
    for i in range(count):
        udp = i % 10 == 9
        name = ServicePortName(
            f"ns-{i % 50}",
            f"svc-{i}",
            "dns" if udp else "http",
            Protocol.UDP if udp else Protocol.TCP,
        )
        s = ConnStats()
        if udp:
            s.udp_sessions_total = rng.randrange(10**6)
            s.udp_datagrams_in = rng.randrange(10**9)
            s.udp_datagrams_out = rng.randrange(10**9)
        else:
            s.accepted = rng.randrange(10**7)
            s.completed = s.accepted - rng.randrange(100)
            s.active = rng.randrange(100)
        s.bytes_in = rng.randrange(10**12)
        s.bytes_out = rng.randrange(10**12)
        rows.append((name, s))
    return rows


class StallMeter:
    """A task that wakes every millisecond and records how late each wake-up was."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            self.late.append(time.perf_counter() - before - 0.001)

    def start(self) -> None:
        self.late = []
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> str:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        late = sorted(self.late)
        p99 = late[int(len(late) * 0.99) - 1]
        return f"p99 {p99 * 1e3:5.2f} ms, max {late[-1] * 1e3:5.2f} ms"


def ms(values: list[float]) -> str:
    values = sorted(values)
    p95 = values[int(len(values) * 0.95) - 1]
    return f"median {statistics.median(values) * 1e3:6.2f} ms  p95 {p95 * 1e3:6.2f} ms"


async def scrape_from_another_process(url: str, scrapes: int) -> tuple[dict[str, Any], str]:
    """Run the scraper as a child process; measure this loop's stalls while it scrapes."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--client",
        url,
        "--scrapes",
        str(scrapes),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    await proc.stdout.readline()  # "ready": the child has started and warmed up
    meter = StallMeter()
    meter.start()
    proc.stdin.write(b"go\n")
    await proc.stdin.drain()
    out = await proc.stdout.readline()
    stalls = await meter.stop()
    await proc.wait()
    return json.loads(out), stalls


async def main(ports: int, scrapes: int) -> None:
    stats = make_stats(ports)
    metrics = ProxyMetrics(lambda: stats, lambda: len(stats))
    server = await start_ops(
        healthz_bind="",
        metrics_bind="127.0.0.1:0",
        health=ProxyHealth(30.0),
        metrics=metrics,
        debug_state=dict,
        configz=dict,
    )
    try:
        base = f"http://127.0.0.1:{server.metrics_port}"
        _, stalls_floor = await scrape_from_another_process(base + "/proxyMode", scrapes)
        result, stalls_served = await scrape_from_another_process(base + "/metrics", scrapes)
    finally:
        await server.close()

    # The same scrapes against a handler that formats on the loop, for comparison.
    async def on_loop(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(metrics.capture()))

    app = web.Application()
    app.router.add_get("/metrics", on_loop)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        _, stalls_on_loop = await scrape_from_another_process(
            f"http://127.0.0.1:{port}/metrics", scrapes
        )
    finally:
        await runner.cleanup()

    capture_times, base_times, ports_times, chunk_times = [], [], [], []
    for _ in range(scrapes):
        start = time.perf_counter()
        captured = metrics.capture()
        capture_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        metrics.render_base()
        base_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        chunk_start = start
        for _chunk in metrics.render_ports(captured):
            now = time.perf_counter()
            chunk_times.append(now - chunk_start)
            chunk_start = now
        ports_times.append(time.perf_counter() - start)

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"service ports: {ports} ({ports // 10} UDP), scrapes: {scrapes}, "
        f"body {result['size'] / 1024:.0f} KiB, {result['samples']} samples"
    )
    print(f"HTTP GET /metrics (client in another process)  {ms(result['times'])}")
    print(f"  capture counters (on the loop)               {ms(capture_times)}")
    print(f"  kube-proxy + process metrics (worker thread) {ms(base_times)}")
    print(f"  per-port text, all families (on the loop)    {ms(ports_times)}")
    print(f"  per-port text, one family chunk              {ms(chunk_times)}")
    print("event-loop lateness while scraping (1 ms ticker):")
    print(f"  noise floor (GET /proxyMode, same loop)      {stalls_floor}")
    print(f"  /metrics as served                           {stalls_served}")
    print(f"  a handler rendering all at once on the loop  {stalls_on_loop}")


def client(url: str, scrapes: int) -> None:
    """Scrape `url` with plain blocking HTTP; print the timings as JSON."""
    times = []
    body = b""
    urllib.request.urlopen(url).read()  # warm up
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(scrapes):
        start = time.perf_counter()
        with urllib.request.urlopen(url) as resp:
            body = resp.read()
        times.append(time.perf_counter() - start)
        time.sleep(0.02)  # let the server's ticker see quiet time between scrapes
    samples = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    print(json.dumps({"times": times, "size": len(body), "samples": samples}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ports", type=int, default=1000, help="service ports (default 1000)")
    parser.add_argument("--scrapes", type=int, default=50, help="scrapes to time (default 50)")
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client(args.client, args.scrapes)
        sys.exit(0)
    try:
        import uvloop

        uvloop.run(main(args.ports, args.scrapes))
    except ImportError:
        asyncio.run(main(args.ports, args.scrapes))
