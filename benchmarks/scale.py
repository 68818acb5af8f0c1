"""The proxy at scale, end to end: N Services from the API-server fake to ClusterIPs answering.

For each scenario (by default 1,000 and 10,000 Services with 3 endpoints each, and 10,000
with 5), in the integration tests' network namespaces (`tests/integration/netns.py`: a node,
a client and three pods, named with this pid, deleted afterwards):

- the in-repo API-server fake (`tests/fakes/apiserver.py`) runs in the node namespace, in the
  driver process, holding N Services (one TCP port, a ClusterIP each) and their EndpointSlices;
- the real proxy (`kube-userspace-proxy run --kubeconfig ...`, iptables-restore backend, the
  default sync periods) starts in the node namespace;
- the driver, also in the node namespace, sends traffic from the node to the ClusterIPs (the
  node's own connections go through the nat OUTPUT rules, as in the issue's measurement).

Reported per scenario: time from the proxy's start until every ClusterIP has answered;
add-a-Service latency (a Service and its EndpointSlice created together, until its ClusterIP
answers) and endpoint-move latency (a Service's only endpoint moved to another pod, until
requests reach the new pod), p50 and p99 of `--changes` changes each; CPU of the idle proxy
(periodic resyncs included) per minute; RSS and open descriptors of every proxy process (the
control process's again after the storm, whose probes scrape /metrics); and,
during a storm of `--storm-rate` endpoint changes per second, the p99 of a request every 10 ms
through a ClusterIP (the data plane) and of `/livez` every 20 ms (from outside), and the
control process's event-loop lag p99 from its own `kube_userspace_proxy_event_loop_lag_seconds`
histogram (scraped before and after; `histogram_quantile`), each beside the same figure
measured just before the storm.

    sudo .venv/bin/python benchmarks/scale.py [--scenarios 1000x3,10000x3,10000x5]
        [--changes 20] [--workers auto] [--quick]
    # the start-up alone, this tree against another checkout's src/, alternating, 3 runs each:
    sudo .venv/bin/python benchmarks/scale.py --scenarios 10000x3 --startup-only \
        --baseline OTHER_CHECKOUT/src --repeat 3

Writes benchmarks/results/scale.md, scale.json and scale.png (matplotlib, from the optional
`bench` extra, installed when missing); with `--workers N` other than auto, scale-workers-N.*
instead. `--replot` redraws scale.png from scale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import math
import os
import random
import resource
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.testbed import (  # noqa: E402
    command,
    cpu_model,
    cpu_seconds,
    install_missing,
    memory_kib,
    process_tree,
    resident_kib,
    source_commit,
)

from tests.integration.netns import NODE_IP, POD_PORT, PODS, Topology, sh  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PROXY = ROOT / ".venv" / "bin" / "kube-userspace-proxy"
OPS = "127.0.0.1:10256"
METRICS = "127.0.0.1:10249"
LAG = "kube_userspace_proxy_event_loop_lag_seconds_bucket"
# Extra addresses on each pod's link, for scenarios with more endpoints than pods.
EXTRA_ADDRESSES = 3


def pod_addresses() -> list[tuple[str, str]]:
    """(pod, address) of every address the pods answer on, the primary ones first."""
    out = list(PODS.items())
    for extra in range(1, EXTRA_ADDRESSES + 1):
        for pod, ip in PODS.items():
            out.append((pod, ip.rsplit(".", 1)[0] + f".{10 + extra}"))
    return out


def cluster_ip(i: int) -> str:
    return f"10.96.{i // 250}.{i % 250 + 1}"


def service(name: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "clusterIP": ip,
            "clusterIPs": [ip],
            "ports": [{"name": "p", "port": 80, "targetPort": POD_PORT, "protocol": "TCP"}],
        },
    }


def endpoint_slice(name: str, ips: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-x",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "ports": [{"name": "p", "port": POD_PORT, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ips],
    }


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# ---- inside the node namespace -------------------------------------------------------------


async def ask(ip: str, port: int = 80, within: float = 1.0) -> str | None:
    """One request: the pod's name, or None (refused, timed out, reset)."""
    try:
        async with asyncio.timeout(within):
            reader, writer = await asyncio.open_connection(ip, port)
            try:
                writer.write(b"x\n")
                data = await reader.read(64)
            finally:
                writer.close()
        return data.decode() or None
    except (OSError, TimeoutError):
        return None


async def ops_get(path: str, within: float = 2.0) -> bool:
    host, port = OPS.split(":")
    try:
        async with asyncio.timeout(within):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"GET {path} HTTP/1.0\r\n\r\n".encode())
            data = await reader.read()
            writer.close()
        return data.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200"))
    except (OSError, TimeoutError):
        return False


async def lag_buckets() -> dict[float, float]:
    """The control loop's lag histogram as the proxy's /metrics has it now: {le: count}."""
    from prometheus_client.parser import text_string_to_metric_families

    host, port = METRICS.split(":")
    try:
        async with asyncio.timeout(5):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
            data = await reader.read()
            writer.close()
    except (OSError, TimeoutError):
        return {}
    text = data.partition(b"\r\n\r\n")[2].decode()
    return {
        float(sample.labels["le"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == LAG
    }


def lag_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile over the samples between two scrapes, in ms."""
    counts = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    if not counts or counts[-1][1] <= 0:
        return None
    rank = q * counts[-1][1]
    lower, below = 0.0, 0.0
    for le, cumulative in counts:
        if cumulative >= rank:
            if le == float("inf"):
                return 1000 * lower
            share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
            return 1000 * (lower + (le - lower) * share)
        lower, below = le, cumulative
    return None


async def until_answers(ip: str, expect: str | None = None, deadline: float = 30.0) -> float | None:
    """Seconds until `ip` answers (with `expect`, when given); None past the deadline.

    A new attempt starts every 5 ms while earlier ones are in flight: a SYN sent before the
    rules existed is lost for a second (its retransmission follows the same conntrack entry,
    never NATed), so waiting for each attempt would measure the probe, not the proxy.
    """
    started = time.monotonic()
    done = asyncio.Event()
    first: list[float] = []
    attempts: set[asyncio.Task[None]] = set()

    async def attempt() -> None:
        answer = await ask(ip, within=1.0)
        if answer is not None and (expect is None or answer == expect) and not first:
            first.append(time.monotonic() - started)
            done.set()

    while not done.is_set() and time.monotonic() - started < deadline:
        task = asyncio.create_task(attempt())
        attempts.add(task)
        task.add_done_callback(attempts.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 0.005)
    for task in list(attempts):
        task.cancel()
    return first[0] if first else None


async def sweep(
    ips: list[str],
    started: float,
    deadline: float,
    marks: dict[str, float] | None = None,
    proxy_pid: int | None = None,
) -> tuple[float | None, int]:
    """Seconds after `started` until every IP has answered once (None: some never did).

    A sample of the IPs is polled first with overlapping attempts (an attempt made before
    the rules exist is lost for a second); once they all answer, every IP is asked, and
    those that do not answer are asked again. `marks` gets the seconds after `started` at
    which the first sampled IP answered ("first") and the whole sample had ("sample"), and
    the CPU seconds that the proxy (`proxy_pid` and its workers) and this process spent
    asking every IP after the sample ("sweep_proxy_cpu", "sweep_probe_cpu").
    """
    sample = ips[:: max(1, len(ips) // 20)] + ips[-1:]
    for ip in sample:
        left = deadline - (time.monotonic() - started)
        if left <= 0 or await until_answers(ip, deadline=left) is None:
            return None, len(ips)
        if marks is not None:
            marks.setdefault("first", time.monotonic() - started)
    if marks is not None:
        marks["sample"] = time.monotonic() - started
    proxy_cpu = tree_cpu(proxy_pid) if proxy_pid else 0.0
    probe_cpu = cpu_seconds(os.getpid())
    probe_sys = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    # In a thread: this loop serves the API-server fake meanwhile.
    answered, pending = await asyncio.to_thread(ask_all, ips, started + deadline)
    last = answered - started if answered else None
    if marks is not None:
        marks["sweep_proxy_cpu"] = (tree_cpu(proxy_pid) if proxy_pid else 0.0) - proxy_cpu
        marks["sweep_probe_cpu"] = cpu_seconds(os.getpid()) - probe_cpu
        marks["sweep_probe_sys"] = resource.getrusage(resource.RUSAGE_SELF).ru_stime - probe_sys
    return (last if not pending else None), len(pending)


def ask_all(
    ips: list[str], until: float, port: int = 80, in_flight: int = 512, within: float = 2.0
) -> tuple[float | None, list[str]]:
    """Ask every IP once (`ask`'s request: connect, send a line, read an answer), again and
    again for those that do not answer, until all have or `until` (monotonic) passes.
    Returns when the last one answered (monotonic; None if none did) and those that never
    did. Plain non-blocking sockets and epoll, `in_flight` at a time, each attempt given
    `within` seconds: a probe that takes little CPU from the proxy on the same machine."""
    pending = list(ips)
    unanswered: list[str] = []
    last: float | None = None
    poller = select.epoll()
    flights: dict[int, tuple[socket.socket, str, float, bool]] = {}  # fd -> (sock, ip, t, sent)

    def finish(fd: int, answered: bool) -> None:
        nonlocal last
        sock, ip, _, _ = flights.pop(fd)
        poller.unregister(fd)
        sock.close()
        if answered:
            last = time.monotonic()
        else:
            unanswered.append(ip)

    try:
        while (pending or flights or unanswered) and time.monotonic() < until:
            if not pending and not flights:
                pending, unanswered = unanswered, []  # another round for those that failed
            while pending and len(flights) < in_flight:
                ip = pending.pop()
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                error = sock.connect_ex((ip, port))
                if error not in (0, errno.EINPROGRESS):
                    sock.close()
                    unanswered.append(ip)
                    continue
                flights[sock.fileno()] = (sock, ip, time.monotonic(), False)
                poller.register(sock.fileno(), select.EPOLLOUT)
            for fd, _ in poller.poll(0.05):
                sock, ip, began, sent = flights[fd]
                if not sent:
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        finish(fd, False)
                        continue
                    try:
                        sock.send(b"x\n")
                    except OSError:
                        finish(fd, False)
                        continue
                    flights[fd] = (sock, ip, began, True)
                    poller.modify(fd, select.EPOLLIN)
                    continue
                try:
                    data = sock.recv(64)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                finish(fd, bool(data))
            now = time.monotonic()
            for fd in [fd for fd, f in flights.items() if now - f[2] > within]:
                finish(fd, False)
    finally:
        for fd in list(flights):
            finish(fd, False)
        poller.close()
    return last, sorted({*pending, *unanswered})


def proxy_processes(pid: int) -> list[dict[str, Any]]:
    """RSS and PSS (MiB), name and open descriptors of the proxy and each of its workers (and
    its fork server). RSS counts a page shared by forked workers once in each of them; PSS
    divides it among every process that maps it (other programs' too, for libraries);
    `tree_memory` also counts each of the tree's pages once."""
    out = []
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            rss, pss = memory_kib(p)
            out.append(
                {
                    "pid": p,
                    "name": command(p),
                    "rss_mib": rss / 1024,
                    "pss_mib": pss / 1024,
                    "fds": len(os.listdir(f"/proc/{p}/fd")),
                }
            )
    return out


def tree_memory(pid: int) -> dict[str, Any]:
    """The proxy's processes (`proxy_processes`) and their sums: RSS, PSS, the tree's physical
    memory with each page counted once (`testbed.resident_kib`), the most descriptors."""
    processes = proxy_processes(pid)
    kib = resident_kib([p["pid"] for p in processes])
    return {
        "processes": processes,
        "rss_mib": sum(p["rss_mib"] for p in processes),
        "pss_mib": sum(p["pss_mib"] for p in processes),
        "resident_mib": None if kib is None else kib / 1024,
        "fds_max": max(p["fds"] for p in processes),
    }


def tree_cpu(pid: int) -> float:
    total = 0.0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)
    return total


async def storm(
    fake: Any, names: list[str], addresses: list[str], rate: int, seconds: float
) -> int:
    """`rate` endpoint changes per second for `seconds`: one endpoint of a Service moves."""
    changes = 0
    started = time.monotonic()
    rng = random.Random(7)
    while (elapsed := time.monotonic() - started) < seconds:
        due = int(elapsed * rate) - changes
        for _ in range(due):
            name = rng.choice(names)
            current = fake.get("EndpointSlice", f"{name}-x")
            if current is None:
                continue
            current["endpoints"][-1]["addresses"] = [rng.choice(addresses)]
            fake.update(current)
            changes += 1
        await asyncio.sleep(0.005)
    return changes


async def probe_loop(stop: asyncio.Event, interval: float, fn: Any) -> tuple[list[float], int]:
    """Run `fn` every `interval` until `stop`; (latencies of successes, failures)."""
    latencies: list[float] = []
    failures = 0
    while not stop.is_set():
        started = time.perf_counter()
        ok = await fn()
        if ok:
            latencies.append(time.perf_counter() - started)
        else:
            failures += 1
        await asyncio.sleep(max(0.0, interval - (time.perf_counter() - started)))
    return latencies, failures


async def probe(seconds: float) -> dict[str, Any]:
    """A request through a ClusterIP every 10 ms and /livez every 20 ms, for `seconds`."""

    async def request() -> bool:
        return await ask(cluster_ip(0), within=2.0) is not None

    async def livez() -> bool:
        return await ops_get("/livez")

    stop = asyncio.Event()
    data = asyncio.create_task(probe_loop(stop, 0.01, request))
    control = asyncio.create_task(probe_loop(stop, 0.02, livez))
    await asyncio.sleep(seconds)
    stop.set()
    (lat, fail), (clat, cfail) = await data, await control
    return {
        "request_p50_ms": 1000 * quantile(lat, 0.5),
        "request_p99_ms": 1000 * quantile(lat, 0.99),
        "request_max_ms": 1000 * max(lat, default=float("nan")),
        "request_failures": fail,
        "livez_p50_ms": 1000 * quantile(clat, 0.5),
        "livez_p99_ms": 1000 * quantile(clat, 0.99),
        "livez_max_ms": 1000 * max(clat, default=float("nan")),
        "livez_failures": cfail,
    }


async def scenario(args: argparse.Namespace) -> dict[str, Any]:
    from tests.fakes.apiserver import FakeApiServer

    n, per = args.services, args.endpoints
    tmp = Path(args.tmp)
    addresses = [ip for _, ip in pod_addresses()]
    fake = FakeApiServer(history_limit=50_000)
    await fake.start()
    names = [f"svc-{i}" for i in range(n)]
    for i, name in enumerate(names):
        fake.create(service(name, cluster_ip(i)))
        fake.create(endpoint_slice(name, [addresses[(i + k) % len(addresses)] for k in range(per)]))
    # The endpoint-move probe: one endpoint, moved between pods.
    pods = list(PODS.items())
    fake.create(service("mover", "10.96.240.1"))
    fake.create(endpoint_slice("mover", [pods[0][1]]))
    kubeconfig = fake.write_kubeconfig(tmp / "kubeconfig")
    log = (tmp / f"proxy-{n}x{per}.log").open("wb")  # closed in the finally below
    # --baseline: the same proxy from another checkout's src/ (PYTHONPATH wins over the
    # editable install; its workers inherit it).
    wrapper = ["env", f"PYTHONPATH={args.src}"] if args.src else []
    command = [
        *wrapper,
        str(PROXY),
        "run",
        "--kubeconfig",
        str(kubeconfig),
        "--state-dir",
        # A fresh node: no state file of an earlier run (which it would serve from first).
        tempfile.mkdtemp(dir=tmp, prefix=f"state-{n}x{per}-"),
        "--hostname-override",
        "node",
        "--node-ip",
        NODE_IP,
        "--iptables-backend",
        "restore",
        "--workers",
        args.workers,
        "--healthz-bind-address",
        OPS,
        "--metrics-bind-address",
        "127.0.0.1:10249",
        "--kube-api-qps",
        "0",
    ]
    if args.stallwatch:
        watch = [sys.executable, str(ROOT / "benchmarks" / "stallwatch.py")]
        out = Path(args.stallwatch) / f"stalls-{n}x{per}.json"
        extra = os.environ.get("STALLWATCH_ARGS", "").split()
        command = [*watch, *extra, str(out), "--", *command[1:]]
    started = time.monotonic()
    proc = subprocess.Popen(  # noqa: ASYNC220
        command, stdout=log, stderr=subprocess.STDOUT, env=compiled_env()
    )
    spies: list[subprocess.Popen[bytes]] = []

    def profile(phase: str, seconds: float) -> None:
        """Sample the proxy (and its workers) with py-spy for `seconds`, if this phase is asked."""
        if args.profile_dir and args.profile_phase == phase:
            out = Path(args.profile_dir) / f"{phase}-{n}x{per}.txt"
            spy = ROOT / ".venv" / "bin" / "py-spy"
            argv = [str(spy), "record", "--pid", str(proc.pid), "--subprocesses", "--rate"]
            argv += ["200", "--duration", str(max(1, int(seconds))), "--format", "raw"]
            argv += ["--output", str(out)]
            spies.append(
                subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )

    profile("startup", args.profile_seconds)
    result: dict[str, Any] = {"services": n, "endpoints": per, "workers": args.workers}
    try:
        ips = [cluster_ip(i) for i in range(n)] + ["10.96.240.1"]
        marks: dict[str, float] = {}
        all_answer, missing = await sweep(
            ips, started, deadline=args.start_deadline, marks=marks, proxy_pid=proc.pid
        )
        result["all_answering_s"] = all_answer
        result["first_answer_s"] = marks.get("first")
        result["sample_answering_s"] = marks.get("sample")
        result["sweep_proxy_cpu_s"] = marks.get("sweep_proxy_cpu")
        result["sweep_probe_cpu_s"] = marks.get("sweep_probe_cpu")
        result["sweep_probe_sys_s"] = marks.get("sweep_probe_sys")
        result["unanswered"] = missing
        if args.startup_only:
            result.update(tree_memory(proc.pid))
            return result
        await asyncio.sleep(3)  # settle: the first syncs' leftovers

        # Idle: CPU over a window that holds periodic resyncs (--iptables-sync-period 30s).
        cpu0, t0 = tree_cpu(proc.pid), time.monotonic()
        await asyncio.sleep(args.idle)
        cpu1, t1 = tree_cpu(proc.pid), time.monotonic()
        result["idle_cpu_percent"] = 100 * (cpu1 - cpu0) / (t1 - t0)
        result["idle_cpu_s_per_min"] = 60 * (cpu1 - cpu0) / (t1 - t0)
        result.update(tree_memory(proc.pid))

        # Add a Service: the Service and its slice created together.
        profile("changes", 2 * args.changes * (args.spacing + 0.3))
        adds: list[float] = []
        for k in range(args.changes):
            name, ip = f"new-{k}", f"10.96.241.{k + 1}"
            await asyncio.sleep(args.spacing)
            fake.create(service(name, ip))
            fake.create(endpoint_slice(name, [pods[k % len(pods)][1]]))
            took = await until_answers(ip, deadline=10)
            adds.append(took if took is not None else float("inf"))
        result["add_service_ms"] = {
            "p50": 1000 * quantile(adds, 0.5),
            "p99": 1000 * quantile(adds, 0.99),
            "samples": [round(1000 * a, 1) for a in adds],
        }

        # Move an endpoint: the mover's only endpoint goes to the next pod.
        moves: list[float] = []
        for k in range(args.changes):
            await asyncio.sleep(args.spacing)
            pod, ip = pods[(k + 1) % len(pods)]
            current = fake.get("EndpointSlice", "mover-x")
            assert current is not None
            current["endpoints"] = [{"addresses": [ip], "conditions": {"ready": True}}]
            fake.update(current)
            took = await until_answers("10.96.240.1", expect=pod, deadline=10)
            moves.append(took if took is not None else float("inf"))
        result["move_endpoint_ms"] = {
            "p50": 1000 * quantile(moves, 0.5),
            "p99": 1000 * quantile(moves, 0.99),
            "samples": [round(1000 * m, 1) for m in moves],
        }

        # A storm of endpoint changes while traffic flows; the same probes just before it.
        # The probes run in a process of their own: this one is the busy API server.
        phases: dict[str, Any] = {}
        for phase in ("before", "storm"):
            probes = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--probe",
                str(args.storm),
                stdout=asyncio.subprocess.PIPE,
            )
            cpu0, began = tree_cpu(proc.pid), time.time()
            lag0 = await lag_buckets()
            if phase == "storm":
                profile("storm", args.storm)
                phases["changes"] = await storm(fake, names, addresses, args.storm_rate, args.storm)
            out, _ = await probes.communicate()
            lag1 = await lag_buckets()
            cpu = 100 * (tree_cpu(proc.pid) - cpu0) / args.storm
            phases[phase] = {
                **json.loads(out),
                "cpu_percent": cpu,
                "wall": [began, time.time()],
                "loop_lag_p50_ms": lag_quantile(lag0, lag1, 0.5),
                "loop_lag_p99_ms": lag_quantile(lag0, lag1, 0.99),
                "loop_lag_samples": (lag1.get(float("inf"), 0) - lag0.get(float("inf"), 0)),
            }
        result["storm"] = phases
        result["processes_after"] = proxy_processes(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        await fake.stop()
        for spy in spies:
            spy.wait()
        if args.profile_dir:
            shutil.copy(tmp / f"proxy-{n}x{per}.log", Path(args.profile_dir))
    return result


# ---- the outer driver (root namespace: creates and deletes the namespaces) -----------------


def run_scenario(
    topo: Topology, tmp: Path, spec: str, args: argparse.Namespace, src: str | None = None
) -> dict[str, Any]:
    """One scenario in the node namespace; `src`: run the proxy from that checkout's src/."""
    n, per = (int(x) for x in spec.split("x"))
    inner = [
        sys.executable,
        __file__,
        "--inside",
        "--services",
        str(n),
        "--endpoints",
        str(per),
        "--tmp",
        str(tmp),
        "--changes",
        str(args.changes),
        "--spacing",
        str(args.spacing),
        "--idle",
        str(args.idle),
        "--storm",
        str(args.storm),
        "--storm-rate",
        str(args.storm_rate),
        "--start-deadline",
        str(args.start_deadline),
        "--workers",
        args.workers,
        *(["--profile-dir", args.profile_dir] if args.profile_dir else []),
        *(["--stallwatch", args.stallwatch] if args.stallwatch else []),
        "--profile-phase",
        args.profile_phase,
        "--profile-seconds",
        str(args.profile_seconds),
        *(["--startup-only"] if args.startup_only else []),
        *(["--src", src] if src else []),
    ]
    done = subprocess.run(
        ["ip", "netns", "exec", topo.node.name, *inner],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"scenario {spec} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["variant"] = "baseline" if src else "this"
    # The next scenario starts from empty tables, as a fresh node would.
    topo.node.run(str(PROXY), "cleanup", check=False)
    return result


def table(results: list[dict[str, Any]]) -> str:
    def fmt(value: Any, unit: str = "", digits: int = 0) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "—"
        if isinstance(value, float) and value == float("inf"):
            return "timeout"
        return f"{value:,.{digits}f}{unit}"

    head = "| figure | target at 10,000 | " + " | ".join(
        f"{r['services']:,} x {r['endpoints']} endpoints" for r in results
    )
    lines = [head + " |", "|---|---|" + "---:|" * len(results)]

    def at(*keys: str | int) -> Any:
        def get(r: Any) -> Any:
            for key in keys:
                r = r[key]
            return r

        return get

    rows: list[tuple[str, str, Any, str, int]] = [
        ("all ClusterIPs answering after start", "≤ 5 s", at("all_answering_s"), " s", 1),
        ("RSS (all proxy processes)", "≤ 250 MB", at("rss_mib"), " MiB", 0),
        ("PSS (all proxy processes: shared pages divided)", "", at("pss_mib"), " MiB", 0),
        ("resident, all proxy processes, each page once", "", at("resident_mib"), " MiB", 0),
        ("RSS of the control process", "", at("processes", 0, "rss_mib"), " MiB", 0),
        (
            "RSS of the control process, after the storm",
            "",
            at("processes_after", 0, "rss_mib"),
            " MiB",
            0,
        ),
        ("open descriptors (largest process)", "≤ 10,100", at("fds_max"), "", 0),
        ("add a Service, p50", "≤ 100 ms", at("add_service_ms", "p50"), " ms", 0),
        ("add a Service, p99", "", at("add_service_ms", "p99"), " ms", 0),
        ("move an endpoint, p50", "≤ 50 ms", at("move_endpoint_ms", "p50"), " ms", 0),
        ("move an endpoint, p99", "", at("move_endpoint_ms", "p99"), " ms", 0),
        ("idle CPU (resyncs included)", "≤ 1 % of a core", at("idle_cpu_percent"), " %", 2),
        ("idle CPU per minute", "", at("idle_cpu_s_per_min"), " s", 2),
        ("request p99, before the storm", "", at("storm", "before", "request_p99_ms"), " ms", 1),
        ("request p99, during the storm", "", at("storm", "storm", "request_p99_ms"), " ms", 1),
        ("/livez p99, before the storm", "", at("storm", "before", "livez_p99_ms"), " ms", 1),
        ("/livez p99, during the storm", "", at("storm", "storm", "livez_p99_ms"), " ms", 1),
        (
            "control loop lag p99, before the storm",
            "",
            at("storm", "before", "loop_lag_p99_ms"),
            " ms",
            1,
        ),
        (
            "control loop lag p99, during the storm",
            "≤ 20 ms",
            at("storm", "storm", "loop_lag_p99_ms"),
            " ms",
            1,
        ),
        ("endpoint changes made in the storm", "", at("storm", "changes"), "", 0),
        ("proxy CPU during the storm", "", at("storm", "storm", "cpu_percent"), " %", 0),
    ]
    for label, target, get, unit, digits in rows:
        cells = " | ".join(
            fmt(float(get(r)) if get(r) is not None else None, unit, digits) for r in results
        )
        lines.append(f"| {label} | {target} | {cells} |")
    lines.append("")
    for r in results:  # where the memory is: each process, RSS against PSS
        each = ", ".join(
            f"{p.get('name') or p['pid']} {p['rss_mib']:.0f}/{p.get('pss_mib', 0):.0f}"
            for p in r.get("processes", [])
        )
        lines.append(f"- {r['services']:,} x {r['endpoints']}, RSS/PSS MiB by process: {each}")
    return "\n".join(lines)


TARGET_ANSWERING_S = 5.0
"""All ClusterIPs answering this soon after a start at 10,000 service ports (the table's)."""


def chart(results: list[dict[str, Any]], path: Path) -> None:
    """Three panels stacked (a docs page shows them at a readable size): change latency, the
    start-up against its target, latency under an endpoint-change storm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['services']:,} x {r['endpoints']}" for r in results]
    fig, axes = plt.subplots(3, 1, figsize=(8, 10.5))
    width = 0.2

    def grouped(ax: Any, series: list[tuple[str, list[float]]], title: str) -> None:
        for k, (name, values) in enumerate(series):
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(results))]
            bars = ax.bar(xs, values, width, label=name)
            ax.bar_label(bars, fmt="%.0f", fontsize=9, padding=2)
        ax.set_xticks(range(len(results)), labels, fontsize=10)
        ax.set_ylabel("ms", fontsize=10)
        ax.set_ylim(0, max(v for _, values in series for v in values) * 1.2)
        ax.set_title(title, fontsize=11)
        ax.legend(fontsize=9, loc="upper left")

    changes = [
        (name, [min(r[key][q], 10_000) for r in results])
        for name, key, q in [
            ("add Service p50", "add_service_ms", "p50"),
            ("add Service p99", "add_service_ms", "p99"),
            ("move endpoint p50", "move_endpoint_ms", "p50"),
            ("move endpoint p99", "move_endpoint_ms", "p99"),
        ]
    ]
    grouped(axes[0], changes, "change latency (lower is better)")
    ax = axes[1]
    answering = [r["all_answering_s"] or 0 for r in results]
    bars = ax.bar(range(len(results)), answering, 0.5, color="tab:green")
    # Inside the bars: a value just under the target would sit on its line.
    ax.bar_label(bars, fmt="%.1f s", fontsize=11, label_type="center", color="white")
    # Drawn above the bars with headroom, so the target is seen, not only named.
    ax.axhline(TARGET_ANSWERING_S, color="tab:red", linestyle="--", linewidth=2)
    ax.text(
        -0.45,
        TARGET_ANSWERING_S,
        f"target at 10,000: ≤ {TARGET_ANSWERING_S:g} s",
        color="tab:red",
        fontsize=10,
        ha="left",
        va="bottom",
    )
    ax.set_xlim(-0.5, len(results) - 0.5)
    ax.set_ylim(0, max(TARGET_ANSWERING_S, *answering) * 1.25)
    ax.set_xticks(range(len(results)), labels, fontsize=10)
    ax.set_ylabel("s", fontsize=10)
    ax.set_title("all ClusterIPs answering after start (lower is better)", fontsize=11)
    storm = [
        (name, [r["storm"][phase][key] for r in results])
        for name, phase, key in [
            ("request p99, before", "before", "request_p99_ms"),
            ("request p99, storm", "storm", "request_p99_ms"),
            ("/livez p99, before", "before", "livez_p99_ms"),
            ("/livez p99, storm", "storm", "livez_p99_ms"),
        ]
    ]
    grouped(axes[2], storm, "latency under an endpoint-change storm (lower is better)")
    for ax in axes:
        ax.tick_params(axis="y", labelsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compiled_env() -> dict[str, str]:
    """The proxy's environment: its modules' bytecode used from (and kept in) __pycache__,
    as an installed package has it (pip compiles at install), even where
    PYTHONDONTWRITEBYTECODE is set (then every start would compile the proxy's modules)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def compile_sources(*sources: str | None) -> None:
    """Compile each `src/` tree once, so that no measured start pays for compiling."""
    for src in (str(ROOT / "src"), *(s for s in sources if s)):
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", src], env=compiled_env(), check=True
        )


def prepare(topo: Topology) -> None:
    """The pods' extra addresses; the node's ephemeral ports (the probes' and the
    kernel-chosen proxy ports) and TIME_WAIT reuse."""
    for pod, ip in pod_addresses()[len(PODS) :]:
        topo.pods[pod].ip("addr", "add", f"{ip}/24", "dev", "eth0")
    topo.node.run("sysctl", "-qw", "net.ipv4.ip_local_port_range=20000 65000")
    topo.node.run("sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1")


def startup_table(results: list[dict[str, Any]]) -> str:
    """Per scenario and variant: medians of the runs (seconds from the proxy's start; the
    CPU that the proxy and the probe spent asking every ClusterIP after the first sample),
    all answering in each run, and this / baseline."""
    lines = [
        "| scenario | proxy | runs | first ClusterIP answering | all answering | each run"
        " | ratio to baseline | sweep: proxy CPU | sweep: probe CPU | RSS, all processes"
        " | PSS, all processes |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        if not ordered:
            return float("nan")
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    specs = list(dict.fromkeys(f"{r['services']}x{r['endpoints']}" for r in results))
    for spec in specs:
        medians: dict[str, float] = {}
        for variant in ("baseline", "this"):
            runs = [
                r
                for r in results
                if f"{r['services']}x{r['endpoints']}" == spec and r["variant"] == variant
            ]
            if not runs:
                continue
            alls = [r["all_answering_s"] or float("inf") for r in runs]
            firsts = [r["first_answer_s"] or float("inf") for r in runs]
            medians[variant] = median(alls)
            ratio = ""
            if variant == "this" and "baseline" in medians:
                ratio = f"{medians['this'] / medians['baseline']:.2f}x"
            each = ", ".join(f"{a:.1f}" for a in alls)
            proxy_cpu = median([r.get("sweep_proxy_cpu_s") or float("nan") for r in runs])
            probe_cpu = median([r.get("sweep_probe_cpu_s") or float("nan") for r in runs])
            rss = median([r.get("rss_mib") or float("nan") for r in runs])
            pss = median([r.get("pss_mib") or float("nan") for r in runs])
            lines.append(
                f"| {spec} | {variant} | {len(runs)} | {median(firsts):.2f} s "
                f"| {medians[variant]:.2f} s | {each} | {ratio} | {proxy_cpu:.1f} s"
                f" | {probe_cpu:.1f} s | {rss:.0f} MiB | {pss:.0f} MiB |"
            )
    return "\n".join(lines)


def startup_only(args: argparse.Namespace) -> int:
    """`--startup-only`: each scenario `--repeat` times (alternating with `--baseline`)."""
    results = []
    variants: list[str | None] = [args.baseline, None] if args.baseline else [None]
    with tempfile.TemporaryDirectory(prefix="kup-scale-") as tmpdir:
        tmp = Path(tmpdir)
        topo = Topology.create(tmp)
        try:
            prepare(topo)
            compile_sources(args.baseline)
            for spec in args.scenarios.split(","):
                for run in range(args.repeat):
                    # Each round swaps the order: neither side always runs first (cold).
                    for src in variants if run % 2 == 0 else variants[::-1]:
                        print(f"scenario {spec} run {run + 1} {src or 'this'} ...", file=sys.stderr)
                        results.append(run_scenario(topo, tmp, spec, args, src))
                        print(json.dumps(results[-1])[:600], file=sys.stderr, flush=True)
        finally:
            topo.destroy()
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": f"{os.cpu_count()} x {cpu_model()}",
        "commit": source_commit(),
        "baseline": args.baseline,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workers": args.workers,
        "load_average": os.getloadavg(),
    }
    text = (
        f"# Start-up: {args.scenarios}\n\n{meta['machine']}; commit {meta['commit']}"
        f"{'; baseline ' + str(args.baseline) if args.baseline else ''}; {meta['date']};"
        f" `--workers {args.workers}`; load average at the end"
        f" {', '.join(f'{x:.2f}' for x in meta['load_average'])}.\n\n"
        + startup_table(results)
        + "\n"
    )
    stem = f"scale-startup-workers-{args.workers}"
    (RESULTS / f"{stem}.md").write_text(text)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="1000x3,10000x3,10000x5")
    parser.add_argument("--changes", type=int, default=20, help="samples per latency figure")
    parser.add_argument("--spacing", type=float, default=2.2, help="seconds between changes")
    parser.add_argument("--idle", type=float, default=62.0, help="idle CPU window, seconds")
    parser.add_argument("--storm", type=float, default=10.0, help="storm length, seconds")
    parser.add_argument("--storm-rate", type=int, default=1000, help="endpoint changes/s")
    parser.add_argument("--start-deadline", type=float, default=180.0)
    parser.add_argument(
        "--workers", default="auto", help="the proxy's --workers (default auto, as the proxy's)"
    )
    parser.add_argument("--quick", action="store_true", help="1,000 only, 5 changes, short")
    parser.add_argument(
        "--startup-only",
        action="store_true",
        help="measure only the start (until all ClusterIPs answer); writes"
        " scale-startup-workers-N.*",
    )
    parser.add_argument(
        "--baseline",
        help="with --startup-only: also run the proxy from another checkout's src/, runs"
        " alternating with this tree's, and report the ratios",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per scenario (and variant)")
    parser.add_argument(
        "--profile-dir",
        help="record one --profile-phase of the proxy with py-spy (collapsed stacks) and"
        " keep its log, in this directory",
    )
    parser.add_argument(
        "--profile-phase", choices=("startup", "changes", "storm"), default="startup"
    )
    parser.add_argument(
        "--stallwatch",
        help="run the proxy under benchmarks/stallwatch.py (the stacks that held its loop"
        " each time it was late) and write stalls-NxE.json in this directory",
    )
    parser.add_argument("--profile-seconds", type=float, default=20.0, help="for the startup")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--services", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--endpoints", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument(
        "--replot",
        action="store_true",
        help="measure nothing: redraw scale.png from benchmarks/results/scale.json",
    )
    args = parser.parse_args()
    if args.replot:
        chart(json.loads((RESULTS / "scale.json").read_text())["results"], RESULTS / "scale.png")
        print(f"wrote {RESULTS / 'scale.png'}")
        return 0
    if args.probe:
        import uvloop

        print(json.dumps(uvloop.run(probe(args.probe))))
        return 0
    if args.inside:
        import uvloop

        print(json.dumps(uvloop.run(scenario(args))))
        return 0
    if os.geteuid() != 0:
        print("needs root (it creates network namespaces)", file=sys.stderr)
        return 2
    if args.quick:
        args.scenarios, args.changes, args.idle, args.storm = "1000x3", 5, 10.0, 3.0
    if args.baseline and not args.startup_only:
        parser.error("--baseline needs --startup-only")
    if args.baseline:
        args.baseline = str(Path(args.baseline).resolve())
    missing = install_missing({}, extra="bench")
    if missing:
        print(f"charts (and --profile-dir) skipped: {missing}", file=sys.stderr)
    if args.startup_only:
        return startup_only(args)
    results = []
    with tempfile.TemporaryDirectory(prefix="kup-scale-") as tmpdir:
        tmp = Path(tmpdir)
        topo = Topology.create(tmp)
        try:
            prepare(topo)
            compile_sources()
            for spec in args.scenarios.split(","):
                print(f"scenario {spec} ...", file=sys.stderr, flush=True)
                results.append(run_scenario(topo, tmp, spec, args))
                print(json.dumps(results[-1])[:2000], file=sys.stderr, flush=True)
        finally:
            topo.destroy()
            sh("true")
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": f"{os.cpu_count()} x {cpu_model()}",
        "commit": source_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workers": args.workers,
    }
    text = (
        f"# Scale: {', '.join(args.scenarios.split(','))}\n\n"
        f"{meta['machine']}; commit {meta['commit']}; {meta['date']}; `--workers {args.workers}`,"
        f" iptables-restore (nft) backend, default sync periods; {args.changes} changes per"
        f" latency figure; storm {args.storm_rate}/s for {args.storm:.0f} s.\n\n"
        + table(results)
        + "\n"
    )
    # The default's figures are scale.*; another --workers writes beside them, not over them.
    stem = "scale" if args.workers == "auto" else f"scale-workers-{args.workers}"
    (RESULTS / f"{stem}.md").write_text(text)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    if not missing:
        chart(results, RESULTS / f"{stem}.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
