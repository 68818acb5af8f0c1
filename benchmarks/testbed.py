"""The testbed that the Service benchmarks share: namespaces, nginx pods, kernel-mode rules, load.

`Testbed.setup` builds the integration tests' topology (`tests/integration/netns.py`: a client
pod, a node and three backend pods joined by veth pairs, in network namespaces named with this
pid), replaces its small Python backends by nginx (`return 200 "<pod name>"`, no access log,
unlimited keep-alive requests) and starts an iperf3 server in pod-a. Each path a benchmark
compares gets its own client source address (`client_route`), so TIME_WAIT tuples of one path
never meet another's; the client namespace gets tcp_tw_reuse=1 and ip_local_port_range
1024-65535, the node namespace ip_forward=1, ephemeral ports from NODE_PORTS up and, once its
nat table is in use, a 10 s conntrack TIME_WAIT timeout (per namespace; 120 s would pile up
~10^5 entries in new-connection runs). `close` kills what was started (by PID) and deletes
the namespaces; nothing touches the root namespace.

Load: wrk (`wrk`, one JSON line per run), iperf3 (`iperf`), one-shot requests (`spread`,
`setup_latency`) and idle connections (`IdleConnections`), all from the client namespace.
CPU: `/proc/PID/stat` of the servers and of whatever a benchmark puts in the path, rusage of
reaped children for the client tools, `/proc/stat` for the whole machine.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import resource
import select
import shutil
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.conftest import IPTABLES  # noqa: E402
from tests.integration.netns import (  # noqa: E402
    POD_PORT,
    PODS,
    Netns,
    Topology,
    stop,
    wait_for,
)

GiB = 1 << 30
HTTP_PORT = 80
BULK_PORT = 5201
# What every Service benchmark runs: command -> Debian package.
TOOLS = {"wrk": "wrk", "nginx": "nginx-light", "iperf3": "iperf3"}
# The first ephemeral port in the node namespace: listeners there stay below it.
NODE_PORTS = 43000
# The node's address on the client's link: a REDIRECTed connection arrives there.
NODE_GATEWAY = "10.244.1.1"

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

# Connection setup as a client sees it: `count` requests one after another, each on a new
# connection; the time from connect() to the first byte of the answer, in microseconds.
SETUP_LATENCY = textwrap.dedent(
    """
    import json, socket, sys, time
    host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    request = b"GET / HTTP/1.1\\r\\nHost: bench\\r\\nConnection: close\\r\\n\\r\\n"
    times, errors = [], 0
    for _ in range(count):
        try:
            start = time.perf_counter()
            with socket.create_connection((host, port), timeout=3) as s:
                s.sendall(request)
                if not s.recv(4096):
                    raise OSError("closed before answering")
                times.append((time.perf_counter() - start) * 1e6)
                while s.recv(4096):
                    pass
        except OSError:
            errors += 1
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))] if times else None
    print(json.dumps({"count": len(times), "errors": errors, "p50_us": pick(0.5),
                      "p90_us": pick(0.9), "p99_us": pick(0.99)}))
    """
)

# Idle connections: opens `count` (one at a time), prints how many opened, holds them until
# stdin closes or says anything, then closes them.
IDLE = textwrap.dedent(
    """
    import resource, socket, sys
    host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held, errors = [], 0
    for _ in range(count):
        try:
            held.append(socket.create_connection((host, port), timeout=3))
        except OSError:
            errors += 1
            if errors > 50:
                break
    print(len(held), errors, flush=True)
    sys.stdin.readline()
    for s in held:
        s.close()
    """
)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc/PID/stat."""
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


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (every thread's children), parents first."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        found.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                children = Path(f"/proc/{current}/task/{task}/children").read_text()
                todo += [int(c) for c in children.split()]
    return found


HELPERS = ("iptables", "ip6tables", "xtables")
"""Short-lived commands a proxy runs now and then (not part of its long-lived processes)."""


def command(pid: int) -> str:
    """A process's name (/proc/PID/comm), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def long_lived(pid: int) -> list[int]:
    """A proxy's processes (`pid`, its workers, its spare): not the iptables runs it starts
    now and then, which would leave CPU and memory sums as they end."""
    return [p for p in process_tree(pid) if not command(p).startswith(HELPERS)]


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB, from /proc/PID/smaps_rollup; (0, 0) if it is gone."""
    rss = pss = 0
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    return rss, pss


def resident_kib(pids: list[int]) -> int | None:
    """The physical memory a group of processes holds, each page counted once, in KiB.

    Summed RSS counts a page that forked processes share (the interpreter's heap a fork
    server froze, the libraries) once in each of them; PSS divides it among every process
    that maps it, this group's or not. This is the union: the PFNs of the present pages of
    every mapping with resident pages (/proc/PID/smaps, /proc/PID/pagemap; root reads the
    PFNs). Pages gone between the reads are skipped, processes gone count nothing; None
    when the PFNs are hidden (not root).
    """
    frames: set[int] = set()
    page = os.sysconf("SC_PAGE_SIZE")
    for pid in pids:
        with contextlib.suppress(OSError):
            ranges: list[tuple[int, int]] = []
            with open(f"/proc/{pid}/smaps") as f:
                current: tuple[int, int] | None = None
                for line in f:
                    head = line.split(None, 1)[0]
                    if "-" in head and not head.endswith(":"):
                        start, end = (int(x, 16) for x in head.split("-"))
                        current = (start, end)
                    elif head == "Rss:" and current is not None and int(line.split()[1]):
                        ranges.append(current)
            with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
                for start, end in ranges:
                    pagemap.seek(start // page * 8)
                    entries = array.array("Q", pagemap.read((end - start) // page * 8))
                    frames.update(e & PFN_MASK for e in entries if e & PAGE_PRESENT)
    if frames == {0}:  # present pages, every PFN hidden: no CAP_SYS_ADMIN
        return None
    frames.discard(0)
    return len(frames) * page // 1024


PAGE_PRESENT = 1 << 63
PFN_MASK = (1 << 55) - 1
"""/proc/PID/pagemap entry: bit 63 the page is present, bits 0-54 its page frame number."""


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def version(*cmd: str) -> str:
    """The first line a command prints (stdout or stderr), or "?"."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return "?"
    out = (done.stdout + done.stderr).strip().splitlines()
    return out[0] if out else "?"


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


def source_commit() -> str:
    """The last commit that changed src/ (what was measured; it survives a rebase of commits
    that only add results), with "+dirty" when src/ has uncommitted changes."""
    git = ["git", "-C", str(ROOT)]
    head = version(*git, "log", "-1", "--format=%h", "--", "src")
    dirty = version(*git, "status", "--porcelain", "--", "src") not in ("", "?")
    return head + ("+dirty" if dirty else "")


def install_missing(packages: dict[str, str], extra: str | None = None) -> str | None:
    """Install what a benchmark needs: Debian `packages` (a file or command -> its package)
    whose file or command is missing, as root with apt-get, and the pip requirements of this
    project's optional `extra` (pyproject.toml) when one of them does not import.

    Returns why something is still missing, or None.
    """
    need = sorted(
        {pkg for what, pkg in packages.items() if not (shutil.which(what) or Path(what).exists())}
    )
    if need:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            return f"needs Debian packages {' '.join(need)} (run as root on Debian)"
        print(f"installing Debian packages: {' '.join(need)}", file=sys.stderr)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *need]
        if subprocess.run(install, env=env, capture_output=True, check=False).returncode:
            subprocess.run(["apt-get", "update", "-qq"], env=env, check=False)
            done = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                return f"apt-get install {' '.join(need)} failed: {done.stderr.strip()[-500:]}"
    if extra is not None:
        with open(ROOT / "pyproject.toml", "rb") as f:
            requirements = tomllib.load(f)["project"]["optional-dependencies"][extra]
        modules = [r.split(">")[0].split("=")[0].split("[")[0].strip() for r in requirements]
        missing = [m for m in modules if not _importable(m.replace("-", "_"))]
        if missing:
            print(f"installing the [{extra}] extra: {' '.join(requirements)}", file=sys.stderr)
            done = subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", *requirements],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode:
                return f"pip install {' '.join(requirements)} failed: {done.stderr[-500:]}"
    return None


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        # Console-tool requirements (py-spy) have no module: a command beside this Python
        # (the virtualenv's bin, often not on PATH under sudo) or on PATH will do.
        command = module.replace("_", "-")
        return (Path(sys.executable).parent / command).exists() or bool(shutil.which(command))
    return True


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


def kernel_ruleset(http_ip: str, bulk_ip: str) -> str:
    """kube-proxy iptables mode for the web Service (three pods) and the bulk one (pod-a)."""
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
            kernel_rules("web", http_ip, HTTP_PORT, pods),
            kernel_rules("bulk", bulk_ip, BULK_PORT, [(PODS["pod-a"], BULK_PORT)]),
            "COMMIT",
            "",
        ]
    )


class Testbed:
    """The namespaces, nginx pods and iperf3 server of one run; `close` removes all of it."""

    def __init__(self, tmp: Path, nginx_workers: int, iptables_backend: str) -> None:
        self.tmp = tmp
        self.nginx_workers = nginx_workers
        self.iptables_backend = iptables_backend
        self.topo: Topology | None = None
        self.lua = tmp / "report.lua"
        self.lua.write_text(WRK_REPORT)
        self.servers: list[int] = []

    @property
    def node(self) -> Netns:
        assert self.topo is not None
        return self.topo.node

    @property
    def client(self) -> Netns:
        assert self.topo is not None
        return self.topo.client

    def setup(self) -> None:
        """Namespaces, sysctls, one nginx per pod on POD_PORT and iperf3 in pod-a."""
        self.topo = topo = Topology.create(self.tmp)
        # The topology starts small Python backends on POD_PORT: nginx replaces them.
        for proc in topo.procs:
            stop(proc)
        topo.procs.clear()
        self.client.run("sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1")
        self.client.run("sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65535")
        self.node.run("sysctl", "-qw", "net.ipv4.ip_forward=1")
        # Proxies in the node dial the pods from ports above every port a benchmark listens
        # on there (proxy ports 40000-40999, peers' ports below 43000), so that a peer started
        # later never finds its port taken by an earlier one's connection.
        self.node.run("sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1")
        self.node.run("sysctl", "-qw", f"net.ipv4.ip_local_port_range={NODE_PORTS} 65535")
        for pod in topo.pods:
            self.nginx(pod, POD_PORT, self.nginx_workers)
        topo.procs.append(
            topo.pods["pod-a"].popen(
                ["iperf3", "-s", "-p", str(BULK_PORT)], self.tmp / "iperf3.log"
            )
        )
        self.wait_listening("pod-a", BULK_PORT)
        for pod in topo.pods:
            self.wait_listening(pod, POD_PORT)

    def wait_listening(self, pod: str, port: int) -> None:
        assert self.topo is not None
        ns = self.topo.pods[pod]
        wait_for(lambda: f":{port} " in ns.run("ss", "-lnt"), f"{pod} listening on {port}")

    def nginx(self, pod: str, port: int, workers: int) -> None:
        """One more nginx in `pod` answering its name on `port`; counted as a server."""
        assert self.topo is not None
        conf_dir = self.tmp / f"nginx-{pod}-{port}"
        conf_dir.mkdir()
        conf = conf_dir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=conf_dir, port=port, name=pod, workers=workers))
        args = ["nginx", "-p", str(conf_dir), "-e", str(conf_dir / "error.log"), "-c", str(conf)]
        ns = self.topo.pods[pod]
        self.topo.procs.append(ns.popen([*args, "-g", "daemon off;"], conf_dir / "stdout.log"))

    def client_route(self, src: str, *destinations: str) -> None:
        """A client source address of its own, used for everything sent to `destinations`."""
        self.client.ip("addr", "add", f"{src}/24", "dev", "eth0")
        for dst in dict.fromkeys(destinations):
            self.client.ip("route", "add", f"{dst}/32", "via", NODE_GATEWAY, "src", src)

    def client_sources(self, sources: list[str], *destinations: str) -> None:
        """Like `client_route`, from several addresses: connections to `destinations` take
        them in turn (SNAT in the client namespace, `-m statistic --mode nth`), as the many
        client pods of a node would, so that whatever steers by client address can spread."""
        self.client_route(sources[0], *destinations)
        if len(sources) == 1:
            return
        chain = f"SPREAD-{sources[0].replace('.', '-')}"
        lines = ["*nat", f":{chain} - [0:0]"]
        for dst in dict.fromkeys(destinations):
            lines.append(f"-A POSTROUTING -d {dst}/32 -p tcp -j {chain}")
        for i, src in enumerate(sources):
            if i:
                self.client.ip("addr", "add", f"{src}/24", "dev", "eth0")
            # Each rule sees the connections the ones before it left: 1/n, 1/(n-1), ... 1/1.
            lines.append(
                f"-A {chain} -m statistic --mode nth --every {len(sources) - i} --packet 0"
                f" -j SNAT --to-source {src}"
            )
        self.restore("\n".join([*lines, "COMMIT", ""]), chain, self.client)
        self.client.run("sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_time_wait=10")

    def restore(self, rules: str, name: str, ns: Netns | None = None) -> None:
        """Add nat rules in the node namespace, or `ns` (iptables-restore --noflush)."""
        path = self.tmp / f"{name}.rules"
        path.write_text(rules)
        restore = IPTABLES[self.iptables_backend] + "-restore"
        (ns or self.node).run(restore, "--noflush", "-w", "5", str(path))

    def kernel_mode(self, http_ip: str, bulk_ip: str) -> None:
        """kube-proxy iptables mode for both Services, and the short conntrack TIME_WAIT."""
        self.restore(kernel_ruleset(http_ip, bulk_ip), "kernel-mode")
        # Conntrack sysctls exist once the nat table is in use in this namespace.
        self.node.run("sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_time_wait=10")

    def started_servers(self) -> None:
        """Record the server processes (nginx workers, iperf3) for CPU accounting."""
        assert self.topo is not None
        pids = []
        for proc in self.topo.procs:
            tree = process_tree(proc.pid)
            pids += tree[1:] or tree
        self.servers = pids

    def close(self) -> None:
        if self.topo is not None:
            self.topo.destroy()
            self.topo = None

    # --- load

    def spread(self, host: str, port: int, count: int = 60) -> dict[str, int]:
        """How many of `count` one-shot requests each pod answered ("error: ..." for failures)."""
        seen: dict[str, int] = json.loads(self.client.python(SPREAD, host, str(port), str(count)))
        return seen

    def setup_latency(self, host: str, port: int, count: int) -> dict[str, Any]:
        """p50/p90/p99 of connect() to the answer's first byte, over `count` new connections."""
        out = self.client.python(SETUP_LATENCY, host, str(port), str(count), timeout=count + 30)
        result: dict[str, Any] = json.loads(out)
        return result

    def wrk(
        self, url: str, seconds: int, *, threads: int, connections: int, close: bool
    ) -> dict[str, Any]:
        """One wrk run of whole `seconds` (wrk takes no fractions): requests/s ("rate"),
        latency percentiles, errors."""
        args = ["wrk", f"-t{threads}", f"-c{connections}"]
        args += [f"-d{seconds}s", "--timeout", "2s", "-s", str(self.lua)]
        if close:
            args += ["-H", "Connection: close"]
        out = self.client.run(*args, url, timeout=seconds + 30)
        line = next(x for x in out.splitlines() if x.startswith("WRKJSON "))
        result: dict[str, Any] = json.loads(line.removeprefix("WRKJSON "))
        result["rate"] = result["requests"] / (result["duration_us"] / 1e6)
        result["errors"] = sum(result[k] for k in ("connect", "read", "write", "status", "timeout"))
        return result

    def iperf(
        self,
        host: str,
        streams: int,
        *,
        bytes_per_stream: int = 0,
        seconds: float = 0.0,
        timeout: float = 60.0,
    ) -> dict[str, Any]:
        """One iperf3 transfer (client sends, zero-copy) of a byte count or for some seconds."""
        args = ["iperf3", "-c", host, "-p", str(BULK_PORT), "-J", "-Z", "-P", str(streams)]
        if bytes_per_stream:
            args += ["-n", str(bytes_per_stream * streams)]
        else:
            args += ["-t", f"{seconds:g}"]
        args += ["--connect-timeout", "3000"]
        out = self.client.run(*args, timeout=timeout, check=False)
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

    def pod_connections(self) -> int:
        """Established connections to POD_PORT, summed over the pods."""
        assert self.topo is not None
        total = 0
        for ns in self.topo.pods.values():
            out = ns.run("ss", "-Htn", "state", "established", f"( sport = :{POD_PORT} )")
            total += len(out.splitlines())
        return total

    # --- CPU

    def cpu(self, path_pids: Iterable[int] = ()) -> dict[str, float]:
        """CPU seconds so far: processes in the path (a proxy), servers, client (reaped
        children: wrk, iperf3), their run-queue wait, and the machine's busy jiffies."""
        child = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy, total = machine_busy()
        path, wait = 0.0, 0.0
        for pid in path_pids:
            with contextlib.suppress(OSError):
                path += cpu_seconds(pid)
                wait += runqueue_wait(pid)
        return {
            "proxy": path,
            "proxy_wait": wait,
            "servers": sum(cpu_seconds(pid) for pid in self.servers),
            "client": child.ru_utime + child.ru_stime,
            "busy": busy,
            "total": total,
            "wall": time.monotonic(),
        }


def cpu_shares(
    got: dict[str, Any], before: dict[str, float], after: dict[str, float], proxy: bool
) -> None:
    """Adds each part's CPU use between two `Testbed.cpu` readings, as a share of one CPU
    (the machine: of all CPUs), and the whole path's CPU seconds (client + servers + proxy)."""
    wall = after["wall"] - before["wall"]
    for part in ("client", "servers") + (("proxy",) if proxy else ()):
        got[f"{part}_cpu_s"] = after[part] - before[part]
        got[f"{part}_cpu_share"] = got[f"{part}_cpu_s"] / wall
    if proxy:
        got["proxy_wait_share"] = (after["proxy_wait"] - before["proxy_wait"]) / wall
    got["path_cpu_s"] = sum(
        got[f"{part}_cpu_s"] for part in ("client", "servers", "proxy") if f"{part}_cpu_s" in got
    )
    got["machine_busy"] = (after["busy"] - before["busy"]) / max(
        1, after["total"] - before["total"]
    )


class IdleConnections:
    """`count` idle connections from the client namespace, held until `close`."""

    def __init__(self, bed: Testbed, host: str, port: int, count: int) -> None:
        command = [sys.executable, "-c", IDLE, host, str(port), str(count)]
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", bed.client.name, *command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def opened(self, timeout: float) -> tuple[int, int]:
        """(connections open, connect errors), once all were tried."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline().split()
                if not line:
                    break
                return int(line[0]), int(line[1])
        raise RuntimeError(f"idle connections not open within {timeout:g} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                self.proc.stdin.write("close\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
