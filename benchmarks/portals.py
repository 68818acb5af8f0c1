"""Time to program iptables portals: from scratch, one change, resyncs.

For each backend (iptc: python-iptables on the legacy tables; restore: iptables-restore on
the nft tables) and each size, in a network namespace created for the run (and deleted after),
one `Portals` is taken through these applies, each timed:

- `scratch`: the first apply of N service ports into empty tables (rendering them included);
- `move one`: one service port moved to another proxy port;
- `no-op resync`: nothing changed (the periodic resync: the cheap tamper check);
- `remove one`, then `add one` (it comes back);
- `foreign commit`: nothing of ours changed, but someone else committed a rule (in nft mode
  the generation moved, so the cheap check reads the jumps and our entry chains);
- `full verify`: an apply that reads and compares every chain (`--iptables-verify-period`).

Service ports are ClusterIP TCP (a container, a host and a guard rule each); every fifth also
has a NodePort (three more rules). The proxier hands over the same `ServicePortInfo` objects
while a Service is unchanged, and so does this. Each figure is the median of `--repeat` runs;
every run starts from empty tables. `--baseline-src` times another checkout's code first, in
the same run (e.g. `git worktree add /tmp/base 6a9c8c4`, then `--baseline-src /tmp/base/src`).
Needs root; touches nothing outside its namespaces.

    sudo .venv/bin/python benchmarks/portals.py [--sizes 1000,10000] [--repeat 3]
        [--backends iptc,restore] [--baseline-src DIR] [--json]
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


def infos(n: int) -> list[Any]:
    """N service ports' facts; the proxier hands the same objects over while they are unchanged."""
    from kube_userspace_proxy.model import ServicePortInfo, ServicePortName

    out = []
    for i in range(n):
        name = ServicePortName(f"ns{i % 50}", f"svc{i}", "http")
        ip = f"10.96.{i // 250}.{i % 250 + 1}"
        out.append(ServicePortInfo(name, 80, (ip,), node_port=30000 + i if i % 5 == 0 else 0))
    return out


def ports(facts: list[Any], moved: int = -1, drop: int = -1) -> list[Any]:
    """ProxiedPorts (fresh objects, as the proxier builds them each sync) for `facts`; the
    port at index `moved` gets another proxy port, the one at `drop` is left out."""
    from kube_userspace_proxy.model import ProxiedPort

    out = []
    for i, info in enumerate(facts):
        if i != drop:
            port = 20000 + i + (30000 if i == moved else 0)
            out.append(ProxiedPort(info, port, port))
    return out


LABELS = ("scratch", "move one", "no-op resync", "remove one", "add one", "foreign commit")
FOREIGN = {
    "iptc": ["iptables-legacy", "-t", "filter", "-A", "FORWARD", "-j", "ACCEPT"],
    "restore": ["iptables-nft", "-t", "filter", "-A", "FORWARD", "-j", "ACCEPT"],
}


def worker(backend: str, size: int, repeat: int) -> dict[str, Any]:
    """Runs inside the namespace: the timings of one backend and size."""
    from kube_userspace_proxy import logs
    from kube_userspace_proxy.portals import Portals, cleanup_all, make_backend

    logs.setup(0)
    facts = infos(size)
    base, moved = ports(facts), ports(facts, moved=size // 2)
    removed = ports(facts, moved=size // 2, drop=size // 3)
    times: dict[str, list[float]] = {label: [] for label in (*LABELS, "full verify")}
    rules = 0
    for _ in range(repeat):
        cleanup_all()
        portals = Portals(make_backend(backend), node_ips=("10.244.0.1",), physdev=True)
        steps = zip(LABELS, (base, moved, moved, removed, moved, moved), strict=True)
        for label, state in steps:
            if label == "foreign commit":  # someone else's rule: the cheap check runs
                subprocess.run(FOREIGN[backend], check=True)
            started = time.perf_counter()
            portals.apply(state)
            times[label].append(time.perf_counter() - started)
            if label == "scratch":  # counted after: rendered before, the apply would not render
                rules = len(portals.render(base))
        if hasattr(portals, "verify_period"):  # a full read and compare of every chain
            portals.verify_period = 0.0
            started = time.perf_counter()
            portals.apply(moved)
            times["full verify"].append(time.perf_counter() - started)
    return {
        "backend": make_backend(backend).name,  # type: ignore[union-attr]
        "size": size,
        "rules": rules,
        **{label: statistics.median(values) for label, values in times.items() if values},
    }


def run_in_namespace(backend: str, size: int, repeat: int, src: str = "") -> dict[str, Any]:
    """One backend and size in a namespace of its own; `src`: import the proxy from there
    (another checkout, e.g. the baseline commit) instead of this tree."""
    ns = f"kupbench{os.getpid()}{backend[:4]}{size}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        worker_args = ["--worker", backend, str(size), str(repeat)]
        env = {**os.environ, "PYTHONPATH": src} if src else None
        done = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, __file__, *worker_args],
            check=True,
            capture_output=True,
            text=True,
            timeout=1800,
            env=env,
        )
        result: dict[str, Any] = json.loads(done.stdout)
        result["code"] = "baseline" if src else "this tree"
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
    parser.add_argument(
        "--baseline-src",
        default="",
        help="a src/ directory of another checkout to time first, in the same run",
    )
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
    sources = [args.baseline_src, ""] if args.baseline_src else [""]
    results = [
        run_in_namespace(backend, int(size), args.repeat, src)
        for backend in args.backends.split(",")
        for size in args.sizes.split(",")
        for src in sources
    ]
    if args.json:
        print(json.dumps({"machine": machine(), "results": results}, indent=2))
        return 0
    print(f"machine: {machine()}; median of {args.repeat} runs\n")
    labels = [label for label in (*LABELS, "full verify") if any(label in r for r in results)]
    print("| code | backend | service ports | rules | " + " | ".join(labels) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(labels))
    for r in results:
        cells = [f"{r[label] * 1000:,.0f} ms" if label in r else "" for label in labels]
        print(
            f"| {r['code']} | {r['backend']} | {r['size']:,} | {r['rules']:,} | "
            + " | ".join(cells)
            + " |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
