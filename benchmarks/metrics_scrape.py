"""Scrape time of /metrics with many service ports, and how long a scrape stalls the event loop.

Starts the real ops sites on 127.0.0.1:0 with N service ports (90% TCP, 10% UDP) whose
ConnStats hold non-zero counters, scrapes /metrics over HTTP a fixed number of times, and
prints: the HTTP scrape time (the scraper is a child process), the on-loop capture time, the
render (formatting) time, the body size, and how late a 1 ms ticker on the server's event loop
woke up while scraping: against /proxyMode (the noise floor), /metrics as served, and a handler
that renders on the loop.

    .venv/bin/python benchmarks/metrics_scrape.py [--ports 1000] [--scrapes 50]
    .venv/bin/python benchmarks/metrics_scrape.py --connections 5   # connections/s, scraped or not
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import socket
import statistics
import sys
import time
import urllib.request
from typing import Any

import uvloop
from aiohttp import web

from kube_userspace_proxy.dataplane import ConnStats, TcpListener
from kube_userspace_proxy.model import Protocol, ServicePortName
from kube_userspace_proxy.ops.health import ProxyHealth
from kube_userspace_proxy.ops.metrics import ProxyMetrics
from kube_userspace_proxy.ops.server import start_ops


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


# -- per-connection cost: connections/s through a real TcpListener, scraped or not -----------


class OneBackend:
    """The smallest Picker: always the same backend."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.addresses = (address,)

    def pick(self, client_ip: str, *, retry: bool = False) -> tuple[str, int] | None:
        return self.address

    def dial_failed(self, address: tuple[str, int], outcome: int = 1) -> None:
        pass

    def dial_succeeded(self, address: tuple[str, int]) -> None:
        pass

    def __bool__(self) -> bool:
        return True


async def child(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def connection_cost(ports: int, seconds: float, concurrency: int, rounds: int) -> None:
    """Connections/s (connect, 1 byte each way, close) without and with a 1 s /metrics scrape."""
    backend = await child("--role-backend")
    assert backend.stdout is not None and backend.stdin is not None
    backend_port = int(await backend.stdout.readline())
    stats = make_stats(ports)
    proxied = ConnStats()
    stats.append((ServicePortName("default", "bench", "tcp"), proxied))
    metrics = ProxyMetrics(lambda: stats, lambda: len(stats))
    server = await start_ops(
        healthz_bind="",
        metrics_bind="127.0.0.1:0",
        health=ProxyHealth(30.0),
        metrics=metrics,
        debug_state=dict,
        configz=dict,
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    listener = TcpListener(sock, OneBackend(("127.0.0.1", backend_port)), proxied)
    await listener.start()
    target = f"127.0.0.1:{sock.getsockname()[1]}"
    metrics_url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    results: dict[str, list[float]] = {"no scraping": [], "scraped every 1 s": []}
    try:
        for _ in range(rounds):
            for mode, rates in results.items():
                scraper = None
                if mode != "no scraping":
                    scraper = await child("--role-scraper", metrics_url, str(seconds))
                load = await child("--role-load", target, str(seconds), str(concurrency))
                out, _ = await load.communicate()
                if scraper is not None:
                    await scraper.communicate()
                rates.append(int(out) / seconds)
    finally:
        await listener.close()
        await server.close()
        backend.stdin.close()
        await backend.wait()
    print(
        f"connections/s through one TcpListener ({concurrency} concurrent clients, "
        f"{seconds:g} s per run, {rounds} runs each, {ports} other service ports in metrics, "
        f"load average {os.getloadavg()[0]:.2f}):"
    )
    for mode, rates in results.items():
        print(
            f"  {mode:18} "
            + "  ".join(f"{r:7.0f}" for r in rates)
            + f"   median {statistics.median(rates):7.0f}"
        )
    print(f"  counted by the listener: {proxied.accepted} accepted, {proxied.completed} completed")


def role_backend() -> None:
    """Accept, answer one byte per byte read, close at EOF; stop when stdin closes."""

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(data)  # type: ignore[attr-defined]

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Echo, "127.0.0.1", 0, backlog=4096)
        print(server.sockets[0].getsockname()[1], flush=True)
        await loop.run_in_executor(None, sys.stdin.read)
        server.close()

    uvloop.run(serve())


def role_load(target: str, seconds: float, concurrency: int) -> None:
    """Open connections for `seconds` (connect, send 1 byte, read it back, close); print count."""
    host, port = target.rsplit(":", 1)
    done = 0

    async def worker(deadline: float) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"x")
            await reader.readexactly(1)
            writer.close()
            await writer.wait_closed()
            done += 1

    async def run() -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(worker(deadline) for _ in range(concurrency)))

    uvloop.run(run())
    print(done)


def role_scraper(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        urllib.request.urlopen(url).read()
        time.sleep(1.0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ports", type=int, default=1000, help="service ports (default 1000)")
    parser.add_argument("--scrapes", type=int, default=50, help="scrapes to time (default 50)")
    parser.add_argument(
        "--connections",
        type=float,
        metavar="SECONDS",
        help="instead: measure connections/s through a TcpListener, with and without a 1 s "
        "scrape, SECONDS per run (default: off)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs per mode (default 2)")
    parser.add_argument("--concurrency", type=int, default=32, help="clients (default 32)")
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--role-backend", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--role-load", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--role-scraper", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client(args.client, args.scrapes)
    elif args.role_backend:
        role_backend()
    elif args.role_load:
        role_load(args.role_load[0], float(args.role_load[1]), int(args.role_load[2]))
    elif args.role_scraper:
        role_scraper(args.role_scraper[0], float(args.role_scraper[1]))
    elif args.connections:
        uvloop.run(connection_cost(args.ports, args.connections, args.concurrency, args.rounds))
    else:
        uvloop.run(main(args.ports, args.scrapes))
