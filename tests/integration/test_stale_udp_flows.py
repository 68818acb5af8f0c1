"""Stale UDP flows: a Service deleted and created again reaches a client that never stopped
sending, and clearing touches only the entries of the changed address, port and protocol."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.integration.conftest import service, write_manifest
from tests.integration.netns import Netns, Topology, sh, stop, wait_for

CLUSTER_IP = "10.96.0.53"

# One UDP socket, one source port, connected to the ClusterIP: a datagram every 200 ms, each
# answer (a pod's name, "refused" or "timeout") one line of the log. Bounded in count and time.
SENDER = textwrap.dedent(
    """
    import socket, sys, time
    host, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 47053)); s.connect((host, port)); s.settimeout(0.2)
    end = time.monotonic() + 150
    with open(log, "a", buffering=1) as out:
        for _ in range(600):
            if time.monotonic() > end:
                break
            started = time.monotonic()
            try:
                s.send(b"hello")
                answer = s.recv(2048).decode()
            except ConnectionRefusedError:
                answer = "refused"
            except TimeoutError:
                answer = "timeout"
            out.write(answer + "\\n")
            time.sleep(max(0.0, 0.2 - (time.monotonic() - started)))
    """
)


def _answers(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


@pytest.mark.parametrize("workers", ["1", "auto"])
def test_a_udp_client_that_keeps_sending_reaches_the_recreated_service(
    topology: Topology, tmp_path: Path, proxy_factory, workers: str
) -> None:  # type: ignore[no-untyped-def]
    first = service("dns", CLUSTER_IP, 53, protocol="UDP", pods=("pod-a",))
    proxy = proxy_factory(first, "--workers", workers)
    proxy.wait_rules(f"{CLUSTER_IP}/32")
    log = tmp_path / "answers.log"
    sender = topology.client.popen(
        [sys.executable, "-u", "-c", SENDER, CLUSTER_IP, "53", str(log)], tmp_path / "sender.out"
    )
    try:
        wait_for(lambda: "pod-a" in _answers(log), "the flow to reach pod-a", timeout=30)
        # The Service goes: its rules go, and the flow's entry with them.
        write_manifest(proxy.manifest, [])
        wait_for(lambda: CLUSTER_IP not in proxy.save(), "the Service's rules to go", timeout=30)
        sent = len(_answers(log))
        wait_for(lambda: len(_answers(log)) >= sent + 3, "three datagrams more", timeout=30)
        # The same ClusterIP again, another backend: the same flow reaches it.
        write_manifest(
            proxy.manifest, service("dns", CLUSTER_IP, 53, protocol="UDP", pods=("pod-b",))
        )
        proxy.wait_rules(f"{CLUSTER_IP}/32", timeout=30)
        recreated = len(_answers(log))
        wait_for(
            lambda: "pod-b" in _answers(log)[recreated:],
            "the same flow to reach pod-b",
            timeout=30,
        )
    finally:
        stop(sender)
    answers = _answers(log)
    assert sender.returncode is not None
    assert answers[-1] == "pod-b", answers[-20:]
    assert "pod-a" not in answers[answers.index("pod-b") :], answers[-20:]


# Runs inside a namespace of its own: entries added by hand, cleared as the portals clear
# them after a commit, then listed.
CLEAR = textwrap.dedent(
    """
    import json, socket
    from pyroute2 import Conntrack
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple
    from kube_userspace_proxy.model import Protocol, ProxiedPort, ServicePortInfo, ServicePortName
    from kube_userspace_proxy.portals.desired import render
    from kube_userspace_proxy.portals.flows import StaleFlows
    from kube_userspace_proxy.portals.settings import Settings

    CLIENT, NODE = "10.244.1.10", "10.244.0.1"
    def add(ct, proto, dst, dport, sport, reply_src, reply_sport):
        t = lambda **k: NFCTAttrTuple(proto=proto, **k)
        ct.entry("add", timeout=120,
                 tuple_orig=t(saddr=CLIENT, daddr=dst, sport=sport, dport=dport),
                 tuple_reply=t(saddr=reply_src, daddr=CLIENT, sport=reply_sport, dport=sport))

    def port(name, ip, svc_port, node_port, cluster, external):
        info = ServicePortInfo(ServicePortName("ns", name, "p", Protocol.UDP), svc_port, (ip,),
                               node_port=node_port)
        return ProxiedPort(info, cluster, external)

    settings = Settings(node_ips=(NODE,))
    dns = port("dns", "10.96.0.53", 53, 30053, 40001, 40002)
    other = port("other", "10.96.0.54", 53, 30054, 40003, 40004)
    flows = StaleFlows()
    flows.committed(render([dns, other], settings))  # the first commit: nothing is stale
    ct = Conntrack()
    add(ct, 17, "10.96.0.53", 53, 5001, NODE, 40001)    # the moved port's: goes
    add(ct, 17, "10.96.0.53", 53, 5002, NODE, 40011)    # already at the new port: stays
    add(ct, 17, "10.96.0.54", 53, 5003, NODE, 40003)    # another address: stays
    add(ct, 17, "10.96.0.53", 54, 5004, NODE, 40001)    # another port: stays
    add(ct, 17, NODE, 30053, 5005, NODE, 40002)         # the moved NodePort's: goes
    add(ct, 17, NODE, 30054, 5006, NODE, 40004)         # another NodePort: stays
    add(ct, 17, "10.96.0.53", 53, 5007, "10.96.0.53", 53)  # not redirected at all: goes
    try:
        add(ct, 6, "10.96.0.53", 53, 5008, NODE, 40001)  # TCP: stays
    except Exception:
        pass
    moved = port("dns", "10.96.0.53", 53, 30053, 40011, 40012)
    deleted = flows.committed(render([moved, other], settings))
    left = sorted(e.tuple_orig.sport for e in ct.dump_entries())
    ct.close()
    print(json.dumps({"deleted": deleted, "left": left, "errors": flows.errors}))
    """
)


def test_only_the_flows_of_a_changed_udp_destination_are_deleted(netns_ok: None) -> None:
    ns = Netns(f"kupct{time.monotonic_ns() % 10**8}")
    sh("ip", "netns", "add", ns.name)
    try:
        result = json.loads(ns.python(CLEAR))
    finally:
        sh("ip", "netns", "del", ns.name, check=False)
    assert result["errors"] == 0
    assert result["deleted"] == 3
    left = set(result["left"])
    assert {5002, 5003, 5004, 5006} <= left
    assert not {5001, 5005, 5007} & left
