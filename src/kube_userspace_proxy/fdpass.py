"""Descriptors between processes: JSON messages with SCM_RIGHTS on a unix SOCK_SEQPACKET socket.

Used to hand the listening sockets of a running proxy over to the process replacing it
(`handover.py` for the control processes, `worker.py` between workers of the same slot).
Sequenced packets keep message boundaries, so descriptors arrive with the message that names
them. A message longer than one packet is split into chunks (the first byte says whether more
follow); a message carries at most SCM_MAX_FD (253) descriptors, so callers send them in
batches. Both ends check that the peer runs as the same user (SO_PEERCRED).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

MAX_FDS = 253
"""SCM_MAX_FD: the most descriptors one message may carry."""
CHUNK = 32 * 1024
_MORE, _LAST = b"+", b"."
_CRED = struct.Struct("3i")
T = TypeVar("T")


class PeerError(OSError):
    """The other end is not a process of this user, or broke the protocol."""


def batches(items: Sequence[T], size: int = MAX_FDS) -> Iterator[Sequence[T]]:
    """`items` in slices of at most `size` (one message's worth of descriptors)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def check_peer(sock: socket.socket) -> int:
    """The peer's pid; PeerError unless it runs with this process's effective uid."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if uid != os.geteuid():
        raise PeerError(f"peer pid {pid} runs as uid {uid}, not {os.geteuid()}")
    return int(pid)


SUN_PATH_MAX = 107
"""The longest path a unix socket address holds (sun_path is 108 bytes with its NUL)."""


@contextlib.contextmanager
def _addressable(path: Path) -> Iterator[str]:
    """`path` as a unix socket address: itself when short enough, else the same file reached
    through a descriptor of its directory (/proc/self/fd/N/name), so that a deep --state-dir
    works (a pytest or kubelet directory is easily over 107 bytes)."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        yield str(path)
        return
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{directory}/{path.name}"
    finally:
        os.close(directory)


def listen(path: str | Path) -> socket.socket:
    """A non-blocking listening socket at `path` (mode 0600; replaces what is there at once)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with _addressable(temporary) as address:
            sock.bind(address)
        os.chmod(temporary, 0o600)  # before the name others look for points at it
        sock.listen(8)
        sock.setblocking(False)
        os.replace(temporary, path)
    except BaseException:
        sock.close()
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    return sock


def connect(path: str | Path, timeout: float) -> socket.socket:
    """A connected non-blocking socket to `path`; OSError (ENOENT, ECONNREFUSED, ...) if none."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout)
        with _addressable(Path(path)) as address:
            sock.connect(address)
        sock.setblocking(False)
        check_peer(sock)
    except BaseException:
        sock.close()
        raise
    return sock


async def accept(server: socket.socket) -> socket.socket:
    """The next connection to `server`, from a process of this user, non-blocking."""
    conn, _ = await asyncio.get_running_loop().sock_accept(server)
    try:
        conn.setblocking(False)
        check_peer(conn)
    except BaseException:
        conn.close()
        raise
    return conn


async def _ready(sock: socket.socket, *, write: bool) -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not future.done():
            future.set_result(None)

    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await future
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def send_bytes(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """Send `data` (chunked), the descriptors `fds` with its first packet."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"{len(fds)} descriptors in one message (at most {MAX_FDS})")
    count = max(1, -(-len(data) // CHUNK))
    for index in range(count):
        packet = (_LAST if index == count - 1 else _MORE) + data[
            index * CHUNK : (index + 1) * CHUNK
        ]
        attach = list(fds) if index == 0 else []
        while True:
            try:
                if attach:
                    socket.send_fds(sock, [packet], attach)
                else:
                    sock.send(packet)
                break
            except (BlockingIOError, InterruptedError):
                await _ready(sock, write=True)


async def send(sock: socket.socket, message: Any, fds: Sequence[int] = ()) -> None:
    """Send a JSON-able `message` with `fds`."""
    await send_bytes(sock, json.dumps(message, separators=(",", ":")).encode(), fds)


async def receive_bytes(sock: socket.socket) -> tuple[bytes, list[socket.socket]]:
    """The next message and the sockets it carried; ConnectionError at the end of the stream."""
    data, fds = await receive_fds(sock)
    return data, [socket.socket(fileno=fd) for fd in fds]


async def receive_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """The next message and the descriptors it carried, as they are (not only sockets: the
    state directory's lock travels in a handover too)."""
    parts: list[bytes] = []
    received: list[int] = []
    try:
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(sock, CHUNK + 1, MAX_FDS)
            except (BlockingIOError, InterruptedError):
                await _ready(sock, write=False)
                continue
            received.extend(fds)
            if flags & socket.MSG_CTRUNC:
                raise PeerError("descriptors were dropped in transit (RLIMIT_NOFILE reached?)")
            if not data:
                raise ConnectionError("the other process closed the connection")
            parts.append(data[1:])
            if data[:1] == _LAST:
                break
        return b"".join(parts), received
    except BaseException:
        for fd in received:
            os.close(fd)
        raise


async def receive(sock: socket.socket) -> tuple[Any, list[socket.socket]]:
    """The next JSON message and the sockets it carried."""
    data, socks = await receive_bytes(sock)
    try:
        return json.loads(data), socks
    except ValueError:
        for s in socks:
            s.close()
        raise PeerError("a message that is not JSON") from None
