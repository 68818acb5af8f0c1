"""Data-plane throughput and connection rate through TcpListener vs direct, on 127.0.0.1.

One run, its own backends, bounded in bytes, rounds and seconds. Three processes: this one (the
clients), a backend process, and a proxy process per mode (splice on, splice off). Reports:

  (a) bulk: `--bytes` (default 1 GiB) sent client -> backend, direct and through the proxy;
      throughput, ratio to direct, and the proxy's CPU seconds per GiB (from /proc).
  (b) connections per second: each connection connects, sends a 16-byte request, reads the
      reply, closes; `--concurrency` clients for `--seconds`; rate and ratio to direct, and the
      proxy's CPU microseconds per connection.

Each figure is the median of `--rounds` interleaved rounds.

    .venv/bin/python benchmarks/loopback.py [--bytes 1073741824] [--seconds 2] [--rounds 3]
        [--concurrency 32] [--loop uvloop|asyncio] [--modes splice,copy] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import uvloop

from kube_userspace_proxy.dataplane import ConnStats, TcpListener

REQUEST = b"GET /small 16 B\n"
REPLY = b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"
CHUNK = 4 << 20
GiB = 1 << 30
MAX_CONNECTIONS = 200_000  # per path, on top of the time bound


def _run(main: Any, loop_kind: str) -> None:
    if loop_kind == "uvloop":
        uvloop.run(main)
    else:
        asyncio.run(main)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- backend process


def _sink(conn: socket.socket) -> None:
    buf = bytearray(1 << 20)
    total = 0
    with conn:
        while n := conn.recv_into(buf):
            total += n
        conn.sendall(total.to_bytes(8, "big"))


def _sink_server(sock: socket.socket) -> None:
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=_sink, args=(conn,), daemon=True).start()


class _Reply(asyncio.Protocol):
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(REPLY)
        self.transport.close()


def backend_main(conn: Connection, loop_kind: str) -> None:
    """Sink (blocking threads, C-speed recv_into) and request/reply (uvloop Protocol)."""
    sink = socket.create_server(("127.0.0.1", 0), backlog=4096)
    threading.Thread(target=_sink_server, args=(sink,), daemon=True).start()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Reply, "127.0.0.1", 0, backlog=4096)
        conn.send({"sink": sink.getsockname()[:2], "rr": server.sockets[0].getsockname()[:2]})
        with contextlib.suppress(EOFError):  # the parent went away
            await loop.run_in_executor(None, conn.recv)

    _run(main(), loop_kind)


# --- proxy process


class _Fixed:
    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.addresses = (address,)

    def pick(self, client_ip: str, *, retry: bool = False) -> tuple[str, int] | None:
        return self.address

    def dial_failed(self, address: tuple[str, int]) -> None:
        pass

    def __bool__(self) -> bool:
        return True


def proxy_main(
    conn: Connection, backends: dict[str, tuple[str, int]], splice: bool, loop_kind: str
) -> None:
    """One TcpListener per backend; sends back {name: proxy port}; runs until told to stop."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        listeners = {}
        for name, address in backends.items():
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            listener = TcpListener(sock, _Fixed(address), ConnStats(), splice=splice)
            await listener.start()
            listeners[name] = listener
        conn.send({name: lst.port for name, lst in listeners.items()})
        with contextlib.suppress(EOFError, BrokenPipeError):  # EOF: the parent went away
            await loop.run_in_executor(None, conn.recv)
            conn.send({name: lst.stats.spliced for name, lst in listeners.items()})

    _run(main(), loop_kind)


# --- reference: HAProxy in TCP mode, one thread (like our one event loop)

HAPROXY_CONFIG = """global
    maxconn 8000
    nbthread 1
defaults
    mode tcp
    timeout connect 2s
    timeout client 60s
    timeout server 60s
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_haproxy(
    backends: dict[str, tuple[str, int]], tmp: str
) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """HAProxy forwarding a free port to each backend; waits until it accepts."""
    ports = {name: _free_port() for name in backends}
    config = HAPROXY_CONFIG
    for name, (host, port) in backends.items():
        config += (
            f"listen {name}\n    bind 127.0.0.1:{ports[name]}\n    server {name} {host}:{port}\n"
        )
    path = os.path.join(tmp, "haproxy.cfg")
    with open(path, "w") as f:
        f.write(config)
    proc = subprocess.Popen(["haproxy", "-db", "-q", "-f", path], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    for port in ports.values():
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    proc.kill()
                    raise RuntimeError("haproxy did not start") from None
                time.sleep(0.05)
    return proc, ports


# --- clients


def bulk(port: int, size: int) -> float:
    """Send `size` bytes and wait for the sink's byte count; returns seconds."""
    payload = memoryview(os.urandom(CHUNK))
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        left = size
        while left > 0:
            n = min(left, CHUNK)
            sock.sendall(payload[:n])
            left -= n
        sock.shutdown(socket.SHUT_WR)
        got = int.from_bytes(sock.recv(8), "big")
    elapsed = time.perf_counter() - started
    if got != size:
        raise RuntimeError(f"sink received {got} bytes of {size}")
    return elapsed


class _Ask(asyncio.Protocol):
    def __init__(self, done: asyncio.Future[int]) -> None:
        self.done = done
        self.size = 0

    def connection_made(self, transport: Any) -> None:
        transport.write(REQUEST)

    def data_received(self, data: bytes) -> None:
        self.size += len(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(self.size)


async def _cps(port: int, seconds: float, concurrency: int) -> tuple[int, float, int]:
    loop = asyncio.get_running_loop()
    done = 0
    errors = 0
    deadline = loop.time() + seconds

    async def worker() -> None:
        nonlocal done, errors
        while loop.time() < deadline and done < MAX_CONNECTIONS:
            fut: asyncio.Future[int] = loop.create_future()
            try:
                await loop.create_connection(lambda: _Ask(fut), "127.0.0.1", port)  # noqa: B023
                size = await fut
            except OSError:
                errors += 1
                continue
            if size == len(REPLY):
                done += 1
            else:
                errors += 1

    started = loop.time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, loop.time() - started, errors


def cps(port: int, seconds: float, concurrency: int, loop_kind: str) -> tuple[float, int, int]:
    """Connections per second (connect, request, reply, close): (rate, count, errors)."""
    result: list[tuple[int, float, int]] = []

    async def main() -> None:
        result.append(await _cps(port, seconds, concurrency))

    _run(main(), loop_kind)
    done, elapsed, errors = result[0]
    return done / elapsed, done, errors


# --- the run


def start(target: Any, *args: Any) -> tuple[mp.process.BaseProcess, Connection, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    if not parent.poll(30):
        proc.kill()
        raise RuntimeError(f"{target.__name__} did not start")
    return proc, parent, parent.recv()


def stop(proc: mp.process.BaseProcess, conn: Connection) -> Any:
    reply = None
    with contextlib.suppress(OSError, EOFError):
        conn.send("stop")
        if conn.poll(10):
            reply = conn.recv()
    proc.join(10)
    if proc.is_alive():
        proc.kill()  # our own child, by its handle
        proc.join()
    return reply


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=GiB, help="bulk size (default 1 GiB)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per cps run (default 2)")
    parser.add_argument("--concurrency", type=int, default=32, help="cps clients (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument(
        "--modes",
        default="splice,copy,haproxy",
        help="paths besides direct: splice, copy (our proxy), haproxy (reference, if installed)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]

    tmp = tempfile.mkdtemp(prefix="kup-bench-")
    backend, backend_conn, addresses = start(backend_main, args.loop)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "loop": args.loop,
            "uvloop": uvloop.__version__,
            "loadavg_before": os.getloadavg()[0],
        },
        "bytes": args.bytes,
        "seconds": args.seconds,
        "concurrency": args.concurrency,
        "paths": {},
    }
    proxies: dict[str, tuple[mp.process.BaseProcess, Connection]] = {}
    haproxy: subprocess.Popen[bytes] | None = None
    try:
        paths: dict[str, dict[str, int]] = {"direct": {k: v[1] for k, v in addresses.items()}}
        pids: dict[str, int | None] = {"direct": None}
        for mode in modes:
            if mode == "haproxy":
                if shutil.which("haproxy") is None:
                    print("haproxy not found: skipping that path", file=sys.stderr)
                    continue
                haproxy, ports = start_haproxy(addresses, tmp)
                paths["haproxy"], pids["haproxy"] = ports, haproxy.pid
                continue
            proc, conn, ports = start(proxy_main, addresses, mode == "splice", args.loop)
            proxies[mode] = (proc, conn)
            paths[f"proxy-{mode}"], pids[f"proxy-{mode}"] = ports, proc.pid
        samples: dict[str, dict[str, list[float]]] = {name: {} for name in paths}
        # Rounds interleave the paths so that load from elsewhere on the machine hits all alike.
        for _ in range(args.rounds):
            for name, ports in paths.items():
                pid = pids[name]
                got = samples[name]
                cpu0 = cpu_seconds(pid) if pid else 0.0
                secs = bulk(ports["sink"], args.bytes)
                got.setdefault("bulk_gbit_s", []).append(args.bytes * 8 / secs / 1e9)
                if pid:
                    cpu = cpu_seconds(pid) - cpu0
                    got.setdefault("proxy_cpu_s_per_gib", []).append(cpu / (args.bytes / GiB))
                    cpu0 = cpu_seconds(pid)
                rate, count, errors = cps(ports["rr"], args.seconds, args.concurrency, args.loop)
                got.setdefault("cps", []).append(rate)
                got.setdefault("errors", []).append(errors)
                if pid and count:
                    cpu = cpu_seconds(pid) - cpu0
                    got.setdefault("proxy_cpu_us_per_conn", []).append(cpu / count * 1e6)
        for name, got in samples.items():
            entry: dict[str, Any] = {k: statistics.median(v) for k, v in got.items()}
            entry["errors"] = sum(got["errors"])
            entry["samples"] = got
            results["paths"][name] = entry
    finally:
        for mode, (proc, conn) in proxies.items():
            spliced = stop(proc, conn)
            if f"proxy-{mode}" in results["paths"]:
                results["paths"][f"proxy-{mode}"]["spliced_directions"] = spliced
        if haproxy is not None:
            haproxy.terminate()  # our own child, by its handle
            try:
                haproxy.wait(10)
            except subprocess.TimeoutExpired:
                haproxy.kill()
                haproxy.wait()
        stop(backend, backend_conn)

    shutil.rmtree(tmp, ignore_errors=True)
    results["machine"]["loadavg_after"] = os.getloadavg()[0]
    direct = results["paths"]["direct"]
    for entry in results["paths"].values():
        entry["bulk_ratio"] = entry["bulk_gbit_s"] / direct["bulk_gbit_s"]
        entry["cps_ratio"] = entry["cps"] / direct["cps"] if direct["cps"] else 0.0
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
        return 0
    m = results["machine"]
    print(
        f"{m['cpus']} CPUs, Linux {m['kernel']}, Python {m['python']}, loop {m['loop']}"
        f" (uvloop {m['uvloop']}); bulk {args.bytes / GiB:g} GiB;"
        f" cps {args.concurrency} clients x {args.seconds:g} s; medians of {args.rounds} rounds;"
        f" load average {m['loadavg_before']:.1f} -> {m['loadavg_after']:.1f}"
    )
    print(
        f"{'path':<14} {'bulk Gbit/s':>11} {'ratio':>6} {'proxy CPU s/GiB':>16}"
        f" {'conn/s':>8} {'ratio':>6} {'proxy CPU us/conn':>18} {'errors':>6}"
    )
    for name, e in results["paths"].items():
        cpu_gib = f"{e['proxy_cpu_s_per_gib']:.2f}" if "proxy_cpu_s_per_gib" in e else "-"
        cpu_conn = f"{e['proxy_cpu_us_per_conn']:.0f}" if "proxy_cpu_us_per_conn" in e else "-"
        print(
            f"{name:<14} {e['bulk_gbit_s']:>11.2f} {e['bulk_ratio']:>6.2f} {cpu_gib:>16}"
            f" {e['cps']:>8.0f} {e['cps_ratio']:>6.2f} {cpu_conn:>18} {e['errors']:>6}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
