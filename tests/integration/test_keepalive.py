"""TCP keepalive: a backend that vanishes without a FIN or RST is noticed on both sides.

An idle connection goes client -> ClusterIP -> proxy -> pod-a. Then pod-a's link goes down
inside its namespace (no FIN, no RST: the node is simply gone). With `--tcp-keepalive 1s`
the proxy's socket to the pod sends a probe after 1 s idle and one a second after, and the
kernel ends it after its probe count (9 in a new namespace) goes unanswered: about 10 s. The
proxy then resets the client. Both sides must be closed within that bound (plus slack).
"""

from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path

import pytest

from tests.integration.conftest import running_proxies, service
from tests.integration.netns import PODS, Topology, stop, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("dataplane")]

IDLE_PORT = 9090
CLUSTER_IP = "10.96.0.30"
KEEPALIVE = 1  # seconds
PROBES = 9  # net.ipv4.tcp_keepalive_probes in a new namespace
BOUND = KEEPALIVE * (1 + PROBES) + 5  # seconds; the slack is for a busy 2-CPU machine

# In pod-a: greets each connection, then holds it open, reading until EOF.
HOLDER = textwrap.dedent(
    """
    import socket, threading
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", PORT)); s.listen(16)
    def hold(c):
        c.sendall(b"hi")
        try:
            while c.recv(1024):
                pass
        except OSError:
            pass
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        threading.Thread(target=hold, args=(c,), daemon=True).start()
    """
).replace("PORT", str(IDLE_PORT))

# In the client: connect, read the greeting, then wait (idle) until the connection ends.
IDLE_CLIENT = textwrap.dedent(
    """
    import socket, sys, time
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
    assert s.recv(2) == b"hi"
    print("connected", flush=True)
    s.settimeout(120)
    try:
        data = s.recv(1024)
        how = "eof" if not data else "data"
    except OSError as exc:
        how = type(exc).__name__
    print(f"ended {how} {time.monotonic():.3f}", flush=True)
    """
)


@pytest.fixture
def backend(dataplane: str) -> str:
    """One rule backend per data plane (the rules play no part in keepalive): both are run."""
    return "iptc" if dataplane == "python" else "restore"


def _established_to_pod(topology: Topology) -> int:
    out = topology.node.run("ss", "-tnH", "state", "established", f"dst {PODS['pod-a']}")
    return len([line for line in out.splitlines() if f":{IDLE_PORT}" in line])


def test_a_vanished_backend_closes_both_sides_within_the_keepalive_bound(
    topology: Topology, tmp_path: Path, backend: str
) -> None:
    pod_a = topology.pods["pod-a"]
    holder = pod_a.popen(["python3", "-u", "-c", HOLDER], tmp_path / "holder.log")
    topology.procs.append(holder)
    wait_for(lambda: f":{IDLE_PORT}" in pod_a.run("ss", "-lnt"), "holder listening")
    objects = service("idle", CLUSTER_IP, 80, pods=("pod-a",))
    objects[0]["spec"]["ports"][0]["targetPort"] = IDLE_PORT
    objects[1]["ports"][0]["port"] = IDLE_PORT
    with running_proxies(topology, tmp_path, backend) as make:
        proxy = make(objects, "--tcp-keepalive", f"{KEEPALIVE}s")
        proxy.wait_rules(CLUSTER_IP)
        out = tmp_path / "client.log"
        client = topology.client.popen(["python3", "-u", "-c", IDLE_CLIENT, CLUSTER_IP, "80"], out)
        try:
            wait_for(lambda: "connected" in out.read_text(), "client connected", timeout=20)
            assert _established_to_pod(topology) == 1
            time.sleep(2 * KEEPALIVE)  # idle long enough for probes that are answered
            assert _established_to_pod(topology) == 1, "answered probes kept it open"
            assert "ended" not in out.read_text()
            # The pod's node vanishes: its link goes down, nothing is sent to anybody.
            pod_a.ip("link", "set", "eth0", "down")
            blackholed = time.monotonic()
            wait_for(lambda: "ended" in out.read_text(), "client side closed", timeout=BOUND)
            wait_for(
                lambda: _established_to_pod(topology) == 0,
                "backend side closed",
                timeout=max(1.0, BOUND - (time.monotonic() - blackholed)),
            )
            match = re.search(r"ended (\S+) ([\d.]+)", out.read_text())
            assert match is not None
            # A reset passed on by the proxy (its dial side timed out), not a clean EOF.
            assert match.group(1) in ("ConnectionResetError", "eof"), match.group(0)
            assert time.monotonic() - blackholed <= BOUND
        finally:
            stop(client)
