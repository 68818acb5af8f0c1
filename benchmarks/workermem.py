"""What a worker process's memory costs per service port, and whether it grows under churn.

The real `WorkerPool` with its worker processes (and its warm spare), `--ports` proxy ports
reserved on loopback, each with 3 endpoints on loopback backends this script serves. RSS of
every worker (from /proc/PID/smaps_rollup) is read at each phase:

- `start`: the workers are up, no table yet;
- `table`: the first publish (every port, as at a start) was applied;
- `touched`: one connection went through every port (the pools' first picks, the listeners'
  first connections: what is made only once traffic arrives);
- `storm`: `--storm` publishes of `--moves` moved endpoints each were applied.

`--src DIR` runs the workers from another checkout's `src/` (PYTHONPATH, which the worker
processes inherit), e.g. the code before a change, for a before/after in one session:

    git archive fa2eff3 src | tar -x -C /tmp/base
    .venv/bin/python benchmarks/workermem.py --src /tmp/base/src
    .venv/bin/python benchmarks/workermem.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import struct
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from testbed import memory_kib  # noqa: E402

from kube_userspace_proxy.app.lifecycle import raise_nofile_limit  # noqa: E402
from kube_userspace_proxy.balancer import EndpointPool  # noqa: E402
from kube_userspace_proxy.dataplane import ConnStats  # noqa: E402
from kube_userspace_proxy.model import Endpoint, Protocol, ServicePortName  # noqa: E402
from kube_userspace_proxy.ports import PortAllocator  # noqa: E402
from kube_userspace_proxy.workers.pool import SharedPort, WorkerPool  # noqa: E402

BACKEND_HOST = "127.0.0.2"
BACKEND_PORTS = range(18000, 18016)
"""The endpoints the pools pick from (3 each, drawn from these): a few pods, many Services."""
LINGER_RESET = struct.pack("ii", 1, 0)


def children(pid: int) -> list[int]:
    """The process ids of `pid`'s children."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(p) for p in f.read().split()]
    return out


def descendants() -> list[int]:
    """The process ids under this one: the fork server, and the workers and the spare it
    forked (they are its children, not this process's)."""
    out: list[int] = []
    todo = children(os.getpid())
    while todo:
        pid = todo.pop()
        out.append(pid)
        with contextlib.suppress(FileNotFoundError):  # it exited meanwhile
            todo += children(pid)
    return sorted(out)


def rss_mib() -> dict[int, float]:
    return {pid: memory_kib(pid)[0] / 1024 for pid in descendants()}


class Answer(asyncio.Protocol):
    """A backend: one byte back; the client ends the connection (with a RST: no TIME_WAIT
    is left on the proxy ports, whose reservations a later run must bind again)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"k")  # type: ignore[attr-defined]
        transport.close()


async def touch(ports: list[int], concurrency: int = 64) -> int:
    """One connection through every port (reset by the client: no TIME_WAIT on the ports);
    how many got the backend's byte. `workercensus.py` uses it too."""
    gate = asyncio.Semaphore(concurrency)
    answered = 0

    async def one(port: int) -> None:
        nonlocal answered
        async with gate:
            try:
                async with asyncio.timeout(10):
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    got = await reader.read(1)  # before `answered` is read: no lost update
                    answered += got == b"k"
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
                    writer.close()
            except (OSError, TimeoutError):
                pass

    await asyncio.gather(*(one(p) for p in ports))
    return answered


def endpoints(rng: random.Random) -> list[Endpoint]:
    return [Endpoint(BACKEND_HOST, port) for port in rng.sample(BACKEND_PORTS, 3)]


async def settle(workers: WorkerPool) -> None:
    """Publish a no-op and give the workers a moment (their RSS after the last apply)."""
    await workers.publish()
    await asyncio.sleep(1.0)


async def measure(args: argparse.Namespace) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    backends = [
        await loop.create_server(Answer, BACKEND_HOST, port, reuse_address=True)
        for port in BACKEND_PORTS
    ]
    workers = WorkerPool(args.workers)
    await workers.start()
    rng = random.Random(7)
    phases: dict[str, dict[int, float]] = {}
    low, high = (int(p) for p in args.port_range.split("-"))
    allocator = PortAllocator((low, high), host="127.0.0.1", share_udp=True)
    ports: list[tuple[SharedPort, EndpointPool]] = []
    try:
        await asyncio.sleep(1.0)
        phases["start"] = rss_mib()
        for i in range(args.ports):
            name = ServicePortName("default", f"s{i}", "p", Protocol.TCP)
            pool = EndpointPool(name)
            pool.update(endpoints(rng), affinity_timeout=None)
            sock = allocator.reserve(Protocol.TCP, name=str(name))
            ports.append((workers.listener(sock, pool, ConnStats(), str(name)), pool))
        started = time.perf_counter()
        await workers.publish()
        first = time.perf_counter() - started
        await settle(workers)
        phases["table"] = rss_mib()
        started = time.perf_counter()
        answered = await touch([p.port for p, _ in ports], args.concurrency)
        touched = time.perf_counter() - started
        await settle(workers)
        phases["touched"] = rss_mib()
        for _ in range(args.storm):
            for _ in range(args.moves):
                port, pool = ports[rng.randrange(len(ports))]
                pool.update(endpoints(rng), affinity_timeout=None)
                port.refresh()
            await workers.publish()
        await settle(workers)
        phases["storm"] = rss_mib()
        serving = workers.pids()
        return {
            "ports": args.ports,
            "workers": args.workers,
            "src": args.src or str(ROOT / "src"),
            "first_publish_ms": 1000 * first,
            "touch_s": touched,
            "answered": answered,
            "serving_pids": serving,
            "rss_mib": {
                phase: {str(pid): round(mib, 1) for pid, mib in rss.items()}
                for phase, rss in phases.items()
            },
        }
    finally:
        await workers.shutdown(1.0)
        for port, _ in ports:
            await port.close()
        for server in backends:
            server.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--storm", type=int, default=50, help="publishes of moved endpoints")
    parser.add_argument("--moves", type=int, default=100, help="endpoints moved per publish")
    parser.add_argument(
        "--port-range",
        default="20000-31999",
        help="proxy ports (outside the ephemeral range: the touch's TIME_WAITs stay out)",
    )
    parser.add_argument("--src", default="", help="run the workers from this src/ directory")
    args = parser.parse_args()
    if args.src:
        os.environ["PYTHONPATH"] = args.src
    raise_nofile_limit()
    import uvloop

    result = uvloop.run(measure(args))
    print(json.dumps(result, indent=2))
    rss = result["rss_mib"]
    assert isinstance(rss, dict)
    pids = sorted({pid for phase in rss.values() for pid in phase})
    print(f"\n| RSS MiB, {args.ports:,} ports | " + " | ".join(f"pid {p}" for p in pids) + " |")
    print("|---|" + "---:|" * len(pids))
    for phase, by_pid in rss.items():
        print(f"| {phase} | " + " | ".join(f"{by_pid.get(p, 0):.1f}" for p in pids) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
