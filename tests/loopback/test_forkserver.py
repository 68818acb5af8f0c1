"""The fork server the workers are forked from: what it loads, what its workers are, and that
a worker's slot is served again after the worker, or the fork server itself, dies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kube_userspace_proxy import app
from kube_userspace_proxy.dataplane.steering import worker_of
from kube_userspace_proxy.model import Protocol, ServicePortName
from kube_userspace_proxy.workers import pool as workerpool
from kube_userspace_proxy.workers import supervisor
from tests.loopback.proxyrun import (
    endpoint_slice,
    loopback_config,
    printed_by,
    running_proxy,
    service,
    start_named_backends,
    wait_for,
    write_manifests,
)

WORKERS = 2
CLIENTS = [f"127.0.{i}.{j}" for i in (1, 2) for j in range(2, 10)]
WEB = ServicePortName("default", "web", "http", Protocol.TCP)
FORBIDDEN = {"aiohttp", "kubernetes_asyncio", "pydantic", "iptc", "yaml", "prometheus_client"}
FORBIDDEN |= {"pyroute2"}
CONTROL = ("app", "cluster", "config", "ops", "proxier", "restart", "portals")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rpartition(")")[2].split()[1])


def _command_line(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return cmdline.read().replace(b"\0", b" ").decode().strip()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(c) for c in children.read().split()]


async def _ask_from(source: str, port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(b"hello\n")
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data.decode()


async def _every_client_served(proxy: app.Proxy) -> None:
    """Clients of every worker get an answer from a backend."""
    port = proxy.proxier.port_of(WEB)
    assert {worker_of(c, WORKERS) for c in CLIENTS} == set(range(WORKERS))
    answers = {await _ask_from(client, port) for client in CLIENTS}
    assert answers <= {"a", "b"} and answers, answers


def _pool(proxy: app.Proxy) -> workerpool.WorkerPool:
    assert proxy.workers is not None
    return proxy.workers


async def _slot_served_again(pool: workerpool.WorkerPool, victim: int, old: int) -> int:
    """The new pid of slot `victim`, once it has joined its port's group (applied the table)."""
    new: int = await wait_for(
        lambda: pool.pids()[victim] not in (0, old) and pool.pids()[victim], 30, "a new worker"
    )
    key = next(iter(pool.groups()))
    await wait_for(lambda: victim in pool.members(key), 30, "the new worker's sockets")
    return new


@pytest.fixture(params=[True, False], ids=["spare", "on-demand"])
async def proxy(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[app.Proxy]:
    monkeypatch.setattr(supervisor, "KEEP_SPARE", request.param)
    backends = await start_named_backends(["a", "b"])
    try:
        manifest = tmp_path / "svc.yaml"
        write_manifests(
            manifest,
            [
                service("web", [{"name": "http", "port": 80}]),
                *endpoint_slice("web", "http", [("127.0.0.1", p) for _, p, _ in backends]),
            ],
        )
        async with running_proxy(loopback_config(manifest, workers=str(WORKERS))) as proxy:
            pool = _pool(proxy)
            await wait_for(lambda: pool.alive == WORKERS and len(pool.groups()) == 1)
            if request.param:
                await wait_for(pool.spare_pid, 30, "the spare")
            yield proxy
    finally:
        for _, _, server in backends:
            server.close()


def test_the_fork_server_loads_the_data_plane_and_none_of_the_control_plane() -> None:
    script = (
        "import json, sys\n"
        "import kube_userspace_proxy.workers.forkserver\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = set(printed_by(script))
    assert "kube_userspace_proxy.workers.process" in loaded
    assert "kube_userspace_proxy.dataplane" in loaded
    assert not {m for m in loaded if m.split(".")[0] in FORBIDDEN}
    ours = [m.split(".") for m in loaded if m.startswith("kube_userspace_proxy.")]
    assert not [m for m in ours if m[1] in CONTROL], ours


async def test_every_worker_is_forked_by_the_fork_server_and_serves(proxy: app.Proxy) -> None:
    pool = _pool(proxy)
    server = pool.fork_server_pid
    assert server and _parent(server) == os.getpid()
    assert "kube_userspace_proxy.workers.forkserver" in _command_line(server)
    forked = [*pool.pids(), *([pool.spare_pid()] if supervisor.KEEP_SPARE else [])]
    assert sorted(_children(server)) == sorted(forked)
    for index, pid in enumerate(pool.pids()):
        assert _command_line(pid) == f"kube-userspace-proxy worker {index} (forked)"
    await _every_client_served(proxy)


async def test_a_dead_workers_slot_is_served_again(proxy: app.Proxy) -> None:
    pool = _pool(proxy)
    spare = pool.spare_pid()
    victim = 0
    old = pool.pids()[victim]
    os.kill(old, signal.SIGKILL)
    new = await _slot_served_again(pool, victim, old)
    if supervisor.KEEP_SPARE:
        assert new == spare  # the spare took the slot; another spare is forked after
        await wait_for(lambda: pool.spare_pid() not in (0, spare), 30, "a new spare")
    assert _parent(new) == pool.fork_server_pid
    assert pool.restarts == 1
    await _every_client_served(proxy)


async def test_a_dead_fork_server_is_restarted_and_workers_are_still_replaced(
    proxy: app.Proxy,
) -> None:
    pool = _pool(proxy)
    first = pool.fork_server_pid
    workers = pool.pids()
    spare = pool.spare_pid()
    os.kill(first, signal.SIGKILL)
    second = await wait_for(
        lambda: pool.fork_server_pid not in (0, first) and pool.fork_server_pid, 30, "another"
    )
    # Its workers serve on: their channels go to this process, not through the fork server.
    assert pool.pids() == workers and pool.restarts == 0
    await _every_client_served(proxy)
    victim = 1
    os.kill(workers[victim], signal.SIGKILL)  # forked by the first fork server
    new = await _slot_served_again(pool, victim, workers[victim])
    if supervisor.KEEP_SPARE:
        assert new == spare  # forked by the first fork server, it took the slot
        await wait_for(lambda: pool.spare_pid() not in (0, spare), 30, "a new spare")
        assert _parent(pool.spare_pid()) == second
    else:
        assert _parent(new) == second
    await wait_for(lambda: pool.alive == WORKERS, 30, "both workers")
    await _every_client_served(proxy)


async def test_each_worker_waits_in_one_epoll_set_the_native_cores(proxy: app.Proxy) -> None:
    """--event-loop auto: a worker serving the native data plane runs asyncio waiting in the
    core (dataplane/coreloop.py), so it holds one epoll instance, the core's; nested in uvloop
    (--event-loop uvloop) it would hold two."""
    assert proxy.dataplane == "native", "the extension is built wherever the suite runs"
    await _every_client_served(proxy)
    for pid in _pool(proxy).pids():
        assert _epoll_instances(pid) == 1, pid


def _epoll_instances(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            count += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[eventpoll]"
    return count
