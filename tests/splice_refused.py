"""A child process whose kernel refuses splice(2): a seccomp filter makes every splice call
fail with EINVAL, as on a kernel or socket type without it. It runs one TcpListener (on the
data plane the environment picks) to the backend on argv, prints its port, and, when stdin
closes, prints the listener's counters as JSON and exits.

    python -m tests.splice_refused BACKEND_PORT

Used by tests/loopback/test_tcp.py: the fallback to copying is then the data plane's own
answer to a real refusal, the same for the Python and the native data plane.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import platform
import socket
import struct
import sys

from kube_userspace_proxy.balancer import EndpointTally
from kube_userspace_proxy.dataplane import ConnStats, TcpListener
from kube_userspace_proxy.model import DialOutcome

# (AUDIT_ARCH_*, __NR_splice) of the machines CI runs on.
_ARCHES = {"x86_64": (0xC000003E, 275), "aarch64": (0xC00000B7, 76)}
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_EINVAL = 22
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


def refuse_splice() -> None:
    """Install the filter on this thread (and the threads and children it starts)."""
    arch, nr = _ARCHES[platform.machine()]
    insns = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ_K, 1, 0, arch),
        (_RET_K, 0, 0, _RET_ALLOW),
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (_JEQ_K, 0, 1, nr),
        (_RET_K, 0, 0, _RET_ERRNO | _EINVAL),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    code = b"".join(struct.pack("HBBI", *insn) for insn in insns)
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = ctypes.create_string_buffer(struct.pack("HL", len(insns), ctypes.addressof(buffer)))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fprog, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


class _One:
    """A picker with one endpoint."""

    proxy_protocol = 0
    source = None

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.picked = EndpointTally()

    def pick(self, client_ip: str, *, retry: bool = False) -> tuple[str, int] | None:
        return self.address

    def dial_failed(self, address: tuple[str, int], outcome: int = DialOutcome.REFUSED) -> None:
        pass

    def dial_succeeded(self, address: tuple[str, int]) -> None:
        pass


async def _serve(backend_port: int) -> None:
    refuse_splice()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    stats = ConnStats()
    listener = TcpListener(sock, _One(("127.0.0.1", backend_port)), stats=stats)
    await listener.start()
    print(listener.port, flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    await listener.close()
    await listener.drain(30.0)  # the connection's counters are in once it has ended
    print(json.dumps({"spliced": stats.spliced, "splice": listener.splice}), flush=True)


if __name__ == "__main__":
    import uvloop

    uvloop.run(_serve(int(sys.argv[1])))
