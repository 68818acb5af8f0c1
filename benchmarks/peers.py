"""This proxy and its peers on one Service, in one run: kernel DNAT, HAProxy, nginx stream,
the Go userspace proxier and the minimal uvloop Protocol proxy.

The testbed of `kernel_vs_userspace.py` (`testbed.py`: a client pod, a node and three nginx
pods in network namespaces named with this pid, deleted afterwards) carries the same Service,
with the same three pods, through nine peers, each with its own ClusterIP and its own
`--clients` client addresses (8: a node proxies for many pods, and this proxy's workers are
chosen by client address; the client namespace SNATs its connections to them in turn):

  kernel      kube-proxy's iptables mode: DNAT in the node namespace (the baseline)
  proxy-1     `kube-userspace-proxy run --workers 1` (its own REDIRECT rules)
  proxy-auto  `kube-userspace-proxy run` with the default `--workers auto` (N processes)
              (both with the default `--dataplane auto`: the native data plane)
  py-1, py-auto   the same with `--dataplane python` (the reference data plane)
  haproxy     Debian's HAProxy, `mode tcp`, `balance roundrobin`, `nbthread N`
  haproxy-1   the same with `nbthread 1` (one core, as `--workers 1`)
  nginx       Debian's nginx stream module, `worker_processes N`, round robin
  go-userspace  kube-proxy's userspace data path in Go (`gouserspace/main.go`: dial ladder,
              serial in the accept loop, two io.Copy loops), built with Debian's golang-go
  protocol    the floor for a Python proxy: `protocolproxy.py`, one uvloop process,
              asyncio.Protocol, round robin, pause/resume flow control
  protocol-auto  the same in N processes on one port (SO_REUSEPORT): the floor for N workers
  tproxy-1, tproxy-auto   (only when named in --peers) proxy-1 and proxy-auto with
              `--preserve-source-ip`: every backend sees the client's own address

N is what `--workers auto` resolves to here (the CPUs this process may run on, at most 4).
HAProxy, nginx, the Go proxier and the Protocol proxy listen in the node namespace and get
the ClusterIP's connections through a REDIRECT rule in PREROUTING, as this proxy does; each is
started by this script, with its defaults otherwise (no splice in HAProxy, no reuseport in
nginx). The bulk Service has one endpoint (pod-a's iperf3: its control and data connections
must reach the same server).

Each round measures every peer in turn (order rotated each round), starting it first and
stopping it afterwards, so only one peer's processes exist at a time:

  after start   every pod answers (60 one-shot requests); RSS (sum over the peer's processes)
  keep-alive    wrk: requests/s over `--seconds`, `--connections` keep-alive connections
  setup         `--setup-count` requests one after another, each on a new connection: p50 of
                connect() to the answer's first byte (added over DNAT: minus kernel's p50)
  new conns     wrk with `Connection: close`: one request per connection
  bulk          iperf3 for `--bulk-seconds`, 1 stream, then 4 streams
  idle          `--idle` connections opened and held (proxied ones cost two descriptors each:
                RLIMIT_NOFILE is 20,000 per process here): RSS, and RSS per connection

CPU: user + system seconds of the peer's processes (/proc/PID/stat) per request, per new
connection and per GiB; for kernel DNAT, which has no process, the ratio column compares the
whole path instead (wrk + nginx or iperf3 + the peer). The figures are medians over rounds;
every figure is also a ratio to kernel DNAT (and to HAProxy). Output: `peers.md` (machine,
settings, table), `peers.json` (every sample), `peers-ratios.png` and `peers-costs.png` in
`--out` (quick runs: `peers-quick.*`). Needs root; installs what is missing (apt: haproxy,
nginx-light, libnginx-mod-stream, wrk, iperf3, golang-go; pip: the `bench` extra, matplotlib).
About 4-6 minutes (2 CPUs, busy); a round that would end after `--budget` seconds is not started.

    sudo .venv/bin/python benchmarks/peers.py [--quick] [--rounds 3] [--seconds 5]
        [--bulk-seconds 3] [--setup-count 1000] [--idle 9000] [--clients 8]
        [--peers kernel,proxy-1,...] [--budget 540] [--out benchmarks/results]
        [--baseline OTHER_CHECKOUT/src]   # also base-1, base-auto: that tree's proxy
                                          # (flags it predates are left out; no base-auto
                                          # without --workers)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop
from testbed import (
    BULK_PORT,
    HTTP_PORT,
    ROOT,
    TOOLS,
    GiB,
    IdleConnections,
    Testbed,
    command,
    cpu_model,
    cpu_seconds,
    cpu_shares,
    install_missing,
    long_lived,
    memory_kib,
    resident_kib,
    source_commit,
    version,
)

from kube_userspace_proxy.config.settings import ProxyConfig
from kube_userspace_proxy.dataplane.steering import worker_of
from tests.integration.conftest import PROXY, Proxy, service, write_manifest
from tests.integration.netns import POD_PORT, PODS, available, stop, wait_for

WORKERS = ProxyConfig(workers="auto").worker_count
STREAM_MODULE = "/usr/lib/nginx/modules/ngx_stream_module.so"
PACKAGES = {**TOOLS, "haproxy": "haproxy", STREAM_MODULE: "libnginx-mod-stream"}
GO_PACKAGES = {"go": "golang-go"}  # only when the go-userspace peer runs
BENCHMARKS = Path(__file__).resolve().parent

HAPROXY_CONF = """\
global
    maxconn {maxconn}
    nbthread {threads}
defaults
    mode tcp
    balance roundrobin
    timeout connect 2s
    timeout client 120s
    timeout server 120s
listen web
    bind 0.0.0.0:{http_port}
{servers}
listen bulk
    bind 0.0.0.0:{bulk_port}
    server a {pod_a}:{target}
"""

NGINX_STREAM_CONF = """\
load_module {module};
worker_processes {workers};
worker_rlimit_nofile {nofile};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections {connections}; }}
stream {{
    upstream web {{
{servers}
    }}
    upstream bulk {{ server {pod_a}:{target}; }}
    server {{ listen {http_port} backlog=4096; proxy_pass web; proxy_connect_timeout 2s; }}
    server {{ listen {bulk_port}; proxy_pass bulk; proxy_connect_timeout 2s; }}
}}
"""

# Short-lived children of a peer, left out of its sums.
PEERS = (
    "kernel",
    "proxy-1",
    "proxy-auto",
    "py-1",
    "py-auto",
    "haproxy",
    "haproxy-1",
    "nginx",
    "go-userspace",
    "protocol",
    "protocol-auto",
)
BASELINE_PEERS = ("base-1", "base-auto")  # with --baseline SRC: this proxy from another tree
# Only when named in --peers: this proxy with --preserve-source-ip, every dial from the client's
# address (the pods are on this node: --hostname-override names the node their slices name).
TRANSPARENT_PEERS = ("tproxy-1", "tproxy-auto")
# A proxied connection holds two descriptors: 9,400 of them fit under RLIMIT_NOFILE 20,000.
MAX_PROXIED = 9400


@dataclass
class Peer:
    """One way to the Service: its ClusterIPs, client addresses and (but for DNAT) processes."""

    key: str
    label: str
    http: str
    bulk: str
    sources: list[str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self, bed: Testbed, tmp: Path) -> None:
        """Start the peer's processes in the node namespace (DNAT: nothing to start)."""

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def pids(self) -> list[int]:
        """The peer's long-lived processes: not the iptables runs this proxy starts now and
        then, which would leave the CPU and memory sums as they end."""
        if self.proc is None:
            return []
        return long_lived(self.proc.pid)

    def redirect(self) -> tuple[int, int] | None:
        """The (HTTP, bulk) ports to REDIRECT the ClusterIPs to, for a peer without rules."""
        return None


@dataclass
class ThisProxy(Peer):
    """`kube-userspace-proxy run --workers <workers>`, from this checkout."""

    workers: str = "1"
    backend: str = "restore"
    src: str | None = None  # another checkout's src/ (--baseline): run its code instead
    extra: tuple[str, ...] = ()  # more flags, e.g. --preserve-source-ip
    proxy: Proxy | None = field(default=None, repr=False)

    def start(self, bed: Testbed, tmp: Path) -> None:
        manifest = tmp / f"services-{self.key}.yaml"
        web = service(f"web-{self.key}", self.http, HTTP_PORT)
        bulk = service(f"bulk-{self.key}", self.bulk, BULK_PORT, pods=("pod-a",))
        bulk[0]["spec"]["ports"][0]["targetPort"] = BULK_PORT
        bulk[1]["ports"][0]["port"] = BULK_PORT
        write_manifest(manifest, [*web, *bulk])
        assert bed.topo is not None
        flags = ("--iptables-sync-period", "30s", "--iptables-min-sync-period", "1s", "-v", "0")
        make = Proxy if self.src is None else OlderProxy
        self.proxy = make(
            bed.topo,
            self.backend,
            manifest,
            tmp / f"{self.key}.log",
            (*flags, "--workers", self.workers, *self.extra),
            wrapper=() if self.src is None else ("env", f"PYTHONPATH={self.src}"),
        )
        self.proxy.start()
        self.proc = self.proxy.proc
        self.proxy.wait_rules(self.http, self.bulk)


def known_flags(src: str) -> frozenset[str]:
    """The long options of `run` in the proxy of another checkout's `src/`."""
    done = subprocess.run(
        [str(PROXY), "run", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": src},
        timeout=60,
    )
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", done.stdout))


class OlderProxy(Proxy):
    """The proxy of a baseline checkout that may predate some flags (e.g. `--workers`,
    `--state-dir`): those it does not know are left out, with their values."""

    def argv(self) -> list[str]:
        src = next(w.partition("=")[2] for w in self.wrapper if w.startswith("PYTHONPATH="))
        known = known_flags(src)
        out: list[str] = []
        skipping = False
        for arg in super().argv():
            if arg.startswith("--"):
                skipping = arg.partition("=")[0] not in known
            elif not arg.startswith("-") and skipping:
                continue  # the value of a flag left out
            else:
                skipping = False
            if not skipping:
                out.append(arg)
        return out


@dataclass
class Haproxy(Peer):
    """HAProxy in TCP mode, round robin over the pods, `nbthread` threads, one process."""

    threads: int = 1
    ports: tuple[int, int] = (41080, 41201)

    def redirect(self) -> tuple[int, int]:
        return self.ports

    def start(self, bed: Testbed, tmp: Path) -> None:
        servers = "\n".join(f"    server {pod} {ip}:{POD_PORT}" for pod, ip in PODS.items())
        conf = tmp / "haproxy.cfg"
        conf.write_text(
            HAPROXY_CONF.format(
                maxconn=MAX_PROXIED,
                threads=self.threads,
                http_port=self.ports[0],
                bulk_port=self.ports[1],
                servers=servers,
                pod_a=PODS["pod-a"],
                target=BULK_PORT,
            )
        )
        self.proc = bed.node.popen(["haproxy", "-db", "-f", str(conf)], tmp / "haproxy.log")
        wait_listening(bed, self.ports, self.proc, tmp / "haproxy.log")


@dataclass
class NginxStream(Peer):
    """nginx's stream module: TCP proxying, round robin, `worker_processes` processes."""

    workers: int = 1
    ports: tuple[int, int] = (42080, 42201)

    def redirect(self) -> tuple[int, int]:
        return self.ports

    def start(self, bed: Testbed, tmp: Path) -> None:
        conf_dir = tmp / "nginx-stream"
        conf_dir.mkdir(exist_ok=True)
        servers = "\n".join(f"        server {ip}:{POD_PORT};" for ip in PODS.values())
        conf = conf_dir / "nginx.conf"
        conf.write_text(
            NGINX_STREAM_CONF.format(
                module=STREAM_MODULE,
                workers=self.workers,
                nofile=19900,
                connections=2 * MAX_PROXIED + 100,
                dir=conf_dir,
                servers=servers,
                pod_a=PODS["pod-a"],
                target=BULK_PORT,
                http_port=self.ports[0],
                bulk_port=self.ports[1],
            )
        )
        log = conf_dir / "stdout.log"
        args = ["nginx", "-p", str(conf_dir), "-e", str(conf_dir / "error.log"), "-c", str(conf)]
        self.proc = bed.node.popen([*args, "-g", "daemon off;"], log)
        wait_listening(bed, self.ports, self.proc, conf_dir / "error.log")


def listen_args(ports: tuple[int, int]) -> list[str]:
    """`LISTEN=ENDPOINT,...` arguments of the Go and the Protocol proxy: HTTP over the three
    pods, bulk to pod-a's iperf3."""
    web = ",".join(f"{ip}:{POD_PORT}" for ip in PODS.values())
    return [f"0.0.0.0:{ports[0]}={web}", f"0.0.0.0:{ports[1]}={PODS['pod-a']}:{BULK_PORT}"]


@dataclass
class GoUserspace(Peer):
    """kube-proxy's userspace data path in Go (benchmarks/gouserspace), built at first start."""

    ports: tuple[int, int] = (40080, 40201)

    def redirect(self) -> tuple[int, int]:
        return self.ports

    def start(self, bed: Testbed, tmp: Path) -> None:
        binary = tmp / "gouserspace"
        if not binary.exists():
            cache = tmp / "go-cache"
            env = {**os.environ, "GOCACHE": str(cache), "GOPATH": str(tmp / "go")}
            env["GO111MODULE"] = "off"  # one file, no module: nothing to download
            subprocess.run(
                ["go", "build", "-o", str(binary), str(BENCHMARKS / "gouserspace" / "main.go")],
                check=True,
                env=env,
                timeout=600,
            )
        log = tmp / "gouserspace.log"
        self.proc = bed.node.popen([str(binary), *listen_args(self.ports)], log)
        wait_listening(bed, self.ports, self.proc, log)


@dataclass
class ProtocolProxy(Peer):
    """The minimal uvloop asyncio.Protocol proxy (benchmarks/protocolproxy.py): one process,
    or `processes` of them on the same ports (SO_REUSEPORT)."""

    ports: tuple[int, int] = (39080, 39201)
    processes: int = 1

    def redirect(self) -> tuple[int, int]:
        return self.ports

    def start(self, bed: Testbed, tmp: Path) -> None:
        log = tmp / f"{self.key}.log"
        script = str(BENCHMARKS / "protocolproxy.py")
        argv = [sys.executable, script, "--processes", str(self.processes)]
        self.proc = bed.node.popen([*argv, *listen_args(self.ports)], log)
        wait_listening(bed, self.ports, self.proc, log)


def wait_listening(
    bed: Testbed, ports: tuple[int, ...], proc: subprocess.Popen[bytes], log: Path
) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"exited: {log.read_text()[-2000:]}")
        listening = bed.node.run("ss", "-lnt")
        return all(f":{port} " in listening for port in ports)

    wait_for(up, f"listening on {ports}")


_TRANSPARENT = ("--preserve-source-ip", "--hostname-override", "node")
_PYTHON_PLANE = ("--dataplane", "python")


def make_peers(backend: str, clients: int, baseline: str | None = None) -> list[Peer]:
    """The peers; peer i has ClusterIPs 10.96.0.(10 + i) (web) and 10.96.1.(10 + i) (bulk) and
    `clients` client addresses from 10.244.1.(32 + 8i) up. `baseline`: also this proxy from that
    `src/`."""
    haproxy = version("haproxy", "-v").split(" - ")[0].replace("HAProxy version ", "HAProxy ")
    nginx = version("nginx", "-v").replace("nginx version: nginx/", "nginx ")

    def at(i: int) -> tuple[str, str, list[str]]:
        sources = [f"10.244.1.{32 + 8 * i + j}" for j in range(clients)]
        return f"10.96.0.{10 + i}", f"10.96.1.{10 + i}", sources

    return [
        Peer("kernel", "kernel iptables DNAT", *at(0)),
        ThisProxy("proxy-1", "this proxy, --workers 1", *at(1), workers="1", backend=backend),
        ThisProxy(
            "proxy-auto",
            f"this proxy, --workers auto ({WORKERS})",
            *at(2),
            workers="auto",
            backend=backend,
        ),
        ThisProxy(
            "py-1",
            "this proxy, --workers 1 --dataplane python",
            *at(13),
            workers="1",
            backend=backend,
            extra=_PYTHON_PLANE,
        ),
        ThisProxy(
            "py-auto",
            f"this proxy, --workers auto ({WORKERS}) --dataplane python",
            *at(14),
            workers="auto",
            backend=backend,
            extra=_PYTHON_PLANE,
        ),
        Haproxy("haproxy", f"{haproxy.split('-')[0]}, nbthread {WORKERS}", *at(3), threads=WORKERS),
        Haproxy("haproxy-1", f"{haproxy.split('-')[0]}, nbthread 1", *at(11), threads=1),
        NginxStream("nginx", f"{nginx} stream, {WORKERS} workers", *at(4), workers=WORKERS),
        GoUserspace("go-userspace", "Go userspace proxier (kube-proxy's data path)", *at(7)),
        ProtocolProxy("protocol", "minimal uvloop Protocol proxy", *at(8)),
        ProtocolProxy(
            "protocol-auto",
            f"minimal uvloop Protocol proxy, {WORKERS} processes",
            *at(12),
            ports=(39180, 39301),
            processes=WORKERS,
        ),
        ThisProxy(
            "tproxy-1",
            "this proxy, --workers 1 --preserve-source-ip",
            *at(9),
            workers="1",
            backend=backend,
            extra=_TRANSPARENT,
        ),
        ThisProxy(
            "tproxy-auto",
            f"this proxy, --workers auto ({WORKERS}) --preserve-source-ip",
            *at(10),
            workers="auto",
            backend=backend,
            extra=_TRANSPARENT,
        ),
        *(
            []
            if baseline is None
            else [
                ThisProxy("base-1", "baseline, --workers 1", *at(5), backend=backend, src=baseline),
            ]
        ),
        *(
            []
            if baseline is None or "--workers" not in known_flags(baseline)
            else [
                ThisProxy(
                    "base-auto",
                    f"baseline, --workers auto ({WORKERS})",
                    *at(6),
                    workers="auto",
                    backend=backend,
                    src=baseline,
                ),
            ]
        ),
    ]


def redirect_rules(peers: list[Peer]) -> str:
    """REDIRECT in PREROUTING for the peers that do not install rules of their own."""
    lines = ["*nat", ":BENCH-PEERS - [0:0]", "-A PREROUTING -j BENCH-PEERS"]
    for peer in peers:
        ports = peer.redirect()
        if ports is None:
            continue
        for ip, port, to in ((peer.http, HTTP_PORT, ports[0]), (peer.bulk, BULK_PORT, ports[1])):
            lines.append(
                f"-A BENCH-PEERS -d {ip}/32 -p tcp -m tcp --dport {port}"
                f" -j REDIRECT --to-ports {to}"
            )
    return "\n".join([*lines, "COMMIT", ""])


class Run:
    """The testbed, the peers and the samples of one run."""

    def __init__(self, args: argparse.Namespace, tmp: Path, peers: list[Peer]) -> None:
        self.args = args
        self.tmp = tmp
        self.peers = peers
        self.bed = Testbed(tmp, args.nginx_workers, args.iptables_backend)
        self.loadavg: list[float] = []

    def setup(self) -> None:
        bed = self.bed
        bed.setup()
        bed.started_servers()
        for peer in self.peers:
            bed.client_sources(peer.sources, peer.http, peer.bulk)
        kernel = self.peers[0]
        bed.kernel_mode(kernel.http, kernel.bulk)
        bed.restore(redirect_rules(self.peers), "redirect")

    def close(self) -> None:
        for peer in self.peers:
            peer.stop()
        self.bed.close()

    def sample(self, peer: Peer) -> dict[str, Any]:
        """Start the peer, measure everything once, stop it."""
        a, bed = self.args, self.bed
        self.loadavg.append(os.getloadavg()[0])
        out: dict[str, Any] = {}
        peer.start(bed, self.tmp)
        try:
            seen: dict[str, int] = {}

            def answered() -> bool:
                nonlocal seen
                seen = bed.spread(peer.http, HTTP_PORT, 60)
                return set(seen) == set(PODS)

            wait_for(answered, f"{peer.key}: every pod answering", timeout=30)
            out["spread"] = seen
            pids = peer.pids()
            if pids:
                out["processes"] = len(pids)
                out["rss_start_kib"], out["pss_start_kib"] = memory(pids)
                out["resident_start_kib"] = resident_kib(pids)
                out["rss_start_by_process_kib"] = [memory_kib(pid)[0] for pid in pids]
                out["process_names"] = [command(pid) for pid in pids]
            url = f"http://{peer.http}:{HTTP_PORT}/"
            load = {"threads": a.threads, "connections": a.connections}
            bed.wrk(url, 1, **load, close=False)  # warm-up

            def measured(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
                before = bed.cpu(pids)
                each = [cpu_seconds(pid) for pid in pids]
                got = work()
                cpu_shares(got, before, bed.cpu(pids), proxy=bool(pids))
                if len(pids) > 1:  # which process of a proxy spent it (control, workers)
                    spent = zip(pids, each, strict=True)
                    got["proxy_cpu_s_by_process"] = [
                        round(cpu_seconds(pid) - was, 3) for pid, was in spent
                    ]
                return got

            for kind, close in (("keepalive", False), ("newconn", True)):
                got = measured(lambda close=close: bed.wrk(url, a.seconds, **load, close=close))
                got["path_cpu_us_per_req"] = got["path_cpu_s"] / max(1, got["requests"]) * 1e6
                if pids:
                    got["proxy_cpu_us_per_req"] = got["proxy_cpu_s"] / max(1, got["requests"]) * 1e6
                out[kind] = got
                if kind == "keepalive":
                    # Unloaded, before the new-connection run leaves TIME_WAIT behind.
                    out["setup"] = bed.setup_latency(peer.http, HTTP_PORT, a.setup_count)
            for streams in (1, 4):
                got = measured(
                    lambda streams=streams: bed.iperf(
                        peer.bulk, streams, seconds=a.bulk_seconds, timeout=a.bulk_seconds + 30
                    )
                )
                if "bytes" in got:
                    gib = got["bytes"] / GiB
                    got["path_cpu_s_per_gib"] = got["path_cpu_s"] / gib
                    if pids:
                        got["proxy_cpu_s_per_gib"] = got["proxy_cpu_s"] / gib
                out[f"bulk{streams}"] = got
            if pids:
                out["idle"] = self.idle(peer, pids)
            if not peer.alive():
                raise RuntimeError(f"{peer.key} exited during its run")
        finally:
            peer.stop()
        self.loadavg.append(os.getloadavg()[0])
        return out

    def idle(self, peer: Peer, pids: list[int]) -> dict[str, Any]:
        """RSS with `--idle` connections open through the peer (each also open to a pod)."""
        bed, count = self.bed, self.args.idle
        before, _ = memory(pids)
        base = bed.pod_connections()
        held = IdleConnections(bed, peer.http, HTTP_PORT, count)
        try:
            opened, errors = held.opened(timeout=120)
            # A peer may drop a few of them (the Go proxier closes a client whose dial ladder
            # ran out under load): what reached the pods is recorded, not a failed run.
            with contextlib.suppress(AssertionError):
                wait_for(
                    lambda: bed.pod_connections() >= base + opened,
                    f"{opened} connections at the pods",
                    timeout=60,
                    interval=0.5,
                )
            at_pods = bed.pod_connections() - base
            rss, pss = memory(pids)
        finally:
            held.close()
        wait_for(lambda: bed.pod_connections() <= base, "idle connections closed", timeout=60)
        if at_pods < opened:
            lost = opened - at_pods
            print(f"  {peer.key}: {lost} of {opened} idle connections never reached a pod")
        return {
            "connections": opened,
            "at_pods": at_pods,
            "errors": errors,
            "rss_kib": rss,
            "pss_kib": pss,
            "rss_before_kib": before,
            "kib_per_connection": (rss - before) / max(1, opened),
        }


def memory(pids: list[int]) -> tuple[int, int]:
    """(RSS, PSS) in KiB, summed over processes."""
    both = [memory_kib(pid) for pid in pids]
    return sum(r for r, _ in both), sum(p for _, p in both)


# --- the figures


@dataclass(frozen=True)
class Figure:
    """One row of the table: a figure per sample, and how it compares with kernel DNAT."""

    key: str
    label: str
    fmt: str
    value: Callable[[dict[str, Any]], float | None]
    # The figure kernel DNAT is compared on (CPU: the whole path's, since DNAT has no process).
    versus: Callable[[dict[str, Any]], float | None] | None = None


def _get(*keys: str) -> Callable[[dict[str, Any]], float | None]:
    def get(sample: dict[str, Any]) -> float | None:
        node: Any = sample
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return float(node) if node is not None else None

    return get


def _mb(*keys: str) -> Callable[[dict[str, Any]], float | None]:
    get = _get(*keys)
    return lambda s: None if (v := get(s)) is None else v / 1024


FIGURES = (
    Figure("keepalive", "keep-alive requests/s", ",.0f", _get("keepalive", "rate")),
    Figure("newconn", "new connections/s", ",.0f", _get("newconn", "rate")),
    Figure(
        "p99",
        "keep-alive latency p99, ms",
        ".2f",
        lambda s: None if (v := _get("keepalive", "p99_us")(s)) is None else v / 1000,
    ),
    Figure("bulk1", "bulk, 1 stream, Gbit/s", ".1f", _get("bulk1", "gbit_s")),
    Figure("bulk4", "bulk, 4 streams, Gbit/s", ".1f", _get("bulk4", "gbit_s")),
    Figure("setup", "connection setup p50, µs", ",.0f", _get("setup", "p50_us")),
    Figure(
        "cpu_req",
        "proxy CPU per keep-alive request, µs",
        ".1f",
        _get("keepalive", "proxy_cpu_us_per_req"),
        _get("keepalive", "path_cpu_us_per_req"),
    ),
    Figure(
        "cpu_conn",
        "proxy CPU per new connection, µs",
        ",.0f",
        _get("newconn", "proxy_cpu_us_per_req"),
        _get("newconn", "path_cpu_us_per_req"),
    ),
    Figure(
        "cpu_gib",
        "proxy CPU per GiB (1 and 4 streams), s",
        ".2f",
        lambda s: _per_gib(s, "proxy_cpu_s"),
        lambda s: _per_gib(s, "path_cpu_s"),
    ),
    Figure("rss_start", "RSS after start, MB", ".1f", _mb("rss_start_kib")),
    Figure(
        "resident_start",
        "memory after start, each page once, MB",
        ".1f",
        _mb("resident_start_kib"),
    ),
    Figure("rss_idle", "RSS with the idle connections, MB", ".1f", _mb("idle", "rss_kib")),
    Figure("kib_idle", "RSS per idle connection, KiB", ".2f", _get("idle", "kib_per_connection")),
    Figure("processes", "processes", "d", _get("processes")),
)


def _per_gib(sample: dict[str, Any], key: str) -> float | None:
    runs = [sample.get(f"bulk{n}", {}) for n in (1, 4)]
    runs = [r for r in runs if "bytes" in r and key in r]
    if not runs:
        return None
    return sum(r[key] for r in runs) / (sum(r["bytes"] for r in runs) / GiB)


REFERENCES = ("haproxy", "haproxy-1", "protocol", "protocol-auto", "go-userspace")


def summarize(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per peer and figure: median, min, max over rounds; ratios of medians to kernel DNAT and
    to HAProxy; the setup p50 added over DNAT."""

    def stats(values: list[float]) -> dict[str, float] | None:
        if not values:
            return None
        return {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
        }

    table: dict[str, dict[str, Any]] = {}
    for peer, got in samples.items():
        entry: dict[str, Any] = {}
        for fig in FIGURES:
            entry[fig.key] = stats([v for s in got if (v := fig.value(s)) is not None])
            if fig.versus is not None:
                entry[f"{fig.key}_path"] = stats(
                    [v for s in got if (v := fig.versus(s)) is not None]
                )
        entry["errors"] = sum(
            s.get(kind, {}).get("errors", 0) + (1 if "error" in s.get(kind, {}) else 0)
            for s in got
            for kind in ("keepalive", "newconn", "bulk1", "bulk4", "setup")
        )
        table[peer] = entry

    def median(peer: str, key: str) -> float | None:
        got = table.get(peer, {}).get(key)
        return got["median"] if got else None

    def paired(peer: str, reference: str) -> dict[str, float]:
        """Per figure, the median over rounds of that round's ratio: the two were measured
        minutes apart, so a machine whose speed drifts during the run (other work) moves
        this less than the ratio of the medians."""
        out: dict[str, float] = {}
        mine_s, other_s = samples.get(peer, []), samples.get(reference, [])
        for fig in FIGURES:
            each = [
                m / o
                for a, b in zip(mine_s, other_s, strict=False)
                if (m := fig.value(a)) is not None and (o := fig.value(b))
            ]
            if each:
                out[fig.key] = statistics.median(each)
        return out

    for peer, entry in table.items():
        ratios: dict[str, float] = {}
        for fig in FIGURES:
            key = fig.key if fig.versus is None else f"{fig.key}_path"
            mine_k, kernel = median(peer, key), median("kernel", key)
            if mine_k is not None and kernel:
                ratios[fig.key] = mine_k / kernel
        entry["vs_kernel"] = ratios
        # The proxy's own figures against HAProxy, the Protocol floor and the Go proxier.
        for reference in REFERENCES:
            versus: dict[str, float] = {}
            for fig in FIGURES:
                mine, other = median(peer, fig.key), median(reference, fig.key)
                if mine is not None and other:
                    versus[fig.key] = mine / other
            entry[f"vs_{reference}"] = versus
            entry[f"vs_{reference}_paired"] = paired(peer, reference)
        mine, kernel = median(peer, "setup"), median("kernel", "setup")
        if peer != "kernel" and mine is not None and kernel is not None:
            entry["setup_added_us"] = mine - kernel
    return table


def markdown(results: dict[str, Any]) -> str:
    m, a, labels = results["machine"], results["settings"], results["labels"]
    peers = list(results["peers"])
    load = results["loadavg"]
    lines = [
        "# This proxy and its peers: one Service, one run",
        "",
        "Generated by `sudo .venv/bin/python benchmarks/peers.py"
        + (" --quick" if a["quick"] else "")
        + "`; every figure is a median over rounds and, in parentheses, a ratio to kernel"
        " iptables DNAT in the same run.",
        "",
        f"- machine: {m['cpu_model']}, {m['cpus']} CPUs ({m['usable_cpus']} usable), Linux"
        f" {m['kernel']}; everything (client, pods, peers) on this one machine, which other"
        " work shares",
        f"- load average (1 min): {load['before']:.2f} before, {load['min']:.2f}-{load['max']:.2f}"
        f" during, {load['after']:.2f} after",
        f"- software: Python {m['python']}, uvloop {m['uvloop']}, {m['haproxy']},"
        f" {m['nginx']}, {m['wrk']}, {m['iperf3']}; this proxy's src/ at commit"
        f" {results['commit']}",
        f"- load: wrk {a['threads']} threads x {a['connections']} connections x"
        f" {a['seconds']:g} s; iperf3 {a['bulk_seconds']:g} s per run; {a['setup_count']}"
        f" sequential new connections for the setup latency; {a['idle']} idle connections;"
        f" {a['clients']} client addresses per peer"
        + "".join(
            f" ({key}: {'/'.join(str(n) for _, n in sorted(spread.items()))} per worker)"
            for key, spread in results["client_workers"].items()
        )
        + ";"
        f" nginx pods: 3 x {a['nginx_workers']} worker(s); {results['rounds_done']} round(s)"
        f" in {results['elapsed_s']:.0f} s",
        "",
        "| figure | " + " | ".join(labels[p] for p in peers) + " |",
        "|---|" + "---:|" * len(peers),
    ]
    for fig in FIGURES:
        cells = []
        for peer in peers:
            entry = results["peers"][peer]
            st = entry.get(fig.key)
            if st is None:
                cells.append("—")
                continue
            text = f"{st['median']:{fig.fmt}}" if fig.fmt != "d" else f"{st['median']:.0f}"
            ratio = entry["vs_kernel"].get(fig.key)
            if ratio is not None and peer != "kernel":
                text += f" ({ratio:.2f}x)"
            cells.append(text)
        lines.append(f"| {fig.label} | " + " | ".join(cells) + " |")
    added = [results["peers"][p].get("setup_added_us") for p in peers]
    lines.append(
        "| connection setup p50 added over DNAT, µs | "
        + " | ".join("—" if v is None else f"{v:,.0f}" for v in added)
        + " |"
    )
    by_process = []
    for peer in peers:
        got = (
            results["samples"][peer][0].get("rss_start_by_process_kib")
            if results["samples"][peer]
            else None
        )
        by_process.append(" + ".join(f"{kib / 1024:.0f}" for kib in got) if got else "—")
    lines.append(
        "| RSS after start by process (first round), MB | " + " | ".join(by_process) + " |"
    )
    lines += [
        "",
        "Ratios of the CPU rows compare the whole path's CPU per unit of work (wrk + nginx or"
        " iperf3 + the peer) with kernel DNAT's, which has no process of its own. RSS is summed"
        " over the peer's processes, so a page forked processes share counts once in each;"
        " the 'each page once' row counts the physical pages of all of them once (pagemap).",
        "",
        "Ratios to HAProxy (the issue's targets are written against it):",
        "",
        "| figure | " + " | ".join(labels[p] for p in peers if p != "kernel") + " |",
        "|---|" + "---:|" * (len(peers) - 1),
    ]
    for fig in FIGURES:
        if fig.key == "processes":
            continue
        cells = []
        for peer in peers:
            if peer == "kernel":
                continue
            ratio = results["peers"][peer]["vs_haproxy"].get(fig.key)
            cells.append("—" if ratio is None else f"{ratio:.2f}")
        lines.append(f"| {fig.label} | " + " | ".join(cells) + " |")
    for reference, text in (
        ("haproxy-1", "HAProxy nbthread 1 (the targets of the native data plane)"),
        ("protocol", "the minimal Protocol proxy (the floor; own overhead is CPU per request)"),
        (
            "protocol-auto",
            f"the minimal Protocol proxy in {WORKERS} processes (the floor for N workers)",
        ),
        ("go-userspace", "the Go userspace proxier (what this project replaces)"),
    ):
        if reference not in peers:
            continue
        mine = [p for p in peers if p.startswith(("proxy-", "py-", "base-", "tproxy-"))]
        lines += [
            "",
            f"Ratios to {text}"
            + (
                "; in parentheses the median of each round's own ratio, which a machine whose"
                " speed drifts during the run moves less"
                if results["rounds_done"] > 1
                else ""
            )
            + ":",
            "",
            "| figure | " + " | ".join(labels[p] for p in mine) + " |",
            "|---|" + "---:|" * len(mine),
        ]
        for fig in FIGURES:
            if fig.key == "processes":
                continue
            cells = []
            for peer in mine:
                got = results["peers"][peer]
                ratio = got.get(f"vs_{reference}", {}).get(fig.key)
                each = got.get(f"vs_{reference}_paired", {}).get(fig.key)
                cell = "—" if ratio is None else f"{ratio:.2f}"
                if each is not None and results["rounds_done"] > 1:
                    cell += f" ({each:.2f})"
                cells.append(cell)
            lines.append(f"| {fig.label} | " + " | ".join(cells) + " |")
    errors = {p: results["peers"][p]["errors"] for p in peers if results["peers"][p]["errors"]}
    lines += [
        "",
        f"Failed requests or runs: {errors or 'none'}.",
        "",
        f"![ratios to kernel DNAT]({results['name']}-ratios.png)",
        f"![costs]({results['name']}-costs.png)",
        "",
    ]
    return "\n".join(lines)


def charts(results: dict[str, Any], out: Path) -> list[Path]:
    """Two PNGs: throughput and whole-path CPU as ratios to kernel DNAT; the peers' costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers, labels = list(results["peers"]), results["labels"]
    name = results["name"]
    colors = plt.get_cmap("tab10").colors
    title = (
        f"{results['machine']['cpus']} CPUs, Linux {results['machine']['kernel']}, one run,"
        f" medians of {results['rounds_done']} round(s), load avg"
        f" {results['loadavg']['min']:.1f}-{results['loadavg']['max']:.1f}"
    )

    # Two panels, so that no axis mixes directions: throughput (higher is better) above,
    # CPU per unit of work and setup latency (lower is better) below. Horizontal bars keep
    # every label upright and readable at a docs page's width; kernel DNAT is the line at 1.
    panels = [
        (
            "Throughput, ratio to kernel DNAT: higher is better",
            [
                ("keepalive", "keep-alive req/s"),
                ("newconn", "new connections/s"),
                ("bulk1", "bulk, 1 stream"),
                ("bulk4", "bulk, 4 streams"),
            ],
        ),
        (
            "Cost, ratio to kernel DNAT: lower is better",
            [
                ("cpu_req", "path CPU per request"),
                ("cpu_conn", "path CPU per new conn"),
                ("cpu_gib", "path CPU per GiB"),
                ("setup", "setup latency p50"),
            ],
        ),
    ]
    shown = [p for p in peers if p != "kernel"]
    # The legend (two columns, the DNAT line too) gets room for its rows below the panels;
    # the bars get taller and their labels smaller as peers are added.
    legend_in = 0.3 * ((len(shown) + 2) // 2) + 0.2
    fig, axes = plt.subplots(2, 1, figsize=(8, 9.5 + 0.25 * len(shown) + legend_in))
    height = 0.8 / len(shown)
    label_size = 10 if len(shown) <= 8 else 8
    for ax, (heading, figs) in zip(axes, panels, strict=True):
        top = 0.0
        for i, peer in enumerate(shown):
            values = [results["peers"][peer]["vs_kernel"].get(k, 0.0) for k, _ in figs]
            ys = [j + (i - (len(shown) - 1) / 2) * height for j in range(len(figs))]
            color = colors[peers.index(peer) % len(colors)]
            bars = ax.barh(ys, values, height, label=labels[peer], color=color)
            ax.bar_label(bars, fmt="%.2f", fontsize=label_size, padding=3)
            top = max(top, *values)
        ax.axvline(1.0, color="black", linewidth=1.2, linestyle="--", label="kernel DNAT = 1")
        ax.set_yticks(range(len(figs)), [text for _, text in figs], fontsize=11)
        ax.invert_yaxis()  # the first figure on top
        ax.set_xlim(0, max(1.0, top) * 1.12)
        ax.tick_params(axis="x", labelsize=10)
        ax.set_title(heading, fontsize=12, loc="left")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncols=2, fontsize=10, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, legend_in / fig.get_figheight(), 1, 1))
    first = out / f"{name}-ratios.png"
    fig.savefig(first, dpi=110)
    plt.close(fig)

    cost_figs = [
        ("cpu_req", "proxy CPU per keep-alive request, µs"),
        ("cpu_conn", "proxy CPU per new connection, µs"),
        ("cpu_gib", "proxy CPU per GiB, s"),
        ("setup_added_us", "setup p50 added over DNAT, µs"),
        ("rss_start", "RSS after start, MB"),
        ("kib_idle", "RSS per idle connection, KiB"),
    ]
    # Three rows of two, so that a docs page shows the labels at a readable size; past six
    # peers the names stand upright and the values over the bars too, so none touches.
    many = len(shown) > 6
    fig, axes = plt.subplots(3, 2, figsize=(8, 11) if many else (8, 9.5))
    for axis, (key, text) in zip(axes.flat, cost_figs, strict=True):
        values = []
        for peer in shown:
            entry = results["peers"][peer]
            got = entry.get(key)
            values.append(got if isinstance(got, float) else (got or {}).get("median", 0.0))
        bars = axis.bar(
            range(len(shown)),
            values,
            color=[colors[(peers.index(p)) % len(colors)] for p in shown],
        )
        axis.bar_label(bars, fmt="%.3g", fontsize=8 if many else 10, rotation=90 if many else 0)
        axis.set_ylim(0, max(values) * (1.35 if many else 1.18))
        axis.set_title(text, fontsize=11)
        # "proxy-auto" -> "proxy\nauto": five labels side by side without touching.
        if many:
            axis.set_xticks(range(len(shown)), shown, fontsize=9, rotation=90)
        else:
            axis.set_xticks(range(len(shown)), [p.replace("-", "\n") for p in shown], fontsize=10)
        axis.tick_params(axis="y", labelsize=10)
    fig.suptitle(
        f"The peers' costs: lower is better (kernel DNAT has no process)\n{title}", fontsize=10
    )
    fig.tight_layout()
    second = out / f"{name}-costs.png"
    fig.savefig(second, dpi=110)
    plt.close(fig)
    return [first, second]


def brief(s: dict[str, Any]) -> str:
    """One line per sample, for progress on stderr."""
    ka, nc = s["keepalive"], s["newconn"]
    bulk = "/".join(f"{s[k].get('gbit_s', 0):.1f}" for k in ("bulk1", "bulk4"))
    proxy = ""
    if "proxy_cpu_us_per_req" in ka:
        proxy = (
            f"; proxy {ka['proxy_cpu_us_per_req']:.1f} µs/req,"
            f" {nc['proxy_cpu_us_per_req']:.0f} µs/conn,"
            f" RSS {s['rss_start_kib'] / 1024:.0f} MB ({s['processes']} procs)"
        )
        if "idle" in s:
            proxy += f", {s['idle']['kib_per_connection']:.2f} KiB/idle conn"
    return (
        f"{ka['rate']:,.0f} req/s, {nc['rate']:,.0f} conn/s, {bulk} Gbit/s,"
        f" setup p50 {s['setup']['p50_us']:.0f} µs{proxy}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (about 1 min)")
    parser.add_argument("--rounds", type=int, help="rounds over all peers (default 3; quick 1)")
    parser.add_argument("--seconds", type=int, help="per wrk run, whole (default 5; quick 2)")
    parser.add_argument("--bulk-seconds", type=float, help="per iperf3 run (default 3; quick 1)")
    parser.add_argument(
        "--setup-count", type=int, help="new connections timed one by one (1000; quick 200)"
    )
    parser.add_argument(
        "--idle", type=int, help=f"idle connections, at most {MAX_PROXIED} (9000; quick 1000)"
    )
    parser.add_argument(
        "--clients", type=int, default=8, help="client addresses per peer, 1..8 (default 8)"
    )
    parser.add_argument("--connections", type=int, default=50, help="wrk connections (50)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (default 2)")
    parser.add_argument("--nginx-workers", type=int, default=1, help="per pod (default 1)")
    parser.add_argument("--iptables-backend", choices=["restore", "iptc"], default="restore")
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help="which peers, comma-separated (kernel, the baseline, is always measured)",
    )
    parser.add_argument(
        "--budget", type=float, default=540, help="seconds; no round starts past it (540)"
    )
    parser.add_argument(
        "--baseline",
        metavar="SRC",
        help="also run this proxy from another checkout's src/ (peers base-1, base-auto)",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results", help="output directory"
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="measure nothing: the tables and charts again from --out's peers.json"
        " (--quick: peers-quick)",
    )
    args = parser.parse_args()
    if args.replot:
        name = "peers-quick" if args.quick else "peers"
        results = json.loads((args.out / f"{name}.json").read_text())
        # The summary again from the samples, so a change of method reaches a stored run.
        results["peers"] = summarize(results["samples"])
        (args.out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / f"{name}.md").write_text(markdown(results))
        pngs = charts(results, args.out)
        print(f"wrote {args.out / name}.md, .json, " + ", ".join(str(p) for p in pngs))
        return 0
    quick = args.quick
    for key, full, short in (
        ("rounds", 3, 1),
        ("seconds", 5, 2),
        ("bulk_seconds", 3.0, 1.0),
        ("setup_count", 1000, 200),
        ("idle", 9000, 1000),
    ):
        if getattr(args, key) is None:
            setattr(args, key, short if quick else full)
    if not 1 <= args.rounds <= 10 or not 1 <= args.seconds <= 60:
        parser.error("--rounds must be 1..10 and --seconds 1..60")
    if not 0.5 <= args.bulk_seconds <= 30 or not 10 <= args.setup_count <= 10000:
        parser.error("--bulk-seconds must be 0.5..30 and --setup-count 10..10000")
    if not 1 <= args.clients <= 8:
        parser.error("--clients must be 1..8")
    if not 1 <= args.idle <= MAX_PROXIED or not 1 <= args.connections <= 4000:
        parser.error(f"--idle must be 1..{MAX_PROXIED} and --connections 1..4000")
    wanted = {"kernel", *args.peers.split(",")}
    if args.baseline is not None:
        args.baseline = str(Path(args.baseline).resolve())
        wanted |= set(BASELINE_PEERS)
    known = {*PEERS, *BASELINE_PEERS, *TRANSPARENT_PEERS}
    if wanted - known:
        parser.error(f"unknown peers {sorted(wanted - known)}; known: {', '.join(sorted(known))}")
    packages = {**PACKAGES, **(GO_PACKAGES if "go-userspace" in wanted else {})}
    reason = available() or install_missing(packages, extra="bench")
    if reason:
        print(f"peers: {reason}", file=sys.stderr)
        return 2
    # Made after installing: the labels name the versions.
    peers = [
        p for p in make_peers(args.iptables_backend, args.clients, args.baseline) if p.key in wanted
    ]
    # The idle-connection client holds --idle descriptors itself.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    tmp = Path(tempfile.mkdtemp(prefix="kup-peers-"))
    run = Run(args, tmp, peers)
    atexit.register(run.close)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(1))
    name = "peers-quick" if quick else "peers"
    results: dict[str, Any] = {
        "name": name,
        "machine": {
            "cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)),
            "cpu_model": cpu_model(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "uvloop": uvloop.__version__,
            "haproxy": " ".join(version("haproxy", "-v").split()[::2][:2]),
            "nginx": version("nginx", "-v").replace("nginx version: ", ""),
            "wrk": " ".join(version("wrk", "-v").split()[:2]),
            "iperf3": version("iperf3", "--version").split(" (")[0],
            "rlimit_nofile": hard,
        },
        "commit": source_commit(),
        "baseline": args.baseline,
        "settings": {
            k: getattr(args, k)
            for k in (
                "quick",
                "rounds",
                "seconds",
                "bulk_seconds",
                "setup_count",
                "idle",
                "clients",
                "connections",
                "threads",
                "nginx_workers",
                "iptables_backend",
            )
        },
        "labels": {p.key: p.label for p in peers},
        "workers_auto": WORKERS,
        # Which worker each client address of the proxy's peers is steered to.
        "client_workers": {
            p.key: dict(Counter(worker_of(src, WORKERS) for src in p.sources))
            for p in peers
            if isinstance(p, ThisProxy) and p.workers != "1"
        },
    }
    load_before = os.getloadavg()[0]
    samples: dict[str, list[dict[str, Any]]] = {p.key: [] for p in peers}
    started = time.monotonic()
    rounds_done = 0
    try:
        run.setup()
        for r in range(args.rounds):
            elapsed = time.monotonic() - started
            if r and elapsed + elapsed / r > args.budget:
                print(f"  round {r + 1} would end past --budget: stopping", file=sys.stderr)
                break
            order = peers[r % len(peers) :] + peers[: r % len(peers)]
            for peer in order:
                samples[peer.key].append(run.sample(peer))
                print(
                    f"  round {r + 1} {peer.key}: {brief(samples[peer.key][-1])}", file=sys.stderr
                )
            rounds_done += 1
    finally:
        run.close()
        shutil.rmtree(tmp, ignore_errors=True)
    during = run.loadavg or [load_before]
    results["loadavg"] = {
        "before": load_before,
        "min": min(during),
        "max": max(during),
        "after": os.getloadavg()[0],
        "samples": during,
    }
    results["elapsed_s"] = time.monotonic() - started
    results["rounds_done"] = rounds_done
    results["peers"] = summarize(samples)
    results["samples"] = samples
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    (args.out / f"{name}.md").write_text(text)
    pngs = charts(results, args.out)
    print(text)
    print(f"wrote {args.out / name}.md, .json, " + ", ".join(p.name for p in pngs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
