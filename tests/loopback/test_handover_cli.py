"""A handover that fails half-way leaves the running proxy serving (the real CLI, 2 workers).

A successor that takes the sockets and then goes away before saying it serves (here: the
test itself, through `handover.take`) must cost nothing: the running proxy keeps every port,
syncs again, and a later successor still takes over cleanly.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kube_userspace_proxy.restart import handover
from tests.loopback.proxyrun import (
    LOOPBACK_RUN_FLAGS,
    ask,
    endpoint_slice,
    served_ports,
    service,
    start_named_backends,
    wait_for,
    write_manifests,
)

CLI = [sys.executable, "-m", "kube_userspace_proxy"]


async def _answers(port: int) -> str:
    try:
        return await ask(port)
    except OSError as exc:
        return f"error: {exc!r}"


async def test_a_successor_that_goes_away_half_way_leaves_the_proxy_serving(
    tmp_path: Path,
) -> None:
    backends = await start_named_backends(["pod-a"])
    manifest, state = tmp_path / "svc.yaml", tmp_path / "state"
    web = [
        service("web", [{"name": "http", "port": 80}]),
        *endpoint_slice("web", "http", [("127.0.0.1", backends[0][1])]),
    ]
    write_manifests(manifest, web)
    flags = [*LOOPBACK_RUN_FLAGS, "--manifests", str(manifest), "--state-dir", str(state)]
    flags += ["--workers", "2", "--loopback-endpoints", "allow", "--shutdown-grace", "2s"]
    logs = [tmp_path / "old.log", tmp_path / "new.log"]
    procs = []
    try:
        with open(logs[0], "wb") as out:
            procs.append(subprocess.Popen([*CLI, "run", *flags], stdout=out, stderr=out))
        await wait_for(lambda: handover.socket_path(str(state)).exists(), 30, "handover.sock")
        ports = await wait_for(lambda: served_ports(state), 10, "the state file")
        port = ports["default/web:http"]
        assert await _answers(port) == "pod-a"

        # Take everything, then vanish before "serving".
        taken = await handover.take(str(state), 2, wait_exit=10)
        assert taken is not None and taken.sockets
        taken.close()
        await wait_for(lambda: "serving on" in logs[0].read_text(), 10, "the old one serving on")
        assert await _answers(port) == "pod-a"
        # It syncs again: a new Service is served.
        api_service = service("api", [{"name": "http", "port": 81}], cluster_ip="10.96.0.11")
        api_slices = endpoint_slice("api", "http", [("127.0.0.1", backends[0][1])])
        write_manifests(manifest, [*web, api_service, *api_slices])
        api = await wait_for(lambda: served_ports(state).get("default/api:http"), 10, "api served")
        await wait_for(lambda: "default/api:http ->" in logs[0].read_text(), 10, "api synced")
        assert await _answers(api) == "pod-a"

        # A real successor still takes over.
        with open(logs[1], "wb") as out:
            procs.append(subprocess.Popen([*CLI, "run", *flags], stdout=out, stderr=out))
        assert procs[0].wait(30) == 0, logs[0].read_text()
        assert "taking over from the running proxy" in logs[1].read_text()
        assert await _answers(port) == "pod-a"
        assert await _answers(api) == "pod-a"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for _, _, server in backends:
            server.close()


async def test_after_a_handover_the_old_process_leaves_the_socket_name_to_the_successor(
    tmp_path: Path,
) -> None:
    """The old process never removes handover.sock once it has handed over: the successor
    binds that name when it is ready, and a check-then-unlink on the way out could remove the
    successor's socket in between (CI saw it: "cannot listen on .../handover.sock"). A name
    nobody listens on is harmless: the next start finds no running proxy and starts afresh."""
    backends = await start_named_backends(["pod-a"])
    manifest, state = tmp_path / "svc.yaml", tmp_path / "state"
    web = [
        service("web", [{"name": "http", "port": 80}]),
        *endpoint_slice("web", "http", [("127.0.0.1", backends[0][1])]),
    ]
    write_manifests(manifest, web)
    flags = [*LOOPBACK_RUN_FLAGS, "--manifests", str(manifest), "--state-dir", str(state)]
    flags += ["--workers", "2", "--loopback-endpoints", "allow", "--shutdown-grace", "2s"]
    logs = [tmp_path / "old.log", tmp_path / "next.log"]
    sock_path = handover.socket_path(str(state))
    procs = []
    try:
        with open(logs[0], "wb") as out:
            procs.append(subprocess.Popen([*CLI, "run", *flags], stdout=out, stderr=out))
        await wait_for(sock_path.exists, 30, "handover.sock")
        await wait_for(lambda: served_ports(state), 10, "the state file")

        # This test is the successor: it takes everything and says it serves, but it does not
        # bind the name yet (a successor that is slow to get there).
        taken = await handover.take(str(state), 2, wait_exit=10)
        assert taken is not None and taken.sockets
        try:

            async def no_paths() -> dict[int, str]:
                return {}

            await taken.workers(no_paths)
            await taken.serving()
            assert procs[0].wait(30) == 0, logs[0].read_text()
            assert "serves every port now: handing over" in logs[0].read_text()
            assert sock_path.exists(), "the old process removed the successor's socket name"
        finally:
            taken.close()

        # The name left behind points at no process: the next proxy starts afresh and serves.
        with open(logs[1], "wb") as out:
            procs.append(subprocess.Popen([*CLI, "run", *flags], stdout=out, stderr=out))
        await wait_for(
            lambda: "a new proxy process can take over" in logs[1].read_text(), 30, "next serving"
        )
        assert "no running proxy to take over from" in logs[1].read_text()
        port = (await wait_for(lambda: served_ports(state), 10, "the state file"))[
            "default/web:http"
        ]
        assert await _answers(port) == "pod-a"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for _, _, server in backends:
            server.close()
