"""What publishing a change to the worker processes costs at 10,000 service ports.

The real `WorkerPool` with its worker processes, 10,000 proxy ports reserved on loopback
(nothing connects to them). After the first publish (every port, as at a start), one
endpoint of one service port moves and `publish()` runs, `--changes` times; then the same
move is published with every port in it, as the full table went out on every change before
the deltas. Reported: the time `publish()` takes until every worker has applied it (p50,
p99) and the control process's CPU per publish, side by side, and their ratio.

    .venv/bin/python benchmarks/publish.py [--ports 10000] [--workers 2] [--changes 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kube_userspace_proxy.app.lifecycle import raise_nofile_limit  # noqa: E402
from kube_userspace_proxy.balancer import EndpointPool  # noqa: E402
from kube_userspace_proxy.dataplane import ConnStats  # noqa: E402
from kube_userspace_proxy.model import Endpoint, Protocol, ServicePortName  # noqa: E402
from kube_userspace_proxy.ports import PortAllocator  # noqa: E402
from kube_userspace_proxy.workers.pool import SharedPort, WorkerPool  # noqa: E402


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(args: argparse.Namespace) -> dict[str, object]:
    workers = WorkerPool(args.workers)
    await workers.start()
    allocator = PortAllocator(None, host="127.0.0.1", share_udp=True)
    ports: list[tuple[SharedPort, EndpointPool]] = []
    try:
        for i in range(args.ports):
            name = ServicePortName("default", f"s{i}", "p", Protocol.TCP)
            pool = EndpointPool(name)
            pool.update([Endpoint("127.0.0.2", 8000 + k) for k in range(3)], affinity_timeout=None)
            sock = allocator.reserve(Protocol.TCP, name=str(name))
            ports.append((workers.listener(sock, pool, ConnStats(), str(name)), pool))
        started = time.perf_counter()
        await workers.publish()
        first = time.perf_counter() - started

        async def one(k: int, *, everything: bool) -> tuple[float, float]:
            port, pool = ports[k % len(ports)]
            pool.update([Endpoint("127.0.0.3", 9000 + k)], affinity_timeout=None)
            if everything:  # as before the deltas: every port, every change
                for other, _ in ports:
                    other.refresh()
                workers._publisher.forget_sent()  # all of it goes again
            port.refresh()
            cpu, wall = time.process_time(), time.perf_counter()
            await workers.publish()
            return time.perf_counter() - wall, time.process_time() - cpu

        results = {}
        for label, everything in (("delta", False), ("every port", True)):
            samples = [await one(k, everything=everything) for k in range(args.changes)]
            walls = [1000 * w for w, _ in samples]
            cpus = [1000 * c for _, c in samples]
            results[label] = {
                "p50_ms": quantile(walls, 0.5),
                "p99_ms": quantile(walls, 0.99),
                "cpu_ms_p50": quantile(cpus, 0.5),
            }
        return {
            "ports": args.ports,
            "workers": args.workers,
            "first_publish_ms": 1000 * first,
            **results,
            "ratio_p50": results["delta"]["p50_ms"] / results["every port"]["p50_ms"],
        }
    finally:
        await workers.shutdown(1.0)
        for port, _ in ports:
            await port.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--changes", type=int, default=20)
    args = parser.parse_args()
    raise_nofile_limit()
    import uvloop

    result = uvloop.run(measure(args))
    print(json.dumps(result, indent=2))
    d, e = result["delta"], result["every port"]
    assert isinstance(d, dict) and isinstance(e, dict)
    print(
        f"\n| publish of one moved endpoint at {args.ports:,} ports, {args.workers} workers "
        f"| p50 | p99 | control CPU p50 |\n|---|---:|---:|---:|\n"
        f"| every port (the full table, before) | {e['p50_ms']:.1f} ms | {e['p99_ms']:.1f} ms "
        f"| {e['cpu_ms_p50']:.1f} ms |\n"
        f"| delta (only the changed port) | {d['p50_ms']:.2f} ms | {d['p99_ms']:.2f} ms "
        f"| {d['cpu_ms_p50']:.2f} ms |\n"
        f"| ratio | {d['p50_ms'] / e['p50_ms']:.3f}x | | |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
