"""Kernel iptables mode vs this proxy (userspace mode) vs direct, for one Service, in one run.

The topology of the integration tests (`tests/integration/netns.py`: a client pod, a node and
three backend pods, joined by veth pairs, in network namespaces named with this pid) carries
the same Service, with the same three endpoints, along three paths:

  kernel     ClusterIP 10.96.0.10:80 -> DNAT in the node namespace, laid out as kube-proxy's
             iptables mode does it: PREROUTING/OUTPUT -> KUBE-SERVICES -> KUBE-SVC-* ->
             `-m statistic --mode random --probability` -> KUBE-SEP-* -> DNAT to a pod
             (with KUBE-MARK-MASQ / KUBE-POSTROUTING, which this traffic does not hit).
  userspace  ClusterIP 10.96.0.11:80 -> the real `kube-userspace-proxy run` in the node
             namespace (its own KUBE-PORTALS-* rules; REDIRECT to its proxy port, then it
             dials a pod round robin).
  direct     pod-a itself (the ceiling: no NAT, no proxy), on a second nginx in pod-a with as
             many workers as the three pods have together, so every path is served by the
             same number of nginx processes (on a busy machine the scheduler shares CPU per
             runnable task, so one worker against three would not be a ceiling).

Backends: nginx, one worker per pod by default (`return 200 "<pod name>"`, no access log,
unlimited keep-alive requests); load: wrk, 2 threads by default (one thread could not saturate
the kernel path on 2 CPUs). Bulk: iperf3 (client sends, `-Z`) against a one-endpoint Service
on pod-a (iperf3's control and data connections must reach the same server), with a ClusterIP
per mode as well. Each path has its own client address (a route with `src` per destination),
so TIME_WAIT tuples of one path never meet another's; the client namespace gets
tcp_tw_reuse=1 and ip_local_port_range 1024-65535, the node namespace ip_forward=1 and a 10 s
conntrack TIME_WAIT timeout (per namespace; 120 s would pile up ~10^5 entries in the
new-connection runs). Before measuring, 60 one-shot requests per path check that every pod
answers.

Measured, per path, in `--rounds` interleaved rounds (path order rotated each round):

  keep-alive  requests/s, `--connections` keep-alive connections for `--seconds`; p99 latency
  new conns   requests/s with `Connection: close` (one request per connection), same bounds
  bulk        Gbit/s over `--bulk-runs` transfers of `--bulk-bytes` per stream x `--streams`
              (each killed after `--bulk-timeout` s)
  CPU         user+system seconds over each run of the proxy (/proc/PID/stat), of the servers
              (nginx workers, iperf3) and of the client (wrk, iperf3: rusage of reaped
              children), as shares of one CPU, and the time the proxy was runnable but
              waiting for a CPU (/proc/PID/schedstat); the machine's busy share (/proc/stat,
              all CPUs, other work included); CPU per unit of work of the whole path
              (client + servers + proxy: microseconds per request or connection, seconds per
              GiB) and of the proxy alone. On a shared machine the whole-path CPU per unit
              is the steadier comparison: its ratio (kernel's / this path's) is the work
              done per CPU second.

Figures are medians over rounds [min-max], with ratios of medians to kernel mode; `--json`
also has every sample, the p50 latency and iperf3's retransmits. Needs root (installs wrk,
nginx-light and iperf3 with apt-get when missing); creates and deletes its own namespaces (and
kills what it started, by PID); configures nothing in the root namespace. The namespaces,
nginx pods, kernel-mode rules and load tools are `testbed.py`'s, shared with `peers.py`. About
2 minutes with the defaults. The proxy runs with `--workers auto` (its default) unless told;
its CPU is that of all its processes (control, workers, spare). Writes
`benchmarks/results/kernel-vs-userspace.json` (everything) and `.png` (the ratios, with the
`bench` extra's matplotlib); `--replot` redraws the chart from that JSON without measuring.

    sudo bash scripts/dev bench kernel_vs_userspace [--seconds 5] [--rounds 3]
        [--connections 50] [--threads 2] [--bulk-bytes 1073741824] [--streams 1]
        [--bulk-runs 2] [--nginx-workers 1] [--iptables-backend restore|iptc]
        [--workers auto] [--json] [--out DIR] [--replot]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
from testbed import (
    BULK_PORT,
    HTTP_PORT,
    ROOT,
    TOOLS,
    GiB,
    Testbed,
    cpu_model,
    cpu_shares,
    install_missing,
    long_lived,
    source_commit,
    version,
)

from tests.integration.conftest import Proxy, service, write_manifest
from tests.integration.netns import PODS, available, stop

PATHS = ("kernel", "userspace", "direct")
NAME = "kernel-vs-userspace"
RESULTS = ROOT / "benchmarks" / "results"
DIRECT_PORT = 8081
# Per path: (HTTP address, bulk address, client source address).
ADDRESSES = {
    "kernel": ("10.96.0.10", "10.96.0.20", "10.244.1.11"),
    "userspace": ("10.96.0.11", "10.96.0.21", "10.244.1.12"),
    "direct": (PODS["pod-a"], PODS["pod-a"], "10.244.1.13"),
}


def manifest_objects() -> list[dict[str, Any]]:
    """The Services the proxy serves: web on all three pods, bulk on pod-a's iperf3."""
    web = service("web", ADDRESSES["userspace"][0], HTTP_PORT)
    bulk = service("bulk", ADDRESSES["userspace"][1], BULK_PORT, pods=("pod-a",))
    bulk[0]["spec"]["ports"][0]["targetPort"] = BULK_PORT
    bulk[1]["ports"][0]["port"] = BULK_PORT
    return [*web, *bulk]


class Bench:
    """The testbed and the proxy of one run; `close` removes all of it."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.bed = Testbed(tmp, args.nginx_workers, args.iptables_backend)
        self.proxy: Proxy | None = None

    def setup(self) -> None:
        bed = self.bed
        bed.setup()
        for http, bulk, src in ADDRESSES.values():
            bed.client_route(src, http, bulk)
        bed.nginx("pod-a", DIRECT_PORT, 3 * self.args.nginx_workers)
        bed.wait_listening("pod-a", DIRECT_PORT)
        bed.started_servers()
        # Kernel mode first, then the proxy (it adds its own chains and jumps beside these).
        bed.kernel_mode(ADDRESSES["kernel"][0], ADDRESSES["kernel"][1])
        manifest = self.tmp / "services.yaml"
        write_manifest(manifest, manifest_objects())
        assert bed.topo is not None
        self.proxy = Proxy(
            bed.topo,
            self.args.iptables_backend,
            manifest,
            self.tmp / "proxy.log",
            # The integration tests resync every second; a benchmark runs with the defaults.
            (
                *("--iptables-sync-period", "30s", "--iptables-min-sync-period", "1s", "-v", "0"),
                *("--workers", self.args.workers),
            ),
        )
        self.proxy.start()
        self.proxy.wait_rules(ADDRESSES["userspace"][0], ADDRESSES["userspace"][1])

    def close(self) -> None:
        if self.proxy is not None and self.proxy.proc is not None:
            stop(self.proxy.proc)
        self.bed.close()

    # --- checks and measurements

    def port(self, path: str) -> int:
        return DIRECT_PORT if path == "direct" else HTTP_PORT

    def spread(self, path: str, count: int = 60) -> dict[str, int]:
        return self.bed.spread(ADDRESSES[path][0], self.port(path), count)

    def wrk(self, path: str, seconds: int, close: bool) -> dict[str, Any]:
        url = f"http://{ADDRESSES[path][0]}:{self.port(path)}/"
        a = self.args
        return self.bed.wrk(url, seconds, threads=a.threads, connections=a.connections, close=close)

    def iperf(self, path: str) -> dict[str, Any]:
        return self.bed.iperf(
            ADDRESSES[path][1],
            self.args.streams,
            bytes_per_stream=self.args.bulk_bytes,
            timeout=self.args.bulk_timeout,
        )

    def cpu(self) -> dict[str, float]:
        assert self.proxy is not None and self.proxy.proc is not None
        # The control process, its workers and the spare: every process of the proxy.
        return self.bed.cpu(long_lived(self.proxy.proc.pid))

    def shares(self, got: dict[str, Any], before: dict[str, float], path: str) -> None:
        """Adds each part's CPU use over the run, as a share of one CPU (machine: of all)."""
        cpu_shares(got, before, self.cpu(), proxy=path == "userspace")

    def sample(self, path: str) -> dict[str, Any]:
        """One round of the three measurements on one path."""
        out: dict[str, Any] = {}
        for kind, close in (("keepalive", False), ("newconn", True)):
            before = self.cpu()
            got = self.wrk(path, self.args.seconds, close)
            self.shares(got, before, path)
            got["path_cpu_us_per_req"] = got["path_cpu_s"] / max(1, got["requests"]) * 1e6
            if path == "userspace":
                got["proxy_cpu_us_per_req"] = got["proxy_cpu_s"] / max(1, got["requests"]) * 1e6
            out[kind] = got
        before = self.cpu()
        runs = [self.iperf(path) for _ in range(self.args.bulk_runs)]
        done = [r for r in runs if "bytes" in r]
        got = {"runs": runs}
        if len(done) < len(runs):
            got["error"] = next(r["error"] for r in runs if "error" in r)
        if done:
            got["bytes"] = sum(r["bytes"] for r in done)
            got["seconds"] = sum(r["seconds"] for r in done)
            got["gbit_s"] = got["bytes"] * 8 / got["seconds"] / 1e9
            got["retransmits"] = sum(r["retransmits"] for r in done)
        self.shares(got, before, path)
        if "bytes" in got:
            got["path_cpu_s_per_gib"] = got["path_cpu_s"] / (got["bytes"] / GiB)
        if path == "userspace" and "bytes" in got:
            got["proxy_cpu_s_per_gib"] = got["proxy_cpu_s"] / (got["bytes"] / GiB)
        out["bulk"] = got
        return out


KINDS = {"keepalive": "rate", "newconn": "rate", "bulk": "gbit_s"}
STATS = (
    "rate",
    "gbit_s",
    "p50_us",
    "p99_us",
    "client_cpu_share",
    "servers_cpu_share",
    "proxy_cpu_share",
    "proxy_wait_share",
    "machine_busy",
    "path_cpu_us_per_req",
    "path_cpu_s_per_gib",
    "proxy_cpu_us_per_req",
    "proxy_cpu_s_per_gib",
    "retransmits",
)
# CPU per unit of work of the whole path (client + servers + proxy), per kind.
PATH_CPU = {"keepalive": "path_cpu_us_per_req", "newconn": "path_cpu_us_per_req"}
PATH_CPU["bulk"] = "path_cpu_s_per_gib"


def summarize(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per path and kind: median, min and max of each figure; ratios of medians to kernel."""
    table: dict[str, Any] = {}
    for path, got in samples.items():
        entry: dict[str, Any] = {}
        for kind in KINDS:
            stats: dict[str, Any] = {}
            for key in STATS:
                values = [s[kind][key] for s in got if key in s[kind]]
                if values:
                    stats[key] = {
                        "median": statistics.median(values),
                        "min": min(values),
                        "max": max(values),
                    }
            stats["errors"] = sum(
                s[kind].get("errors", 0) + (1 if "error" in s[kind] else 0) for s in got
            )
            entry[kind] = stats
        table[path] = entry
    for entry in table.values():
        for kind, key in KINDS.items():
            mine, kernel = entry[kind].get(key), table.get("kernel", {}).get(kind, {}).get(key)
            if mine and kernel and kernel["median"]:
                entry[kind]["vs_kernel"] = mine["median"] / kernel["median"]
            cpu_key = PATH_CPU[kind]
            mine = entry[kind].get(cpu_key)
            kernel = table.get("kernel", {}).get(kind, {}).get(cpu_key)
            if mine and kernel and mine["median"]:
                # Work per CPU second relative to kernel mode (kernel's CPU per unit / ours).
                entry[kind]["cpu_vs_kernel"] = kernel["median"] / mine["median"]
    return table


def print_table(results: dict[str, Any]) -> None:
    m, a = results["machine"], results["settings"]
    print(
        f"{m['cpus']} CPUs ({m['cpu_model']}), Linux {m['kernel']}, Python {m['python']},"
        f" uvloop {m['uvloop']}; {m['nginx']}, {m['wrk']}, {m['iperf3']};"
        f" load average {m['loadavg_before']:.2f} -> {m['loadavg_after']:.2f};"
        f" commit {results.get('commit', '?')}"
    )
    print(
        f"wrk {a['threads']} thread(s) x {a['connections']} connections x {a['seconds']:g} s;"
        f" bulk {a['bulk_runs']} runs of {a['streams']} x {a['bulk_bytes'] / GiB:g} GiB;"
        f" nginx workers/pod {a['nginx_workers']}; iptables backend {a['iptables_backend']};"
        f" medians of {a['rounds']} rounds [min-max]"
    )

    def cell(stats: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
        if key not in stats:
            return "-"
        v = {k: stats[key][k] * scale for k in ("median", "min", "max")}
        return f"{v['median']:{fmt}} [{v['min']:{fmt}}-{v['max']:{fmt}}]"

    def ratio(stats: dict[str, Any]) -> str:
        return f"{stats['vs_kernel']:.2f}" if "vs_kernel" in stats else "-"

    print(
        f"{'path':<10} {'keep-alive req/s':>22} {'x':>5} {'p99 ms':>6}"
        f" {'new conn/s':>18} {'x':>5} {'bulk Gbit/s':>18} {'x':>5} {'errors':>6}"
    )
    for path, e in results["paths"].items():
        ka, nc, bulk = e["keepalive"], e["newconn"], e["bulk"]
        errors = ka["errors"] + nc["errors"] + bulk["errors"]
        print(
            f"{path:<10} {cell(ka, 'rate', '.0f'):>22} {ratio(ka):>5}"
            f" {cell(ka, 'p99_us', '.1f', 1e-3).split()[0]:>6}"
            f" {cell(nc, 'rate', '.0f'):>18} {ratio(nc):>5}"
            f" {cell(bulk, 'gbit_s', '.1f'):>18} {ratio(bulk):>5} {errors:>6}"
        )
    print(
        "CPU per unit of work, whole path (client + servers + proxy; x = kernel's / this path's,"
        " i.e. work per CPU second vs kernel mode)"
    )
    print(
        f"{'path':<10} {'keep-alive us/req':>22} {'x':>5} {'new conn us/conn':>20} {'x':>5}"
        f" {'bulk s/GiB':>18} {'x':>5}"
    )

    def cpu_ratio(stats: dict[str, Any]) -> str:
        return f"{stats['cpu_vs_kernel']:.2f}" if "cpu_vs_kernel" in stats else "-"

    for path, e in results["paths"].items():
        ka, nc, bulk = e["keepalive"], e["newconn"], e["bulk"]
        print(
            f"{path:<10} {cell(ka, 'path_cpu_us_per_req', '.1f'):>22} {cpu_ratio(ka):>5}"
            f" {cell(nc, 'path_cpu_us_per_req', '.0f'):>20} {cpu_ratio(nc):>5}"
            f" {cell(bulk, 'path_cpu_s_per_gib', '.2f'):>18} {cpu_ratio(bulk):>5}"
        )
    print(
        "CPU use, median share of one CPU: client (wrk / iperf3) + servers (nginx / iperf3)"
        " + proxy [proxy runnable but waiting for a CPU]; busy = whole machine, all CPUs,"
        " other work included"
    )
    for path, e in results["paths"].items():
        parts = []
        for kind, label in (("keepalive", "keep-alive"), ("newconn", "new conn"), ("bulk", "bulk")):
            st = e[kind]

            def share(key: str, st: dict[str, Any] = st) -> str:
                return f"{st[key]['median']:.2f}" if key in st else "-"

            wait = f" [{share('proxy_wait_share')}]" if "proxy_wait_share" in st else ""
            parts.append(
                f"{label} {share('client_cpu_share')} + {share('servers_cpu_share')}"
                f" + {share('proxy_cpu_share')}{wait} (busy {share('machine_busy')})"
            )
        print(f"  {path:<10} " + "; ".join(parts))
    e = results["paths"].get("userspace", {})
    if "proxy_cpu_us_per_req" in e.get("keepalive", {}):
        per_gib = e["bulk"].get("proxy_cpu_s_per_gib")
        print(
            f"the proxy alone: {cell(e['keepalive'], 'proxy_cpu_us_per_req', '.1f')} us"
            f" per keep-alive request, {cell(e['newconn'], 'proxy_cpu_us_per_req', '.0f')} us"
            " per new connection"
            + (f", {cell(e['bulk'], 'proxy_cpu_s_per_gib', '.2f')} s per GiB" if per_gib else "")
        )


def chart(results: dict[str, Any], path: Path) -> Path:
    """Two panels, both "higher is better", as ratios to kernel mode: throughput, and work per
    CPU second of the whole path; each bar labelled, sized for a docs page."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [("keepalive", "keep-alive\nrequests"), ("newconn", "new\nconnections")]
    kinds.append(("bulk", "bulk,\n1 stream"))
    shown = [("userspace", "this proxy (userspace)", "tab:orange")]
    shown.append(("direct", "direct to a pod", "tab:gray"))
    panels = [
        ("vs_kernel", "Throughput"),
        ("cpu_vs_kernel", "Work per CPU second"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 4.2), sharey=True)
    width = 0.38
    top = 0.0
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.axhline(1.0, color="tab:blue", linewidth=1.5, linestyle="--", label="kernel mode = 1")
        for i, (path_key, label, color) in enumerate(shown):
            values = [results["paths"][path_key][kind].get(key, 0.0) for kind, _ in kinds]
            xs = [j + (i - 0.5) * width for j in range(len(kinds))]
            bars = ax.bar(xs, values, width, label=label, color=color)
            ax.bar_label(bars, fmt="%.2f", fontsize=11, padding=2)
            top = max(top, *values)
        ax.set_xticks(range(len(kinds)), [text for _, text in kinds], fontsize=11)
        ax.set_title(f"{title}, ratio to kernel mode", fontsize=12)
        ax.tick_params(axis="y", labelsize=11)
    axes[0].set_ylim(0, max(1.2, top) * 1.12)
    axes[0].set_ylabel("ratio (higher is better)", fontsize=11)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncols=3, fontsize=11, frameon=False)
    m, a = results["machine"], results["settings"]
    fig.suptitle(
        f"{m['cpus']} CPUs, Linux {m['kernel'].split('-')[0]}, --workers {a.get('workers', '1')},"
        f" medians of {a['rounds']} rounds, load avg {m['loadavg_before']:.1f}"
        f"-{m['loadavg_after']:.1f}, commit {results.get('commit', '?')}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # the legend below the panels
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5, help="per wrk run, whole (5)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--connections", type=int, default=50, help="wrk connections (50)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (default 2)")
    parser.add_argument("--bulk-bytes", type=int, default=GiB, help="per stream (1 GiB)")
    parser.add_argument("--streams", type=int, default=1, help="parallel bulk streams (1)")
    parser.add_argument(
        "--bulk-runs", type=int, default=2, help="bulk transfers per path and round (2)"
    )
    parser.add_argument(
        "--bulk-timeout", type=float, default=60.0, help="seconds before a bulk run is killed"
    )
    parser.add_argument(
        "--nginx-workers", type=int, default=1, help="worker_processes per pod (default 1)"
    )
    parser.add_argument("--iptables-backend", choices=["restore", "iptc"], default="restore")
    parser.add_argument(
        "--workers", default="auto", help="the proxy's --workers (default auto, as the proxy's)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help=f"writes {NAME}.json and {NAME}.png here (default benchmarks/results)",
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help=f"measure nothing: redraw {NAME}.png from the {NAME}.json in --out",
    )
    args = parser.parse_args()
    if args.replot:
        results = json.loads((args.out / f"{NAME}.json").read_text())
        print(f"wrote {chart(results, args.out / f'{NAME}.png')}")
        return 0
    if args.connections > 4000 or args.connections < 1:
        parser.error("--connections must be 1..4000 (the proxy holds two descriptors each)")
    if not 1 <= args.rounds <= 20 or not 1 <= args.seconds <= 120:
        parser.error("--rounds must be 1..20 and --seconds 1..120")
    if not 1 <= args.nginx_workers <= 8:
        parser.error("--nginx-workers must be 1..8")
    if not 1 <= args.bulk_runs <= 10 or not 1 <= args.streams <= 16:
        parser.error("--bulk-runs must be 1..10 and --streams 1..16")
    if not 1 << 20 <= args.bulk_bytes <= 8 * GiB:
        parser.error("--bulk-bytes must be 1 MiB..8 GiB")
    reason = available()
    if reason:
        print(f"kernel_vs_userspace: {reason}", file=sys.stderr)
        return 2
    reason = install_missing(TOOLS)
    if reason:
        print(f"kernel_vs_userspace: {reason}", file=sys.stderr)
        return 2

    tmp = Path(tempfile.mkdtemp(prefix="kup-kvu-"))
    bench = Bench(args, tmp)
    atexit.register(bench.close)
    # A SIGTERM or SIGHUP still runs the cleanup (namespaces, processes).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(1))
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "uvloop": uvloop.__version__,
            "nginx": version("nginx", "-v").replace("nginx version: ", ""),
            "wrk": " ".join(version("wrk", "-v").split()[:2]),
            "iperf3": version("iperf3", "--version").split(" (")[0],
            "loadavg_before": os.getloadavg()[0],
        },
        "commit": source_commit(),
        "settings": {
            k: getattr(args, k)
            for k in (
                "seconds",
                "rounds",
                "connections",
                "threads",
                "bulk_bytes",
                "streams",
                "bulk_runs",
                "nginx_workers",
                "iptables_backend",
                "workers",
            )
        },
    }
    samples: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    started = time.monotonic()
    try:
        bench.setup()
        spread = {path: bench.spread(path) for path in PATHS}
        results["spread"] = spread
        for path, seen in spread.items():
            expected = {"pod-a"} if path == "direct" else set(PODS)
            if set(seen) != expected:
                raise RuntimeError(f"{path}: answers {seen}, expected every one of {expected}")
        for path in PATHS:  # warm up: caches, the proxy's first connections
            bench.wrk(path, 1, close=False)
        for r in range(args.rounds):
            order = PATHS[r % len(PATHS) :] + PATHS[: r % len(PATHS)]
            for path in order:
                samples[path].append(bench.sample(path))
                print(f"  round {r + 1} {path}: {brief(samples[path][-1])}", file=sys.stderr)
        assert bench.proxy is not None and bench.proxy.proc
        if bench.proxy.proc.poll() is not None:
            tail = bench.proxy.log.read_text()[-2000:]
            raise RuntimeError(f"the proxy exited during the run: {tail}")
        results["conntrack_count_end"] = int(
            bench.bed.node.run("sysctl", "-n", "net.netfilter.nf_conntrack_count").strip()
        )
    finally:
        bench.close()
        shutil.rmtree(tmp, ignore_errors=True)
    results["machine"]["loadavg_after"] = os.getloadavg()[0]
    results["elapsed_s"] = time.monotonic() - started
    results["paths"] = summarize(samples)
    results["samples"] = samples
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(results, indent=2) + "\n")
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    else:
        print_table(results)
    missing = install_missing({}, extra="bench")
    if missing:
        print(f"chart skipped: {missing}", file=sys.stderr)
    else:
        print(f"wrote {args.out / NAME}.json, {chart(results, args.out / f'{NAME}.png').name}")
    return 0


def brief(s: dict[str, Any]) -> str:
    """One line per sample, for progress on stderr."""

    def cpu(got: dict[str, Any]) -> str:
        parts = [got.get(f"{p}_cpu_share") for p in ("client", "servers", "proxy")]
        return "cpu " + "/".join(f"{v:.2f}" for v in parts if v is not None)

    ka, nc, bulk = s["keepalive"], s["newconn"], s["bulk"]
    rate = f"{bulk['gbit_s']:.1f} Gbit/s" if "gbit_s" in bulk else f"bulk failed: {bulk['error']}"
    return (
        f"{ka['rate']:.0f} req/s ({cpu(ka)}), {nc['rate']:.0f} conn/s ({cpu(nc)}),"
        f" {rate} ({cpu(bulk)})"
    )


if __name__ == "__main__":
    sys.exit(main())
