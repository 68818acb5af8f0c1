"""UDP through UdpListener on each event loop: what `--event-loop auto` costs UDP.

Where the native data plane serves, `--event-loop auto` runs asyncio's loop waiting in the
native core (`dataplane/coreloop.py`) instead of uvloop; UDP stays Python on either. This
measures a UDP proxy port on each loop side by side, on 127.0.0.1: an echo backend process, a
proxy process per loop (one UdpListener, the real balancer), and `--clients` client processes,
each sending a 64-byte datagram and waiting for its echo, again and again, for `--seconds`
(and at most 2,000,000 round trips). Reports the round trips per second and the proxy's CPU
microseconds per round trip (from /proc), the median of `--rounds` interleaved rounds, and
each loop's ratio to uvloop's.

    .venv/bin/python benchmarks/udp_loops.py [--rounds 3] [--seconds 3] [--clients 8]
        [--loops uvloop,native,asyncio] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loopback import cpu_seconds, start, stop

MAX_ROUND_TRIPS = 2_000_000  # per client and run, on top of the time bound
PAYLOAD = b"q" * 64


def echo_main(conn: Connection) -> None:
    """The backend: echoes every datagram until the parent goes away."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(1.0)
    conn.send(sock.getsockname())
    while not conn.poll(0):
        try:
            data, peer = sock.recvfrom(2048)
        except TimeoutError:
            continue
        sock.sendto(data, peer)


def proxy_main(conn: Connection, backend: tuple[str, int], loop: str) -> None:
    """One UdpListener on `loop` (native: the core's, as --event-loop auto runs it)."""
    from kube_userspace_proxy.balancer import EndpointPool
    from kube_userspace_proxy.dataplane import ConnStats, UdpListener, coreloop
    from kube_userspace_proxy.model import Endpoint, ServicePortName

    async def main() -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        pool = EndpointPool(ServicePortName("bench", "udp"))
        pool.update([Endpoint(*backend)], affinity_timeout=None)
        listener = UdpListener(sock, pool, ConnStats(), idle_timeout=30.0)
        await listener.start()
        conn.send(sock.getsockname())
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        conn.send(listener.stats.udp_datagrams_in)
        await listener.close()

    kind: Any = loop
    with asyncio.Runner(loop_factory=coreloop.factory(kind)) as runner:
        runner.run(main())


def client_main(conn: Connection, address: tuple[str, int], seconds: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(2.0)
    conn.send("ready")
    conn.recv()  # go
    done = lost = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end and done < MAX_ROUND_TRIPS:
        sock.sendto(PAYLOAD, address)
        try:
            sock.recv(2048)
        except TimeoutError:
            lost += 1
            continue
        done += 1
    conn.send((done, lost))


def one_run(pid: int, address: tuple[str, int], seconds: float, clients: int) -> dict[str, float]:
    started = [start(client_main, address, seconds) for _ in range(clients)]
    cpu0 = cpu_seconds(pid)
    t0 = time.monotonic()
    for _, conn, _ in started:
        conn.send("go")
    done = lost = 0
    for proc, conn, _ in started:
        n, m = conn.recv()
        done += n
        lost += m
        proc.join(10)
    elapsed = time.monotonic() - t0
    cpu = cpu_seconds(pid) - cpu0
    return {
        "rate": done / elapsed,
        "cpu_us": cpu / done * 1e6 if done else float("nan"),
        "lost": lost,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--loops", default="uvloop,native,asyncio")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    loops = [name.strip() for name in args.loops.split(",") if name.strip()]
    if not 1 <= args.rounds <= 20 or not 0 < args.seconds <= 60 or not 1 <= args.clients <= 64:
        parser.error("--rounds 1..20, --seconds up to 60, --clients 1..64")
    backend, bconn, address = start(echo_main)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in loops}
    try:
        for _ in range(args.rounds):  # rounds interleave the loops
            for name in loops:
                proc, conn, port_address = start(proxy_main, address, name)
                try:
                    assert proc.pid is not None
                    samples[name].append(
                        one_run(proc.pid, port_address, args.seconds, args.clients)
                    )
                finally:
                    stop(proc, conn)
    finally:
        stop(backend, bconn)
    summary = {
        name: {
            "rate": statistics.median(s["rate"] for s in runs),
            "cpu_us": statistics.median(s["cpu_us"] for s in runs),
            "lost": sum(s["lost"] for s in runs),
        }
        for name, runs in samples.items()
    }
    if args.json:
        print(json.dumps({"summary": summary, "samples": samples}, indent=2))
        return 0
    print(
        f"{os.cpu_count()} CPUs, Linux {platform.release()}, Python {platform.python_version()};"
        f" {args.clients} clients x {args.seconds:g} s; medians of {args.rounds} rounds"
    )
    ref = summary.get("uvloop")
    print(f"{'loop':<10}{'round trips/s':>15}{'ratio':>7}{'CPU us/rt':>11}{'ratio':>7}{'lost':>6}")
    for name, row in summary.items():
        rate_ratio = row["rate"] / ref["rate"] if ref else float("nan")
        cpu_ratio = row["cpu_us"] / ref["cpu_us"] if ref else float("nan")
        print(
            f"{name:<10}{row['rate']:>15.0f}{rate_ratio:>7.2f}{row['cpu_us']:>11.1f}"
            f"{cpu_ratio:>7.2f}{row['lost']:>6.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
