"""Data-plane throughput and connection rate through TcpListener vs direct, on 127.0.0.1.

One run, its own backends, bounded in bytes, rounds and seconds. Processes: this one (the
clients), a backend process, and a proxy process per mode (native: the native data plane,
its core nested in the event loop of `--loop`; native-loop: the native data plane on the loop
that waits in its core, as `--event-loop auto` runs it; splice: the Python data plane; copy:
the Python data plane without splice; haproxy: HAProxy `nbthread 1`, the reference; with
`--baseline SRC` every mode again from another checkout's `src`, e.g. today's main, so
before and after are measured side by side; the native ones only if that checkout has the
extension built). Reports:

  (a) bulk: `--bytes` (default 1 GiB; 0 skips it) sent client -> backend, direct and through
      the proxy; throughput, ratio to direct, and the proxy's CPU seconds per GiB (from /proc).
  (b) connections per second: each connection connects, sends a 16-byte request, reads the
      reply, closes; `--concurrency` clients for `--seconds`; rate and ratio to direct, and the
      proxy's CPU microseconds per connection.
  (c) keep-alive requests per second: `--concurrency` connections each sending a 16-byte
      request and waiting for its reply, again and again, for `--seconds`; rate, ratio to
      direct, and the proxy's CPU microseconds per request.

Each figure is the median of `--rounds` interleaved rounds; `sys` is the share of the proxy's
CPU time spent in the kernel. `--syscalls`: after the rounds, one more connection run and one
more keep-alive run per path with `strace -c -f` attached to the proxy process: system calls
per proxied connection and per keep-alive request, by name (strace slows the proxy; the counts
per unit of work are what it gives, not rates). `--profile DIR` records each proxy process
with py-spy (the `bench` extra) over the whole run, as collapsed stacks (DIR/PATH.txt, for
flamegraph.pl or speedscope).

    .venv/bin/python benchmarks/loopback.py [--bytes 1073741824] [--seconds 2] [--rounds 3]
        [--concurrency 32] [--loop uvloop|asyncio]
        [--modes native,native-loop,splice,copy,haproxy]
        [--baseline /tmp/base/src] [--profile DIR] [--syscalls] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import operator
import os
import platform
import re
import shutil
import signal
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

REQUEST = b"GET /small 16 B\n"
REPLY = b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"
CHUNK = 4 << 20
GiB = 1 << 30
MAX_CONNECTIONS = 200_000  # per path, on top of the time bound
MAX_REQUESTS = 1_000_000  # per keep-alive connection, on top of the time bound


def _run(main: Any, loop_kind: str) -> None:
    if loop_kind == "uvloop":
        uvloop.run(main)
    elif loop_kind == "native":  # the native core's wait is the loop's (--event-loop native)
        from kube_userspace_proxy.dataplane import coreloop

        with asyncio.Runner(loop_factory=coreloop.new_event_loop) as runner:
            runner.run(main)
    else:
        asyncio.run(main)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/PID/stat."""
    user, system = cpu_split(pid)
    return user + system


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


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


class _KeepAlive(asyncio.Protocol):
    """One reply per request, connection kept open (requests are sent one at a time)."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(REPLY * (len(data) // len(REQUEST)))


def backend_main(conn: Connection, loop_kind: str) -> None:
    """Sink (blocking threads, C-speed recv_into) and request/reply (uvloop Protocol)."""
    sink = socket.create_server(("127.0.0.1", 0), backlog=4096)
    threading.Thread(target=_sink_server, args=(sink,), daemon=True).start()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Reply, "127.0.0.1", 0, backlog=4096)
        ka = await loop.create_server(_KeepAlive, "127.0.0.1", 0, backlog=4096)
        conn.send(
            {
                "sink": sink.getsockname()[:2],
                "rr": server.sockets[0].getsockname()[:2],
                "ka": ka.sockets[0].getsockname()[:2],
            }
        )
        with contextlib.suppress(EOFError):  # the parent went away
            await loop.run_in_executor(None, conn.recv)

    _run(main(), loop_kind)


# --- proxy process


def proxy_main(  # noqa: PLR0917 - multiprocessing passes arguments by position
    conn: Connection,
    backends: dict[str, tuple[str, int]],
    splice: bool,
    loop_kind: str,
    src: str | None = None,
    keepalive: float | None = None,
    dataplane: str = "python",
) -> None:
    """One TcpListener per backend; sends back {name: proxy port}; runs until told to stop.

    `src`: import the proxy from this source tree (a baseline checkout) instead.
    `dataplane`: native or python (a baseline that predates the choice has only python).
    """
    if src is not None:
        sys.path.insert(0, src)
    from kube_userspace_proxy.balancer import EndpointPool
    from kube_userspace_proxy.dataplane import ConnStats, TcpListener, tcp
    from kube_userspace_proxy.model import Endpoint, ServicePortName

    if hasattr(tcp, "set_default"):
        tcp.set_default(dataplane)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        listeners = {}
        for name, address in backends.items():
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            extra = {} if keepalive is None else {"keepalive": keepalive}
            # The real balancer, with its per-endpoint tallies and recent-picks ring.
            pool = EndpointPool(ServicePortName("bench", name))
            pool.update([Endpoint(*address)], affinity_timeout=None)
            listener = TcpListener(sock, pool, ConnStats(), splice=splice, **extra)
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


class _Ping(asyncio.Protocol):
    """Request, wait for the whole reply, request again, until the deadline."""

    def __init__(self, deadline: float, done: asyncio.Future[int]) -> None:
        self.deadline = deadline
        self.done = done
        self.count = 0
        self.got = 0
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(REQUEST)

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got < len(REPLY):
            return
        self.got -= len(REPLY)
        self.count += 1
        if self.count < MAX_REQUESTS and time.monotonic() < self.deadline:
            self.transport.write(REQUEST)
        else:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(self.count)


async def _keepalive(port: int, seconds: float, concurrency: int) -> tuple[int, float, int]:
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + seconds
    futures: list[asyncio.Future[int]] = []
    errors = 0
    started = loop.time()
    for _ in range(concurrency):
        fut: asyncio.Future[int] = loop.create_future()
        try:
            await loop.create_connection(lambda: _Ping(deadline, fut), "127.0.0.1", port)  # noqa: B023
        except OSError:
            errors += 1
            continue
        futures.append(fut)
    async with asyncio.timeout(seconds + 10):
        counts = await asyncio.gather(*futures)
    return sum(counts), loop.time() - started, errors


def cps(
    port: int, seconds: float, concurrency: int, loop_kind: str, *, keepalive: bool = False
) -> tuple[float, int, int]:
    """Connections per second (connect, request, reply, close): (rate, count, errors).

    `keepalive`: requests per second over `concurrency` long-lived connections instead.
    """
    result: list[tuple[int, float, int]] = []

    async def main() -> None:
        run = _keepalive if keepalive else _cps
        result.append(await run(port, seconds, concurrency))

    _run(main(), loop_kind)
    done, elapsed, errors = result[0]
    return done / elapsed, done, errors


# --- the run


def _has_native(src: str | None) -> bool:
    """Whether the checkout `src` has the native data plane built (its modes can be compared)."""
    if src is None:
        return False
    folder = os.path.join(src, "kube_userspace_proxy", "dataplane")
    return os.path.isdir(folder) and any(n.startswith("_native.") for n in os.listdir(folder))


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


def start_profiler(pid: int, path: str) -> subprocess.Popen[bytes] | None:
    """py-spy recording `pid` as collapsed stacks into `path` until it is stopped."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        print("py-spy not found (pip install -e '.[bench]'): no profile", file=sys.stderr)
        return None
    args = [exe, "record", "--pid", str(pid), "--format", "raw", "--output", path]
    return subprocess.Popen([*args, "--rate", "250", "--nonblocking"], stdout=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=GiB, help="bulk size (default 1 GiB; 0: none)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per cps run (default 2)")
    parser.add_argument("--concurrency", type=int, default=32, help="cps clients (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument(
        "--modes",
        default="native,splice,copy,haproxy",
        help="paths besides direct: native (nested in --loop), native-loop (the core's loop),"
        " splice (Python), copy (Python without splice),"
        " haproxy (reference, if installed)",
    )
    parser.add_argument(
        "--baseline",
        metavar="SRC",
        help="also run the splice/copy modes from this source tree (e.g. a checkout of main)",
    )
    parser.add_argument(
        "--keepalive",
        type=float,
        metavar="SECONDS",
        help="TCP keepalive of our proxy (default: the listener's; 0: off); not the baseline's",
    )
    parser.add_argument("--profile", metavar="DIR", help="py-spy each proxy into DIR/PATH.txt")
    parser.add_argument(
        "--syscalls",
        action="store_true",
        help="also count each proxy's system calls per connection and per request (strace)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not 1 <= args.rounds <= 20 or not 0.5 <= args.seconds <= 60:
        parser.error("--rounds must be 1..20 and --seconds 0.5..60")
    if not 1 <= args.concurrency <= 1000 or not 0 <= args.bytes <= 16 * GiB:
        parser.error("--concurrency must be 1..1000 and --bytes 0..16 GiB")

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
        "baseline": args.baseline,
        "paths": {},
    }
    proxies: dict[str, tuple[mp.process.BaseProcess, Connection]] = {}
    profilers: list[subprocess.Popen[bytes]] = []
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
            trees = [("proxy", None)] + ([("base", args.baseline)] if args.baseline else [])
            if mode in {"native", "native-loop"} and not _has_native(args.baseline):
                trees = trees[:1]  # a baseline from before the native data plane has none
            for label, src in trees:
                keepalive = args.keepalive if src is None else None  # main has no such setting
                plane = "native" if mode.startswith("native") else "python"
                splice = mode != "copy"
                loop = "native" if mode == "native-loop" else args.loop
                proc, conn, ports = start(
                    proxy_main, addresses, splice, loop, src, keepalive, plane
                )
                name = f"{label}-{mode}"
                proxies[name] = (proc, conn)
                paths[name], pids[name] = ports, proc.pid
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            for name, (proc, _) in proxies.items():
                assert proc.pid is not None
                prof = start_profiler(proc.pid, os.path.join(args.profile, f"{name}.txt"))
                if prof is not None:
                    profilers.append(prof)
        samples: dict[str, dict[str, list[float]]] = {name: {} for name in paths}
        split0 = {name: cpu_split(pid) for name, pid in pids.items() if pid}
        # Rounds interleave the paths so that load from elsewhere on the machine hits all alike.
        for _ in range(args.rounds):
            for name, ports in paths.items():
                pid = pids[name]
                got = samples[name]
                cpu0 = cpu_seconds(pid) if pid else 0.0
                if args.bytes:
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
                    cpu0 = cpu_seconds(pid)
                rate, count, errors = cps(
                    ports["ka"], args.seconds, args.concurrency, args.loop, keepalive=True
                )
                got.setdefault("ka", []).append(rate)
                got["errors"][-1] += errors
                if pid and count:
                    cpu = cpu_seconds(pid) - cpu0
                    got.setdefault("proxy_cpu_us_per_req", []).append(cpu / count * 1e6)
        if args.syscalls:
            for name, ports in paths.items():
                if pids[name]:
                    results.setdefault("syscalls", {})[name] = count_syscalls(
                        pids[name], ports, args
                    )
        for name, pid in pids.items():
            if pid:  # the share of the proxy's CPU time spent in the kernel (syscalls)
                user, system = map(operator.sub, cpu_split(pid), split0[name])
                samples[name]["system_share"] = [system / max(user + system, 1e-9)]
        for name, got in samples.items():
            entry: dict[str, Any] = {k: statistics.median(v) for k, v in got.items()}
            entry["errors"] = sum(got["errors"])
            entry["samples"] = got
            results["paths"][name] = entry
    finally:
        for prof in profilers:
            prof.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            try:
                prof.wait(20)
            except subprocess.TimeoutExpired:
                prof.kill()
                prof.wait()
        for name, (proc, conn) in proxies.items():
            spliced = stop(proc, conn)
            if name in results["paths"]:
                results["paths"][name]["spliced_directions"] = spliced
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
        if args.bytes:
            entry["bulk_ratio"] = entry["bulk_gbit_s"] / direct["bulk_gbit_s"]
        entry["cps_ratio"] = entry["cps"] / direct["cps"] if direct["cps"] else 0.0
        entry["ka_ratio"] = entry["ka"] / direct["ka"] if direct["ka"] else 0.0
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
        return 0
    m = results["machine"]
    print(
        f"{m['cpus']} CPUs, Linux {m['kernel']}, Python {m['python']}, loop {m['loop']}"
        f" (uvloop {m['uvloop']}); bulk {args.bytes / GiB:g} GiB;"
        f" cps and keep-alive {args.concurrency} clients x {args.seconds:g} s;"
        f" medians of {args.rounds} rounds;"
        f" load average {m['loadavg_before']:.1f} -> {m['loadavg_after']:.1f}"
        + (f"; base = {args.baseline}" if args.baseline else "")
    )
    print(
        f"{'path':<12} {'bulk Gbit/s':>11} {'ratio':>5} {'CPU s/GiB':>9}"
        f" {'conn/s':>7} {'ratio':>5} {'CPU us/conn':>11}"
        f" {'req/s':>7} {'ratio':>5} {'CPU us/req':>10} {'sys':>4} {'errors':>6}"
    )

    def fmt(e: dict[str, Any], key: str, spec: str) -> str:
        return f"{e[key]:{spec}}" if key in e else "-"

    for name, e in results["paths"].items():
        print(
            f"{name:<12} {fmt(e, 'bulk_gbit_s', '.2f'):>11} {fmt(e, 'bulk_ratio', '.2f'):>5}"
            f" {fmt(e, 'proxy_cpu_s_per_gib', '.2f'):>9}"
            f" {e['cps']:>7.0f} {e['cps_ratio']:>5.2f} {fmt(e, 'proxy_cpu_us_per_conn', '.0f'):>11}"
            f" {e['ka']:>7.0f} {e['ka_ratio']:>5.2f} {fmt(e, 'proxy_cpu_us_per_req', '.1f'):>10}"
            f" {fmt(e, 'system_share', '.2f'):>4} {e['errors']:>6}"
        )
    print_ratios(results["paths"])
    if "syscalls" in results:
        print_syscalls(results["syscalls"])
    return 0


# --- system calls per unit of work (strace -c)

STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:(\d+)\s+)?(\w+)\s*$")


def strace_counts(path: str) -> dict[str, int]:
    """{syscall: calls} from an `strace -c` summary."""
    counts: dict[str, int] = {}
    with open(path) as summary:
        for line in summary:
            if (match := STRACE_ROW.match(line)) and match.group(3) != "total":
                counts[match.group(3)] = counts.get(match.group(3), 0) + int(match.group(1))
    return counts


def traced(pid: int, run: Any, tmp: str) -> tuple[dict[str, int], int]:
    """Run `run()` (returning the units of work done) with strace -c -f attached to `pid`:
    ({syscall: calls}, units)."""
    out = os.path.join(tmp, f"strace-{pid}-{time.monotonic_ns()}.txt")
    tracer = subprocess.Popen(
        ["strace", "-c", "-f", "-q", "-o", out, "-p", str(pid)], stderr=subprocess.DEVNULL
    )
    time.sleep(1.0)  # attached (strace gives no signal; a second is plenty for one process)
    try:
        units = run()
    finally:
        tracer.send_signal(signal.SIGINT)  # strace writes its summary as it detaches
        try:
            tracer.wait(30)
        except subprocess.TimeoutExpired:
            tracer.kill()
            tracer.wait()
    return strace_counts(out), units


def count_syscalls(pid: int, ports: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    """System calls of the proxy process per new connection and per keep-alive request."""
    if shutil.which("strace") is None:
        raise SystemExit("--syscalls needs strace (apt-get install strace)")
    tmp = tempfile.mkdtemp(prefix="kup-strace-")
    try:
        conn, conns = traced(
            pid, lambda: cps(ports["rr"], args.seconds, args.concurrency, args.loop)[1], tmp
        )
        req, reqs = traced(
            pid,
            lambda: cps(ports["ka"], args.seconds, args.concurrency, args.loop, keepalive=True)[1],
            tmp,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "connections": conns,
        "requests": reqs,
        "per_connection": {k: v / conns for k, v in sorted(conn.items())} if conns else {},
        "per_request": {k: v / reqs for k, v in sorted(req.items())} if reqs else {},
    }


def print_syscalls(syscalls: dict[str, Any]) -> None:
    """A Markdown table: system calls per connection and per request, by name and in all."""
    names = sorted(
        {k for got in syscalls.values() for k, v in got["per_connection"].items() if v >= 0.05}
    )
    paths = list(syscalls)
    print()
    print("| system calls per proxied connection | " + " | ".join(paths) + " |")
    print("|---|" + "---:|" * len(paths))
    for name in names:
        cells = [f"{syscalls[p]['per_connection'].get(name, 0):.2f}" for p in paths]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for key, label in (
        ("per_connection", "per connection"),
        ("per_request", "per keep-alive request"),
    ):
        cells = [f"**{sum(syscalls[p][key].values()):.2f}**" for p in paths]
        print(f"| **all, {label}** | " + " | ".join(cells) + " |")


def print_ratios(paths: dict[str, Any]) -> None:
    """Proxy CPU per connection and per request of each proxy path, as ratios to the others."""
    keys = (("proxy_cpu_us_per_conn", "CPU/conn"), ("proxy_cpu_us_per_req", "CPU/req"))
    for ours in (n for n in paths if n.startswith("proxy-")):
        for other in (n for n in paths if n.startswith("base-") or n == "haproxy"):
            if other.startswith("base-") and other[5:] != ours[6:]:
                continue
            parts = [
                f"{label} {paths[ours][key] / paths[other][key]:.2f}x"
                for key, label in keys
                if paths[ours].get(key) and paths[other].get(key)
            ]
            if parts:
                print(f"{ours} vs {other}: " + ", ".join(parts))


if __name__ == "__main__":
    sys.exit(main())
