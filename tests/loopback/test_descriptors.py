"""Descriptor exhaustion (EMFILE): a proxy child process with a low RLIMIT_NOFILE.

The child runs one TcpListener and one UdpListener to echo backends of this process, then
lowers its own descriptor limit to a few spare descriptors. The test exhausts them with held
client connections and checks what the proxy does: counts it, logs it at most once a second,
never penalizes the endpoint, never logs an unhandled exception, never spins, and serves
again by itself once descriptors are free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

# Every test here runs over both TCP data planes (tests/conftest.py `dataplane`).
pytestmark = pytest.mark.usefixtures("dataplane")

CHILD = textwrap.dedent(
    """
    import asyncio, json, logging, os, resource, socket, sys, time
    import uvloop
    from kube_userspace_proxy.balancer import EndpointTally
    from kube_userspace_proxy.dataplane import ConnStats, TcpListener, UdpListener

    class Fixed:
        def __init__(self, address):
            self.address = tuple(address)
            self.addresses = (self.address,)
            self.failed = 0
            self.proxy_protocol = 0
            self.source = None
            self.picked = EndpointTally()
        def pick(self, client_ip, *, retry=False):
            return self.address
        def dial_failed(self, address, outcome=1):
            self.failed += 1
        def dial_succeeded(self, address):
            pass
        def __bool__(self):
            return True

    def bound(kind):
        sock = socket.socket(socket.AF_INET, kind)
        sock.bind(("127.0.0.1", 0))
        return sock

    async def main():
        loop = asyncio.get_running_loop()
        tcp_pick, udp_pick = Fixed(sys.argv[2:4]), Fixed(sys.argv[4:6])
        tcp_pick.address = (sys.argv[2], int(sys.argv[3]))
        udp_pick.address = (sys.argv[4], int(sys.argv[5]))
        tcp_stats, udp_stats = ConnStats(), ConnStats()
        tcp = TcpListener(bound(socket.SOCK_STREAM), tcp_pick, tcp_stats, name="tcp")
        udp = UdpListener(
            bound(socket.SOCK_DGRAM), udp_pick, udp_stats, name="udp", idle_timeout=30
        )
        await tcp.start()
        await udp.start()
        spare = int(sys.argv[6])
        used = len(os.listdir("/proc/self/fd"))
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + spare, hard))
        print(json.dumps({"tcp": tcp.port, "udp": udp.port}), flush=True)
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            times = os.times()
            print(json.dumps({
                "tcp": {k: getattr(tcp_stats, k) for k in ("accepted", "active", "failed",
                        "dial_failures", "no_descriptors")},
                "udp": {k: getattr(udp_stats, k) for k in ("udp_sessions_total",
                        "udp_dropped_no_descriptors", "no_descriptors", "dial_failures")},
                "penalized": tcp_pick.failed + udp_pick.failed,
                "cpu": times.user + times.system,
            }), flush=True)

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(created).3f %(levelname)s %(message)s")
    (uvloop.run if sys.argv[1] == "uvloop" else asyncio.run)(main())
    """
)

SPARE = 24  # descriptors left to the child: room for about ten proxied connections


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


class _UdpEcho(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.transport.sendto(data, addr)


class Child:
    """The proxy child process: its ports, and its counters on request."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"child failed: {self.stderr()}")
        self.ports = json.loads(line)

    def stats(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        reply: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return reply

    def stderr(self) -> str:
        self.proc.kill()
        self.proc.wait()
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


def echo_once(port: int, timeout: float = 3.0) -> bool:
    """A connection through the proxy that echoes a line back."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"ping\n")
            return sock.recv(16) == b"ping\n"
    except OSError:
        return False


def hold(port: int) -> socket.socket | None:
    """A connection through the proxy that echoed once, kept open; None if it failed."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=3)
    except OSError:
        return None
    try:
        sock.sendall(b"ping\n")
        if sock.recv(16) == b"ping\n":
            return sock
    except OSError:
        pass
    sock.close()
    return None


def udp_once(port: int, timeout: float = 1.0) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(b"ping", ("127.0.0.1", port))
        try:
            return sock.recv(16) == b"ping"
        except OSError:
            return False


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
async def test_descriptor_exhaustion_is_counted_contained_and_recovered(loop_kind: str) -> None:
    loop = asyncio.get_running_loop()
    tcp_backend = await loop.create_server(_Echo, "127.0.0.1", 0)
    udp_backend, _ = await loop.create_datagram_endpoint(_UdpEcho, local_addr=("127.0.0.1", 0))
    tcp_port = tcp_backend.sockets[0].getsockname()[1]
    udp_port = udp_backend.get_extra_info("sockname")[1]
    child_args = ["127.0.0.1", str(tcp_port), "127.0.0.1", str(udp_port), str(SPARE)]
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, loop_kind, *child_args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    held: list[socket.socket] = []
    try:
        child = await asyncio.to_thread(Child, proc)
        port, uport = child.ports["tcp"], child.ports["udp"]
        assert await asyncio.to_thread(echo_once, port)
        assert await asyncio.to_thread(udp_once, uport)
        # Exhaust: hold proxied connections (two descriptors each) until one fails.
        started = time.monotonic()
        for _ in range(SPARE):
            sock = await asyncio.to_thread(hold, port)
            if sock is None:
                break
            held.append(sock)
        else:
            raise AssertionError(f"{SPARE} connections held: no exhaustion")
        stats = await asyncio.to_thread(child.stats)
        assert stats["tcp"]["no_descriptors"] >= 1, stats
        # New UDP clients need session sockets (kept 30 s here): one spare descriptor at most.
        for _ in range(3):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
                client.sendto(b"ping", ("127.0.0.1", uport))
        await asyncio.sleep(0.5)
        # Now not one descriptor is left: connections wait in the backlog, accept fails.
        for _ in range(5):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            held.append(sock)
        stats = await asyncio.to_thread(child.stats)
        cpu_before, exhausted = stats["cpu"], stats["tcp"]["no_descriptors"]
        await asyncio.sleep(2.0)
        stats = await asyncio.to_thread(child.stats)
        assert stats["cpu"] - cpu_before < 0.8, f"the proxy spins while exhausted: {stats}"
        assert stats["tcp"]["no_descriptors"] > exhausted, stats
        assert stats["udp"]["udp_dropped_no_descriptors"] >= 1, stats
        assert stats["udp"]["no_descriptors"] >= 1, stats
        # Out of descriptors is this process's fault, never the endpoint's.
        assert stats["tcp"]["dial_failures"] == 0
        assert stats["udp"]["dial_failures"] == 0
        assert stats["penalized"] == 0
        # Free the descriptors: the proxy serves again by itself.
        for sock in held:
            sock.close()
        held.clear()
        deadline = time.monotonic() + 15
        while not await asyncio.to_thread(echo_once, port, 1.0):
            assert time.monotonic() < deadline, "the proxy did not recover"
        assert await asyncio.to_thread(udp_once, uport)
        elapsed = time.monotonic() - started
        err = await asyncio.to_thread(child.stderr)
    finally:
        for sock in held:
            sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        tcp_backend.close()
        udp_backend.close()
    for marker in ("Traceback", "Unhandled exception", "Exception in callback", "Fatal error"):
        assert marker not in err, err[-3000:]
    warnings = [line for line in err.splitlines() if "out of file descriptors" in line]
    assert warnings, err[-3000:]
    # At most one line a second (plus the first).
    assert len(warnings) <= elapsed + 1, warnings
