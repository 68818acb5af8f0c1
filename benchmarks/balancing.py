"""L4 balancing beyond kube-proxy, measured: rr against lc, ejection against a blackholed
endpoint (beside kernel DNAT), and how many clients sh keeps when an endpoint goes.

The topology of the integration tests (`tests/integration/netns.py`: a client pod, a node and
three backend pods joined by veth pairs, in network namespaces named with this pid; the root
namespace is never touched). The pods run a holding backend: it answers each connection's
first bytes with its pod's name and keeps the connection until the client closes it. The
client takes its source addresses in turn from eight of its own (10.244.1.20-27), so that the
proxy's two workers (steered by client address) both serve. The proxy is the real
`kube-userspace-proxy run --workers 2` in the node namespace, capturing ClusterIP
10.96.0.10:80; kernel mode is kube-proxy's iptables DNAT for ClusterIP 10.96.0.20:80.

1. spread (rr, lc): `--spread-seconds` of new connections at `--spread-rate`/s; a quarter of
   them (drawn with a fixed seed) are held ten times longer (2.5 s against 0.25 s). The client
   knows which pod answered each connection, and samples every 100 ms how many each pod holds:
   the spread is max - min of those counts per sample (and their standard deviation).
2. blackhole: `iptables -j DROP` on the pods' port inside pod-c's namespace (SYNs vanish);
   `--blackhole-count` new connections at 10/s (connect to first byte of the answer, 3 s
   client timeout) through the proxy with ejection (the defaults: 5 failed dials, 30 s), the
   proxy without (`--outlier-consecutive-failures 0`; a failed dial still skips the endpoint
   for 1 s), and kernel DNAT. Slow: more than 200 ms, a timeout counted as slow.
3. sh: the share of the other endpoints' clients (100,000 client addresses) that keep their
   endpoint when one of 3, 10 and 50 goes (ideal 1.0, target at least 0.95), beside the
   1/(N-1) that `hash % N` would keep.

Writes benchmarks/results/balancing.{json,md,png}. Needs root; bounded in count and time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.testbed import cpu_model, kernel_rules, source_commit  # noqa: E402

from tests.integration.conftest import IPTABLES, Proxy, write_manifest  # noqa: E402
from tests.integration.netns import (  # noqa: E402
    POD_PORT,
    PODS,
    Topology,
    stop,
    wait_for,
)

RESULTS = ROOT / "benchmarks" / "results"
PROXY_IP, KERNEL_IP, PORT = "10.96.0.10", "10.96.0.20", 80
SOURCES = [f"10.244.1.{20 + i}" for i in range(8)]
BACKEND_BY = "iptables-nft"

HOLDING = textwrap.dedent(
    """
    import socket, sys, threading
    name, port = sys.argv[1].encode(), int(sys.argv[2])
    def serve(c):
        try:
            c.recv(64); c.sendall(name + b"\\n")
            while c.recv(4096):
                pass
        except OSError:
            pass
        finally:
            c.close()
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(1024)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
    """
)

# New connections at `rate`/s for `count` of them, each in a thread of its own (a slow one
# does not delay the next); per connection: seconds from connect() to the answer, pod name or
# "error: ..."; it is held `short` s, or `long` s (a `share` of them, drawn with a fixed seed).
# With `sample`, it prints the per-pod counts of open connections every 100 ms too.
LOAD = textwrap.dedent(
    """
    import json, random, socket, sys, threading, time
    host, port, count, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    short, long_, sources = float(sys.argv[5]), float(sys.argv[6]), sys.argv[7].split(",")
    share, sample = float(sys.argv[8]), sys.argv[9] == "1"
    draw = random.Random(7)
    longs = [draw.random() < share for _ in range(count)]  # the same ones in every run
    results, held, lock = [None] * count, {}, threading.Lock()
    def one(i):
        src = sources[i % len(sources)]
        start = time.perf_counter()
        try:
            s = socket.create_connection((host, port), timeout=3, source_address=(src, 0))
        except OSError as exc:
            results[i] = (time.perf_counter() - start, "error: " + type(exc).__name__); return
        try:
            s.sendall(b"x")
            name = s.recv(64).decode().strip() or "error: closed"
            results[i] = (time.perf_counter() - start, name)
            with lock: held[name] = held.get(name, 0) + 1
            time.sleep(long_ if longs[i] else short)
            with lock: held[name] -= 1
        except OSError as exc:
            results[i] = (time.perf_counter() - start, "error: " + type(exc).__name__)
        finally:
            s.close()
    samples, done = [], threading.Event()
    def sampler():
        while not done.wait(0.1):
            with lock: samples.append(dict(held))
    if sample:
        threading.Thread(target=sampler, daemon=True).start()
    threads, begin = [], time.perf_counter()
    for i in range(count):
        delay = begin + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(i,), daemon=True); t.start(); threads.append(t)
    for t in threads:
        t.join(10)
    done.set()
    print(json.dumps({"results": results, "samples": samples}))
    """
)


def holding_backends(topo: Topology, tmp: Path) -> None:
    """Replace the topology's one-shot backends with holding ones."""
    for proc in topo.procs:
        stop(proc)
    topo.procs.clear()
    for pod, ns in topo.pods.items():
        topo.procs.append(
            ns.popen([sys.executable, "-u", "-c", HOLDING, pod, str(POD_PORT)], tmp / f"{pod}.log")
        )
    for pod, ns in topo.pods.items():
        wait_for(lambda ns=ns: f":{POD_PORT} " in ns.run("ss", "-lnt"), f"{pod} listening")


def manifest(scheduler: str) -> list[dict[str, Any]]:
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "web",
            "namespace": "default",
            "annotations": {"kube-userspace-proxy.io/scheduler": scheduler},
        },
        "spec": {
            "clusterIP": PROXY_IP,
            "ports": [{"name": "p", "protocol": "TCP", "port": PORT, "targetPort": POD_PORT}],
        },
    }
    piece = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-x",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": "web"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "p", "protocol": "TCP", "port": POD_PORT}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": True}, "nodeName": "node"}
            for ip in PODS.values()
        ],
    }
    return [svc, piece]


def load(
    topo: Topology,
    host: str,
    count: int,
    rate: float,
    *,
    short: float = 0.0,
    long_: float = 0.0,
    share: float = 0.0,
    sample: bool = False,
) -> dict[str, Any]:
    out = topo.client.python(
        LOAD,
        host,
        str(PORT),
        str(count),
        str(rate),
        str(short),
        str(long_),
        ",".join(SOURCES),
        str(share),
        "1" if sample else "0",
        timeout=count / rate + long_ + 60,
    )
    result: dict[str, Any] = json.loads(out)
    return result


class Run:
    """One proxy in the node namespace (started, checked, stopped by PID)."""

    dataplane = "auto"  # --dataplane of every run (main() sets it)

    def __init__(self, topo: Topology, tmp: Path, name: str, *flags: str) -> None:
        path = tmp / f"{name}.yaml"
        write_manifest(path, manifest("rr"))
        flags = ("--workers", "2", "--dataplane", Run.dataplane, *flags)
        self.proxy = Proxy(topo, "restore", path, tmp / f"{name}.log", flags)
        self.path = path

    def start(self, scheduler: str) -> None:
        write_manifest(self.path, manifest(scheduler))
        self.proxy.start()
        self.proxy.wait_rules(PROXY_IP)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # every pod answers through it
            got = load(self.proxy.topo, PROXY_IP, 12, 50.0)
            if all(not n.startswith("error") for _, n in got["results"]):
                return
            time.sleep(0.5)
        raise RuntimeError("the proxy does not answer")

    def stop(self) -> None:
        if self.proxy.proc is not None:
            stop(self.proxy.proc)
            self.proxy.proc = None


def spread(topo: Topology, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    count = int(args.spread_rate * args.spread_seconds)
    for scheduler in ("rr", "lc"):
        run = Run(topo, tmp, f"spread-{scheduler}")
        run.start(scheduler)
        try:
            got = load(
                topo, PROXY_IP, count, args.spread_rate,
                short=0.25, long_=2.5, share=0.25, sample=True,
            )  # fmt: skip
        finally:
            run.stop()
        samples = [[s.get(pod, 0) for pod in PODS] for s in got["samples"] if sum(s.values()) > 0]
        gaps = [max(c) - min(c) for c in samples]
        stdevs = [statistics.pstdev(c) for c in samples]
        errors = sum(1 for _, n in got["results"] if n.startswith("error"))
        out[scheduler] = {
            "connections": count,
            "errors": errors,
            "samples": len(samples),
            "mean_open": statistics.mean(sum(c) for c in samples),
            "gap_mean": statistics.mean(gaps),
            "gap_p95": sorted(gaps)[int(0.95 * (len(gaps) - 1))],
            "gap_max": max(gaps),
            "stdev_mean": statistics.mean(stdevs),
            "series": samples,
        }
    return out


def blackhole(topo: Topology, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    pod_c = topo.pods["pod-c"]
    rule = ["INPUT", "-p", "tcp", "--dport", str(POD_PORT), "-j", "DROP"]
    out: dict[str, Any] = {}
    pod_c.run(BACKEND_BY, "-A", *rule)
    try:
        for label, host, flags in (
            ("proxy, ejection (5 failures, 30s)", PROXY_IP, ()),
            ("proxy, no ejection", PROXY_IP, ("--outlier-consecutive-failures", "0")),
            ("kernel DNAT", KERNEL_IP, None),
        ):
            run = None
            if flags is not None:
                run = Run(topo, tmp, f"blackhole-{len(out)}", *flags)
                pod_c.run(BACKEND_BY, "-D", *rule)  # the readiness probe reaches every pod
                try:
                    run.start("rr")
                finally:
                    pod_c.run(BACKEND_BY, "-A", *rule)
            try:
                got = load(topo, host, args.blackhole_count, 10.0)
            finally:
                if run is not None:
                    run.stop()
            times = sorted(t * 1000 for t, n in got["results"] if not n.startswith("error"))
            errors = sum(1 for _, n in got["results"] if n.startswith("error"))
            slow = sum(1 for t in times if t > 200) + errors
            series = [(t * 1000, n) for t, n in got["results"]]
            out[label] = {
                "connections": args.blackhole_count,
                "slow_over_200ms": slow,
                "errors_or_timeouts": errors,
                "p50_ms": times[len(times) // 2] if times else None,
                "p99_ms": (
                    3000.0
                    if errors >= 0.01 * args.blackhole_count
                    else times[min(len(times) - 1, int(0.99 * len(times)))]
                ),
                "series": series,
            }
    finally:
        pod_c.run(BACKEND_BY, "-D", *rule, check=False)
    return out


def sh_share(clients: int = 100_000) -> dict[str, Any]:
    from kube_userspace_proxy.balancer import EndpointPool
    from kube_userspace_proxy.model import Endpoint, ServicePortName

    name = ServicePortName("default", "web", "p")
    ips = [f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}" for i in range(1, clients + 1)]
    out: dict[str, Any] = {}
    for count in (3, 10, 50):
        endpoints = [Endpoint(f"10.244.{i // 250}.{i % 250 + 1}", 8080) for i in range(count)]
        before, after = EndpointPool(name), EndpointPool(name)
        for pool, eps in ((before, endpoints), (after, endpoints[1:])):
            pool.set_scheduler("sh")
            pool.update(eps, affinity_timeout=None)
        gone = endpoints[0].address
        kept = moved = 0
        for ip in ips:
            was = before.pick(ip)
            if was == gone:
                continue
            if after.pick(ip) == was:
                kept += 1
            else:
                moved += 1
        out[str(count)] = {
            "endpoints": count,
            "kept_share": kept / (kept + moved),
            "modulo_hash_share": 1 / (count - 1),  # hash % N: a client keeps it 1/(N-1)
            "target": 0.95,
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# Balancing: rr against lc, ejection against a blackholed endpoint, sh's stability",
        "",
        f"`python benchmarks/balancing.py` on {m['cpus']} CPUs ({m['cpu_model']}), "
        f"src {m['commit']}, {m['date']}; load average before: {m['load_before']};"
        f" `--dataplane {result['args'].get('dataplane', 'auto')}`"
        f" ({result.get('dataplane', 'the Python one: before the native data plane')}).",
        "",
        "## Spread of open connections per endpoint (3 pods, 2 workers)",
        "",
        f"{result['args']['spread_rate']:g} new connections/s for "
        f"{result['args']['spread_seconds']:g} s; a quarter of them (a fixed draw) are held "
        "2.5 s, the rest 0.25 s. Per 100 ms sample: max - min of the pods' open connections.",
        "",
        "| scheduler | mean open | gap mean | gap p95 | gap max | stdev mean | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for sched, s in result["spread"].items():
        lines.append(
            f"| {sched} | {s['mean_open']:.1f} | {s['gap_mean']:.2f} | {s['gap_p95']} | "
            f"{s['gap_max']} | {s['stdev_mean']:.2f} | {s['errors']} |"
        )
    lines += [
        "",
        "## One of three endpoints blackholed (SYNs dropped in pod-c)",
        "",
        f"{result['args']['blackhole_count']} new connections at 10/s, connect to the first "
        "byte of the answer; a 3 s client timeout counts as slow. Target: at most 8 slow.",
        "",
        "| path | slow (>200 ms) | timeouts/errors | p50 ms | p99 ms |",
        "|---|---|---|---|---|",
    ]
    for label, b in result["blackhole"].items():
        lines.append(
            f"| {label} | {b['slow_over_200ms']} | {b['errors_or_timeouts']} | "
            f"{_ms(b['p50_ms'])} | {_ms(b['p99_ms'])} |"
        )
    lines += [
        "",
        "## sh: the other endpoints' clients that keep theirs when one endpoint goes",
        "",
        "100,000 client addresses; `hash % N` would keep 1/(N-1) of them. Target: >= 0.95.",
        "",
        "| endpoints | kept (sh, Maglev) | kept (hash % N) |",
        "|---|---|---|",
    ]
    for n, s in result["sh"].items():
        lines.append(f"| {n} | {s['kept_share']:.4f} | {s['modulo_hash_share']:.3f} |")
    lines += ["", "![balancing](balancing.png)", ""]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for sched, s in result["spread"].items():
        gaps = [max(c) - min(c) for c in s["series"]]
        ax.plot([i / 10 for i in range(len(gaps))], gaps, label=f"{sched}", lw=1)
    ax.set_title("max - min open connections per pod")
    ax.set_xlabel("seconds")
    ax.legend()
    ax = axes[1]
    for label, b in result["blackhole"].items():
        ax.plot(range(len(b["series"])), [min(t, 3000) for t, _ in b["series"]], ".", ms=3,
                label=f"{label}: {b['slow_over_200ms']} slow")  # fmt: skip
    ax.axhline(200, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_title("new connection time, one pod blackholed (ms)")
    ax.set_xlabel("connection (10/s)")
    ax.legend(fontsize=7)
    ax = axes[2]
    ns = list(result["sh"])
    ax.bar([f"{n} (sh)" for n in ns], [result["sh"][n]["kept_share"] for n in ns])
    ax.bar([f"{n} (%N)" for n in ns], [result["sh"][n]["modulo_hash_share"] for n in ns])
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.set_title("others' clients kept when 1 of N goes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def dataplane_serving(flag: str) -> str:
    """The TCP data plane `--dataplane flag` resolves to in this installation."""
    from kube_userspace_proxy.dataplane import tcp

    return f"the {tcp.resolve(flag)} data plane"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spread-rate", type=float, default=40.0, help="connections/s")
    parser.add_argument("--spread-seconds", type=float, default=20.0, help="seconds per run")
    parser.add_argument("--blackhole-count", type=int, default=250, help="connections per path")
    parser.add_argument("--out", type=Path, default=RESULTS / "balancing")
    parser.add_argument(
        "--dataplane", choices=("auto", "native", "python"), default="auto", help="the proxy's"
    )
    args = parser.parse_args()
    Run.dataplane = args.dataplane
    if args.blackhole_count > 2000 or args.spread_rate * args.spread_seconds > 5000:
        parser.error("bounded: at most 2000 blackhole connections and 5000 spread ones")
    with open("/proc/loadavg") as f:
        load_before = " ".join(f.read().split()[:3])
    result: dict[str, Any] = {
        "machine": {
            "cpus": len(__import__("os").sched_getaffinity(0)),
            "cpu_model": cpu_model(),
            "commit": source_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_before": load_before,
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "dataplane": dataplane_serving(args.dataplane),
    }
    result["sh"] = sh_share()
    with tempfile.TemporaryDirectory(prefix="kup-balancing-") as tmp_dir:
        tmp = Path(tmp_dir)
        topo = Topology.create(tmp)
        try:
            holding_backends(topo, tmp)
            topo.node.run("sysctl", "-qw", "net.ipv4.ip_forward=1")  # kernel DNAT forwards
            client = topo.client
            for src in SOURCES:
                client.ip("addr", "add", f"{src}/24", "dev", "eth0")
            rules = "\n".join(
                [
                    "*nat",
                    ":KUBE-SERVICES - [0:0]",
                    ":KUBE-MARK-MASQ - [0:0]",
                    "-A PREROUTING -j KUBE-SERVICES",
                    "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
                    kernel_rules("kweb", KERNEL_IP, PORT, [(ip, POD_PORT) for ip in PODS.values()]),
                    "COMMIT",
                    "",
                ]
            )
            (tmp / "kernel.rules").write_text(rules)
            topo.node.run(IPTABLES["restore"] + "-restore", "--noflush", str(tmp / "kernel.rules"))
            result["spread"] = spread(topo, tmp, args)
            result["blackhole"] = blackhole(topo, tmp, args)
        finally:
            topo.destroy()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    chart(result, args.out.with_suffix(".png"))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
