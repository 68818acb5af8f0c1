"""Network namespaces for integration tests: a node, a client pod and three backend pods.

Everything lives in namespaces named with this process's pid; the root namespace's links,
addresses, routes and rules are never touched. `Topology.destroy` kills what it started (by
PID) and deletes the namespaces, and is safe to call after a partial setup.

```
 client 10.244.1.10 --veth-- 10.244.1.1 |
        fd00:1::10           fd00:1::1  |
                                         node (lo: 10.244.0.1 and fd00::1, the node IPs; the
 pod-a 10.244.11.10 --veth-- 10.244.11.1 |   proxy runs here); routes 10.96.0.0/16 and
 pod-b 10.244.12.10 --veth-- 10.244.12.1 |   fd00:96::/112 -> client, so the node's own packets
 pod-c 10.244.13.10 --veth-- 10.244.13.1 |   to ClusterIPs have a route before nat OUTPUT
```

The client reaches the node over IPv6 as well (dual-stack Services); the pods are IPv4 only.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests import polling

NODE_IP = "10.244.0.1"
NODE_IP6 = "fd00::1"
CLIENT_IP = "10.244.1.10"
CLIENT_IP6 = "fd00:1::10"
PODS = {"pod-a": "10.244.11.10", "pod-b": "10.244.12.10", "pod-c": "10.244.13.10"}
POD_PORT = 8080
_counter = itertools.count()

# A backend pod: TCP and UDP on POD_PORT answering with the pod's name.
BACKEND = textwrap.dedent(
    """
    import socket, sys, threading
    name, PORT = sys.argv[1].encode(), int(sys.argv[2])
    def tcp():
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", PORT)); s.listen(512)
        while True:
            c, _ = s.accept()
            try:
                c.settimeout(2); c.recv(1024); c.sendall(name)
            except OSError:
                pass
            finally:
                c.close()
    threading.Thread(target=tcp, daemon=True).start()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", PORT))
    print("ready", flush=True)
    while True:
        data, peer = u.recvfrom(2048)
        u.sendto(name, peer)
    """
)

# Client requests: one connection (or datagram socket) per request; prints JSON answers.
CLIENT = textwrap.dedent(
    """
    import json, socket, sys
    proto, host, port, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    out = []
    for _ in range(count):
        try:
            if proto == "tcp":
                s = socket.create_connection((host, port), timeout=3)
                s.sendall(b"hello\\n")
                data = b""
                while chunk := s.recv(1024):
                    data += chunk
                s.close()
            else:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                s = socket.socket(family, socket.SOCK_DGRAM); s.settimeout(2)
                s.sendto(b"hello", (host, port)); data = s.recv(2048); s.close()
            out.append(data.decode())
        except ConnectionRefusedError:
            out.append("refused")
        except OSError as exc:
            out.append(f"error: {exc}")
    print(json.dumps(out))
    """
)


def available() -> str | None:
    """Why namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    probe = f"kupprobe{os.getpid()}"
    if (
        subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=False).returncode
        != 0
    ):
        return "`ip netns add` does not work here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def sh(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


@dataclass
class Netns:
    """One namespace; commands run inside it through `ip netns exec`."""

    name: str

    def run(self, *args: str, check: bool = True, timeout: float = 30) -> str:
        return sh("ip", "netns", "exec", self.name, *args, check=check, timeout=timeout).stdout

    def ip(self, *args: str) -> None:
        sh("ip", "-n", self.name, *args)

    def python(self, code: str, *args: str, timeout: float = 60) -> str:
        return self.run(sys.executable, "-c", code, *args, timeout=timeout)

    def popen(self, args: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.name, *args], stdout=out, stderr=subprocess.STDOUT
            )

    def ask(self, proto: str, host: str, port: int, count: int = 1) -> list[str]:
        """Answers of `count` requests (backend names, "refused" or "error: ...")."""
        answers: list[str] = json.loads(self.python(CLIENT, proto, host, str(port), str(count)))
        return answers


@dataclass
class Topology:
    """The namespaces of one test and the processes started in them."""

    node: Netns
    client: Netns
    pods: dict[str, Netns]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    def create(cls, tmp: Path) -> Topology:
        tag = f"{os.getpid()}x{next(_counter)}"
        topo = cls(
            Netns(f"kupnode{tag}"),
            Netns(f"kupcli{tag}"),
            {pod: Netns(f"kup{pod[-1]}{tag}") for pod in PODS},
        )
        try:
            topo._build(tmp)
        except BaseException:
            topo.destroy()
            raise
        return topo

    def namespaces(self) -> list[Netns]:
        return [self.node, self.client, *self.pods.values()]

    def _build(self, tmp: Path) -> None:
        for ns in self.namespaces():
            sh("ip", "netns", "add", ns.name)
            ns.ip("link", "set", "lo", "up")
        node = self.node
        node.ip("addr", "add", f"{NODE_IP}/32", "dev", "lo")
        node.ip("-6", "addr", "add", f"{NODE_IP6}/128", "dev", "lo")
        self._link("vcli", self.client, "10.244.1.1", CLIENT_IP)
        # nodad: usable at once, not after duplicate address detection (a second or more)
        node.ip("-6", "addr", "add", "fd00:1::1/64", "dev", "vcli", "nodad")
        self.client.ip("-6", "addr", "add", f"{CLIENT_IP6}/64", "dev", "eth0", "nodad")
        self.client.ip("-6", "route", "add", "default", "via", "fd00:1::1")
        for i, (pod, ip) in enumerate(PODS.items(), start=1):
            self._link(f"vpod{i}", self.pods[pod], f"10.244.1{i}.1", ip)
        node.ip("route", "add", "10.96.0.0/16", "via", CLIENT_IP)
        node.ip("-6", "route", "add", "fd00:96::/112", "via", CLIENT_IP6)
        for pod, ns in self.pods.items():
            proc = ns.popen(
                [sys.executable, "-u", "-c", BACKEND, pod, str(POD_PORT)], tmp / f"{pod}.log"
            )
            self.procs.append(proc)
        for pod, ns in self.pods.items():
            wait_for(lambda ns=ns: f":{POD_PORT}" in ns.run("ss", "-lntu"), f"{pod} listening")

    def _link(self, name: str, peer: Netns, node_ip: str, peer_ip: str) -> None:
        self.node.ip(
            "link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", peer.name
        )
        self.node.ip("addr", "add", f"{node_ip}/24", "dev", name)
        self.node.ip("link", "set", name, "up")
        peer.ip("addr", "add", f"{peer_ip}/24", "dev", "eth0")
        peer.ip("link", "set", "eth0", "up")
        peer.ip("route", "add", "default", "via", node_ip)

    def destroy(self) -> None:
        for proc in self.procs:
            stop(proc)
        for ns in self.namespaces():
            sh("ip", "netns", "del", ns.name, check=False)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10) -> None:
    """Stop a process this test started (by its PID), escalating to SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def wait_for(
    check: Callable[[], object], what: str, timeout: float = 60.0, interval: float = 0.05
) -> None:
    """Poll `check()` until it is truthy; fail naming `what` after `timeout` seconds (never
    less than the suite's floor: tests/polling.py)."""
    polling.poll(check, what, timeout, interval, tolerate=(RuntimeError, OSError, ValueError))
