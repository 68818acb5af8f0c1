"""Who may take the running proxy's sockets over: a process of the same user in the same
network namespace, checked by the running process itself before it sends anything.

The user comes from SO_PEERCRED. The network namespace is judged twice, and a peer must pass
every judgment that can be made (none possible: refused):

- the connection's own namespace (SO_NETNS_COOKIE of the accepted socket: the kernel creates
  it in the namespace of the socket that connected), compared with the listening socket's.
  This works when the peer's pid is not visible here (the chart's surge pod has a PID
  namespace of its own, so SO_PEERCRED reports pid 0 for it);
- `/proc/<pid>/ns/net` of the peer compared with this process's, when that pid is visible.

The peer's executable is not pinned: an upgrade hands over to a new version in a new container.
"""

from __future__ import annotations

import os
import socket
import struct

from kube_userspace_proxy import fdpass

SO_NETNS_COOKIE = getattr(socket, "SO_NETNS_COOKIE", 71)
"""Linux 5.14+ (71 on every architecture but alpha, mips, parisc and sparc, which this
proxy's images do not target); Python's socket module does not name it before 3.13."""
_COOKIE = struct.Struct("Q")


class RefusedPeer(fdpass.PeerError):
    """The peer may not take anything over; the message says why."""


def netns_cookie(sock: socket.socket) -> int | None:
    """The network namespace `sock` belongs to (a cookie unique for the boot), or None when
    the kernel cannot tell (before 5.14)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, _COOKIE.size)
    except OSError:
        return None
    return int(_COOKIE.unpack(raw)[0])


def _proc_netns(pid: int | str) -> tuple[int, int] | None:
    try:
        found = os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return None
    return (found.st_dev, found.st_ino)


def check(conn: socket.socket, server: socket.socket) -> int:
    """The peer's pid (0: in a PID namespace this process cannot see); RefusedPeer unless it
    runs as this process's user in this process's network namespace."""
    pid = fdpass.check_peer(conn)  # PeerError: another user
    judged = False
    ours, theirs = netns_cookie(server), netns_cookie(conn)
    if ours is not None and theirs is not None:
        if ours != theirs:
            raise RefusedPeer(f"peer pid {pid} connected from another network namespace")
        judged = True
    if pid > 0 and (proc := _proc_netns(pid)) is not None:
        if proc != _proc_netns("self"):
            raise RefusedPeer(f"peer pid {pid} runs in another network namespace")
        judged = True
    if not judged:
        raise RefusedPeer(f"peer pid {pid}: its network namespace cannot be told")
    return pid
