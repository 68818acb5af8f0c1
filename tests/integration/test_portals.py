"""Portals driven directly against real tables in a throwaway namespace (no traffic)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.netns import Netns, sh

pytestmark = pytest.mark.integration

# Runs inside the namespace: builds a varied set of service ports, then runs `steps`.
DRIVER = textwrap.dedent(
    """
    import json, socket, subprocess, sys
    from kube_userspace_proxy import logs
    from kube_userspace_proxy.model import *
    from kube_userspace_proxy.portals import Portals, cleanup_all, make_backend
    from kube_userspace_proxy.portals.restore import restore_text

    logs.setup(0)
    args = json.loads(sys.argv[1])

    def ports(n, shift=0):
        out = []
        for i in range(n):
            proto = Protocol.UDP if i % 4 == 3 else Protocol.TCP
            name = ServicePortName("ns%d" % (i % 3), "svc%d" % i, "p", proto)
            ips = ("10.96.%d.%d" % (i // 200, i % 200 + 1),)
            if i % 5 == 0:
                ips += ("fd00:96::%x" % (i + 1),)
            info = ServicePortInfo(
                name, 80 + i % 3, ips,
                node_port=30000 + i if i % 2 == 0 else 0,
                external_ips=("192.0.2.%d" % (i % 200 + 1),) if i % 7 == 0 else (),
                load_balancer_ips=("198.51.100.%d" % (i % 200 + 1),) if i % 11 == 0 else (),
            )
            base = 40000 + i + (shift if i == n - 1 else 0)  # shift moves the last port only
            out.append(ProxiedPort(info, base, base + 1000 if i % 6 == 0 else base))
        return out

    now = [0.0]  # the Portals' clock: moved on by "advance" steps only

    def new_portals():
        return Portals(
            make_backend(args["backend"]),
            node_ips=("10.244.0.1", "fd00::1"),
            bind_address=args.get("bind_address", "::"),
            nodeport_addresses=args.get("nodeport_addresses", ()),
            verify_period=args.get("verify_period", 3600.0),
            clock=lambda: now[0],
        )

    portals = new_portals()
    result = {"backend": portals.backend.name, "steps": [], "inputs": []}
    # What each commit hands over, as iptables-restore text (the restore backend commits
    # through commit_many, several tables at once; iptc through commit).
    if hasattr(portals.backend, "commit_many"):
        commit_many = portals.backend.commit_many

        def recording_many(batch):
            result["inputs"].extend(restore_text(table, ops) for _, table, ops, _ in batch)
            return commit_many(batch)

        portals.backend.commit_many = recording_many
    else:
        commit = portals.backend.commit

        def recording(family, table, ops, base=None):
            result["inputs"].append(restore_text(table, ops))
            return commit(family, table, ops, base)

        portals.backend.commit = recording
    for step in args["steps"]:
        if step[0] == "apply":  # as the proxier does: the commit that goes live, then the rest
            portals.apply(ports(step[1], step[2] if len(step) > 2 else 0))
            portals.commit_deferred()
        elif step[0] == "live":  # the first commit alone
            portals.apply(ports(step[1], step[2] if len(step) > 2 else 0))
        elif step[0] == "deferred":
            portals.commit_deferred()
        elif step[0] == "connect":  # from the node to HOST:PORT: does proxy port LISTEN get it?
            host, port, listen = step[1:4]
            with socket.socket() as server:
                server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                server.bind(("0.0.0.0", listen))
                server.listen(1)
                server.settimeout(5)
                try:
                    with socket.create_connection((host, port), 5):
                        server.accept()[0].close()
                    got = True
                except OSError:  # refused: a rule sent it to a port nobody listens on
                    got = False
            result.setdefault("connected", []).append(got)
        elif step[0] == "run":
            subprocess.run(step[1], check=True)
        elif step[0] == "output":  # a command's output, kept
            out = subprocess.run(step[1], check=True, capture_output=True, text=True).stdout
            result.setdefault("output", []).append(out)
        elif step[0] == "restore":  # rules of someone else (or of an earlier release)
            subprocess.run([step[1], "--noflush"], input=step[2], text=True, check=True)
        elif step[0] == "advance":
            now[0] += step[1]
        elif step[0] == "cleanup":
            result["removed"] = cleanup_all()
        elif step[0] == "claimed":  # read back by a Portals of its own, as a restart would
            result["claimed"] = sorted([*k, v] for k, v in new_portals().claimed_ports().items())
        result["steps"].append(
            {"commits": portals.commits, "repairs": portals.repairs, "verifies": portals.verifies}
        )
    print(json.dumps(result))
    """
)
SAVES = {
    "iptc": ("iptables-legacy-save", "ip6tables-legacy-save"),
    "restore": ("iptables-nft-save", "ip6tables-nft-save"),
}


@pytest.fixture
def node(netns_ok: None) -> Iterator[Netns]:
    ns = Netns(f"kupportals{os.getpid()}x{time.monotonic_ns() % 10**6}")
    sh("ip", "netns", "add", ns.name)
    try:
        yield ns
    finally:
        sh("ip", "netns", "del", ns.name, check=False)


def drive(ns: Netns, backend: str, *steps: list[Any], **extra: Any) -> dict[str, Any]:
    arg = json.dumps({"backend": backend, "steps": list(steps), **extra})
    result: dict[str, Any] = json.loads(ns.python(DRIVER, arg, timeout=120))
    return result


def tables(ns: Netns, backend: str) -> dict[str, list[str]]:
    """Our rule lines per family and table, in kernel order."""
    out: dict[str, list[str]] = {}
    for family, save in zip(("v4", "v6"), SAVES[backend], strict=True):
        table = ""
        for line in ns.run(save).splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith("-A ") and "KUBE-" in line:
                out.setdefault(f"{family} {table}", []).append(line)
    return out


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_first_apply_installs_exactly_the_rendered_rules(node: Netns, backend: str) -> None:
    result = drive(node, backend, ["apply", 60])
    got = tables(node, backend)
    assert result["backend"].startswith(backend)
    assert sum(len(v) for v in got.values()) > 200
    for key, lines in got.items():
        assert len(lines) == len(set(lines)), f"duplicates in {key}"
    assert len(got["v4 nat"]) > len(got["v6 nat"]) > 0


def expected_claims(n: int) -> list[list[Any]]:
    """What `claimed_ports` must read back after DRIVER's `ports(n)` were applied."""
    out: list[list[Any]] = []
    for i in range(n):
        key = [f"ns{i % 3}/svc{i}:p", "UDP" if i % 4 == 3 else "TCP"]
        cluster = 40000 + i
        external = cluster + 1000 if i % 6 == 0 else cluster
        out.append([*key, "cluster", cluster])
        # NodePorts and external IPs have rules of their own; LoadBalancer IPs look like
        # ClusterIPs, so they only show as a port of their own.
        if i % 2 == 0 or i % 7 == 0 or (i % 11 == 0 and external != cluster):
            out.append([*key, "external", external])
    return sorted(out)


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_a_new_portals_reads_back_the_proxy_ports_of_installed_rules(
    node: Netns, backend: str
) -> None:
    result = drive(node, backend, ["claimed"], ["apply", 60], ["claimed"])
    assert result["claimed"] == expected_claims(60)
    assert [k for k in result["claimed"] if k[0] == "ns0/svc0:p"] == [
        ["ns0/svc0:p", "TCP", "cluster", 40000],
        ["ns0/svc0:p", "TCP", "external", 41000],
    ]


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_no_rules_means_no_claimed_ports(node: Netns, backend: str) -> None:
    assert drive(node, backend, ["claimed"])["claimed"] == []


def test_both_backends_write_the_same_lines(netns_ok: None, tmp_path: Path) -> None:
    results = {}
    for backend in ("iptc", "restore"):
        ns = Netns(f"kupsame{backend[:4]}{os.getpid()}")
        sh("ip", "netns", "add", ns.name)
        try:
            steps = [["apply", 80], ["apply", 75, 3]]  # a fresh set, then a changed one
            drive(ns, backend, *steps, nodeport_addresses=["10.244.0.0/16", "fd00::/64"])
            results[backend] = tables(ns, backend)
        finally:
            sh("ip", "netns", "del", ns.name, check=False)
    assert results["iptc"] == results["restore"]


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_resync_without_changes_commits_nothing(node: Netns, backend: str) -> None:
    iptables = "iptables-legacy" if backend == "iptc" else "iptables-nft"
    foreign = [iptables, "-t", "nat", "-A", "POSTROUTING", "-p", "tcp", "-j", "ACCEPT"]
    result = drive(node, backend, ["apply", 30], ["apply", 30], ["run", foreign], ["apply", 30])
    commits = [step["commits"] for step in result["steps"]]
    first = commits[0]
    assert commits == [first, first, first, first]
    assert result["steps"][-1]["repairs"] == 0


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_one_changed_port_is_one_small_commit(node: Netns, backend: str) -> None:
    steps = (["apply", 30], ["apply", 30, 500], ["apply", 30, 500])
    before, after, resync = drive(node, backend, *steps)["steps"]
    # The last port has IPv4 nat rules, and a KUBE-PROXY-PORTS guard rule in the filter table
    # of each family the proxy ports serve (dual-stack here): one commit per table touched,
    # and with the restore backend a second one for its deletes.
    assert after["commits"] - before["commits"] == (3 if backend == "iptc" else 6)
    assert resync == after  # the state the commits left is recognised as ours: no repair


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_a_table_flushed_by_hand_is_rebuilt(node: Netns, backend: str) -> None:
    iptables = "iptables-legacy" if backend == "iptc" else "iptables-nft"
    wipe = f"{iptables} -t nat -F && {iptables} -t nat -X"
    result = drive(node, backend, ["apply", 30], ["run", ["sh", "-c", wipe]], ["apply", 30])
    assert result["steps"][-1]["repairs"] == 1
    installed = tables(node, backend)
    fresh = Netns(node.name + "b")
    sh("ip", "netns", "add", fresh.name)
    try:
        drive(fresh, backend, ["apply", 30])
        assert installed == tables(fresh, backend)
    finally:
        sh("ip", "netns", "del", fresh.name, check=False)


def test_auto_picks_iptc_where_legacy_tables_hold_rules(node: Netns) -> None:
    node.run("iptables-legacy", "-A", "INPUT", "-p", "tcp", "--dport", "22", "-j", "ACCEPT")
    code = "from kube_userspace_proxy.portals import make_backend; print(make_backend('auto').name)"
    assert node.python(code).strip() == "iptc (legacy)"


def test_auto_picks_restore_on_nft_otherwise(node: Netns) -> None:
    code = "from kube_userspace_proxy.portals import make_backend; print(make_backend('auto').name)"
    assert node.python(code).strip() == "restore (nft)"


def test_iptc_waits_for_the_xtables_lock(node: Netns, tmp_path: Path) -> None:
    lock = tmp_path / "xtables.lock"
    held = 1.5
    with open(lock, "w") as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)
        started = time.monotonic()
        arg = json.dumps({"backend": "iptc", "steps": [["apply", 3]]})
        proc = subprocess.Popen(
            ["ip", "netns", "exec", node.name, sys.executable, "-c", DRIVER, arg],
            env={**os.environ, "XTABLES_LOCKFILE": str(lock)},
            stdout=subprocess.PIPE,
        )
        time.sleep(held)  # the lock must stay held for a while to show that apply waits
        assert proc.poll() is None
        assert "KUBE-" not in node.run("iptables-legacy-save")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert time.monotonic() - started >= held
    assert json.loads(out)["steps"][0]["commits"] >= 1


STAMPS = textwrap.dedent(
    """
    import json, random
    from kube_userspace_proxy.model import *
    from kube_userspace_proxy.portals.iptc import Encoder
    from kube_userspace_proxy.portals.desired import render
    from kube_userspace_proxy.portals.settings import Settings

    rng = random.Random(7)
    ports = []
    for i in range(120):
        proto = rng.choice([Protocol.TCP, Protocol.UDP])
        name = ServicePortName("ns-%d" % rng.randrange(99), "svc-" + "x" * rng.randrange(40), "p")
        ip = lambda: "10.%d.%d.%d" % (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        info = ServicePortInfo(
            ServicePortName(name.namespace, name.name + str(i), "p", proto),
            rng.randrange(1, 65536), (ip(),),
            node_port=rng.choice([0, rng.randrange(30000, 32768)]),
            external_ips=(ip(),) if rng.random() < 0.3 else (),
            load_balancer_ips=(ip(),) if rng.random() < 0.3 else (),
        )
        port = rng.randrange(1, 65536)
        ports.append(ProxiedPort(info, port, rng.choice([port, rng.randrange(1, 65536)])))
    bind = ["0.0.0.0", "10.244.0.7"]
    rules = []
    for b in bind:
        s = Settings(("10.244.%d.1" % rng.randrange(256),), b, ("10.244.0.0/16",))
        rules += [r for r in render(ports, s) if r.family == 4]
    encoder = Encoder()
    bad = [r.line for r in rules if encoder.encode(r) != encoder.build(r)]
    templated = sum(t is not None for t in encoder._templates.values())
    print(json.dumps({"rules": len(rules), "bad": bad[:5], "shapes": len(encoder._templates),
                      "templated": templated}))
    """
)


def test_iptc_templates_stamp_what_python_iptables_builds(node: Netns) -> None:
    result = json.loads(node.python(STAMPS, timeout=300))
    assert result["bad"] == []
    assert result["rules"] > 400
    assert result["templated"] == result["shapes"] >= 8


# ---- shards, the cheap check, the full verify, cleanup and upgrades -------------------------

IPTABLES = {
    "iptc": ("iptables-legacy", "iptables-legacy-restore"),
    "restore": ("iptables-nft", "iptables-nft-restore"),
}


def shard_of_port(i: int, chain: str) -> str:
    """The shard of portal chain `chain` that DRIVER's port `i` has its ClusterIP rules in."""
    from kube_userspace_proxy.portals.rules import shard_chain, shard_for

    return shard_chain(chain, shard_for(chain, f"10.96.{i // 200}.{i % 200 + 1}/32", 0))


def fresh_install(name: str, backend: str, n: int, shift: int = 0) -> dict[str, list[str]]:
    """Our rules as a first apply of `n` ports writes them into empty tables."""
    fresh = Netns(name + "f")
    sh("ip", "netns", "add", fresh.name)
    try:
        drive(fresh, backend, ["apply", n, shift])
        return tables(fresh, backend)
    finally:
        sh("ip", "netns", "del", fresh.name, check=False)


CONNECT = """
import socket
for host, port in (("10.96.0.5", 81), ("10.244.0.77", 30004)):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((host, port))  # no proxy port listens: refused once the SYN was counted
    except OSError:
        pass
    s.close()
"""


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_a_new_connection_passes_only_the_jump_into_its_own_shard(
    node: Netns, backend: str
) -> None:
    # The node's own addresses (the DNAT goes to 10.244.0.1) and a route for the ClusterIPs.
    setup = "ip link set lo up && ip addr add 10.244.0.1/32 dev lo"
    setup += " && ip addr add 10.244.0.77/32 dev lo && ip route add 10.96.0.0/16 dev lo"
    drive(node, backend, ["run", ["sh", "-c", setup]], ["apply", 30],
          ["run", [sys.executable, "-c", CONNECT]])  # fmt: skip
    save = SAVES[backend][0]
    taken: dict[str, int] = {}
    for line in node.run(save, "-c", "-t", "nat").splitlines():
        m = re.fullmatch(r"\[(\d+):\d+\] -A (KUBE-[A-Z-]+) .* -j (KUBE-[A-Z-]+-[0-9A-F]{2})", line)
        if m and int(m[1]):
            taken[m[3]] = taken.get(m[3], 0) + int(m[1])
    # Port 4 (TCP, ClusterIP 10.96.0.5 port 81, NodePort 30004): the SYN to its ClusterIP
    # passed the jump to shard 05 alone; the one to its NodePort on 10.244.0.77 passed no
    # ClusterIP shard's jump (4D is empty) and then only the jump to NodePort shard 75
    # (ports 29952-30207), once, for TCP.
    assert taken == {"KUBE-PORTALS-HOST-05": 1, "KUBE-NODEPORT-HOST-75": 1}


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_one_change_restore_input_holds_only_the_changed_rules(node: Netns, backend: str) -> None:
    result = drive(node, backend, ["apply", 300], ["live", 300, 100], ["deferred"])
    first, live, _ = (step["commits"] for step in result["steps"])
    inputs = result["inputs"][first:]
    # Port 299 (UDP, IPv4 only) moved from proxy port 40299 to 40399: its ClusterIP rules in
    # one nat shard (its ClusterIP's), its guard rule in the filter shard of each family (both
    # ports are in shard 9D, 40192-40447); nothing else. The new nat rules go to the head of
    # their shards, where they shadow the old ones.
    heads = ["*filter", "*filter", "*nat"]
    assert sorted(text.splitlines()[0] for text in inputs) == sorted(
        heads * (1 if backend == "iptc" else 2)
    )
    body = [line for text in inputs for line in text.splitlines()[1:-1]]
    assert all('--comment "ns2/svc299:p"' in line for line in body), body
    assert sorted(line.split()[0] + " " + line.split()[-1] for line in body) == sorted(
        [
            *("-D 40299", "-D 10.244.0.1:40299", "-I 40399", "-I 10.244.0.1:40399"),
            *("-D icmp-port-unreachable", "-A icmp-port-unreachable"),
            *("-D icmp6-port-unreachable", "-A icmp6-port-unreachable"),
        ]
    )
    nat = [line for text in inputs if text.startswith("*nat") for line in text.splitlines()]
    assert {line.split()[1] for line in nat[1:-1] if line[:1] == "-"} == {
        shard_of_port(299, "KUBE-PORTALS-CONTAINER"),
        shard_of_port(299, "KUBE-PORTALS-HOST"),
    }
    if backend == "restore":  # the first commit adds only, the second deletes only
        assert len(inputs) == 6
        adds = [line for text in inputs[: live - first] for line in text.splitlines()]
        assert not [line for line in adds if line.startswith("-D")]
        deletes = [line for text in inputs[live - first :] for line in text.splitlines()]
        assert all(line.startswith("-D") for line in deletes if line.startswith("-"))


# Port 296 of DRIVER's ports: TCP, ClusterIP 10.96.1.97 port 82, NodePort 30296; moved by
# `ports(297, 100)` from proxy port 40296 to 40396, in the same filter shard (9D: ports
# 40192-40447), as a move to the allocator's next port lands.
NODE_SETUP = (
    "ip link set lo up && ip addr add 10.244.0.1/32 dev lo && ip route add 10.96.0.0/16 dev lo"
)


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_a_moved_port_takes_connections_at_its_first_commit_and_its_deletes_follow(
    node: Netns, backend: str
) -> None:
    save = [SAVES[backend][0], "-t", "nat"]
    to_old, to_new = ["connect", "10.96.1.97", 82, 40296], ["connect", "10.96.1.97", 82, 40396]
    steps = (["run", ["sh", "-c", NODE_SETUP]], ["apply", 297], to_old, ["live", 297, 100])
    steps += (to_new, ["output", save], ["deferred"], to_new)
    result = drive(node, backend, *steps)
    # A real connection from the node to the ClusterIP reached the old proxy port, then the
    # new one right after the first commit of the move, and still after the deletes.
    assert result["connected"] == [True, True, True]
    counts = [step["commits"] for step in result["steps"]]
    live = result["inputs"][counts[2] : counts[3]]
    deferred = result["inputs"][counts[5] : counts[6]]
    mine = '--comment "ns2/svc296:p"'
    shard = shard_of_port(296, "KUBE-PORTALS-HOST")
    held = [line for line in result["output"][0].splitlines() if line.startswith(f"-A {shard} ")]
    ours = [line for line in held if mine in line]
    # After the first commit: the new rule leads its shard. With iptc the old one is gone;
    # with restore it is still there behind the new one, until the second commit.
    assert held[0].endswith("--to-destination 10.244.0.1:40396")
    assert [line.rsplit(":", 1)[-1] for line in ours] == (
        ["40396"] if backend == "iptc" else ["40396", "40296"]
    )
    if backend == "restore":
        adds = [line for text in live for line in text.splitlines() if line[:1] == "-"]
        assert adds and not [line for line in adds if line.startswith("-D")], adds
        assert all("40396" in line for line in adds), adds
        # nat: ClusterIP and NodePort, container and host; filter: guards (both families)
        # and the NodePort's ACCEPT
        assert sum(line.startswith("-I ") for line in adds) == 4
        deletes = [line for text in deferred for line in text.splitlines() if line[:1] == "-"]
        assert sorted(line.split()[0] for line in deletes) == ["-D"] * 7, deletes
        assert all("40296" in line for line in deletes), deletes
    else:
        assert deferred == []
    # In the end, the same rules as a first apply of the moved ports writes (a moved port's
    # rules lead their chains instead of following the name order: compared sorted).
    installed = {key: sorted(lines) for key, lines in tables(node, backend).items()}
    fresh = fresh_install(node.name, backend, 297, 100)
    assert installed == {key: sorted(lines) for key, lines in fresh.items()}


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_a_deleted_jump_and_a_deleted_shard_are_recreated_by_the_next_apply(
    node: Netns, backend: str
) -> None:
    iptables = IPTABLES[backend][0]
    shard = shard_of_port(0, "KUBE-PORTALS-CONTAINER")
    last = int(shard[-2:], 16)
    entry = f"-d 0.0.0.{last}/0.0.0.255 -m comment --comment 'shard {shard[-2:]}: destinations"
    entry += f" ending in {shard[-2:]}' -j {shard}"
    wipe = (
        f"{iptables} -t nat -D PREROUTING 1"  # the jump into KUBE-PORTALS-CONTAINER
        f" && {iptables} -t nat -D KUBE-PORTALS-CONTAINER {entry}"
        f" && {iptables} -t nat -F {shard} && {iptables} -t nat -X {shard}"
    )
    result = drive(node, backend, ["apply", 30], ["run", ["sh", "-c", wipe]], ["apply", 30])
    assert result["steps"][1]["commits"] == result["steps"][0]["commits"]
    assert result["steps"][-1]["repairs"] == 1  # found by the cheap check, not a full verify
    assert result["steps"][-1]["verifies"] == 0
    assert tables(node, backend) == fresh_install(node.name, backend, 30)


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_a_missing_canary_rewrites_everything_of_ours_in_the_table(
    node: Netns, backend: str
) -> None:
    iptables = IPTABLES[backend][0]
    shard = shard_of_port(0, "KUBE-PORTALS-HOST")
    # A flushed shard alone is only seen by the full verify; without the canary, the whole
    # table is rewritten at once, that shard included.
    wipe = f"{iptables} -t nat -X KUBE-PORTALS-CANARY && {iptables} -t nat -F {shard}"
    result = drive(node, backend, ["apply", 30], ["run", ["sh", "-c", wipe]], ["apply", 30])
    assert result["steps"][-1]["repairs"] == 1
    assert result["steps"][-1]["verifies"] == 0
    assert tables(node, backend) == fresh_install(node.name, backend, 30)


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_the_full_verify_runs_at_its_period_and_repairs_a_flushed_shard(
    node: Netns, backend: str
) -> None:
    iptables = IPTABLES[backend][0]
    flush = [iptables, "-t", "nat", "-F", shard_of_port(0, "KUBE-PORTALS-HOST")]
    steps = (["apply", 30], ["run", flush], ["apply", 30], ["advance", 61], ["apply", 30])
    result = drive(node, backend, *steps, verify_period=60.0)
    _, _, within, _, after = result["steps"]
    assert (within["repairs"], within["verifies"]) == (0, 0)  # the cheap check cannot see it
    assert (after["repairs"], after["verifies"]) == (1, 4)  # 2 tables x 2 families read in full
    assert tables(node, backend) == fresh_install(node.name, backend, 30)


FOREIGN = """*nat
:KUBE-SERVICES - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-PORTALS-OTHER - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m tcp --dport 443 -j ACCEPT
COMMIT
*filter
:KUBE-PROXY-CANARY - [0:0]
-A INPUT -p tcp -m tcp --dport 9999 -j ACCEPT
COMMIT
"""


def test_cleanup_removes_our_chains_shards_included_from_legacy_and_nft_alone(
    node: Netns,
) -> None:
    for mode in ("legacy", "nft"):
        restore_in(node, f"iptables-{mode}-restore", FOREIGN)
        restore_in(node, f"ip6tables-{mode}-restore", FOREIGN.replace("10.96.0.1/32", "fd00::1"))
    before = {save: node.run(save) for save in (*SAVES["iptc"], *SAVES["restore"])}
    drive(node, "iptc", ["apply", 30])  # IPv4 and IPv6, on the legacy tables
    result = drive(node, "restore", ["apply", 30], ["cleanup"])  # and on the nft ones
    assert result["removed"] > 0
    for save, text in before.items():
        rules = sorted(line for line in text.splitlines() if line[:1] in "-:")
        after = sorted(line for line in node.run(save).splitlines() if line[:1] in "-:")
        assert after == rules, save


def restore_in(ns: Netns, restore: str, text: str) -> None:
    args = ["ip", "netns", "exec", ns.name, restore, "--noflush"]
    subprocess.run(args, input=text, text=True, check=True, capture_output=True, timeout=30)


# What the release before the shards installed for DRIVER's port 0 (ClusterIPs, NodePort):
# the rules right in the entry chains.
OLD_LAYOUT = """*nat
:KUBE-PORTALS-CONTAINER - [0:0]
:KUBE-PORTALS-HOST - [0:0]
:KUBE-NODEPORT-CONTAINER - [0:0]
:KUBE-NODEPORT-HOST - [0:0]
-A PREROUTING -m comment --comment "handle ClusterIPs; NOTE: this must be before the NodePort rules" -j KUBE-PORTALS-CONTAINER
-A OUTPUT -m comment --comment "handle ClusterIPs; NOTE: this must be before the NodePort rules" -j KUBE-PORTALS-HOST
-A PREROUTING -m addrtype --dst-type LOCAL -m comment --comment "handle service NodePorts; NOTE: this must be the last rule in the chain" -j KUBE-NODEPORT-CONTAINER
-A OUTPUT -m addrtype --dst-type LOCAL -m comment --comment "handle service NodePorts; NOTE: this must be the last rule in the chain" -j KUBE-NODEPORT-HOST
-A KUBE-PORTALS-CONTAINER -d 10.96.0.1/32 -p tcp -m comment --comment "ns0/svc0:p" -m tcp --dport 80 -j REDIRECT --to-ports 40000
-A KUBE-PORTALS-HOST -d 10.96.0.1/32 -p tcp -m comment --comment "ns0/svc0:p" -m tcp --dport 80 -j DNAT --to-destination 10.244.0.1:40000
-A KUBE-NODEPORT-CONTAINER -p tcp -m comment --comment "ns0/svc0:p" -m tcp --dport 30000 -j REDIRECT --to-ports 41000
-A KUBE-NODEPORT-HOST -p tcp -m comment --comment "ns0/svc0:p" -m tcp --dport 30000 -j DNAT --to-destination 10.244.0.1:41000
COMMIT
*filter
:KUBE-NODEPORT-NON-LOCAL - [0:0]
:KUBE-PROXY-PORTS - [0:0]
-A INPUT -m comment --comment "Ensure that non-local NodePort traffic can flow" -j KUBE-NODEPORT-NON-LOCAL
-A INPUT -m state --state NEW -m conntrack ! --ctstate DNAT -m comment --comment "refuse proxy ports not reached via nat" -j KUBE-PROXY-PORTS
-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "ns0/svc0:p" -m tcp --dport 41000 -m state --state NEW -m conntrack --ctstate DNAT -j ACCEPT
-A KUBE-PROXY-PORTS -p tcp -m comment --comment "ns0/svc0:p" -m tcp --dport 40000 -j REJECT --reject-with tcp-reset
COMMIT
"""  # noqa: E501


@pytest.mark.parametrize("backend", ["iptc", "restore"])
def test_rules_of_the_layout_before_shards_are_read_back_then_replaced(
    node: Netns, backend: str
) -> None:
    restore_in(node, IPTABLES[backend][1], OLD_LAYOUT)
    result = drive(node, backend, ["claimed"], ["apply", 30])
    assert result["claimed"] == [
        ["ns0/svc0:p", "TCP", "cluster", 40000],
        ["ns0/svc0:p", "TCP", "external", 41000],
    ]
    assert tables(node, backend) == fresh_install(node.name, backend, 30)


# Runs inside the namespace: one commit_many of a large good nat input and a filter input that
# iptables-restore refuses (a delete of a rule that is not there).
BATCH = textwrap.dedent(
    """
    import json
    from kube_userspace_proxy.errors import PortalsError
    from kube_userspace_proxy.portals.plan import Append, Delete, ResetChain
    from kube_userspace_proxy.portals.restore import RestoreBackend
    from kube_userspace_proxy.portals.rules import Rule
    chain = "KUBE-PORTALS-HOST-01"
    rules = [
        Rule(4, "nat", chain, "DNAT", "ns/svc%d:p" % i, "tcp",
             "10.96.%d.%d/32" % (i // 250, i % 250 + 1), 80, to_port=20000 + i,
             to_addr="10.244.0.1")
        for i in range(3000)
    ]
    good = [ResetChain(chain), *(Append(r) for r in rules)]
    bad = [Delete("INPUT", 0, "-p tcp -m comment --comment not-there -j ACCEPT")]
    out = RestoreBackend("nft").commit_many([(4, "nat", good, None), (4, "filter", bad, None)])
    print(json.dumps([isinstance(o, PortalsError) and str(o) for o in out]))
    """
)


def test_a_large_input_commits_and_a_refused_table_fails_alone(node: Netns) -> None:
    # 3,000 rules (~400 KB) from a memfd, beside a table whose input is refused.
    nat_error, filter_error = json.loads(node.python(BATCH, timeout=120))
    assert nat_error is False
    assert filter_error and "iptables-nft-restore" in filter_error
    lines = node.run("iptables-nft-save", "-t", "nat").splitlines()
    assert len([line for line in lines if line.startswith("-A KUBE-PORTALS-HOST-01 ")]) == 3000
    assert (
        lines.count(  # the last line of the input arrived whole
            '-A KUBE-PORTALS-HOST-01 -d 10.96.11.250/32 -p tcp -m comment --comment "ns/svc2999:p"'
            " -m tcp --dport 80 -j DNAT --to-destination 10.244.0.1:22999"
        )
        == 1
    )
