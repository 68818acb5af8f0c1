"""Time to program iptables portals: from scratch, one change, resyncs.

For each backend (iptc: python-iptables on the legacy tables; restore: iptables-restore on
the nft tables) and each size, in a network namespace created for the run (and deleted after),
one `Portals` is taken through these applies, each timed:

- `scratch`: the first apply of N service ports into empty tables (rendering them included),
  with the cyclic collector held off and what it built frozen after, as in the proxy's first
  sync;
- `move one`: one service port moved to another proxy port, the one the proxy's
  `PortAllocator` would hand out next (its cursor: the next free port after the last one
  given, here 20000 + N), so its filter rule lands in a port shard in use, as 255 moves in
  256 do;
- `no-op resync`: nothing changed (the periodic resync: the cheap tamper check);
- `move one, new shard`: the same port moved far from every port in use (the worst case:
  the filter commit also creates a port shard and its jump);
- `remove one`, then `add one` (it comes back);
- `foreign commit`: nothing of ours changed, but someone else committed a rule (in nft mode
  the generation moved, so the cheap check reads the jumps and our entry chains);
- `full verify`: an apply that reads and compares every chain (`--iptables-verify-period`).

Each apply is timed to the moment the change is live. Where the code commits the deletes that
can wait in a second commit (`Portals.commit_deferred`, as the proxier runs it right after),
that commit is timed on its own: `move one: deletes`, `move one, new shard: deletes`, `remove
one: deletes` (absent for a baseline without it).

Service ports are ClusterIP TCP (a container, a host and a guard rule each); every fifth also
has a NodePort (three more rules). The proxier hands over the same `ServicePortInfo` and
`ProxiedPort` objects while a service port is unchanged, and so does this. Each figure is the
median of `--repeat` runs; every run starts from empty tables. `--baseline-src` times another
checkout's code first, in the same run (e.g. `git worktree add /tmp/base 6a9c8c4`, then
`--baseline-src /tmp/base/src`); the steps are this file's, so the figures compare.
Needs root; touches nothing outside its namespaces.

    sudo .venv/bin/python benchmarks/portals.py [--sizes 1000,10000] [--repeat 3]
        [--backends iptc,restore] [--baseline-src DIR] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
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


_TARGETS: dict[tuple[int, int], Any] = {}


def ports(facts: list[Any], moved: int = -1, to: int = 0, drop: int = -1) -> list[Any]:
    """ProxiedPorts for `facts`, on proxy ports 20000 + i; the port at index `moved` gets
    proxy port `to` instead, the one at `drop` is left out. A service port keeps its
    ProxiedPort object while its proxy port is unchanged, as the proxier keeps it
    (`_Served.target`)."""
    from kube_userspace_proxy.model import ProxiedPort

    out = []
    for i, info in enumerate(facts):
        if i != drop:
            port = to if i == moved else 20000 + i
            target = _TARGETS.get((i, port))
            if target is None or target.info is not info:
                target = _TARGETS[(i, port)] = ProxiedPort(info, port, port)
            out.append(target)
    return out


LABELS = (
    "scratch",
    "move one",
    "no-op resync",
    "move one, new shard",
    "remove one",
    "add one",
    "foreign commit",
)
DEFERRED = ("move one", "move one, new shard", "remove one")
"""Steps whose second commit (the deletes that can wait) is timed as `LABEL: deletes`."""
COLUMNS = (*LABELS[:2], "move one: deletes", *LABELS[2:4], "move one, new shard: deletes",
           LABELS[4], "remove one: deletes", *LABELS[5:], "full verify")  # fmt: skip
FOREIGN = {
    "iptc": ["iptables-legacy", "-t", "filter", "-A", "FORWARD", "-j", "ACCEPT"],
    "restore": ["iptables-nft", "-t", "filter", "-A", "FORWARD", "-j", "ACCEPT"],
}


@contextlib.contextmanager
def gc_held() -> Iterator[None]:
    """The collector held off, as `collector.held_off` does (a baseline may predate it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def worker(backend: str, size: int, repeat: int) -> dict[str, Any]:
    """Runs inside the namespace: the timings of one backend and size."""
    from kube_userspace_proxy import logs
    from kube_userspace_proxy.portals import Portals, cleanup_all, make_backend

    logs.setup(0)
    facts = infos(size)
    m = size // 2
    base = ports(facts)
    moved = ports(facts, moved=m, to=20000 + size)  # the allocator's next port
    far = ports(facts, moved=m, to=50000 + m)  # beyond every port in use: a new port shard
    removed = ports(facts, moved=m, to=50000 + m, drop=size // 3)
    times: dict[str, list[float]] = {label: [] for label in COLUMNS}
    rules = 0
    for _ in range(repeat):
        cleanup_all()
        portals = Portals(make_backend(backend), node_ips=("10.244.0.1",), physdev=True)
        # A baseline checkout may have no second commit: its applies delete at once.
        deferred = getattr(portals, "commit_deferred", None)
        steps = zip(LABELS, (base, moved, moved, far, removed, far, far), strict=True)
        for label, state in steps:
            if label == "foreign commit":  # someone else's rule: the cheap check runs
                subprocess.run(FOREIGN[backend], check=True)
            # The proxy's first sync holds the cyclic collector off and then freezes what it
            # built (app.py, `collector.Hold`): the first apply here does the same.
            hold = gc_held if label == "scratch" else contextlib.nullcontext
            started = time.perf_counter()
            with hold():
                portals.apply(state)
            times[label].append(time.perf_counter() - started)
            if label == "scratch":
                gc.freeze()
            if label == "scratch":  # counted after: rendered before, the apply would not render
                rules = len(portals.render(base))
            if deferred is not None:
                started = time.perf_counter()
                deferred()
                if label in DEFERRED:
                    times[f"{label}: deletes"].append(time.perf_counter() - started)
        if hasattr(portals, "verify_period"):  # a full read and compare of every chain
            portals.verify_period = 0.0
            started = time.perf_counter()
            portals.apply(far)
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
    labels = [label for label in COLUMNS if any(label in r for r in results)]
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
