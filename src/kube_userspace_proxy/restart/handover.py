"""Restarts that refuse nothing: a new proxy process takes the sockets of the running one.

The running proxy listens on `<state-dir>/handover.sock` (a unix SOCK_SEQPACKET socket, mode
0600). Before it reads or sends anything it checks the peer (`peers`: the same user and the
same network namespace) and refuses any other with one warning, serving on. A new process
started with the same state directory connects before it binds anything, and the two talk
(`fdpass`, JSON messages):

    new -> old   hello {version, workers}
    old -> new   offer {version, workers}       (mismatch: new says "stop", see below)
    new -> old   take                           (the old one stops syncing from here on)
    old -> new   sockets (batches of at most 253 descriptors, each described), then state:
                 the last applied snapshot and proxy ports (the state file's encoding) and
                 the reuseport groups' order as the old WorkerPool tracked it
    new -> old   workers {slot: path}           each new worker listens at its path
    old -> new   exported {slot: count}         each old worker sent its own sockets there
    new -> old   serving                        the new one serves every port now
    old:         stops accepting (its descriptors closed, the sockets left as they are),
                 closes its ops sites, drains within its grace, exits

Same sockets: same accept queues and the same reuseport groups in the same order, so nothing
is refused or reset and the workers' steering stays valid. Until "serving" the old process
serves as before: a handover that fails half-way leaves it serving (the new one exits with an
error). Different worker counts or protocol versions: the new process asks the old one to stop
as on SIGTERM, waits until it has exited, and starts as after any restart (from the state file).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kube_userspace_proxy import fdpass, logs
from kube_userspace_proxy.errors import ProxyError
from kube_userspace_proxy.model import SocketKey
from kube_userspace_proxy.restart import peers
from kube_userspace_proxy.restart.sockets import ProxyPortSocket, SocketDescription, decode, encode

log = logs.get(__name__)

VERSION = 1
SOCKET_NAME = "handover.sock"
CONNECT_TIMEOUT = 2.0
STEP_TIMEOUT = 60.0
"""Seconds either side waits for the other's next message (a busy node is slow)."""

D = TypeVar("D", bound=SocketDescription)


def network_namespace() -> int:
    """This process's network namespace (an inode number; 0 when unknown). Sockets are
    handed over only within one: a state directory shared across namespaces is not a node."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def socket_path(directory: str) -> Path:
    """Where the running proxy of `directory` listens for its successor."""
    return Path(directory) / SOCKET_NAME


class Giver(Protocol):
    """What the running (old) process gives away; implemented by the app."""

    workers: int
    """Worker processes (1: the control process serves)."""

    def handover_sockets(self) -> list[tuple[SocketDescription, int]]:
        """(description, descriptor) of every socket the control process serves."""
        ...

    def state_lock_fd(self) -> int:
        """The descriptor of the state directory's lock (restart/statelock.py), -1 if none:
        it travels with the state, so the lock never lies free between the two processes."""
        ...

    def handover_state(self) -> tuple[bytes, list[Any]]:
        """The applied state (state-file encoding) and the groups as [[proto, host, port,
        members]]."""
        ...

    async def export_workers(self, paths: dict[int, str]) -> dict[int, int]:
        """Each worker sends its sockets to its slot's path; slot -> how many."""
        ...

    async def hold(self) -> None:
        """Stop changing what is served (no syncs) until `resume()` or `handed_over()`."""
        ...

    def resume(self) -> None:
        """The handover failed: sync again."""
        ...

    def handed_over(self) -> None:
        """The new process serves: stop accepting, release everything, drain, exit."""
        ...

    def stop(self) -> None:
        """Stop as on SIGTERM (the new process starts afresh once this one is gone)."""
        ...


LISTEN_RETRY = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Seconds between tries to listen on handover.sock after a failure (the last one repeats)."""


async def serve(directory: str, giver: Giver, ready: Awaitable[Any]) -> None:
    """Answer successors at `<directory>/handover.sock` once `ready` (a root task)."""
    await ready
    path = socket_path(directory)
    failures, last_error = 0, ""
    while True:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            server = fdpass.listen(path)
            try:
                inode = os.stat(path).st_ino
            except OSError:
                server.close()
                raise
            break
        except OSError as exc:
            # Until it can, a successor finds nobody to take over from, and the state
            # directory locked: say so once, and again if the reason changes; keep trying.
            if str(exc) != last_error:
                log.warning(
                    "cannot listen on %s (%s): a restart cannot take over from this process"
                    " until it can; trying again every %gs at most",
                    path,
                    exc,
                    LISTEN_RETRY[-1],
                )
            last_error = str(exc)
            await asyncio.sleep(LISTEN_RETRY[min(failures, len(LISTEN_RETRY) - 1)])
            failures += 1
    log.info("a new proxy process can take over through %s", path)
    handed_over = False
    try:
        while True:
            try:
                conn = await fdpass.accept(server)
            except OSError as exc:
                log.warning("refused a handover connection: %s", exc)
                continue
            with conn:
                try:
                    peer = peers.check(conn, server)
                except OSError as exc:
                    # Checked before anything is read or sent: no offer, no "stop", no socket.
                    log.warning("refused a handover connection: %s; nothing sent", exc)
                    continue
                if await _give(conn, giver, peer):
                    handed_over = True
                    break
        server.close()  # done: the process stops (this task is cancelled with the others)
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        # After a handover the name is the successor's, which binds it when it is ready: a
        # check, then an unlink, here could remove its socket in between (no restart could
        # take over from it then). A name left behind is harmless: a connect is refused.
        if not handed_over:
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == inode:  # still ours: no successor replaced it
                    path.unlink()
        raise
    finally:
        server.close()


async def _give(conn: socket.socket, giver: Giver, peer: int) -> bool:
    """One checked successor's handover; True once it serves (this process is done)."""
    held = False
    try:
        async with asyncio.timeout(STEP_TIMEOUT):
            hello, _ = await fdpass.receive(conn)
            offer = {"op": "offer", "version": VERSION, "workers": giver.workers}
            await fdpass.send(conn, {**offer, "netns": network_namespace()})
            try:
                answer, _ = await fdpass.receive(conn)
            except ConnectionError:  # it decided against a handover (another namespace)
                return False
            if answer.get("op") == "stop":
                log.warning(
                    "process %d replaces this one without a handover (%s workers, protocol"
                    " %s; here %d, %d): stopping as on SIGTERM",
                    peer,
                    hello.get("workers"),
                    hello.get("version"),
                    giver.workers,
                    VERSION,
                )
                # Left open until this process has exited: then the successor starts.
                os.dup(conn.fileno())
                giver.stop()
                return False
            if answer.get("op") != "take":
                return False
            await giver.hold()
            held = True
            log.info("handing every socket over to process %d", peer)
            items = giver.handover_sockets()
            for batch in fdpass.batches(items):
                await fdpass.send(
                    conn,
                    {"op": "sockets", "items": [encode(d) for d, _ in batch]},
                    [f for _, f in batch],
                )
            state, groups = giver.handover_state()
            lock = giver.state_lock_fd()
            await fdpass.send(conn, {"op": "state", "groups": groups}, [lock] if lock >= 0 else [])
            await fdpass.send_bytes(conn, state)
            workers, _ = await fdpass.receive(conn)
            paths = {int(slot): str(path) for slot, path in workers.get("paths", {}).items()}
            counts = await giver.export_workers(paths) if paths else {}
            await fdpass.send(conn, {"op": "exported", "counts": counts})
        # The new process starts serving from the sockets: it may take a while on a busy node.
        async with asyncio.timeout(STEP_TIMEOUT * 2):
            serving, _ = await fdpass.receive(conn)
        if serving.get("op") != "serving":
            raise fdpass.PeerError(f"expected 'serving', got {serving!r}")
    except Exception as exc:  # whatever went wrong, this process serves on
        log.warning("the handover to process %d failed (%r); serving on", peer, exc)
        if held:
            giver.resume()
        return False
    log.info("process %d serves every port now: handing over", peer)
    giver.handed_over()
    return True


@dataclass
class Taken:
    """What the new process received: the control process's sockets and the applied state."""

    conn: socket.socket
    peer: int
    sockets: list[tuple[SocketDescription, socket.socket]] = field(default_factory=list)
    state: bytes = b""
    groups: dict[SocketKey, list[int]] = field(default_factory=dict)
    lock_fd: int = -1
    """The state directory's lock, shared with the old process (the taker claims it)."""

    def claim(self, kind: type[D]) -> list[tuple[D, socket.socket]]:
        """Take the sockets of `kind` (`ProxyPortSocket`, `NodePortSocket`, `HealthSocket`,
        `OpsSocket`): the caller owns them from now on."""
        claimed: list[tuple[D, socket.socket]] = []
        kept: list[tuple[SocketDescription, socket.socket]] = []
        for description, sock in self.sockets:
            if isinstance(description, kind):
                claimed.append((description, sock))
            else:
                kept.append((description, sock))
        self.sockets = kept
        return claimed

    def listen_address(self) -> str | None:
        """The address the handed-over proxy ports are bound to (None: none came)."""
        for description, sock in self.sockets:
            if isinstance(description, ProxyPortSocket):
                with contextlib.suppress(OSError):
                    return str(sock.getsockname()[0])
        return None

    async def workers(self, prepare: Callable[[], Awaitable[dict[int, str]]]) -> dict[int, int]:
        """Have the old workers send their sockets to the paths `prepare` set up."""
        paths = await prepare()
        async with asyncio.timeout(STEP_TIMEOUT):
            await fdpass.send(self.conn, {"op": "workers", "paths": paths})
            answer, _ = await fdpass.receive(self.conn)
        return {int(slot): int(count) for slot, count in answer.get("counts", {}).items()}

    async def serving(self) -> None:
        """Tell the old process that this one serves: it stops accepting and drains."""
        await fdpass.send(self.conn, {"op": "serving"})
        self.conn.close()

    def close(self) -> None:
        """End the handover (before `serving`: the old process serves on); close every
        socket received and not used (this process's descriptors only)."""
        self.conn.close()
        for _, sock in self.sockets:
            sock.close()
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # the old process's copy keeps the lock
            self.lock_fd = -1


async def take(directory: str, workers: int, *, wait_exit: float) -> Taken | None:
    """Take over from the proxy running with `directory`, if one answers.

    None: no process answered (no socket, a stale one, refused), or it ran with other worker
    counts or protocol version and has been asked to stop and has exited (waiting up to
    `wait_exit` seconds): start as usual. Raises ProxyError when the handover fails half-way
    (the old process serves on).
    """
    path = socket_path(directory)
    try:
        conn = await asyncio.to_thread(fdpass.connect, path, CONNECT_TIMEOUT)
    except FileNotFoundError:
        log.info("no running proxy to take over from (%s does not exist)", path)
        return None
    except OSError as exc:
        log.info("no running proxy to take over from (%s: %s)", path, exc.strerror or exc)
        return None
    peer = fdpass.check_peer(conn)
    taken = Taken(conn, peer)
    try:
        async with asyncio.timeout(STEP_TIMEOUT):
            await fdpass.send(conn, {"op": "hello", "version": VERSION, "workers": workers})
            offer, _ = await fdpass.receive(conn)
            if offer.get("netns") != network_namespace():
                log.info(
                    "the proxy at %s (pid %d) runs in another network namespace: no handover",
                    path,
                    peer,
                )
                taken.close()
                return None
            if offer.get("version") != VERSION or offer.get("workers") != workers:
                log.warning(
                    "the running proxy (pid %d) has %s worker process(es) and handover protocol"
                    " %s, this one %d and %d: no handover; it is asked to stop, and this one"
                    " starts once it has exited (connections are refused in between)",
                    peer,
                    offer.get("workers"),
                    offer.get("version"),
                    workers,
                    VERSION,
                )
                await fdpass.send(conn, {"op": "stop"})
            else:
                await _receive_all(taken)
                log.info(
                    "taking over from the running proxy (pid %d): %d socket(s) received",
                    peer,
                    len(taken.sockets),
                )
                return taken
    except (OSError, TimeoutError, ValueError, KeyError, TypeError, AttributeError) as exc:
        taken.close()
        raise ProxyError(
            f"the handover from the running proxy (pid {peer}) failed: {exc!r}; it serves on"
        ) from None
    try:
        async with asyncio.timeout(wait_exit):
            with contextlib.suppress(ConnectionError):
                while True:  # the old process holds the connection until it has exited
                    await fdpass.receive(conn)
    except TimeoutError:
        raise ProxyError(
            f"the running proxy (pid {peer}) did not exit within {wait_exit:.0f}s"
        ) from None
    finally:
        taken.close()
    return None


async def _receive_all(taken: Taken) -> None:
    conn = taken.conn
    await fdpass.send(conn, {"op": "take"})
    while True:
        data, fds = await fdpass.receive_fds(conn)
        try:
            message = json.loads(data)
        except ValueError:
            for fd in fds:
                os.close(fd)
            raise fdpass.PeerError("a message that is not JSON") from None
        if message.get("op") == "state":
            for fd in fds[1:]:
                os.close(fd)
            taken.lock_fd = fds[0] if fds else -1
        else:
            socks = [socket.socket(fileno=fd) for fd in fds]
        if message.get("op") == "sockets":
            try:
                described = [decode(d) for d in message["items"]]
                taken.sockets.extend(zip(described, socks, strict=True))
            except ValueError:
                for sock in socks:
                    sock.close()
                raise
            continue
        if message.get("op") != "state":
            raise fdpass.PeerError(f"unexpected message {message.get('op')!r}")
        taken.groups = {
            (str(p), str(h), int(n)): [int(m) for m in members]
            for p, h, n, members in message["groups"]
        }
        taken.state, _ = await fdpass.receive_bytes(conn)
        return
