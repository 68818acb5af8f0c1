"""--preserve-source-ip in a two-node model like kind's: backends see the client's own address
wherever their reply comes back through this node, and a node address elsewhere.

```
 ext 192.168.60.10 --veth-- 192.168.60.1 |                               |
                                          node-a 192.168.50.1 --veth-- 192.168.50.2 node-b
 cpod 10.244.1.10 --ptp veth-- 10.244.1.1 |  (the proxy; podCIDR          (podCIDR 10.244.2.0/24)
 apod 10.244.1.11 --ptp veth-- 10.244.1.1 |   10.244.1.0/24)              | 10.244.2.1 --ptp-- bpod
                                                                                    10.244.2.10
```

Each node routes the other's pod CIDR over the link between them; node-b reaches the external
client through node-a. Every backend answers with its name and the address it saw
(getpeername). The node runs with strict reverse-path filtering (rp_filter=1).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import IPTABLES, PROXY, SAVE, SAVE6, write_manifest
from tests.integration.netns import CLIENT, Netns, sh, stop, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("dataplane")]

NODE_A, NODE_B = "192.168.50.1", "192.168.50.2"
EXT_GW, EXT = "192.168.60.1", "192.168.60.10"
CPOD, APOD, BPOD = "10.244.1.10", "10.244.1.11", "10.244.2.10"
NODE_A_ADDRESSES = {NODE_A, EXT_GW, "10.244.1.1"}
PORT = 8080
MARK, TABLE, PRIORITY = "0x1000", "4040", "1500"
_counter = itertools.count()

# A pod: TCP and UDP on PORT answering "<name> <the peer address it saw>".
PEER_BACKEND = textwrap.dedent(
    """
    import socket, sys, threading
    name, PORT = sys.argv[1], int(sys.argv[2])
    def tcp():
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", PORT)); s.listen(512)
        while True:
            c, _ = s.accept()
            try:
                c.settimeout(2); data = c.recv(1024)
                while b"hello" not in data:  # a PROXY header may come in a segment of its own
                    more = c.recv(1024)
                    if not more:
                        break
                    data += more
                said = ""  # a PROXY protocol v1 header: the client it names
                if data.startswith(b"PROXY "):
                    said = " PROXY:" + data.split(b" ")[2].decode()
                c.sendall(f"{name} {c.getpeername()[0]}{said}".encode())
            except OSError:
                pass
            finally:
                c.close()
    threading.Thread(target=tcp, daemon=True).start()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", PORT))
    print("ready", flush=True)
    while True:
        data, peer = u.recvfrom(2048)
        u.sendto(f"{name} {peer[0]}".encode(), peer)
    """
)


@dataclass
class TwoNodes:
    """The namespaces of one test and the processes started in them."""

    a: Netns
    b: Netns
    ext: Netns
    cpod: Netns
    apod: Netns
    bpod: Netns
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def namespaces(self) -> list[Netns]:
        return [self.a, self.b, self.ext, self.cpod, self.apod, self.bpod]

    def build(self, tmp: Path) -> None:
        for ns in self.namespaces():
            sh("ip", "netns", "add", ns.name)
            ns.ip("link", "set", "lo", "up")
        a, b = self.a, self.b
        a.ip("link", "add", "up0", "type", "veth", "peer", "name", "up0", "netns", b.name)
        for ns, ip in ((a, NODE_A), (b, NODE_B)):
            ns.ip("addr", "add", f"{ip}/24", "dev", "up0")
            ns.ip("link", "set", "up0", "up")
            ns.run("sysctl", "-qw", "net.ipv4.ip_forward=1")
        a.ip("link", "add", "vext", "type", "veth", "peer", "name", "eth0", "netns", self.ext.name)
        a.ip("addr", "add", f"{EXT_GW}/24", "dev", "vext")
        a.ip("link", "set", "vext", "up")
        self.ext.ip("addr", "add", f"{EXT}/24", "dev", "eth0")
        self.ext.ip("link", "set", "eth0", "up")
        self.ext.ip("route", "add", "default", "via", EXT_GW)
        self._ptp(a, "vcpod", self.cpod, CPOD, "10.244.1.1")
        self._ptp(a, "vapod", self.apod, APOD, "10.244.1.1")
        self._ptp(b, "vbpod", self.bpod, BPOD, "10.244.2.1")
        a.ip("route", "add", "10.244.2.0/24", "via", NODE_B)
        b.ip("route", "add", "10.244.1.0/24", "via", NODE_A)
        b.ip("route", "add", "192.168.60.0/24", "via", NODE_A)
        # The node's own packets to ClusterIPs need a route before nat OUTPUT DNATs them.
        a.ip("route", "add", "10.96.0.0/16", "dev", "up0")
        # Strict reverse-path filtering: the replies must pass it all the same.
        for conf in ("all", "default", "up0", "vext", "vcpod", "vapod"):
            a.run("sysctl", "-qw", f"net.ipv4.conf.{conf}.rp_filter=1")
        for name, ns in (("apod", self.apod), ("bpod", self.bpod)):
            self.procs.append(
                ns.popen([sys.executable, "-u", "-c", PEER_BACKEND, name, str(PORT)], tmp / name)
            )
        for ns in (self.apod, self.bpod):
            wait_for(lambda ns=ns: f":{PORT}" in ns.run("ss", "-lntu"), f"{ns.name} listening")

    @staticmethod
    def _ptp(node: Netns, name: str, pod: Netns, ip: str, gateway: str) -> None:
        """A pod on a point-to-point veth, as the ptp CNI plugin makes them: no subnet route in
        the pod, so even a pod of the same node is reached through the node."""
        node.ip("link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", pod.name)
        node.ip("addr", "add", f"{gateway}/32", "dev", name)
        node.ip("link", "set", name, "up")
        node.ip("route", "add", f"{ip}/32", "dev", name)
        pod.ip("addr", "add", f"{ip}/32", "dev", "eth0")
        pod.ip("link", "set", "eth0", "up")
        pod.ip("route", "add", gateway, "dev", "eth0")
        pod.ip("route", "add", "default", "via", gateway)

    def destroy(self) -> None:
        for proc in self.procs:
            stop(proc, signal.SIGKILL)
        for ns in self.namespaces():
            sh("ip", "netns", "del", ns.name, check=False)


@pytest.fixture
def nodes(netns_ok: None, tmp_path: Path) -> Iterator[TwoNodes]:
    tag = f"{os.getpid()}x{next(_counter)}"
    topo = TwoNodes(*(Netns(f"kt{n}{tag}") for n in ("a", "b", "ext", "cp", "ap", "bp")))
    try:
        topo.build(tmp_path)
        yield topo
    finally:
        topo.destroy()


def _endpoint(ip: str, node: str) -> dict[str, Any]:
    return {"addresses": [ip], "conditions": {"ready": True}, "nodeName": node}


def _service(
    name: str,
    cluster_ip: str,
    port: int,
    endpoints: list[dict[str, Any]],
    *,
    protocol: str = "TCP",
    node_port: int = 0,
    local: bool = False,
    annotations: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    spec: dict[str, Any] = {
        "type": "NodePort" if node_port else "ClusterIP",
        "clusterIP": cluster_ip,
        "clusterIPs": [cluster_ip],
        "ports": [{"name": "p", "protocol": protocol, "port": port, "targetPort": PORT}],
    }
    if node_port:
        spec["ports"][0]["nodePort"] = node_port
        spec["externalTrafficPolicy"] = "Local" if local else "Cluster"
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "annotations": annotations or {}},
            "spec": spec,
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-x", "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "p", "protocol": protocol, "port": PORT}],
            "endpoints": endpoints,
        },
    ]


NODE_OBJECT = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {"name": "node-a"},
    "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
    "status": {"addresses": [{"type": "InternalIP", "address": NODE_A}]},
}
BOTH = [_endpoint(APOD, "node-a"), _endpoint(BPOD, "node-b")]
OBJECTS = [
    NODE_OBJECT,
    *_service("both", "10.96.0.10", 80, BOTH),
    *_service("both-udp", "10.96.0.11", 53, BOTH, protocol="UDP"),
    *_service("local-np", "10.96.0.12", 80, BOTH, node_port=30080, local=True),
    *_service("remote-np", "10.96.0.13", 80, [_endpoint(BPOD, "node-b")], node_port=30081),
    *_service(
        "pp",
        "10.96.0.14",
        80,
        BOTH,
        annotations={"kube-userspace-proxy.io/proxy-protocol": "v1"},
    ),
]


@contextlib.contextmanager
def proxy_in(
    nodes: TwoNodes, tmp: Path, backend: str, *extra: str, log_name: str = "proxy.log"
) -> Iterator[subprocess.Popen[bytes]]:
    manifest = tmp / "services.yaml"
    write_manifest(manifest, OBJECTS)
    log = tmp / log_name
    proc = nodes.a.popen(
        [
            str(PROXY),
            "run",
            "--manifests",
            str(manifest),
            "--hostname-override",
            "node-a",
            "--iptables-backend",
            backend,
            "--proxy-port-range",
            "40000-40999",
            "--healthz-bind-address",
            "127.0.0.1:0",
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--iptables-sync-period",
            "1s",
            "--iptables-min-sync-period",
            "100ms",
            "--state-dir",
            str(tmp / "state"),
            *extra,
        ],
        log,
    )
    try:
        yield proc
    finally:
        stop(proc, signal.SIGKILL)


def ask(ns: Netns, proto: str, host: str, port: int, count: int) -> list[tuple[str, str]]:
    """(backend name, address it saw) of `count` requests, each on its own socket."""
    answers = json.loads(ns.python(CLIENT, proto, host, str(port), str(count)))
    return [tuple(a.split(" ", 1)) if " " in a else (a, "") for a in answers]


def _serving(nodes: TwoNodes, proc: subprocess.Popen[bytes], log: Path) -> None:
    def answered() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"proxy exited: {log.read_text()[-3000:]}")
        return ask(nodes.cpod, "tcp", "10.96.0.10", 80, 1)[0][0] in {"apod", "bpod"}

    wait_for(answered, "the proxy serving 10.96.0.10:80", timeout=60)


def _rule(nodes: TwoNodes) -> str:
    return nodes.a.run("ip", "rule", "show", "priority", PRIORITY)


def _routes(nodes: TwoNodes, family: str = "-4") -> str:
    """Our table's routes ("" also when the table does not exist: ip then fails)."""
    return nodes.a.run("ip", family, "route", "show", "table", TABLE, check=False).strip()


def _debug_state(nodes: TwoNodes) -> dict[str, Any]:
    code = "import sys,urllib.request;print(urllib.request.urlopen(sys.argv[1]).read().decode())"
    text = nodes.a.python(code, "http://127.0.0.1:10249/debug/state")
    state: dict[str, Any] = json.loads(text)
    return state


def _source_dials(nodes: TwoNodes) -> dict[str, float]:
    """kube_userspace_proxy_source_address_dials_total by reason, as /metrics gives it now."""
    metrics = nodes.a.python(
        "import urllib.request;print(urllib.request.urlopen("
        "'http://127.0.0.1:10249/metrics').read().decode())"
    )
    dials: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("kube_userspace_proxy_source_address_dials_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            dials[reason] = dials.get(reason, 0) + float(line.rsplit(" ", 1)[1])
    return dials


# Each backend and each worker count, over both data planes (`dataplane`): the rules do not
# depend on the data plane nor the workers on the backend, so pairs suffice.
@pytest.mark.parametrize(("backend", "workers"), [("iptc", "1"), ("restore", "auto")])
def test_backends_see_the_client_where_the_reply_comes_back(
    nodes: TwoNodes, tmp_path: Path, backend: str, workers: str
) -> None:
    with proxy_in(nodes, tmp_path, backend, "--preserve-source-ip", "--workers", workers) as proc:
        log = tmp_path / "proxy.log"
        _serving(nodes, proc, log)
        # Each step's dials are counted by the reason of the source address they got: the
        # counts are read before and after it (the probes of `_serving` are not in them).
        counted = _source_dials(nodes)

        def dialed(step: str, **reasons: int) -> None:
            nonlocal counted
            before, counted = counted, _source_dials(nodes)
            delta = {r: counted.get(r, 0) - before.get(r, 0) for r in counted}
            expected = {r: reasons.get(r.replace("-", "_"), 0) for r in counted}
            assert delta == expected, (step, delta, log.read_text()[-3000:])

        # A pod of this node -> ClusterIP with endpoints on both nodes: its own address, always.
        for proto, ip, port in (("tcp", "10.96.0.10", 80), ("udp", "10.96.0.11", 53)):
            answers = ask(nodes.cpod, proto, ip, port, 8)
            assert {name for name, _ in answers} == {"apod", "bpod"}, answers
            assert {seen for _, seen in answers} == {CPOD}, (proto, answers)
            dialed(f"{proto} from a pod", client_pod=8)

        # External client -> NodePort, externalTrafficPolicy Local, local endpoint: its address.
        answers = ask(nodes.ext, "tcp", EXT_GW, 30080, 4)
        assert answers == [("apod", EXT)] * 4
        dialed("external client, local endpoint", local_endpoint=4)

        # External client -> NodePort whose only endpoint is remote: works, from the node.
        answers = ask(nodes.ext, "tcp", EXT_GW, 30081, 4)
        assert {name for name, _ in answers} == {"bpod"}, answers
        assert {seen for _, seen in answers} <= NODE_A_ADDRESSES, answers
        dialed("external client, remote endpoint", node=4)

        # A Service with the PROXY protocol annotation still gets its header, first.
        answers = ask(nodes.cpod, "tcp", "10.96.0.14", 80, 4)
        assert {name for name, _ in answers} == {"apod", "bpod"}, answers
        assert {seen for _, seen in answers} == {f"{CPOD} PROXY:{CPOD}"}, answers
        dialed("PROXY protocol", client_pod=4)

        # A hostNetwork client: works, and the endpoints see a node address.
        answers = ask(nodes.a, "tcp", "10.96.0.10", 80, 6)
        assert {name for name, _ in answers} == {"apod", "bpod"}, answers
        assert {seen for _, seen in answers} <= NODE_A_ADDRESSES, answers
        dialed("hostNetwork client", node=6)
        assert set(counted) == {"client-pod", "local-endpoint", "node"}, counted

        # The rules of the mode are in place, in the backend's tables.
        assert f"--set-xmark {MARK}/{MARK}" in nodes.a.run(SAVE[backend], "-t", "mangle")
        assert f"--set-xmark {MARK}/{MARK}" in nodes.a.run(SAVE6[backend], "-t", "mangle")
        assert f"fwmark {MARK}/{MARK} lookup {TABLE}" in _rule(nodes)
        assert "local default dev lo" in _routes(nodes)
        assert "local default dev lo" in _routes(nodes, "-6")

        # The choice shown per endpoint.
        sources = _debug_state(nodes)["default/both:p"]["sourceAddress"]["cluster"]
        assert sources == {f"{APOD}:{PORT}": "client", f"{BPOD}:{PORT}": "client-if-pod"}

        # A deleted ip rule is back within a sync period (1 s here; polled generously).
        nodes.a.run("ip", "rule", "del", "priority", PRIORITY)
        gone = time.monotonic()
        wait_for(lambda: f"lookup {TABLE}" in _rule(nodes), "the ip rule back", timeout=30)
        assert time.monotonic() - gone < 30
        assert {s for _, s in ask(nodes.cpod, "tcp", "10.96.0.10", 80, 4)} == {CPOD}

    # cleanup removes its rules, rule and routes, and nothing else.
    nodes.a.run(str(PROXY), "cleanup")
    for save in (SAVE[backend], SAVE6[backend]):
        assert "KUBE-PORTALS-TPROXY" not in nodes.a.run(save, "-t", "mangle")
    assert _rule(nodes).strip() == ""
    assert _routes(nodes) == ""
    assert _routes(nodes, "-6") == ""
    assert "10.244.2.0/24 via" in nodes.a.run("ip", "route")


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_without_the_flag_nothing_of_the_mode_is_installed(
    nodes: TwoNodes, tmp_path: Path, backend: str
) -> None:
    with proxy_in(nodes, tmp_path, backend) as proc:
        _serving(nodes, proc, tmp_path / "proxy.log")
        answers = ask(nodes.cpod, "tcp", "10.96.0.10", 80, 4)
        assert {seen for _, seen in answers} <= NODE_A_ADDRESSES, answers
        for save in (SAVE[backend], SAVE6[backend]):
            assert "KUBE-PORTALS-TPROXY" not in nodes.a.run(save, "-t", "mangle")
            assert "--transparent" not in nodes.a.run(save, "-t", "mangle")
        assert _rule(nodes).strip() == ""
        assert _routes(nodes) == ""
        assert _routes(nodes, "-6") == ""
        assert "KUBE-PORTALS-CONTAINER" in nodes.a.run(IPTABLES[backend], "-t", "nat", "-S")


def test_a_missing_prerequisite_is_named_and_nothing_is_installed(
    nodes: TwoNodes, tmp_path: Path
) -> None:
    """Without CAP_NET_ADMIN the proxy exits 1 naming it, before installing anything."""
    manifest = tmp_path / "services.yaml"
    write_manifest(manifest, OBJECTS)
    done = subprocess.run(
        [
            "ip", "netns", "exec", nodes.a.name,
            "capsh", "--drop=cap_net_admin", "--",
            "-c", f"exec {PROXY} run --manifests {manifest} --hostname-override node-a"
            f" --iptables-backend restore --preserve-source-ip --state-dir {tmp_path / 's'}"
            " --healthz-bind-address 127.0.0.1:0 --metrics-bind-address 127.0.0.1:0",
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "CAP_NET_ADMIN" in done.stderr
    assert len([line for line in done.stderr.splitlines() if "error" in line.lower()]) <= 1
    assert "KUBE-PORTALS" not in nodes.a.run("iptables-nft-save")
    assert _rule(nodes).strip() == ""


# Asks 10.96.0.10:80 over and over from a pod until the stop file appears (at most 60 s,
# 20,000 requests); prints the counts of each kind of answer as JSON.
LOAD = textwrap.dedent(
    """
    import collections, json, os, socket, sys, time
    stop, counts = sys.argv[1], collections.Counter()
    deadline = time.monotonic() + 60
    print("started", flush=True)
    while not os.path.exists(stop) and time.monotonic() < deadline and sum(counts.values()) < 20000:
        try:
            s = socket.create_connection(("10.96.0.10", 80), timeout=3)
            s.sendall(b"hello"); data = s.recv(1024).decode(); s.close()
            counts[data.split(" ", 1)[1] if " " in data else "empty"] += 1
        except OSError as exc:
            counts[type(exc).__name__] += 1
        time.sleep(0.005)
    print(json.dumps(counts), flush=True)
    """
)


def test_a_handover_keeps_serving_from_the_clients_address(nodes: TwoNodes, tmp_path: Path) -> None:
    flags = ("--preserve-source-ip", "--shutdown-grace", "10s")
    stop_file = tmp_path / "stop"
    with proxy_in(nodes, tmp_path, "restore", *flags, log_name="old.log") as old:
        _serving(nodes, old, tmp_path / "old.log")
        wait_for(
            lambda: "a new proxy process can take over" in (tmp_path / "old.log").read_text(),
            "the old proxy ready to hand over",
            timeout=60,
        )
        load = subprocess.Popen(
            ["ip", "netns", "exec", nodes.cpod.name, sys.executable, "-u", "-c", LOAD,
             str(stop_file)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert load.stdout is not None and load.stdout.readline().strip() == "started"
            with proxy_in(nodes, tmp_path, "restore", *flags, log_name="new.log") as new:
                wait_for(
                    lambda: "handed over" in (tmp_path / "old.log").read_text(),
                    "the handover",
                    timeout=60,
                )
                assert old.wait(60) == 0, (tmp_path / "old.log").read_text()[-3000:]
                assert "taking over from the running proxy" in (tmp_path / "new.log").read_text()
                time.sleep(0.5)  # the load runs against the new process for a while
                stop_file.touch()
                out, _ = load.communicate(timeout=90)
                assert new.poll() is None
        finally:
            stop_file.touch()
            if load.poll() is None:
                load.kill()
                load.wait()
    counts = json.loads(out.strip().splitlines()[-1])
    assert set(counts) == {CPOD}, counts  # every answer, before and after, saw the pod
    assert counts[CPOD] > 20, counts
