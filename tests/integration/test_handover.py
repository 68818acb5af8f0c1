"""Restarts that refuse nothing (docs/operations.md, "Restarts and upgrades without
refusals"): a new proxy process takes every socket over from the running one, in network
namespaces with real iptables, while a client keeps opening connections through a ClusterIP.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Proxy, service, write_manifest
from tests.integration.netns import PODS, Topology, stop, wait_for

pytestmark = pytest.mark.integration

PORT = 8090  # the test's own backends: they wait as long as a held connection needs
WEB, DNS = "10.96.0.10", "10.96.0.53"
RESTARTS = 5

# Per TCP connection: every chunk is answered with "<pod>:<chunk>"; UDP likewise.
BACKEND = textwrap.dedent(
    """
    import socket, sys, threading
    name, port = sys.argv[1].encode(), int(sys.argv[2])
    def serve(c):
        with c:
            while data := c.recv(1024):
                c.sendall(name + b":" + data)
    def tcp():
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port)); s.listen(1024)
        while True:
            threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
    threading.Thread(target=tcp, daemon=True).start()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", port))
    while True:
        data, peer = u.recvfrom(2048)
        u.sendto(name + b":" + data, peer)
    """
)

# The load: threads opening a new connection per request (request, reply, close) and a new
# UDP socket per datagram, until the stop file appears; bounded in count and time.
LOAD = textwrap.dedent(
    """
    import errno, json, os, socket, sys, threading, time
    host, port, udp_host, stop_file = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    deadline, limit = time.monotonic() + 120, 200000
    counts = {"sent": 0, "answered": 0, "refused": 0, "reset": 0, "other": 0,
              "udp_sent": 0, "udp_answered": 0}
    errors = []
    lock = threading.Lock()
    def done():
        return os.path.exists(stop_file) or time.monotonic() > deadline or counts["sent"] > limit
    def tcp():
        while not done():
            with lock:
                counts["sent"] += 1
            try:
                with socket.create_connection((host, port), timeout=5) as s:
                    s.sendall(b"x")
                    reply = s.recv(1024)
                kind = "answered" if reply.endswith(b":x") else "other"
                if kind == "other":
                    errors.append(repr(reply))
            except ConnectionRefusedError:
                kind = "refused"
            except ConnectionResetError:
                kind = "reset"
            except OSError as exc:
                kind = "other"; errors.append(repr(exc))
            with lock:
                counts[kind] += 1
    lost = []
    def udp():
        while not done():
            counts["udp_sent"] += 1
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                u.settimeout(3)
                sent = time.monotonic()
                try:
                    u.sendto(b"u", (udp_host, 53))
                    if u.recv(1024).endswith(b":u"):
                        counts["udp_answered"] += 1
                except OSError as exc:
                    errors.append("udp " + repr(exc))
                    late = None
                    if isinstance(exc, TimeoutError):
                        u.settimeout(5)
                        try:
                            u.recv(1024); late = time.monotonic() - sent
                        except OSError:
                            pass
                    lost.append({"sent": sent, "sport": u.getsockname()[1], "late": late,
                                 "n": counts["udp_sent"]})
            time.sleep(0.02)
    threads = [threading.Thread(target=tcp) for _ in range(4)] + [threading.Thread(target=udp)]
    for t in threads:
        t.start()
    print("started", flush=True)
    for t in threads:
        t.join()
    print(json.dumps({"counts": counts, "errors": errors[:20], "lost": lost}), flush=True)
    """
)

# One connection held across a restart: a request before it, one after.
HELD = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    s.sendall(b"before"); print(s.recv(1024).decode(), flush=True)
    sys.stdin.readline()
    s.sendall(b"after"); print(s.recv(1024).decode(), flush=True)
    s.close()
    """
)


ASK = textwrap.dedent(
    """
    import json, socket, sys
    out = []
    for _ in range(int(sys.argv[3])):
        try:
            with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as s:
                s.sendall(b"x"); out.append(s.recv(1024).decode().split(":")[0])
        except OSError as exc:
            out.append(f"error: {exc}")
    print(json.dumps(out))
    """
)


def _ask(topo: Topology, count: int = 1) -> list[str]:
    """The pods that answered `count` requests to the web ClusterIP (or "error: ...")."""
    answers: list[str] = json.loads(topo.client.python(ASK, WEB, "80", str(count)))
    return answers


def _objects() -> list[dict[str, Any]]:
    objects = [*service("web", WEB, 80), *service("dns", DNS, 53, protocol="UDP")]
    for obj in objects:  # the test's backends, on their own port
        ports = obj["spec"]["ports"] if obj["kind"] == "Service" else obj["ports"]
        for entry in ports:
            entry["targetPort" if obj["kind"] == "Service" else "port"] = PORT
    return objects


def _start_backends(topo: Topology, tmp: Path) -> None:
    for pod, ns in topo.pods.items():
        topo.procs.append(
            ns.popen([sys.executable, "-u", "-c", BACKEND, pod, str(PORT)], tmp / f"b-{pod}.log")
        )
    for pod, ns in topo.pods.items():
        wait_for(lambda ns=ns: f":{PORT}" in ns.run("ss", "-lntu"), f"{pod} listening")


def _client(topo: Topology, code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["ip", "netns", "exec", topo.client.name, sys.executable, "-u", "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _wait_log(proxy: Proxy, needle: str, timeout: float = 60) -> None:
    def seen() -> bool:
        assert proxy.proc is not None
        text = proxy.log.read_text(errors="replace")
        if proxy.proc.poll() is not None and needle not in text:
            raise AssertionError(f"proxy exited before {needle!r}: {text[-3000:]}")
        return needle in text

    wait_for(seen, f"{needle!r} in {proxy.log.name}", timeout=timeout)


@pytest.mark.parametrize("workers", ["1", "default"])
def test_five_restarts_refuse_and_reset_nothing(
    topology: Topology, tmp_path: Path, workers: str
) -> None:
    _start_backends(topology, tmp_path)
    manifest = tmp_path / "services.yaml"
    write_manifest(manifest, _objects())
    flags = ("--state-dir", str(tmp_path / "state"), "--shutdown-grace", "20s")
    if workers != "default":
        flags += ("--workers", workers)
    procs: list[Proxy] = []
    held: list[subprocess.Popen[str]] = []
    load = None
    stop_file = tmp_path / "stop-load"
    events: list[tuple[float, str]] = []

    def start(run: int) -> Proxy:
        proxy = Proxy(topology, "restore", manifest, tmp_path / f"proxy{run}.log", flags)
        proxy.start()
        procs.append(proxy)
        return proxy

    try:
        events.append((time.monotonic(), "start 0"))
        current = start(0)
        current.wait_rules(f"{WEB}/32", f"{DNS}/32")
        _wait_log(current, "a new proxy process can take over")
        assert "no running proxy to take over from" in current.log.read_text()
        wait_for(lambda: _ask(topology)[0] in PODS, "web answering")
        load = _client(topology, LOAD, WEB, "80", DNS, str(stop_file))
        assert load.stdout is not None and load.stdout.readline().strip() == "started"
        for run in range(1, RESTARTS + 1):
            keep = _client(topology, HELD, WEB, "80")
            held.append(keep)
            assert keep.stdout is not None and keep.stdin is not None
            assert keep.stdout.readline().strip().endswith(":before")
            time.sleep(0.5)  # let the load run against this process for a while
            events.append((time.monotonic(), f"start {run}"))
            old, current = current, start(run)
            _wait_log(old, "handed over: no new connections here")
            events.append((time.monotonic(), f"handed over {run} (seen)"))
            keep.stdin.write("go\n")
            keep.stdin.flush()
            # The held connection belongs to the old process, which is draining it.
            assert keep.stdout.readline().strip().endswith(":after"), f"restart {run}"
            assert keep.wait(10) == 0
            assert old.proc is not None and old.proc.wait(30) == 0, old.log.read_text()[-3000:]
            events.append((time.monotonic(), f"old exited {run}"))
            _wait_log(current, "a new proxy process can take over")
            text = current.log.read_text()
            assert "taking over from the running proxy" in text
            if workers == "default":
                assert "the workers received" in text
        stop_file.touch()
        out, _ = load.communicate(timeout=60)
        result = json.loads(out.strip().splitlines()[-1])
        counts = result["counts"]
        # Each unanswered datagram: when it was sent against the nearest restart step, and
        # whether an answer came later (after the 3 s) at all; then the kernel's UDP drops.
        for lost in result["lost"]:
            near = min(events, key=lambda e: abs(e[0] - lost["sent"]))
            print(f"unanswered {lost}: {lost['sent'] - near[0]:+.3f} s from {near[1]}")
        if result["lost"]:
            for ns in (topology.node, topology.client):
                print(ns.name, ns.run("nstat", "-az", "Udp*", check=False))
        print(f"workers={workers}: {counts}")  # shown with -s: the figures in docs/operations.md
        assert counts["refused"] == 0, result
        assert counts["reset"] == 0, result
        assert counts["other"] == 0, result
        assert counts["answered"] == counts["sent"] > 100, result
        assert counts["udp_answered"] == counts["udp_sent"] > 10, result
        # The last process serves, spreading over every pod.
        assert set(_ask(topology, 6)) == set(PODS)
    finally:
        stop_file.touch()
        for proc in [*held, *([load] if load else [])]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        for proxy in procs:
            for run_proc in proxy.runs:
                stop(run_proc, signal.SIGKILL)


def test_a_stale_handover_socket_means_an_ordinary_start(
    topology: Topology, tmp_path: Path
) -> None:
    _start_backends(topology, tmp_path)
    manifest = tmp_path / "services.yaml"
    write_manifest(manifest, _objects())
    state = tmp_path / "state"
    state.mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(state / "handover.sock"))  # a crashed proxy's: the file, nobody listening
    stale.close()
    proxy = Proxy(
        topology, "restore", manifest, tmp_path / "proxy.log", ("--state-dir", str(state))
    )
    proxy.start()
    try:
        proxy.wait_rules(f"{WEB}/32")
        _wait_log(proxy, "a new proxy process can take over")
        text = proxy.log.read_text()
        assert "no running proxy to take over from" in text
        assert "Connection refused" in text
        wait_for(lambda: _ask(topology)[0] in PODS, "web answering")
        assert set(_ask(topology, 6)) == set(PODS)
    finally:
        for run_proc in proxy.runs:
            stop(run_proc, signal.SIGKILL)


def test_other_worker_counts_stop_the_old_process_first(topology: Topology, tmp_path: Path) -> None:
    _start_backends(topology, tmp_path)
    manifest = tmp_path / "services.yaml"
    write_manifest(manifest, _objects())
    state = ("--state-dir", str(tmp_path / "state"), "--shutdown-grace", "2s")
    old = Proxy(topology, "restore", manifest, tmp_path / "old.log", (*state, "--workers", "1"))
    new = Proxy(topology, "restore", manifest, tmp_path / "new.log", state)
    old.start()
    try:
        old.wait_rules(f"{WEB}/32")
        _wait_log(old, "a new proxy process can take over")
        new.start()
        assert old.proc is not None and old.proc.wait(30) == 0
        assert "replaces this one without a handover" in old.log.read_text()
        _wait_log(new, "a new proxy process can take over")
        text = new.log.read_text()
        assert "no handover; it is asked to stop" in text
        assert "taking over" not in text
        wait_for(lambda: _ask(topology)[0] in PODS, "web answering")
        assert set(_ask(topology, 6)) == set(PODS)
    finally:
        for proxy in (old, new):
            for run_proc in proxy.runs:
                stop(run_proc, signal.SIGKILL)


# A same-user process in another network namespace that reaches the state directory: it says
# hello, then asks for `op` ("take" or "stop") whatever it is offered; prints what it received.
INTRUDER = textwrap.dedent(
    """
    import json, os, socket, sys, time
    path, op = sys.argv[1], sys.argv[2]
    got = {"descriptors": 0, "messages": [], "end": ""}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    def send(message):
        s.send(b"." + json.dumps(message).encode())
    try:
        s.connect(path)
        send({"op": "hello", "version": 1, "workers": 1})
        asked = False
        while len(got["messages"]) < 100:
            data, fds, _, _ = socket.recv_fds(s, 65536, 253)
            got["descriptors"] += len(fds)
            for fd in fds:
                os.close(fd)
            if not data:
                got["end"] = "closed"
                break
            got["messages"].append(data[:120].decode(errors="replace"))
            if not asked:
                send({"op": op})
                asked = True
    except OSError as exc:
        got["end"] = repr(exc)
    print(json.dumps(got))
    """
)


def test_a_peer_in_another_network_namespace_gets_nothing(
    topology: Topology, tmp_path: Path
) -> None:
    _start_backends(topology, tmp_path)
    manifest = tmp_path / "services.yaml"
    write_manifest(manifest, _objects())
    state = tmp_path / "state"
    proxy = Proxy(
        topology,
        "restore",
        manifest,
        tmp_path / "proxy.log",
        ("--state-dir", str(state), "--workers", "1"),
    )
    proxy.start()
    try:
        proxy.wait_rules(f"{WEB}/32")
        _wait_log(proxy, "a new proxy process can take over")
        wait_for(lambda: _ask(topology)[0] in PODS, "web answering")
        sock = str(state / "handover.sock")
        for op in ("take", "stop"):
            # The client namespace is not the proxy's (the node's); same user (root).
            got = json.loads(topology.client.python(INTRUDER, sock, op))
            assert got["descriptors"] == 0, got
            assert got["messages"] == [], got  # no offer, no state
            assert proxy.proc is not None and proxy.proc.poll() is None, proxy.log.read_text()
            assert set(_ask(topology, 6)) == set(PODS)
        refusals = [
            line
            for line in proxy.log.read_text().splitlines()
            if "refused a handover connection" in line
        ]
        assert len(refusals) == 2, refusals
        assert all("another network namespace" in line for line in refusals), refusals
        assert "handing every socket over" not in proxy.log.read_text()
    finally:
        for run_proc in proxy.runs:
            stop(run_proc, signal.SIGKILL)
