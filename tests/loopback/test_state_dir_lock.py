"""One process owns a state directory (the real CLI): three proxies started at once with one
--state-dir end with one serving, the others exit 1 naming the directory and the owner's PID;
a fourth started later takes over through the handover (a DaemonSet's surge), refusing
nothing, and the lock moves to it."""

from __future__ import annotations

import asyncio
import fcntl
import os
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kube_userspace_proxy import fdpass
from kube_userspace_proxy.app import lifecycle
from kube_userspace_proxy.config.settings import ProxyConfig
from kube_userspace_proxy.errors import ProxyError
from kube_userspace_proxy.restart import handover, statelock
from tests.loopback.proxyrun import (
    LOOPBACK_RUN_FLAGS,
    ask,
    endpoint_slice,
    loopback_config,
    running_proxy,
    served_ports,
    service,
    start_named_backends,
    wait_for,
    write_manifests,
)

WEB = "default/web:http"
CLI = [sys.executable, "-m", "kube_userspace_proxy"]


def _locked_by_someone(state: Path) -> bool:
    """True while some process holds the state directory's lock (tried from here)."""
    try:
        fd = os.open(statelock.lock_path(str(state)), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


async def test_three_started_at_once_end_with_one_serving_and_a_fourth_takes_over(
    tmp_path: Path,
) -> None:
    backends = await start_named_backends(["pod-a"])
    manifest, state = tmp_path / "svc.yaml", tmp_path / "state"
    write_manifests(
        manifest,
        [
            service("web", [{"name": "http", "port": 80}]),
            *endpoint_slice("web", "http", [("127.0.0.1", backends[0][1])]),
        ],
    )
    flags = [*LOOPBACK_RUN_FLAGS, "--manifests", str(manifest), "--state-dir", str(state)]
    flags += ["--workers", "1", "--loopback-endpoints", "allow", "--shutdown-grace", "1s"]
    logs = [tmp_path / f"proxy-{i}.log" for i in range(4)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for log in logs[:3]:
            with open(log, "wb") as out:
                procs.append(subprocess.Popen([*CLI, "run", *flags], stdout=out, stderr=out))

        def settled() -> bool:
            alive = [p for p in procs if p.poll() is None]
            return len(alive) == 1 and statelock.holder(str(state)) == alive[0].pid

        try:
            await wait_for(settled, 60, "one of the three left, owning the directory")
        except AssertionError as exc:
            logs_now = [log.read_text()[-1500:] for log in logs[:3]]
            states = [(p.pid, p.poll(), text) for p, text in zip(procs, logs_now, strict=True)]
            holder = statelock.holder(str(state))
            raise AssertionError(f"{exc}; holder {holder}: {states}") from None
        (owner,) = [p for p in procs if p.poll() is None]
        assert _locked_by_someone(state)
        for proc, log in zip(procs, logs, strict=False):
            if proc is owner:
                continue
            text = log.read_text()
            if proc.returncode == 0:  # started late enough to take over, then handed over
                assert "handed over" in text, text
            else:
                assert proc.returncode == 1, text
                assert f"--state-dir {state} is in use by another proxy process (pid" in text
                assert "Traceback" not in text, text
        port = await wait_for(lambda: served_ports(state).get(WEB), 30, "the state file")
        assert await ask(port) == "pod-a"

        # The surge: a fourth takes over; the owner hands over and exits; the lock moves.
        stop = asyncio.Event()
        answers: list[str] = []

        async def keep_asking() -> None:
            while not stop.is_set():
                answers.append(await _answer(port))
                await asyncio.sleep(0.02)

        asker = asyncio.create_task(keep_asking())
        with open(logs[3], "wb") as out:
            fourth = subprocess.Popen([*CLI, "run", *flags], stdout=out, stderr=out)
        procs.append(fourth)
        await wait_for(lambda: owner.poll() is not None, 60, "the old owner to exit")
        await wait_for(
            lambda: statelock.holder(str(state)) == fourth.pid, 30, "the lock to move to the new"
        )
        await asyncio.sleep(0.3)
        stop.set()
        await asker
        assert owner.returncode == 0, logs[procs.index(owner)].read_text()
        assert fourth.poll() is None and _locked_by_someone(state)
        assert answers and set(answers) == {"pod-a"}, answers  # nothing refused
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for _, _, server in backends:
            server.close()


async def _answer(port: int) -> str:
    try:
        return await ask(port)
    except OSError as exc:
        return f"error: {exc!r}"


async def test_a_proxy_that_stops_lets_the_directory_go(tmp_path: Path) -> None:
    # In one process (as an embedding or a test suite runs it): the second serve must not find
    # the first one's lock, which only a process exit would otherwise release.
    manifest, state = tmp_path / "svc.yaml", tmp_path / "state"
    write_manifests(manifest, [service("web", [{"name": "http", "port": 80}])])
    for _ in range(2):
        async with running_proxy(loopback_config(manifest, state_dir=str(state))):
            assert _locked_by_someone(state)
        assert not _locked_by_someone(state)


async def test_a_holder_that_resets_the_handover_is_named_with_the_directory(
    tmp_path: Path,
) -> None:
    # Three started at once: the one serving hands over to the second and resets the third's
    # handover connection; the third's one error names the directory, the holder and why.
    state = str(tmp_path / "state")
    held = statelock.try_acquire(state)
    assert held is not None
    server = fdpass.listen(handover.socket_path(state))
    reset_one = asyncio.create_task(_accept_and_reset(server))
    try:
        with pytest.raises(ProxyError) as error:
            await lifecycle._own_state_dir(ProxyConfig(state_dir=state, workers="1"))
        text = str(error.value)
        assert f"--state-dir {state} is in use by another proxy process (pid {os.getpid()})" in text
        assert "which did not hand over (the handover from the running proxy" in text
        assert "Error" in text  # the reset, as the handover saw it
        await asyncio.wait_for(reset_one, 30)
    finally:
        reset_one.cancel()
        server.close()
        held.release()


async def _accept_and_reset(server: socket.socket) -> None:
    conn = await fdpass.accept(server)
    # Its hello arrives, unread: closing now resets the connection.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not select.select([conn], [], [], 0)[0] and loop.time() < deadline:
        await asyncio.sleep(0.01)
    conn.close()
