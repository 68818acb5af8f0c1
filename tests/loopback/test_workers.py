"""Worker processes on loopback: steering by client IP, affinity, UDP, supervision, counters.

Clients take distinct source addresses from 127.0.0.0/8 (all local), so the kernel's reuseport
steering sees distinct client IPs without any namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kube_userspace_proxy import app
from kube_userspace_proxy.balancer import PINS_SHOWN
from kube_userspace_proxy.dataplane.steering import worker_of
from kube_userspace_proxy.model import Protocol, ServicePortName
from kube_userspace_proxy.ops.metrics import sample_value
from kube_userspace_proxy.workers import pool as workerpool
from kube_userspace_proxy.workers import publisher
from kube_userspace_proxy.workers.process import REPORT_PART
from kube_userspace_proxy.workers.protocol import Collected
from tests.loopback.proxyrun import (
    LOOPBACK_RUN_FLAGS,
    endpoint_slice,
    loopback_config,
    running_proxy,
    service,
    start_named_backends,
    wait_for,
    write_manifests,
)

WORKERS = 2
CLIENTS = [f"127.0.{i}.{j}" for i in (1, 2) for j in range(2, 14)]  # 24 client IPs
WEB = ServicePortName("default", "web", "http", Protocol.TCP)
DNS = ServicePortName("default", "dns", "dns", Protocol.UDP)


def _web(ports: Sequence[int], **spec: Any) -> list[dict[str, Any]]:
    return [
        service("web", [{"name": "http", "port": 80, "protocol": "TCP"}], **spec),
        *endpoint_slice("web", "http", [("127.0.0.1", p) for p in ports]),
    ]


@pytest.fixture
async def backends() -> AsyncIterator[list[tuple[str, int, asyncio.Server]]]:
    started = await start_named_backends(["a", "b", "c"])
    yield started
    for _, _, server in started:
        server.close()


@pytest.fixture
async def proxy_with_workers(
    tmp_path: Path, backends: list[tuple[str, int, asyncio.Server]]
) -> AsyncIterator[app.Proxy]:
    manifest = tmp_path / "svc.yaml"
    write_manifests(
        manifest,
        _web([p for _, p, _ in backends], sessionAffinity="ClientIP"),
    )
    config = loopback_config(manifest, workers=str(WORKERS))
    async with running_proxy(config) as proxy:
        assert proxy.workers is not None
        await wait_for(lambda: proxy.workers is not None and proxy.workers.alive == WORKERS)
        yield proxy


async def ask_from(source: str, port: int) -> str:
    """Connect from `source`, send a line, return the backend's answer (its name)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(b"hello\n")
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data.decode()


def _port(proxy: app.Proxy, name: ServicePortName = WEB) -> int:
    return proxy.proxier.port_of(name)


async def test_each_client_ip_keeps_its_endpoint_across_workers(
    proxy_with_workers: app.Proxy,
) -> None:
    port = _port(proxy_with_workers)
    seen: dict[str, set[str]] = {}
    for _ in range(4):
        for client in CLIENTS:
            seen.setdefault(client, set()).add(await ask_from(client, port))
    assert all(len(names) == 1 for names in seen.values()), seen
    # The clients really were spread over both workers, and so over the endpoints.
    assert {worker_of(c, WORKERS) for c in CLIENTS} == set(range(WORKERS))
    assert len({next(iter(names)) for names in seen.values()}) == 3


async def test_a_start_gives_each_reuseport_group_one_steering_program(
    proxy_with_workers: app.Proxy,
) -> None:
    pool = proxy_with_workers.workers
    assert pool is not None
    # The first worker's socket starts the port's group alone (it gets every connection,
    # no program needed); the second one's join brings the group's program; nothing after.
    assert pool.programs_sent == 1
    port = _port(proxy_with_workers)
    seen: dict[str, set[str]] = {}
    for _ in range(3):
        for client in CLIENTS:
            seen.setdefault(client, set()).add(await ask_from(client, port))
    assert all(len(names) == 1 for names in seen.values()), seen  # steered by client IP
    assert len({next(iter(names)) for names in seen.values()}) == 3


def _clients_of(worker: int) -> list[str]:
    """The client addresses the steering program sends to `worker`."""
    return [c for c in CLIENTS if worker_of(c, WORKERS) == worker]


async def _steered(proxy: app.Proxy) -> workerpool.WorkerPool:
    """The worker pool, once every worker's socket is in the web port's group."""
    pool = proxy.workers
    assert pool is not None
    key = ("TCP", "127.0.0.1", _port(proxy))
    await wait_for(lambda: set(pool.members(key)) == set(range(WORKERS)), 30, "both workers")
    return pool


async def _picks_by_worker(proxy: app.Proxy, pool: workerpool.WorkerPool) -> dict[int, list[str]]:
    """Each worker's recent picks for the web port (endpoint addresses), as it reports them."""
    await pool.collect(debug=True)
    balancer = proxy.proxier.debug_state()[str(WEB)]["balancer"]["cluster"]
    return {
        entry["worker"]: [endpoint for endpoint, _ in entry["picks"]]
        for entry in balancer["recentPicks"]
    }


async def test_each_worker_starts_its_round_robin_at_a_different_endpoint(
    proxy_with_workers: app.Proxy, backends: list[tuple[str, int, asyncio.Server]]
) -> None:
    # The demo's /debug/ui showed two sticky clients, one per worker, both pinned to #1.
    proxy = proxy_with_workers
    pool = await _steered(proxy)
    port = _port(proxy)
    first = {w: await ask_from(_clients_of(w)[0], port) for w in range(WORKERS)}
    # Each connection was the first pick of the worker it was steered to.
    by_port = {f"127.0.0.1:{p}": name for name, p, _ in backends}
    picks = await _picks_by_worker(proxy, pool)
    assert {w: [by_port[a] for a in picks.get(w, [])] for w in range(WORKERS)} == {
        w: [name] for w, name in first.items()
    }
    assert len(set(first.values())) == WORKERS, first


async def test_a_table_push_neither_resets_nor_moves_back_a_workers_round_robin(
    tmp_path: Path,
    proxy_with_workers: app.Proxy,
    backends: list[tuple[str, int, asyncio.Server]],
) -> None:
    proxy = proxy_with_workers
    pool = await _steered(proxy)
    port = _port(proxy)
    fresh = {w: iter(_clients_of(w)) for w in range(WORKERS)}  # a new client: a new pick
    picked: dict[int, list[str]] = {w: [] for w in range(WORKERS)}
    for w in range(WORKERS):
        for _ in range(2):
            picked[w].append(await ask_from(next(fresh[w]), port))
    names = {name for name, _, _ in backends}
    assert all(len(set(p)) == 2 for p in picked.values()), picked
    # The push: a fourth endpoint joins; once the proxier has it, the workers have it too
    # when a publish returns (it sends the change, or waits for the one sending it).
    extra = await start_named_backends(["d"])
    try:
        ports = [p for _, p, _ in (*backends, *extra)]
        write_manifests(tmp_path / "svc.yaml", _web(ports, sessionAffinity="ClientIP"))
        await wait_for(
            lambda: len(proxy.proxier.debug_state()[str(WEB)]["endpoints"]["cluster"]) == 4,
            30,
            "the fourth endpoint",
        )
        await pool.publish()
        for w in range(WORKERS):
            # Three endpoints before the push: the one each worker has not picked yet was its
            # next, and still is (a reset would give its start again, a step back its last).
            (expected,) = names - set(picked[w])
            assert await ask_from(next(fresh[w]), port) == expected, (w, picked[w])
    finally:
        for _, _, server in extra:
            server.close()


async def test_counters_are_summed_over_the_workers(proxy_with_workers: app.Proxy) -> None:
    proxy = proxy_with_workers
    port = _port(proxy)
    for client in CLIENTS:
        await ask_from(client, port)
    ops = proxy.ops
    assert ops is not None and ops.metrics_port is not None
    url = f"http://127.0.0.1:{ops.metrics_port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as response:
            text = await response.text()
        async with http.get(f"{url}/debug/state") as response:
            state = await response.json()
    # The only Service here: its accepted connections, whatever other labels the series has.
    accepted = sample_value(text, "kube_userspace_proxy_connections_total", {"result": "accepted"})
    assert accepted == len(CLIENTS)
    assert state[str(WEB)]["connections"]["accepted"] == len(CLIENTS)
    pins = state[str(WEB)]["affinity"]
    assert pins["pins"] == len(CLIENTS)
    shown = {pin["clientIP"] for pin in pins["shown"]}
    assert shown <= set(CLIENTS) and len(shown) == min(len(CLIENTS), PINS_SHOWN)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


async def test_a_killed_worker_is_restarted_and_the_others_keep_serving(
    dataplane: str,  # first: the workers start with this data plane (both are run)
    tmp_path: Path,
    proxy_with_workers: app.Proxy,
    backends: list[tuple[str, int, asyncio.Server]],
) -> None:
    proxy = proxy_with_workers
    pool = proxy.workers
    assert pool is not None
    echo_server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    echo = ServicePortName("default", "echo", "tcp", Protocol.TCP)
    write_manifests(
        tmp_path / "svc.yaml",
        [
            *_web([p for _, p, _ in backends], sessionAffinity="ClientIP"),
            service("echo", [{"name": "tcp", "port": 7}], cluster_ip="10.96.0.7"),
            *endpoint_slice(
                "echo", "tcp", [("127.0.0.1", echo_server.sockets[0].getsockname()[1])]
            ),
        ],
    )
    # Steered once every worker listens on it.
    await wait_for(
        lambda: set(pool.members(("TCP", "127.0.0.1", proxy.proxier.port_of(echo)))) == {0, 1},
        5,
        "both workers to serve the echo Service",
    )
    port, echo_port = _port(proxy), proxy.proxier.port_of(echo)
    victim = 0
    theirs = [c for c in CLIENTS if worker_of(c, WORKERS) == victim]
    ours = [c for c in CLIENTS if worker_of(c, WORKERS) != victim]
    # Long-lived connections on both workers.
    held = {}
    for client in (theirs[0], ours[0]):
        held[client] = await asyncio.open_connection("127.0.0.1", echo_port, local_addr=(client, 0))
        held[client][1].write(b"ping\n")
        assert await asyncio.wait_for(held[client][0].readline(), 5) == b"ping\n"
    old_pid = pool.pids()[victim]
    failures: list[tuple[float, str, str]] = []
    stop = asyncio.Event()

    async def steady_load() -> int:
        done = 0
        deadline = time.monotonic() + 20
        while not stop.is_set() and time.monotonic() < deadline:
            client = CLIENTS[done % len(CLIENTS)]
            began = time.monotonic()
            try:
                await ask_from(client, port)
            except OSError as exc:
                failures.append((began, client, repr(exc)))
            done += 1
        return done

    load = asyncio.create_task(steady_load())
    await asyncio.sleep(0.2)
    killed_at = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    await wait_for(lambda: pool.restarts, 5, "the control process to see the exit")
    dead_at = time.monotonic()  # the process has exited: its sockets are gone
    new_pid = await wait_for(
        lambda: pool.pids()[victim] not in (0, old_pid) and pool.pids()[victim], 5, "a restart"
    )
    restarted_in = time.monotonic() - killed_at
    await asyncio.sleep(0.3)
    stop.set()
    made = await load
    try:
        assert new_pid != old_pid and pool.restarts == 1
        assert restarted_in < 1.0, f"restarted after {restarted_in:.2f}s"
        assert made > 20
        # Connections the killed worker had accepted may end with it; every other one succeeded.
        unexpected = [f for f in failures if f[0] >= dead_at or f[1] not in theirs]
        assert not unexpected, [
            (round(f[0] - killed_at, 3), f[1], worker_of(f[1], WORKERS), f[2]) for f in failures
        ]
        # Only the killed worker's held connection ended; the other one still echoes.
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(held[theirs[0]][0].read(), 5) == b""
        reader, writer = held[ours[0]]
        writer.write(b"still here\n")
        assert await asyncio.wait_for(reader.readline(), 5) == b"still here\n"
    finally:
        for _, writer in held.values():
            writer.close()
        echo_server.close()


async def test_a_restarted_worker_serves_the_current_state(
    tmp_path: Path, proxy_with_workers: app.Proxy
) -> None:
    proxy = proxy_with_workers
    pool = proxy.workers
    assert pool is not None
    victim = 1
    old_pid = pool.pids()[victim]
    os.kill(old_pid, signal.SIGKILL)
    await wait_for(lambda: pool.pids()[victim] not in (0, old_pid), 5, "a restart")
    # A change after the restart reaches the new worker too: one new endpoint only.
    fresh = await start_named_backends(["z"])
    try:
        write_manifests(tmp_path / "svc.yaml", _web([fresh[0][1]]))
        port = _port(proxy)

        async def all_on_z() -> bool:
            answers = {await ask_from(c, port) for c in CLIENTS[:8]}
            return answers == {"z"}

        deadline = time.monotonic() + 5
        while not await all_on_z():
            assert time.monotonic() < deadline, "the workers never served the new endpoint"
            await asyncio.sleep(0.05)
        assert {worker_of(c, WORKERS) for c in CLIENTS[:8]} == {0, 1}
    finally:
        fresh[0][2].close()


async def test_a_dial_failure_in_one_worker_penalizes_the_endpoint_in_the_others(
    tmp_path: Path, backends: list[tuple[str, int, asyncio.Server]]
) -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, not listening: connecting is refused
    try:
        live = backends[0][1]
        manifest = tmp_path / "svc.yaml"
        write_manifests(manifest, _web([dead.getsockname()[1], live]))
        async with running_proxy(loopback_config(manifest, workers=str(WORKERS))) as proxy:
            assert proxy.workers is not None
            await wait_for(lambda: proxy.workers is not None and proxy.workers.alive == WORKERS)
            port = _port(proxy)
            first = next(c for c in CLIENTS if worker_of(c, WORKERS) == 0)
            second = next(c for c in CLIENTS if worker_of(c, WORKERS) == 1)
            # Two connections from one worker's client: round robin reaches the refusing
            # endpoint once, the dial ladder moves on to the live one, and it is penalized.
            assert [await ask_from(first, port) for _ in range(2)] == ["a", "a"]
            await proxy.collect()
            stats = dict(proxy.proxier.port_stats())[WEB]
            assert stats.dial_failures == 1
            await asyncio.sleep(0.1)  # the penalty travels through the control process
            # The other worker's round robin would reach it too, were it not told.
            assert [await ask_from(second, port) for _ in range(2)] == ["a", "a"]
            await proxy.collect()
            assert stats.dial_failures == 1, "the second worker dialed the failed endpoint too"
    finally:
        dead.close()


async def test_udp_sessions_and_affinity_hold_across_workers(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    echoes = []
    for name in ("u1", "u2", "u3"):
        transport, _ = await loop.create_datagram_endpoint(
            lambda n=name: _Echo(n), local_addr=("127.0.0.1", 0)
        )
        echoes.append(transport)
    try:
        manifest = tmp_path / "dns.yaml"
        ports = [t.get_extra_info("sockname")[1] for t in echoes]
        write_manifests(
            manifest,
            [
                service(
                    "dns",
                    [{"name": "dns", "port": 53, "protocol": "UDP"}],
                    sessionAffinity="ClientIP",
                ),
                *endpoint_slice("dns", "dns", [("127.0.0.1", p) for p in ports], protocol="UDP"),
            ],
        )
        config = loopback_config(manifest, workers=str(WORKERS), udp_idle_timeout=0.05)
        async with running_proxy(config) as proxy:
            assert proxy.workers is not None
            await wait_for(lambda: proxy.workers is not None and proxy.workers.alive == WORKERS)
            port = _port(proxy, DNS)
            seen: dict[str, set[str]] = {}
            for round_ in range(3):
                for client in CLIENTS:
                    # A new source port each round: a new session, the same pinned endpoint.
                    answer = await asyncio.to_thread(_udp_ask, client, port, f"q{round_}")
                    seen.setdefault(client, set()).add(answer)
                await asyncio.sleep(0.1)  # sessions expire between rounds
            assert all(len(names) == 1 for names in seen.values()), seen
            assert len({next(iter(n)) for n in seen.values()}) == 3
    finally:
        for transport in echoes:
            transport.close()


class _Echo(asyncio.DatagramProtocol):
    def __init__(self, name: str) -> None:
        self.name = name.encode()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.transport.sendto(self.name + b"|" + data, addr)  # type: ignore[attr-defined]


def _udp_ask(source: str, port: int, payload: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((source, 0))
        sock.settimeout(2)
        for _ in range(3):
            sock.sendto(payload.encode(), ("127.0.0.1", port))
            try:
                data, _ = sock.recvfrom(2048)
            except TimeoutError:
                continue
            name, _, echoed = data.decode().partition("|")
            assert echoed == payload
            return name
    raise AssertionError(f"no UDP answer for {source}")


async def test_a_worker_that_cannot_start_is_a_clear_error(
    tmp_path: Path, backends: list[tuple[str, int, asyncio.Server]]
) -> None:
    broken = tmp_path / "site"
    broken.mkdir()
    # Only the worker processes fail to start: each one the fork server forks exits at once
    # (sys.orig_argv names the fork server's module).
    (broken / "sitecustomize.py").write_text(
        "import os, sys\n"
        "def refuse():\n"
        "    sys.stderr.write('worker start refused by the test\\n'); os._exit(3)\n"
        "if 'kube_userspace_proxy.workers.forkserver' in sys.orig_argv:\n"
        "    os.register_at_fork(after_in_child=refuse)\n"
    )
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, _web([p for _, p, _ in backends]))
    env = {**os.environ, "PYTHONPATH": str(broken)}
    cli = Path(os.sys.executable).parent / "kube-userspace-proxy"
    process = await asyncio.create_subprocess_exec(
        str(cli),
        "run",
        "--manifests",
        str(manifest),
        *LOOPBACK_RUN_FLAGS,
        "--workers",
        "2",
        "--state-dir",
        "",
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    text = stderr.decode()
    assert process.returncode == 1, text
    assert "worker 0 could not start (exit code 3)" in text, text


@pytest.mark.timeout(60)
async def test_a_stalled_worker_loop_fails_livez_until_it_runs_again(
    proxy_with_workers: app.Proxy,
) -> None:
    proxy = proxy_with_workers
    pool, ops = proxy.workers, proxy.ops
    assert pool is not None and ops is not None and ops.healthz_port is not None
    url = f"http://127.0.0.1:{ops.healthz_port}/livez"

    async def livez() -> int:
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            return response.status

    assert await livez() == 200
    stalled = pool.pids()[0]
    os.kill(stalled, signal.SIGSTOP)  # its event loop stops answering pings
    try:
        deadline = time.monotonic() + 20
        while await livez() == 200:
            assert time.monotonic() < deadline, "/livez never noticed the stalled worker"
            await asyncio.sleep(0.5)
    finally:
        os.kill(stalled, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while await livez() != 200:
        assert time.monotonic() < deadline, "/livez never recovered"
        await asyncio.sleep(0.2)
    assert pool.pids()[0] == stalled  # the same process, running again


async def test_reports_come_in_parts_and_are_summed_whole(
    tmp_path: Path, backends: list[tuple[str, int, asyncio.Server]]
) -> None:
    """A worker reports REPORT_PART service ports per message, yielding between them (the
    whole of 10,000 in one message held the control loop 70-130 ms); nothing is lost."""
    filler = [
        obj
        for i in range(REPORT_PART + 20)
        for obj in (
            service(
                f"idle-{i}", [{"name": "http", "port": 80}], cluster_ip=f"10.97.{i >> 8}.{i & 255}"
            ),
            *endpoint_slice(f"idle-{i}", "http", [("127.0.0.1", 9)]),
        )
    ]
    manifest = tmp_path / "svc.yaml"
    write_manifests(
        manifest, [*filler, *_web([p for _, p, _ in backends], sessionAffinity="ClientIP")]
    )
    async with running_proxy(loopback_config(manifest, workers=str(WORKERS))) as proxy:
        pool = proxy.workers
        assert pool is not None
        await wait_for(lambda: pool.alive == WORKERS and _port(proxy) != 0, seconds=60)
        parts: list[tuple[int, int]] = []  # (worker, request) of each part the control took
        take_part = pool._counters.take_part

        def counting(worker: Any, part: Collected) -> None:
            parts.append((part.worker, part.seq))
            take_part(worker, part)

        pool._counters.take_part = counting  # type: ignore[method-assign]
        for client in CLIENTS:
            await ask_from(client, _port(proxy))
        assert proxy.ops is not None
        url = f"http://127.0.0.1:{proxy.ops.metrics_port}/debug/state"
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            state = await response.json()
    assert len(state) == REPORT_PART + 21
    assert state[str(WEB)]["connections"]["accepted"] == len(CLIENTS)
    assert state[str(WEB)]["affinity"]["pins"] == len(CLIENTS)
    picked = state[str(WEB)]["balancer"]["cluster"]["endpoints"]
    assert sum(endpoint["total"] for endpoint in picked) == len(CLIENTS)
    per_report = {key: parts.count(key) for key in set(parts)}
    assert len(per_report) == WORKERS  # one collect, answered by each worker
    assert all(count >= 2 for count in per_report.values())


async def _workers_serving(proxy: app.Proxy, count: int) -> workerpool.WorkerPool:
    """The proxy's worker pool, once every worker is up and `count` service ports are served."""
    pool = proxy.workers
    assert pool is not None
    await wait_for(lambda: pool.alive == WORKERS and proxy.proxier.served_count == count)
    return pool


def _many(count: int, ports: Sequence[int], moved: dict[int, int] | None = None) -> list[Any]:
    """`count` Services `s0`.. each with one endpoint (`moved`: Service -> another port)."""
    objects: list[Any] = []
    for i in range(count):
        port = (moved or {}).get(i, ports[i % len(ports)])
        objects.append(service(f"s{i}", [{"name": "http", "port": 80}], cluster_ip=f"10.96.1.{i}"))
        objects.extend(endpoint_slice(f"s{i}", "http", [("127.0.0.1", port)]))
    return objects


async def test_an_endpoint_move_publishes_only_the_changed_port_to_the_workers(
    tmp_path: Path, backends: list[tuple[str, int, asyncio.Server]]
) -> None:
    ports = [p for _, p, _ in backends]
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, _many(20, ports))
    async with running_proxy(loopback_config(manifest, workers=str(WORKERS))) as proxy:
        pool = await _workers_serving(proxy, 20)
        s5 = ServicePortName("default", "s5", "http", Protocol.TCP)
        port = proxy.proxier.port_of(s5)
        assert await ask_from(CLIENTS[0], port) == "c"  # s5: ports[5 % 3]
        deltas, sent = pool.deltas, pool.ports_sent
        write_manifests(manifest, _many(20, ports, moved={5: ports[0]}))

        async def every_worker_on_a() -> bool:
            answers = {await ask_from(c, port) for c in CLIENTS[:8]}
            return answers == {"a"}

        deadline = time.monotonic() + 5
        while not await every_worker_on_a():
            assert time.monotonic() < deadline, "the workers never served the moved endpoint"
            await asyncio.sleep(0.05)
        assert {worker_of(c, WORKERS) for c in CLIENTS[:8]} == {0, 1}
        assert pool.deltas == deltas + 1
        assert pool.ports_sent == sent + 1, "the delta carried more than the changed port"


async def test_a_restarted_worker_gets_the_full_current_table(
    tmp_path: Path, backends: list[tuple[str, int, asyncio.Server]]
) -> None:
    ports = [p for _, p, _ in backends]
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, _many(12, ports))
    async with running_proxy(loopback_config(manifest, workers=str(WORKERS))) as proxy:
        pool = await _workers_serving(proxy, 12)
        # A change the workers got as a delta, before the restart.
        names = [ServicePortName("default", f"s{i}", "http", Protocol.TCP) for i in range(12)]
        deltas = pool.deltas
        write_manifests(manifest, _many(12, ports, moved={4: ports[0]}))
        await wait_for(lambda: pool.deltas > deltas, 5, "the delta")
        victim = 1
        tables = pool.tables
        old_pid = pool.pids()[victim]
        os.kill(old_pid, signal.SIGKILL)
        await wait_for(lambda: pool.pids()[victim] not in (0, old_pid), 5, "a restart")
        await wait_for(lambda: pool.tables == tables + 1, 5, "the full table")
        # Every port, answered by the new worker: each Service on its current endpoint.
        client = next(c for c in CLIENTS if worker_of(c, WORKERS) == victim)
        names_by_port = {p: n for n, p, _ in backends}
        for i, name in enumerate(names):
            want = names_by_port[ports[0] if i == 4 else ports[i % len(ports)]]
            assert await ask_from(client, proxy.proxier.port_of(name)) == want, name


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_ports_a_worker_could_not_open_are_sent_again_until_they_serve(
    tmp_path: Path, backends: list[tuple[str, int, asyncio.Server]]
) -> None:
    import resource

    ports = [p for _, p, _ in backends]
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, _many(4, ports))
    async with running_proxy(loopback_config(manifest, workers=str(WORKERS))) as proxy:
        pool = await _workers_serving(proxy, 4)
        assert proxy.ops is not None
        victim = 1
        pid = pool.pids()[victim]
        _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        # Worker 1 runs short of descriptors: room for one more, not for eight new ports.
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_open_fds(pid) + 1, hard))
        write_manifests(manifest, _many(12, ports))
        await wait_for(lambda: proxy.proxier.served_count == 12, 5, "12 Services")
        await wait_for(lambda: pool.unserved >= 6, 5, "worker 1's EMFILE reported")
        url = f"http://127.0.0.1:{proxy.ops.metrics_port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            text = await response.text()
        assert sample_value(text, "kube_userspace_proxy_worker_unserved_ports") == pool.unserved
        assert sample_value(text, "kube_userspace_proxy_workers") == WORKERS
        # Meanwhile its clients reach the ports it could not open through the other worker
        # (where it has no descriptor to accept with, they fail: that worker is short).
        client = next(c for c in CLIENTS if worker_of(c, WORKERS) == victim)
        names = [ServicePortName("default", f"s{i}", "http", Protocol.TCP) for i in range(12)]
        names_by_port = {p: n for n, p, _ in backends}
        missing = {key[2] for key in pool.unserved_ports(victim)}
        for i, name in enumerate(names):
            if proxy.proxier.port_of(name) in missing:
                answer = await ask_from(client, proxy.proxier.port_of(name))
                assert answer == names_by_port[ports[i % len(ports)]]
        # Descriptors back: the retry (after 1 s, then 2 s, ...) opens them in worker 1 itself.
        short = _open_fds(pid)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (hard, hard))
        await wait_for(lambda: pool.unserved == 0, 15, "the ports sent again and served")
        assert pool.pids()[victim] == pid, "the worker was replaced instead"
        assert _open_fds(pid) >= short + 6
        for i, name in enumerate(names):
            assert (
                await ask_from(client, proxy.proxier.port_of(name))
                == names_by_port[ports[i % len(ports)]]
            )


async def test_a_big_delta_goes_to_the_workers_in_parts_each_port_joined_in_order(
    tmp_path: Path,
    backends: list[tuple[str, int, asyncio.Server]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(publisher, "PART", 3)  # 8 ports: parts of 3, 3 and 2
    ports = [p for _, p, _ in backends]
    objects: list[Any] = []
    for i in range(8):
        objects.append(
            service(
                f"s{i}",
                [{"name": "http", "port": 80}],
                cluster_ip=f"10.96.1.{i}",
                sessionAffinity="ClientIP",
            )
        )
        objects.extend(endpoint_slice(f"s{i}", "http", [("127.0.0.1", p) for p in ports]))
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, objects)
    async with running_proxy(loopback_config(manifest, workers=str(WORKERS))) as proxy:
        pool = await _workers_serving(proxy, 8)
        # Worker 1 got each part after worker 0 had applied it: every group in that order.
        groups = pool.groups()
        assert len(groups) == 8 and all(m == [0, 1] for m in groups.values()), groups
        assert pool.programs_sent == 8  # one route per group, attached by worker 1
        for i in (0, 4, 7):
            port = proxy.proxier.port_of(ServicePortName("default", f"s{i}", "http", Protocol.TCP))
            seen: dict[str, set[str]] = {}
            for _ in range(3):
                for client in CLIENTS[:12]:
                    seen.setdefault(client, set()).add(await ask_from(client, port))
            assert all(len(names) == 1 for names in seen.values()), seen  # steered
