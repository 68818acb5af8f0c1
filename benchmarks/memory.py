"""The control process's memory: at start, serving N Services, and after /metrics scrapes.

Each case runs the real proxy (`kube-userspace-proxy run --manifests`, the iptables-restore
backend, the default `--workers auto`) in a network namespace of its own (named with this
pid, deleted afterwards), from this tree and, with `--baseline OTHER/src`, from another
checkout's src/ right after it, so the two figures come from the same minutes:

- `start`: no Services; the control process's RSS once it serves (the issue's target: 40 MB);
- `NxE`: N Services with E endpoints each (one YAML file); its RSS once all are served,
  after each of three `/metrics` scrapes and after one `/debug/state` (a scrape used to
  leave the RSS ~45 MiB higher for good at 10,000: see docs/benchmarks.md).

Also, in this process, the per-port `/metrics` text of N idle TCP service ports: the time of
a scrape and what stays allocated after it (`ops/portmetrics.py`).

    sudo .venv/bin/python benchmarks/memory.py [--cases start,10000x3] [--baseline OTHER/src]

The API-server mode at 10,000 x 3 is `benchmarks/scale.py`'s (its table has the control
process's RSS after start and after the storm).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROXY = ROOT / ".venv" / "bin" / "kube-userspace-proxy"
METRICS = "127.0.0.1:10249"
NODE_IP = "10.250.0.1"


def rss_mib(pid: int) -> float:
    """The RSS of process `pid` in MiB (0 once it is gone)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def manifest(services: int, endpoints: int) -> str:
    """`services` Services (one TCP port, a ClusterIP each) and their EndpointSlices."""
    docs = []
    for i in range(services):
        ip = f"10.96.{1 + i // 250}.{1 + i % 250}"
        addresses = "".join(
            f"- addresses: [10.244.{1 + k}.{1 + i % 250}]\n" for k in range(endpoints)
        )
        docs.append(
            f"---\napiVersion: v1\nkind: Service\nmetadata: {{name: s{i}, namespace: default}}\n"
            f"spec:\n  clusterIP: {ip}\n  ports: [{{name: http, port: 80, protocol: TCP}}]\n"
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n"
            f"metadata: {{name: s{i}-a, namespace: default, labels: "
            f"{{kubernetes.io/service-name: s{i}}}}}\naddressType: IPv4\n"
            f"ports: [{{name: http, port: 8080, protocol: TCP}}]\nendpoints:\n{addresses}"
        )
    return "".join(docs)


@contextlib.contextmanager
def namespace() -> Iterator[str]:
    """A network namespace with lo up and the node's address on a veth; deleted after."""
    name = f"kupmem{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for command in (
            "link set lo up",
            "link add mem0 type veth peer name mem1",
            f"addr add {NODE_IP}/24 dev mem0",
            "link set mem0 up",
            "link set mem1 up",
        ):
            subprocess.run(["ip", "-n", name, *command.split()], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def fetch(ns: str, path: str) -> int:
    """GET http://METRICS/path from inside `ns`; the body's length."""
    script = (
        "import sys, urllib.request\n"
        f"print(len(urllib.request.urlopen('http://{METRICS}{path}', timeout=60).read()))"
    )
    done = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(done.stdout)


def run_case(case: str, src: str | None, tmp: Path, deadline: float) -> dict[str, Any]:
    """One case from this tree (`src` None) or from another checkout's src/."""
    services, endpoints = (0, 0) if case == "start" else (int(x) for x in case.split("x"))
    directory = tmp / case
    directory.mkdir(exist_ok=True)
    (directory / "all.yaml").write_text(manifest(services, endpoints))
    state = tempfile.mkdtemp(dir=tmp, prefix="state-")  # a fresh one: no earlier ports
    env = dict(os.environ, PYTHONPATH=src) if src else None
    result: dict[str, Any] = {"case": case, "src": src or "this tree"}
    with namespace() as ns:
        command = ["ip", "netns", "exec", ns, str(PROXY), "run", "--manifests", str(directory)]
        command += ["--state-dir", state, "--node-ip", NODE_IP, "--iptables-backend", "restore"]
        command += ["--metrics-bind-address", METRICS]
        command += ["--healthz-bind-address", "127.0.0.1:10256"]
        log = (tmp / f"proxy-{case}-{'base' if src else 'tree'}.log").open("w+")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            began = time.monotonic()
            want = f"serving {services} new service ports" if services > 100 else "handover"
            while time.monotonic() - began < deadline:
                log.seek(0)
                if want in log.read():
                    break
                if proc.poll() is not None:
                    raise SystemExit(f"the proxy exited: see {log.name}")
                time.sleep(0.5)
            else:
                raise SystemExit(f"not serving within {deadline} s: see {log.name}")
            time.sleep(5)  # the first sync's leftovers: the state file, the rule commit
            pid = proc.pid  # `ip netns exec` execs the proxy: the same process
            result["serving_mib"] = rss_mib(pid)
            for k in range(3):
                fetch(ns, "/metrics")
                time.sleep(1)
                result[f"after_scrape_{k + 1}_mib"] = rss_mib(pid)
            fetch(ns, "/debug/state")
            time.sleep(1)
            result["after_debug_state_mib"] = rss_mib(pid)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    return result


def metrics_text(services: int) -> dict[str, float]:
    """The per-port /metrics text of `services` idle TCP service ports, in this process."""
    from kube_userspace_proxy import collector
    from kube_userspace_proxy.dataplane import ConnStats
    from kube_userspace_proxy.model import Protocol, ServicePortName
    from kube_userspace_proxy.ops.portmetrics import PortMetrics

    ports = [
        (ServicePortName("default", f"svc-{i}", "http", Protocol.TCP), ConnStats())
        for i in range(services)
    ]
    metrics = PortMetrics(lambda: ports)
    gc.collect()
    collector.release_free_memory()
    base = rss_mib(os.getpid())
    out: dict[str, float] = {}
    for k in range(3):
        began = time.perf_counter()
        body = b"".join(metrics.render(metrics.capture()))
        out[f"scrape_{k + 1}_ms"] = 1000 * (time.perf_counter() - began)
        del body
    collector.release_free_memory()
    out["kept_after_mib"] = rss_mib(os.getpid()) - base
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="start,10000x3")
    parser.add_argument("--baseline", help="another checkout's src/, run after this tree")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds to serve")
    args = parser.parse_args()
    print(f"/metrics text of 10,000 idle TCP ports, in-process: {metrics_text(10_000)}")
    with tempfile.TemporaryDirectory(prefix="kup-memory-") as tmp:
        for case in args.cases.split(","):
            for src in (None, args.baseline) if args.baseline else (None,):
                print(run_case(case, src, Path(tmp), args.deadline), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
