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
also has every sample, the p50 latency and iperf3's retransmits. Needs root;
creates and deletes its own namespaces (and kills what it started, by PID); installs nothing
in the root namespace. About 2 minutes with the defaults.

    sudo .venv/bin/python benchmarks/kernel_vs_userspace.py [--seconds 5] [--rounds 3]
        [--connections 50] [--threads 2] [--bulk-bytes 1073741824] [--streams 1]
        [--bulk-runs 2] [--nginx-workers 1] [--iptables-backend restore|iptc] [--json]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.conftest import IPTABLES, Proxy, service, write_manifest  # noqa: E402
from tests.integration.netns import (  # noqa: E402
    POD_PORT,
    PODS,
    Netns,
    Topology,
    available,
    stop,
    wait_for,
)

GiB = 1 << 30
PATHS = ("kernel", "userspace", "direct")
HTTP_PORT = 80
BULK_PORT = 5201
DIRECT_PORT = 8081
# Per path: (HTTP address, bulk address, client source address).
ADDRESSES = {
    "kernel": ("10.96.0.10", "10.96.0.20", "10.244.1.11"),
    "userspace": ("10.96.0.11", "10.96.0.21", "10.244.1.12"),
    "direct": (PODS["pod-a"], PODS["pod-a"], "10.244.1.13"),
}

NGINX_CONF = """\
worker_processes {workers};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
worker_rlimit_nofile 16384;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    keepalive_requests 10000000;
    keepalive_timeout 60s;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    server {{
        listen {port} backlog=4096 reuseport;
        location / {{ default_type text/plain; return 200 "{name}\\n"; }}
    }}
}}
"""

# wrk prints one JSON line when it is done.
WRK_REPORT = """\
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %d, "duration_us": %d, "bytes": %d, "connect": %d, "read": %d, '
    .. '"write": %d, "status": %d, "timeout": %d, "p50_us": %d, "p99_us": %d}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(99)))
end
"""

# Which pods answer: `count` requests, one connection each (run in the client namespace).
SPREAD = textwrap.dedent(
    """
    import collections, json, socket, sys
    host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    seen = collections.Counter()
    for _ in range(count):
        try:
            with socket.create_connection((host, port), timeout=3) as s:
                s.sendall(b"GET / HTTP/1.0\\r\\nHost: bench\\r\\n\\r\\n")
                data = b""
                while chunk := s.recv(4096):
                    data += chunk
            seen[data.split(b"\\r\\n\\r\\n", 1)[-1].decode().strip()] += 1
        except OSError as exc:
            seen[f"error: {exc}"] += 1
    print(json.dumps(seen))
    """
)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def runqueue_wait(pid: int) -> float:
    """Seconds a process has spent runnable but waiting for a CPU (/proc/PID/schedstat)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def version(*cmd: str) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return "?"
    out = (done.stdout + done.stderr).strip().splitlines()
    return out[0] if out else "?"


def kernel_rules(name: str, cluster_ip: str, port: int, endpoints: list[tuple[str, int]]) -> str:
    """kube-proxy iptables-mode rules (nat) for one ClusterIP port, for iptables-restore."""
    svc = f"KUBE-SVC-{name.upper()}"
    seps = [f"KUBE-SEP-{name.upper()}{i}" for i in range(len(endpoints))]
    comment = f'-m comment --comment "default/{name}:p"'
    lines = [f":{chain} - [0:0]" for chain in (svc, *seps)]
    lines.append(
        f"-A KUBE-SERVICES -d {cluster_ip}/32 -p tcp {comment} -m tcp --dport {port} -j {svc}"
    )
    for i, (sep, (ip, target)) in enumerate(zip(seps, endpoints, strict=True)):
        left = len(endpoints) - i
        if left > 1:
            lines.append(
                f"-A {svc} {comment} -m statistic --mode random"
                f" --probability {1 / left:.11f} -j {sep}"
            )
        else:
            lines.append(f"-A {svc} {comment} -j {sep}")
        lines.append(f"-A {sep} -s {ip}/32 {comment} -j KUBE-MARK-MASQ")
        lines.append(f"-A {sep} -p tcp {comment} -m tcp -j DNAT --to-destination {ip}:{target}")
    return "\n".join(lines)


def kernel_ruleset() -> str:
    pods = [(ip, POD_PORT) for ip in PODS.values()]
    return "\n".join(
        [
            "*nat",
            ":KUBE-SERVICES - [0:0]",
            ":KUBE-MARK-MASQ - [0:0]",
            ":KUBE-POSTROUTING - [0:0]",
            '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
            '-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
            '-A POSTROUTING -m comment --comment "kubernetes postrouting rules"'
            " -j KUBE-POSTROUTING",
            "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
            "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
            "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000",
            '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring'
            ' SNAT" -j MASQUERADE --random-fully',
            kernel_rules("web", ADDRESSES["kernel"][0], HTTP_PORT, pods),
            kernel_rules("bulk", ADDRESSES["kernel"][1], BULK_PORT, [(PODS["pod-a"], BULK_PORT)]),
            "COMMIT",
            "",
        ]
    )


def manifest_objects() -> list[dict[str, Any]]:
    """The Services the proxy serves: web on all three pods, bulk on pod-a's iperf3."""
    web = service("web", ADDRESSES["userspace"][0], HTTP_PORT)
    bulk = service("bulk", ADDRESSES["userspace"][1], BULK_PORT, pods=("pod-a",))
    bulk[0]["spec"]["ports"][0]["targetPort"] = BULK_PORT
    bulk[1]["ports"][0]["port"] = BULK_PORT
    return [*web, *bulk]


class Bench:
    """The namespaces, servers and proxy of one run; `close` removes all of it."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.topo: Topology | None = None
        self.proxy: Proxy | None = None
        self.lua = tmp / "report.lua"
        self.lua.write_text(WRK_REPORT)
        self.servers: list[int] = []

    def setup(self) -> None:
        self.topo = topo = Topology.create(self.tmp)
        # The topology starts small Python backends on POD_PORT: nginx replaces them.
        for proc in topo.procs:
            stop(proc)
        topo.procs.clear()
        client, node = topo.client, topo.node
        client.run("sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1")
        client.run("sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65535")
        node.run("sysctl", "-qw", "net.ipv4.ip_forward=1")
        for http, bulk, src in ADDRESSES.values():
            client.ip("addr", "add", f"{src}/24", "dev", "eth0")
            for dst in {http, bulk}:
                client.ip("route", "add", f"{dst}/32", "via", "10.244.1.1", "src", src)
        for pod, ns in topo.pods.items():
            self._nginx(pod, ns, POD_PORT, self.args.nginx_workers)
        self._nginx("pod-a", topo.pods["pod-a"], DIRECT_PORT, 3 * self.args.nginx_workers)
        pod_a = topo.pods["pod-a"]
        topo.procs.append(
            pod_a.popen(["iperf3", "-s", "-p", str(BULK_PORT)], self.tmp / "iperf3.log")
        )
        for pod, ns in topo.pods.items():
            ports = [POD_PORT, BULK_PORT, DIRECT_PORT] if pod == "pod-a" else [POD_PORT]
            wait_for(
                lambda ns=ns, ports=ports: all(f":{p} " in ns.run("ss", "-lnt") for p in ports),
                f"{pod} listening",
            )
        self.servers = self.server_pids()
        # Kernel mode first, then the proxy (it adds its own chains and jumps beside these).
        restore = IPTABLES[self.args.iptables_backend] + "-restore"
        rules = self.tmp / "kernel-mode.rules"
        rules.write_text(kernel_ruleset())
        node.run(restore, "--noflush", "-w", "5", str(rules))
        manifest = self.tmp / "services.yaml"
        write_manifest(manifest, manifest_objects())
        self.proxy = Proxy(
            topo,
            self.args.iptables_backend,
            manifest,
            self.tmp / "proxy.log",
            # The integration tests resync every second; a benchmark runs with the defaults.
            ("--iptables-sync-period", "30s", "--iptables-min-sync-period", "1s", "-v", "0"),
        )
        self.proxy.start()
        self.proxy.wait_rules(ADDRESSES["userspace"][0], ADDRESSES["userspace"][1])
        # Conntrack sysctls exist once the nat table is in use in this namespace.
        node.run("sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_time_wait=10")

    def _nginx(self, pod: str, ns: Netns, port: int, workers: int) -> None:
        assert self.topo is not None
        conf_dir = self.tmp / f"nginx-{pod}-{port}"
        conf_dir.mkdir()
        conf = conf_dir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=conf_dir, port=port, name=pod, workers=workers))
        args = ["nginx", "-p", str(conf_dir), "-e", str(conf_dir / "error.log"), "-c", str(conf)]
        self.topo.procs.append(ns.popen([*args, "-g", "daemon off;"], conf_dir / "stdout.log"))

    def close(self) -> None:
        if self.proxy is not None and self.proxy.proc is not None:
            stop(self.proxy.proc)
        if self.topo is not None:
            self.topo.destroy()
            self.topo = None

    # --- checks and measurements

    def spread(self, path: str, count: int = 60) -> dict[str, int]:
        assert self.topo is not None
        host = ADDRESSES[path][0]
        port = DIRECT_PORT if path == "direct" else HTTP_PORT
        out = self.topo.client.python(SPREAD, host, str(port), str(count))
        seen: dict[str, int] = json.loads(out)
        return seen

    def url(self, path: str) -> str:
        host = ADDRESSES[path][0]
        return f"http://{host}:{DIRECT_PORT if path == 'direct' else HTTP_PORT}/"

    def wrk(self, path: str, seconds: float, close: bool) -> dict[str, Any]:
        assert self.topo is not None
        args = ["wrk", f"-t{self.args.threads}", f"-c{self.args.connections}"]
        args += [f"-d{seconds:g}s", "--timeout", "2s", "-s", str(self.lua)]
        if close:
            args += ["-H", "Connection: close"]
        out = self.topo.client.run(*args, self.url(path), timeout=seconds + 30)
        line = next(x for x in out.splitlines() if x.startswith("WRKJSON "))
        result: dict[str, Any] = json.loads(line.removeprefix("WRKJSON "))
        result["rate"] = result["requests"] / (result["duration_us"] / 1e6)
        result["errors"] = sum(result[k] for k in ("connect", "read", "write", "status", "timeout"))
        return result

    def iperf(self, path: str) -> dict[str, Any]:
        assert self.topo is not None
        total = self.args.bulk_bytes * self.args.streams
        args = ["iperf3", "-c", ADDRESSES[path][1], "-p", str(BULK_PORT), "-J", "-Z"]
        args += ["-n", str(total), "-P", str(self.args.streams), "--connect-timeout", "3000"]
        out = self.topo.client.run(*args, timeout=self.args.bulk_timeout, check=False)
        try:
            report = json.loads(out)
        except json.JSONDecodeError:
            return {"error": out[-300:] or "no output"}
        if "error" in report:
            return {"error": report["error"]}
        received = report["end"]["sum_received"]
        return {
            "gbit_s": received["bits_per_second"] / 1e9,
            "bytes": received["bytes"],
            "seconds": received["seconds"],
            "retransmits": report["end"]["sum_sent"].get("retransmits", 0),
        }

    def server_pids(self) -> list[int]:
        """nginx workers (children of each master) and the iperf3 server."""
        assert self.topo is not None
        pids = []
        for proc in self.topo.procs:
            try:
                children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text()
            except OSError:
                continue
            pids += [int(c) for c in children.split()] or [proc.pid]
        return pids

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: proxy, servers, client (reaped children: wrk, iperf3), machine."""
        assert self.proxy is not None and self.proxy.proc is not None
        child = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy, total = machine_busy()
        return {
            "proxy": cpu_seconds(self.proxy.proc.pid),
            "proxy_wait": runqueue_wait(self.proxy.proc.pid),
            "servers": sum(cpu_seconds(pid) for pid in self.servers),
            "client": child.ru_utime + child.ru_stime,
            "busy": busy,
            "total": total,
            "wall": time.monotonic(),
        }

    def shares(self, got: dict[str, Any], before: dict[str, float], path: str) -> None:
        """Adds each part's CPU use over the run, as a share of one CPU (machine: of all)."""
        after = self.cpu()
        wall = after["wall"] - before["wall"]
        for part in ("client", "servers") + (("proxy",) if path == "userspace" else ()):
            got[f"{part}_cpu_s"] = after[part] - before[part]
            got[f"{part}_cpu_share"] = got[f"{part}_cpu_s"] / wall
        if path == "userspace":
            got["proxy_wait_share"] = (after["proxy_wait"] - before["proxy_wait"]) / wall
        got["path_cpu_s"] = sum(
            got[f"{part}_cpu_s"]
            for part in ("client", "servers", "proxy")
            if f"{part}_cpu_s" in got
        )
        got["machine_busy"] = (after["busy"] - before["busy"]) / max(
            1, after["total"] - before["total"]
        )

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per wrk run (default 5)")
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
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    if args.connections > 4000 or args.connections < 1:
        parser.error("--connections must be 1..4000 (the proxy holds two descriptors each)")
    if not 1 <= args.rounds <= 20 or not 0.5 <= args.seconds <= 120:
        parser.error("--rounds must be 1..20 and --seconds 0.5..120")
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
    for tool in ("wrk", "nginx", "iperf3"):
        if shutil.which(tool) is None:
            print(f"kernel_vs_userspace: needs `{tool}` (apt-get install wrk nginx-light iperf3)")
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
        assert bench.topo is not None and bench.proxy is not None and bench.proxy.proc
        if bench.proxy.proc.poll() is not None:
            tail = bench.proxy.log.read_text()[-2000:]
            raise RuntimeError(f"the proxy exited during the run: {tail}")
        results["conntrack_count_end"] = int(
            bench.topo.node.run("sysctl", "-n", "net.netfilter.nf_conntrack_count").strip()
        )
    finally:
        bench.close()
        shutil.rmtree(tmp, ignore_errors=True)
    results["machine"]["loadavg_after"] = os.getloadavg()[0]
    results["elapsed_s"] = time.monotonic() - started
    results["paths"] = summarize(samples)
    results["samples"] = samples
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    else:
        print_table(results)
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


def source_commit() -> str:
    """The checkout's commit, with "+dirty" when src/ has uncommitted changes."""
    git = ["git", "-C", str(ROOT)]
    head = version(*git, "rev-parse", "--short", "HEAD")
    dirty = version(*git, "status", "--porcelain", "--", "src") not in ("", "?")
    return head + ("+dirty" if dirty else "")


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    sys.exit(main())
