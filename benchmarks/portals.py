"""Time to program iptables portals: from scratch, one change, and a no-op resync.

For each backend (iptc: python-iptables on the legacy tables; restore: iptables-restore on
the nft tables) and each size, in a network namespace created for the run (and deleted after):

- `scratch`: the first `Portals.apply` of N service ports into empty tables;
- `one change`: the next apply with one service port moved to another proxy port;
- `resync`: an apply with nothing changed (the periodic resync: re-read and compare).

Service ports are ClusterIP TCP (a container and a host rule each); every fifth also has a
NodePort (three more rules). Each figure is the median of `--repeat` runs; every run starts
from empty tables. Needs root; touches nothing outside its namespaces.

    sudo .venv/bin/python benchmarks/portals.py [--sizes 1000,10000] [--repeat 3]
        [--backends iptc,restore] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def ports(n: int, moved: int = -1) -> list[Any]:
    from kube_userspace_proxy.model import ProxiedPort, ServicePortInfo, ServicePortName

    out = []
    for i in range(n):
        name = ServicePortName(f"ns{i % 50}", f"svc{i}", "http")
        ip = f"10.96.{i // 250}.{i % 250 + 1}"
        info = ServicePortInfo(name, 80, (ip,), node_port=30000 + i if i % 5 == 0 else 0)
        port = 20000 + i + (30000 if i == moved else 0)
        out.append(ProxiedPort(info, port, port))
    return out


def worker(backend: str, size: int, repeat: int) -> dict[str, Any]:
    """Runs inside the namespace: the timings of one backend and size."""
    from kube_userspace_proxy import logs
    from kube_userspace_proxy.portals import Portals, cleanup_all, make_backend

    logs.setup(0)
    base, changed = ports(size), ports(size, moved=size // 2)
    times: dict[str, list[float]] = {"scratch": [], "one change": [], "resync": []}
    rules = 0
    for _ in range(repeat):
        cleanup_all()
        portals = Portals(make_backend(backend), node_ips=("10.244.0.1",), physdev=True)
        rules = len(portals.render(base))
        for label, state in (("scratch", base), ("one change", changed), ("resync", changed)):
            started = time.perf_counter()
            portals.apply(state)
            times[label].append(time.perf_counter() - started)
    return {
        "backend": make_backend(backend).name,  # type: ignore[union-attr]
        "size": size,
        "rules": rules,
        **{label: statistics.median(values) for label, values in times.items()},
    }


def run_in_namespace(backend: str, size: int, repeat: int) -> dict[str, Any]:
    ns = f"kupbench{os.getpid()}{backend[:4]}{size}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        worker_args = ["--worker", backend, str(size), str(repeat)]
        done = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, __file__, *worker_args],
            check=True,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        result: dict[str, Any] = json.loads(done.stdout)
        return result
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    iptables = subprocess.run(
        ["iptables", "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return f"{os.cpu_count()} x {cpu}; Linux {platform.release()}; {iptables}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backends", default="iptc,restore")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=3, metavar=("BACKEND", "SIZE", "REPEAT"))
    args = parser.parse_args()
    if args.worker:
        backend, size, repeat = args.worker
        print(json.dumps(worker(backend, int(size), int(repeat))))
        return 0
    if os.geteuid() != 0:
        print("needs root (it creates a network namespace)", file=sys.stderr)
        return 2
    results = [
        run_in_namespace(backend, int(size), args.repeat)
        for backend in args.backends.split(",")
        for size in args.sizes.split(",")
    ]
    if args.json:
        print(json.dumps({"machine": machine(), "results": results}, indent=2))
        return 0
    print(f"machine: {machine()}; median of {args.repeat} runs\n")
    print("| backend | service ports | rules | from scratch | one change | no-op resync |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['backend']} | {r['size']:,} | {r['rules']:,} | {r['scratch'] * 1000:,.0f} ms"
            f" | {r['one change'] * 1000:,.0f} ms | {r['resync'] * 1000:,.0f} ms |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
