"""A worker's replacement: how long a slot goes unserved after its worker dies, with a forked
warm spare and with a worker forked when needed; and what the tree's memory is either way.

On loopback (no rules, no namespaces): the proxy runs in this process (`app.serve`, as the
loopback tests do) with `--workers 2` and N Services from a manifest. Each round kills one
worker with SIGKILL (a slot's worker more than 10 s after its start: no crash-loop back-off)
and measures until its replacement (a) took the slot and (b) serves it:
its sockets joined the reuseport groups, i.e. it applied the full table. Modes alternate round
by round. `--load` runs `stress-ng --cpu 2` beside it for the run (killed by PID).

    .venv/bin/python benchmarks/replacement.py [--services 10000] [--kills 5] [--load]

Writes benchmarks/results/replacement.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.testbed import command, memory_kib, process_tree  # noqa: E402

from kube_userspace_proxy import app  # noqa: E402
from kube_userspace_proxy.config.settings import ProxyConfig  # noqa: E402
from kube_userspace_proxy.workers import supervisor  # noqa: E402
from tests.loopback import proxyrun  # noqa: E402
from tests.loopback.proxyrun import (  # noqa: E402
    endpoint_slice,
    loopback_config,
    service,
    write_manifests,
)

RESULTS = ROOT / "benchmarks" / "results"


def manifest(path: Path, count: int) -> None:
    objects: list[Any] = []
    for i in range(count):
        objects.append(
            service(f"s{i}", [{"name": "http", "port": 80}], cluster_ip=f"10.96.{i >> 8}.{i & 255}")
        )
        objects.extend(endpoint_slice(f"s{i}", "http", [("127.0.0.1", 9)]))
    write_manifests(path, objects)


def running_proxy(config: ProxyConfig) -> contextlib.AbstractAsyncContextManager[app.Proxy]:
    """The loopback tests' `running_proxy`, with deadlines for 10,000 Services."""
    return proxyrun.running_proxy(config, start=120, sync=300, stop_within=120)


def tree_memory() -> dict[str, Any]:
    """RSS and PSS (MiB) of this process and its descendants, and of each."""
    each = []
    for pid in process_tree(os.getpid()):
        rss, pss = memory_kib(pid)
        if rss:
            each.append(
                {"pid": pid, "name": command(pid), "rss_mib": rss / 1024, "pss_mib": pss / 1024}
            )
    return {
        "rss_mib": sum(p["rss_mib"] for p in each),
        "pss_mib": sum(p["pss_mib"] for p in each),
        "processes": each,
    }


async def run_mode(path: Path, services: int, spare: bool, kills: int) -> dict[str, Any]:
    supervisor.KEEP_SPARE = spare
    config = loopback_config(path, workers="2", guard_proxy_ports=False)
    out: dict[str, Any] = {"spare": spare, "took_ms": [], "served_ms": []}
    async with running_proxy(config) as proxy:
        pool = proxy.workers
        assert pool is not None
        deadline = time.monotonic() + 300
        while not (pool.alive == 2 and proxy.proxier.served_count == services):
            assert time.monotonic() < deadline, "never served"
            await asyncio.sleep(0.1)
        await asyncio.sleep(3)  # the spare (if any) is up; the first publishes are done
        out["memory"] = tree_memory()
        for k in range(kills):
            victim = k % 2
            key = next(iter(pool.groups()))
            old = pool.pids()[victim]
            os.kill(old, signal.SIGKILL)
            killed = time.monotonic()
            took = None
            while True:
                now = time.monotonic()
                if took is None and pool.pids()[victim] not in (0, old):
                    took = now
                if took is not None and victim in pool.members(key):
                    break
                assert now - killed < 60, "not replaced"
                await asyncio.sleep(0.002)
            out["took_ms"].append(1000 * (took - killed))
            out["served_ms"].append(1000 * (now - killed))
            # A worker that dies within 10 s of its start is restarted after a growing delay
            # (a crash loop): space the kills so that each is a first failure.
            await asyncio.sleep(supervisor.RECENT + 1)
        out["memory_after"] = tree_memory()
    return out


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "max": max(values)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "svc.yaml"
        manifest(path, args.services)
        runs: dict[str, list[dict[str, Any]]] = {"spare": [], "on demand": []}
        for _ in range(args.rounds):
            for name, spare in (("spare", True), ("on demand", False)):
                runs[name].append(await run_mode(path, args.services, spare, args.kills))
        return {
            name: {
                "took_ms": summary([v for r in rs for v in r["took_ms"]]),
                "served_ms": summary([v for r in rs for v in r["served_ms"]]),
                "rss_mib": statistics.median(r["memory"]["rss_mib"] for r in rs),
                "pss_mib": statistics.median(r["memory"]["pss_mib"] for r in rs),
                "runs": rs,
            }
            for name, rs in runs.items()
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--kills", type=int, default=5, help="kills per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per mode, alternating")
    parser.add_argument("--load", action="store_true", help="stress-ng --cpu 2 beside it")
    parser.add_argument("--out", default="replacement")
    args = parser.parse_args()
    hog = None
    if args.load:
        hog = subprocess.Popen(["stress-ng", "--cpu", "2", "--timeout", "900s", "--quiet"])
    try:
        result = asyncio.run(main_async(args))
    finally:
        if hog is not None:
            hog.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                hog.wait(10)
            if hog.poll() is None:
                hog.kill()
                hog.wait()
    result["args"] = vars(args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"{args.services:,} Services, --workers 2, {args.kills} kills x {args.rounds} runs per mode"
        + (", stress-ng --cpu 2 beside it" if args.load else ""),
        "",
        "| mode | slot taken, median / max | slot served, median / max | tree RSS | tree PSS |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("spare", "on demand"):
        r = result[name]
        lines.append(
            f"| {name} | {r['took_ms']['median']:.0f} / {r['took_ms']['max']:.0f} ms"
            f" | {r['served_ms']['median']:.0f} / {r['served_ms']['max']:.0f} ms"
            f" | {r['rss_mib']:.0f} MiB | {r['pss_mib']:.0f} MiB |"
        )
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
