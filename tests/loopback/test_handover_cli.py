"""A handover that fails half-way leaves the running proxy serving (the real CLI, 2 workers).

A successor that takes the sockets and then goes away before saying it serves (here: the
test itself, through `handover.take`) must cost nothing: the running proxy keeps every port,
syncs again, and a later successor still takes over cleanly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

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


@dataclasses.dataclass
class _Runs:
    """The proxy processes of one test: the CLI with two workers over one Service, `web`."""

    tmp: Path
    flags: list[str]
    manifest: Path
    state: Path
    web: list[dict[str, Any]]
    backend_port: int
    procs: list[subprocess.Popen[bytes]] = dataclasses.field(default_factory=list)

    def start(self, name: str) -> Path:
        """Start one more proxy process, its output in `<name>.log`; that log's path."""
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as out:
            self.procs.append(subprocess.Popen([*CLI, "run", *self.flags], stdout=out, stderr=out))
        return log


@contextlib.asynccontextmanager
async def _runs(tmp_path: Path) -> AsyncIterator[_Runs]:
    backends = await start_named_backends(["pod-a"])
    manifest, state = tmp_path / "svc.yaml", tmp_path / "state"
    web = [
        service("web", [{"name": "http", "port": 80}]),
        *endpoint_slice("web", "http", [("127.0.0.1", backends[0][1])]),
    ]
    write_manifests(manifest, web)
    flags = [*LOOPBACK_RUN_FLAGS, "--manifests", str(manifest), "--state-dir", str(state)]
    flags += ["--workers", "2", "--loopback-endpoints", "allow", "--shutdown-grace", "2s"]
    runs = _Runs(tmp_path, flags, manifest, state, web, backends[0][1])
    try:
        yield runs
    finally:
        for proc in runs.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for _, _, server in backends:
            server.close()


async def test_a_successor_that_goes_away_half_way_leaves_the_proxy_serving(
    tmp_path: Path,
) -> None:
    async with _runs(tmp_path) as runs:
        state = runs.state
        old = runs.start("old")
        await wait_for(lambda: handover.socket_path(str(state)).exists(), 30, "handover.sock")
        ports = await wait_for(lambda: served_ports(state), 10, "the state file")
        port = ports["default/web:http"]
        assert await _answers(port) == "pod-a"

        # Take everything, then vanish before "serving".
        taken = await handover.take(str(state), 2, wait_exit=10)
        assert taken is not None and taken.sockets
        taken.close()
        await wait_for(lambda: "serving on" in old.read_text(), 10, "the old one serving on")
        assert await _answers(port) == "pod-a"
        # It syncs again: a new Service is served.
        api_service = service("api", [{"name": "http", "port": 81}], cluster_ip="10.96.0.11")
        api_slices = endpoint_slice("api", "http", [("127.0.0.1", runs.backend_port)])
        write_manifests(runs.manifest, [*runs.web, api_service, *api_slices])
        api = await wait_for(lambda: served_ports(state).get("default/api:http"), 10, "api served")
        await wait_for(lambda: "default/api:http ->" in old.read_text(), 10, "api synced")
        assert await _answers(api) == "pod-a"

        # A real successor still takes over.
        new = runs.start("new")
        assert runs.procs[0].wait(30) == 0, old.read_text()
        assert "taking over from the running proxy" in new.read_text()
        assert await _answers(port) == "pod-a"
        assert await _answers(api) == "pod-a"


async def test_after_a_handover_the_old_process_leaves_the_socket_name_to_the_successor(
    tmp_path: Path,
) -> None:
    """The old process never removes handover.sock once it has handed over: the successor
    binds that name when it is ready, and a check-then-unlink on the way out could remove the
    successor's socket in between (CI saw it: "cannot listen on .../handover.sock"). A name
    nobody listens on is harmless: the next start finds no running proxy and starts afresh."""
    async with _runs(tmp_path) as runs:
        state = runs.state
        sock_path = handover.socket_path(str(state))
        old = runs.start("old")
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
            assert runs.procs[0].wait(30) == 0, old.read_text()
            assert "serves every port now: handing over" in old.read_text()
            assert sock_path.exists(), "the old process removed the successor's socket name"
        finally:
            taken.close()

        # The name left behind points at no process: the next proxy starts afresh and serves.
        nxt = runs.start("next")
        await wait_for(
            lambda: "a new proxy process can take over" in nxt.read_text(), 30, "next serving"
        )
        assert "no running proxy to take over from" in nxt.read_text()
        ports = await wait_for(lambda: served_ports(state), 10, "the state file")
        assert await _answers(ports["default/web:http"]) == "pod-a"


async def test_a_proxy_that_cannot_listen_for_successors_keeps_trying(tmp_path: Path) -> None:
    """Something in the way of handover.sock (here a directory by that name) costs a warning,
    not the restarts of this process's life: it listens once it can, and a successor takes
    over then."""
    async with _runs(tmp_path) as runs:
        sock_path = handover.socket_path(str(runs.state))
        sock_path.mkdir(parents=True, mode=0o700)
        runs.state.chmod(0o700)
        old = runs.start("old")
        await wait_for(lambda: "cannot listen on" in old.read_text(), 30, "the warning")
        ports = await wait_for(lambda: served_ports(runs.state), 10, "the state file")
        assert await _answers(ports["default/web:http"]) == "pod-a"
        assert "a new proxy process can take over" not in old.read_text()

        sock_path.rmdir()
        await wait_for(
            lambda: "a new proxy process can take over" in old.read_text(), 60, "listening"
        )
        assert old.read_text().count("cannot listen on") == 1  # said once for one reason
        new = runs.start("new")
        assert runs.procs[0].wait(30) == 0, old.read_text()
        assert "taking over from the running proxy" in new.read_text()
        assert await _answers(ports["default/web:http"]) == "pod-a"
