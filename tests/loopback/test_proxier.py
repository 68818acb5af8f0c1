"""Proxier: one service port's failure is contained and retried; the others keep serving."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Sequence
from types import MappingProxyType

import pytest

from kube_userspace_proxy.model import (
    Endpoint,
    Path,
    Protocol,
    ProxiedPort,
    ServicePortInfo,
    ServicePortName,
    Snapshot,
)
from kube_userspace_proxy.ports import PortAllocator
from kube_userspace_proxy.proxier.local import LocalDataPlane
from kube_userspace_proxy.proxier.reconciler import Proxier
from tests.loopback.proxyrun import ask, start_named_backends, wait_for

A = ServicePortName("default", "a", "http", Protocol.TCP)
B = ServicePortName("default", "b", "http", Protocol.TCP)


def _snapshot(backend_port: int, **node_ports: int) -> Snapshot:
    infos = {
        name: ServicePortInfo(
            name=name,
            port=80,
            cluster_ips=("10.96.0.10",),
            node_port=node_ports.get(name.name, 0),
        )
        for name in (A, B)
    }
    endpoints = {name: (Endpoint("127.0.0.1", backend_port),) for name in (A, B)}
    return Snapshot(services=MappingProxyType(infos), endpoints=MappingProxyType(endpoints))


@pytest.fixture
async def proxier() -> AsyncIterator[Proxier]:
    made = Proxier(PortAllocator(None, host="127.0.0.1"), node_port_addresses=lambda: ["127.0.0.1"])
    yield made
    await made.shutdown(0.5)


@pytest.fixture
async def backend_port() -> AsyncIterator[int]:
    [(_, port, server)] = await start_named_backends(["pod"])
    yield port
    server.close()
    await server.wait_closed()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_taken_node_port_is_reported_retried_and_held_once_free(
    proxier: Proxier, backend_port: int
) -> None:
    node_port = _free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", node_port))
    squatter.listen()
    try:
        await proxier.sync(_snapshot(backend_port, a=node_port))
        assert "can't hold NodePort" in proxier.errors()[A]
        # The service port itself, and the other Service, still serve.
        assert await ask(proxier.port_of(A)) == "pod"
        assert await ask(proxier.port_of(B)) == "pod"
    finally:
        squatter.close()
    await proxier.sync(_snapshot(backend_port, a=node_port))
    assert A not in proxier.errors()
    assert await ask(node_port) == "pod"  # the NodePort socket is ours now, and serves


async def test_an_unexpected_error_in_one_service_port_spares_the_others(
    proxier: Proxier, backend_port: int
) -> None:
    # Port 70000 cannot be bound (OverflowError, not OSError): an error nobody planned for.
    await proxier.sync(_snapshot(backend_port, a=70000))
    assert "OverflowError" in proxier.errors()[A]
    assert await ask(proxier.port_of(B)) == "pod"
    await proxier.sync(_snapshot(backend_port))
    assert A not in proxier.errors()
    assert await asyncio.wait_for(ask(proxier.port_of(A)), 2) == "pod"


def _info(name: ServicePortName, **fields: object) -> ServicePortInfo:
    return ServicePortInfo(name=name, port=80, cluster_ips=("10.96.0.10",), **fields)  # type: ignore[arg-type]


def _snap(
    infos: list[ServicePortInfo], endpoints: dict[ServicePortName, tuple[Endpoint, ...]]
) -> Snapshot:
    return Snapshot(
        services=MappingProxyType({i.name: i for i in infos}),
        endpoints=MappingProxyType(endpoints),
        node_name="node-1",
    )


class RecordingRules:
    """A rule sink at the proxier's boundary: records each desired set, fails on request."""

    def __init__(self, claimed: dict[tuple[str, str, str], int] | None = None) -> None:
        self.applied: list[list[ProxiedPort]] = []
        self.deferred_commits = 0
        self.fail = False
        self.claimed = claimed or {}

    def claimed_ports(self) -> dict[tuple[str, str, str], int]:
        return dict(self.claimed)

    def apply(self, ports: Sequence[ProxiedPort], node_ips: Sequence[str]) -> None:
        if self.fail:
            raise RuntimeError("iptables-restore failed")
        self.applied.append(list(ports))

    def commit_deferred(self) -> None:
        self.deferred_commits += 1


def _two_free_ports() -> tuple[int, int]:
    """Two adjacent free ports, for a tiny --proxy-port-range."""
    for _ in range(50):
        first = _free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", first + 1))
            except OSError:
                continue
        return first, first + 1
    raise AssertionError("no two adjacent free ports")


async def test_a_service_needing_two_ports_rolls_back_when_the_second_is_missing(
    backend_port: int,
) -> None:
    low, high = _two_free_ports()
    proxier = Proxier(PortAllocator((low, high), host="127.0.0.1"))
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", high))
    info = _info(A, external_ips=("192.0.2.1",), external_traffic_local=True)
    eps = {A: (Endpoint("127.0.0.1", backend_port, node_name="node-1"),)}
    try:
        await proxier.sync(_snap([info], eps))
        assert "no free TCP port" in proxier.errors()[A]
        assert proxier.port_of(A) == 0  # nothing half-open is left behind
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", low))  # the first port was given back
    finally:
        squatter.close()
    await proxier.sync(_snap([info], eps))
    assert A not in proxier.errors()
    assert {proxier.port_of(A, Path.CLUSTER), proxier.port_of(A, Path.EXTERNAL)} == {low, high}
    assert await ask(proxier.port_of(A, Path.CLUSTER)) == "pod"
    assert await ask(proxier.port_of(A, Path.EXTERNAL)) == "pod"
    await proxier.shutdown(0.5)


async def test_endpoints_still_follow_when_a_second_port_cannot_be_had() -> None:
    started = await start_named_backends(["pod-a", "pod-b"])
    (_, port_a, server_a), (_, port_b, server_b) = started
    low = _free_port()
    proxier = Proxier(PortAllocator((low, low), host="127.0.0.1"))
    try:
        await proxier.sync(_snap([_info(A)], {A: (Endpoint("127.0.0.1", port_a),)}))
        assert await ask(proxier.port_of(A)) == "pod-a"
        # Now it wants a second (external) port, and the range has none; its endpoint moves.
        changed = _info(A, external_ips=("192.0.2.1",), external_traffic_local=True)
        await proxier.sync(
            _snap([changed], {A: (Endpoint("127.0.0.1", port_b, node_name="node-1"),)})
        )
        assert A in proxier.errors()
        assert await ask(proxier.port_of(A)) == "pod-b"
    finally:
        await proxier.shutdown(0.5)
        for server in (server_a, server_b):
            server.close()
            await server.wait_closed()


async def test_a_removed_port_is_not_reused_until_a_commit_no_longer_names_it(
    backend_port: int,
) -> None:
    low, high = _two_free_ports()
    rules = RecordingRules()
    proxier = Proxier(PortAllocator((low, high), host="127.0.0.1"), portals=rules)
    eps = {n: (Endpoint("127.0.0.1", backend_port),) for n in (A, B)}
    try:
        await proxier.sync(_snap([_info(A)], eps))
        port_a = proxier.port_of(A)
        # A goes and B and C come in one sync whose commit fails: A's port is still named by
        # the rules in the kernel, so neither B nor C may have it.
        c = ServicePortName("default", "c", "http", Protocol.TCP)
        eps[c] = eps[A]
        rules.fail = True
        with pytest.raises(RuntimeError):
            await proxier.sync(_snap([_info(B), _info(c)], eps))
        assert proxier.port_of(B) not in (0, port_a)
        assert proxier.port_of(c) == 0 and "no free TCP port" in proxier.errors()[c]
        with pytest.raises(RuntimeError):
            await proxier.sync(_snap([_info(B), _info(c)], eps))
        assert proxier.port_of(c) == 0  # still held back: no commit has succeeded
        rules.fail = False
        await proxier.sync(_snap([_info(B), _info(c)], eps))  # this commit drops A's rules
        await proxier.sync(_snap([_info(B), _info(c)], eps))  # now the port may serve C
        assert proxier.port_of(c) == port_a
        assert await ask(port_a) == "pod"
    finally:
        await proxier.shutdown(0.5)


async def test_a_removed_port_is_released_only_once_its_deferred_deletes_are_committed(
    backend_port: int,
) -> None:
    low, high = _two_free_ports()
    calls: list[str] = []

    class DeferringRules(RecordingRules):
        """Rules whose stale leftovers (naming retired ports) go in a second commit."""

        fail_deferred = False

        def apply(self, ports: Sequence[ProxiedPort], node_ips: Sequence[str]) -> None:
            calls.append("apply")
            super().apply(ports, node_ips)

        def commit_deferred(self) -> None:
            calls.append("deferred")
            if self.fail_deferred:
                raise RuntimeError("iptables-restore failed")
            super().commit_deferred()

    rules = DeferringRules()
    proxier = Proxier(PortAllocator((low, high), host="127.0.0.1"), portals=rules)
    c = ServicePortName("default", "c", "http", Protocol.TCP)
    eps = {n: (Endpoint("127.0.0.1", backend_port),) for n in (A, B, c)}
    try:
        await proxier.sync(_snap([_info(A)], eps))
        port_a = proxier.port_of(A)
        # A goes, B comes: the commit is live, but the deletes of A's rules fail.
        rules.fail_deferred = True
        await proxier.sync(_snap([_info(B)], eps))
        assert calls[-2:] == ["apply", "deferred"]
        assert proxier.rules_pending  # A's port waits for a commit that deletes its rules
        await proxier.sync(_snap([_info(B), _info(c)], eps))
        assert proxier.port_of(c) == 0, "a port that a stale rule may name was reused"
        rules.fail_deferred = False
        await proxier.sync(_snap([_info(B), _info(c)], eps))  # its deletes go through now
        assert not proxier.rules_pending
        await proxier.sync(_snap([_info(B), _info(c)], eps))
        assert proxier.port_of(c) == port_a
        assert await ask(port_a) == "pod"
    finally:
        await proxier.shutdown(0.5)


async def test_node_port_sockets_follow_the_external_traffic_policy() -> None:
    started = await start_named_backends(["pod-local", "pod-remote"])
    (_, port_l, server_l), (_, port_r, server_r) = started
    node_port = _free_port()
    proxier = Proxier(
        PortAllocator(None, host="127.0.0.1"), node_port_addresses=lambda: ["127.0.0.1"]
    )
    eps = {
        A: (
            Endpoint("127.0.0.1", port_l, node_name="node-1"),
            Endpoint("127.0.0.1", port_r, node_name="node-2"),
        )
    }
    try:
        local = _info(A, node_port=node_port, external_traffic_local=True)
        await proxier.sync(_snap([local], eps))
        # Two proxy ports: ClusterIP traffic uses every endpoint, external traffic local ones.
        assert {await ask(proxier.port_of(A, Path.CLUSTER)) for _ in range(4)} == {
            "pod-local",
            "pod-remote",
        }
        assert {await ask(proxier.port_of(A, Path.EXTERNAL)) for _ in range(4)} == {"pod-local"}
        assert {await ask(node_port) for _ in range(4)} == {"pod-local"}
        # externalTrafficPolicy back to Cluster: one proxy port, and the NodePort follows.
        await proxier.sync(_snap([_info(A, node_port=node_port)], eps))
        assert proxier.port_of(A, Path.EXTERNAL) == proxier.port_of(A, Path.CLUSTER)
        assert {await ask(node_port) for _ in range(4)} == {"pod-local", "pod-remote"}
        # And to Local again.
        await proxier.sync(_snap([local], eps))
        assert {await ask(node_port) for _ in range(4)} == {"pod-local"}
    finally:
        await proxier.shutdown(0.5)
        for server in (server_l, server_r):
            server.close()
            await server.wait_closed()


async def test_after_a_restart_each_service_port_gets_back_the_port_its_rules_name(
    backend_port: int,
) -> None:
    old_a, old_b, gone = _free_port(), _free_port(), _free_port()
    rules = RecordingRules(
        {
            (str(A), "TCP", "cluster"): old_a,
            (str(B), "TCP", "cluster"): old_b,
            ("default/deleted:http", "TCP", "cluster"): gone,
        }
    )
    allocator = PortAllocator(None, host="127.0.0.1")
    proxier = Proxier(allocator, portals=rules)
    eps = {n: (Endpoint("127.0.0.1", backend_port),) for n in (A, B)}
    try:
        await proxier.sync(_snap([_info(A), _info(B)], eps))
        assert (proxier.port_of(A), proxier.port_of(B)) == (old_a, old_b)
        assert await ask(old_a) == "pod"
        # The port of a Service that no longer exists was held only until the first commit.
        assert gone not in allocator.reserved(Protocol.TCP)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", gone))
    finally:
        await proxier.shutdown(0.5)


async def test_an_endpoint_only_change_reaches_the_pool_without_a_rule_apply() -> None:
    rules = RecordingRules()
    proxier = Proxier(PortAllocator(None, host="127.0.0.1"), portals=rules)
    backends = await start_named_backends(["old", "new"])
    (_, old_port, _), (_, new_port, _) = backends
    c = ServicePortName("default", "c", "http", Protocol.TCP)
    # The state hands over the same objects for what did not change, as these snapshots do.
    info_a, info_b, info_c = _info(A), _info(B), _info(c)
    old, new = (Endpoint("127.0.0.1", old_port),), (Endpoint("127.0.0.1", new_port),)
    try:
        await proxier.sync(_snap([info_a, info_b], {A: old, B: old}))  # the first: full
        assert len(rules.applied) == 1
        assert await ask(proxier.port_of(A)) == "old"
        await proxier.sync(_snap([info_a, info_b], {A: new, B: old}), full=False)
        assert await ask(proxier.port_of(A)) == "new"
        assert await ask(proxier.port_of(B)) == "old"
        assert len(rules.applied) == 1  # no rule target changed: no rules handed over
        # A new service port changes the rules.
        added = _snap([info_a, info_b, info_c], {A: new, B: old, c: new})
        await proxier.sync(added, full=False)
        assert len(rules.applied) == 2
        assert {p.info.name for p in rules.applied[-1]} == {A, B, c}
        # The periodic resync hands the whole set over again (the portals check it).
        await proxier.sync(added, full=True)
        assert len(rules.applied) == 3
    finally:
        await proxier.shutdown(0.5)
        for _, _, server in backends:
            server.close()


class GatedRules(RecordingRules):
    """Rules whose commit waits for `gate` (in the commit's thread), as a slow one would."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.started: list[dict[ServicePortName, int]] = []  # the ports each commit named

    def apply(self, ports: Sequence[ProxiedPort], node_ips: Sequence[str]) -> None:
        self.started.append({p.info.name: p.cluster_port for p in ports})
        assert self.gate.wait(30), "the test never opened the gate"
        super().apply(ports, node_ips)


class CommitFirstDataPlane(LocalDataPlane):
    """Listeners in this process whose reconcile ends (`publish`) only once a rule commit
    has started: a proxier that commits after its listeners are made never gets there."""

    def __init__(self, rules: GatedRules) -> None:
        super().__init__()
        self.rules = rules

    async def publish(self) -> None:
        await wait_for(lambda: self.rules.started, 5, "a rule commit under way")


async def test_the_first_commit_runs_while_the_listeners_are_made(backend_port: int) -> None:
    rules = GatedRules()
    proxier = Proxier(
        PortAllocator(None, host="127.0.0.1"),
        portals=rules,
        dataplane=CommitFirstDataPlane(rules),
    )
    eps = {n: (Endpoint("127.0.0.1", backend_port),) for n in (A, B)}
    sync = asyncio.create_task(proxier.sync(_snap([_info(A), _info(B)], eps)))
    try:
        # The commit has started, naming ports, and waits; the listeners serve meanwhile.
        await wait_for(lambda: rules.started and proxier.port_of(A) and proxier.port_of(B))
        assert rules.started == [{A: proxier.port_of(A), B: proxier.port_of(B)}]
        assert await ask(proxier.port_of(A)) == "pod"
        assert not sync.done()  # the sync ends with its commit
        rules.gate.set()
        await asyncio.wait_for(sync, 10)
        # One commit in all: the one made early named the ports the listeners serve on.
        assert len(rules.applied) == 1
        assert not proxier.rules_pending
        assert proxier.rule_applies == 1
    finally:
        rules.gate.set()
        await proxier.shutdown(0.5)


async def test_a_first_commit_that_fails_early_is_made_again_after_the_listeners(
    backend_port: int,
) -> None:
    failures = [RuntimeError("iptables-restore failed")]

    class FailingOnce(RecordingRules):
        def apply(self, ports: Sequence[ProxiedPort], node_ips: Sequence[str]) -> None:
            if failures:
                raise failures.pop()
            super().apply(ports, node_ips)

    rules = FailingOnce()
    proxier = Proxier(PortAllocator(None, host="127.0.0.1"), portals=rules)
    eps = {n: (Endpoint("127.0.0.1", backend_port),) for n in (A, B)}
    try:
        await proxier.sync(_snap([_info(A), _info(B)], eps))
        assert not failures
        assert [{p.info.name: p.cluster_port for p in ports} for ports in rules.applied] == [
            {A: proxier.port_of(A), B: proxier.port_of(B)}
        ]
        assert not proxier.rules_pending
    finally:
        await proxier.shutdown(0.5)


async def test_a_first_commit_names_only_the_ports_it_could_reserve(backend_port: int) -> None:
    low, high = _two_free_ports()
    rules = GatedRules()
    rules.gate.set()
    proxier = Proxier(PortAllocator((low, high), host="127.0.0.1"), portals=rules)
    c = ServicePortName("default", "c", "http", Protocol.TCP)
    eps = {n: (Endpoint("127.0.0.1", backend_port),) for n in (A, B, c)}
    try:
        await proxier.sync(_snap([_info(A), _info(B), _info(c)], eps))
        served = {n: proxier.port_of(n) for n in (A, B, c) if proxier.port_of(n)}
        assert len(served) == 2 and set(served.values()) == {low, high}
        assert "no free TCP port" in next(iter(proxier.errors().values()))
        assert rules.started == [served]  # the same set: one commit
        assert len(rules.applied) == 1
    finally:
        await proxier.shutdown(0.5)
