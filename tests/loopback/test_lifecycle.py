"""The installed command as a process: the demo, and SIGTERM with a transfer in flight."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import pytest

from tests.loopback.proxyrun import LOOPBACK_RUN_FLAGS, endpoint_slice, service, write_manifests

CLI = [sys.executable, "-m", "kube_userspace_proxy"]


@pytest.fixture(scope="module")
def demo_run() -> subprocess.CompletedProcess[str]:
    """One run of `demo` (its pods hold fixed ports: one demo at a time)."""
    return subprocess.run(
        [*CLI, "demo", "--requests", "30"], check=False, capture_output=True, text=True, timeout=60
    )


def test_the_demo_prints_the_spread_and_exits_0(
    demo_run: subprocess.CompletedProcess[str],
) -> None:
    result = demo_run
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # Round robin: each of the three pods got 10 of 30 requests.
    rr = out.split("demo/myapp:http")[1].split("demo/myapp-sticky")[0]
    for pod in ("pod-a", "pod-b", "pod-c"):
        assert f"{pod} (127.0.0.1" in rr
        assert " 10 " in rr.split(pod)[1].splitlines()[0]
    # Affinity: all 30 to a single pod.
    sticky = out.split("demo/myapp-sticky:http")[1].split("demo/echo-udp")[0]
    assert sum(" 30 " in line for line in sticky.splitlines()) == 1
    # UDP spread and the rules that would capture the ClusterIPs and NodePort.
    assert "demo/echo-udp:echo" in out
    assert "KUBE-PORTALS-CONTAINER" in out and "--dport 30080" in out


def test_the_demo_installs_no_rules_and_does_not_say_it_left_some(
    demo_run: subprocess.CompletedProcess[str],
) -> None:
    assert demo_run.returncode == 0, demo_run.stderr
    assert "stopped (this process installed no iptables rules)" in demo_run.stderr
    assert "rules left in place" not in demo_run.stderr


def test_the_serve_hint_for_udp_works_with_python_alone() -> None:
    proc = subprocess.Popen(
        [*CLI, "demo", "--serve", "--requests", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        hint = ""
        deadline = time.monotonic() + 30
        while not hint and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "the demo ended before printing its hints"
            if "demo/echo-udp:echo" in line and "python3 -c" in line:
                hint = line.split("#")[0].strip()
        assert hint, "no UDP hint printed"
        assert "nc " not in hint
        argv = shlex.split(hint)
        assert argv[0] == "python3"
        reply = subprocess.run(
            [sys.executable, *argv[1:]], check=True, capture_output=True, text=True, timeout=30
        )
        assert reply.stdout.strip() in {"pod-a: hi", "pod-b: hi", "pod-c: hi"}
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "rules left in place" not in err


async def wait_refused(port: int, seconds: float = 30.0) -> None:
    """Poll until a new connection to `port` is refused."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            _, probe = await asyncio.open_connection("127.0.0.1", port)
        except ConnectionRefusedError:
            return
        probe.close()
        assert time.monotonic() < deadline, f"port {port} still accepts new connections"
        await asyncio.sleep(0.05)


class _SlowSink(asyncio.Protocol):
    """A backend that reads slowly and hashes what it got, then answers with the digest."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.digest.update(data)

    def eof_received(self) -> bool:
        self.transport.write(self.digest.hexdigest().encode())
        self.transport.close()
        return True


async def test_sigterm_lets_a_transfer_in_flight_finish_and_exits_0(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    backend = await loop.create_server(_SlowSink, "127.0.0.1", 0)
    backend_port = backend.sockets[0].getsockname()[1]
    manifest = tmp_path / "svc.yaml"
    write_manifests(
        manifest,
        [
            service("bulk", [{"name": "data", "port": 9000}]),
            *endpoint_slice("bulk", "data", [("127.0.0.1", backend_port)]),
        ],
    )
    proc = subprocess.Popen(
        [
            *CLI,
            "run",
            "--manifests",
            str(manifest),
            *LOOPBACK_RUN_FLAGS,
            "--shutdown-grace",
            "10s",
            "--state-dir",
            "",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        port = 0
        deadline = time.monotonic() + 15
        while not port and time.monotonic() < deadline:
            line = await asyncio.to_thread(proc.stderr.readline)
            if "default/bulk:data ->" in line:
                port = int(line.split("->")[1].split(":")[1].split()[0])
        assert port, "the proxy never announced its port"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = os.urandom(1 << 20)
        writer.write(payload[: 1 << 19])
        await writer.drain()
        proc.send_signal(signal.SIGTERM)
        # While the grace period runs, the proxy is alive but takes no new connection...
        await wait_refused(port)
        assert proc.poll() is None
        # ...and the transfer in flight goes on to the end.
        writer.write(payload[1 << 19 :])
        await writer.drain()
        writer.write_eof()
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.decode() == hashlib.sha256(payload).hexdigest()
        writer.close()
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
        backend.close()
