"""A client cannot forge the PROXY header: the race of issue 22 (item 1), made deterministic.

The backend's accept queue is kept full (listen backlog 0, one parked connection), so the
kernel drops the proxy's SYNs and the dial hangs. Meanwhile the client sends its own
`PROXY TCP4 6.6.6.6 ...` line and more than the proxy queues while dialing (so the proxy
stops reading and never notices what comes next), then resets. Then the queue is freed: the
dial completes to a client that is gone. The backend must see the real header first (built
from the address accept() returned) or nothing at all; never the client's line.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest

from kube_userspace_proxy.model import Protocol, ServicePortName
from tests.loopback.proxyrun import (
    endpoint_slice,
    loopback_config,
    running_proxy,
    service,
    wait_for,
    write_manifests,
)

# Every test here runs over both TCP data planes (tests/conftest.py `dataplane`).
pytestmark = pytest.mark.usefixtures("dataplane")

FORGED = b"PROXY TCP4 6.6.6.6 127.0.0.1 1234 80\r\n"
CLIENT = "127.0.0.2"
# More than the proxy queues while dialing (high_water, 256 KiB) and then some left unread.
PAYLOAD = FORGED + b"x" * (1024 * 1024)
HIGH_WATER = 256 * 1024
# What each data plane reads from a client while it dials: the Python one up to its high
# water mark, the native one nothing (the client's socket is read once the dial connected).
QUEUED_WHILE_DIALING = {"python": HIGH_WATER, "native": 0}


def _rx_queue(local_port: int, remote: tuple[str, int]) -> int | None:
    """Bytes the proxy has not read yet on its socket from `remote` (from /proc/net/tcp)."""
    packed = struct.unpack("<I", socket.inet_aton(remote[0]))[0]
    remote_hex = f"{packed:08X}:{remote[1]:04X}"
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if fields[1].endswith(f":{local_port:04X}") and fields[2] == remote_hex:
                return int(fields[4].split(":")[1], 16)
    return None


ATTEMPTS = 3
"""Races lost to a slow machine (the dial ladder, 0.25 + 0.5 + 1 + 2 s, ran out before the
set-up was done: nothing reached the backend) are run again, this many times in all."""


@pytest.fixture
def backend() -> Iterator[socket.socket]:
    """A listener with an accept queue of one (listen backlog 0)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    listener.setblocking(False)
    yield listener
    listener.close()


async def first_line_seen(
    listener: socket.socket, proxy_port: int, queued: int
) -> tuple[bytes, int] | None:
    """Run the race once: (the first line the backend got, the client's port); None when the
    proxy gave up on the dial before the set-up was done. `queued`: what the data plane reads
    while it dials before it stops reading (the native one reads nothing until connected)."""
    loop = asyncio.get_running_loop()
    backend_port = listener.getsockname()[1]
    parked = socket.create_connection(("127.0.0.1", backend_port))  # the queue is full now
    client = socket.socket()
    try:
        client.bind((CLIENT, 0))
        client.setblocking(False)
        await loop.sock_connect(client, ("127.0.0.1", proxy_port))
        client_port = client.getsockname()[1]
        await loop.sock_sendall(client, PAYLOAD)

        # The proxy has queued what it queues while dialing (so it stopped reading) and left
        # some unread: from now on it does not look at this socket until the dial completes.
        def proxy_stopped_reading() -> bool:
            unread = _rx_queue(proxy_port, (CLIENT, client_port))
            if unread is None:
                return False
            unsent = struct.unpack("i", fcntl.ioctl(client, termios.TIOCOUTQ, b"\0" * 4))[0]
            left = unread + unsent
            return left > 0 and len(PAYLOAD) - left >= queued

        await wait_for(proxy_stopped_reading, 30, "the proxy to stop reading, bytes left unread")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        client.close()  # RST
        parked.close()
    # Free the backend's queue: the dial's next SYN gets through, if the dial still runs.
    first, _ = await asyncio.wait_for(loop.sock_accept(listener), 30)
    first.close()  # the parked connection
    try:
        dialed, _ = await asyncio.wait_for(loop.sock_accept(listener), 10)
    except TimeoutError:
        return None
    with dialed:
        dialed.setblocking(False)
        seen = b""
        while b"\r\n" not in seen and len(seen) < 256:
            chunk = await asyncio.wait_for(loop.sock_recv(dialed, 256), 30)
            if not chunk:
                break
            seen += chunk
    return seen.split(b"\r\n", 1)[0] + b"\r\n", client_port


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_a_client_written_proxy_line_never_reaches_the_backend_first(
    tmp_path: Path, backend: socket.socket, workers: str, dataplane: str
) -> None:
    manifest = tmp_path / "svc.yaml"
    svc = service("pp", [{"name": "p", "port": 80, "protocol": "TCP"}])
    svc["metadata"]["annotations"] = {"kube-userspace-proxy.io/proxy-protocol": "v1"}
    backend_port = backend.getsockname()[1]
    write_manifests(manifest, [svc, *endpoint_slice("pp", "p", [("127.0.0.1", backend_port)])])
    async with running_proxy(loopback_config(manifest, workers=workers)) as proxy:
        if proxy.workers is not None:
            await wait_for(lambda: proxy.workers is not None and proxy.workers.alive == 2, 30)
        port = proxy.proxier.port_of(ServicePortName("default", "pp", "p", Protocol.TCP))
        for _ in range(ATTEMPTS):
            seen = await first_line_seen(backend, port, QUEUED_WHILE_DIALING[dataplane])
            if seen is not None:
                break
        assert seen is not None, f"the proxy gave up on the dial {ATTEMPTS} times: no verdict"
        first_line, client_port = seen
        assert first_line != FORGED, "the backend took the client's line as the header"
        assert first_line in (
            b"PROXY TCP4 %s 127.0.0.1 %d %d\r\n" % (CLIENT.encode(), client_port, port),
            b"PROXY UNKNOWN\r\n",
        ), first_line
