"""Client-IP steering across worker processes: a classic BPF program on a reuseport group.

Every worker listens on every proxy port with SO_REUSEPORT. The kernel keeps the sockets of
one port in a group, in the order they joined, and a socket that leaves is replaced by the
group's last one. A cBPF program attached with SO_ATTACH_REUSEPORT_CBPF returns the index of
the socket that gets a new connection (TCP) or datagram (UDP). Ours hashes the source address
(IPv4, or the four words of an IPv6 one) to a worker, then maps that worker to its index in
this port's group (`route`), which the control process tracks from the join and leave order.
cBPF was chosen over eBPF (SK_REUSEPORT + REUSEPORT_SOCKARRAY, stable by key) because it needs
no bpf() loader, no map and no capability beyond owning the socket.
"""

from __future__ import annotations

import ctypes
import socket
import struct
from collections.abc import Sequence

SO_ATTACH_REUSEPORT_CBPF = 51
_SKF_NET_OFF = -0x100000  # loads relative to the network header (the data starts past TCP/UDP)

# Classic BPF opcodes (linux/filter.h).
_LD_W_ABS = 0x20
_LD_B_ABS = 0x30
_ALU_MUL_K = 0x24
_ALU_RSH_K = 0x74
_ALU_MOD_K = 0x94
_ALU_XOR_X = 0xAC
_JMP_JA = 0x05
_JMP_JEQ_K = 0x15
_RET_K = 0x06
_RET_A = 0x16
_TAX = 0x07

_INSN = struct.Struct("HBBI")
_GOLDEN = 0x9E3779B1  # Fibonacci hashing: spreads nearby addresses over the workers


def _net(offset: int) -> int:
    return (_SKF_NET_OFF + offset) & 0xFFFFFFFF


def worker_of(address: str, workers: int) -> int:
    """The worker the program sends `address` to (the same hash, in Python; for tests)."""
    packed = socket.inet_pton(socket.AF_INET6 if ":" in address else socket.AF_INET, address)
    if len(packed) == 16 and packed[:12] == b"\0" * 10 + b"\xff\xff":
        packed = packed[12:]  # a v4-mapped client arrives as IPv4
    words = struct.unpack(f"!{len(packed) // 4}I", packed)
    value = 0
    for word in words:
        value ^= word
    return (((value * _GOLDEN) & 0xFFFFFFFF) >> 16) % workers


def route_for(members: Sequence[int], workers: int) -> tuple[int, ...]:
    """Group index per worker, from the group's members in join order (-1: not a worker).

    A worker missing from the group (dead, or not listening yet) has its clients sent to the
    next worker that is there, so each client still lands on one worker.
    """
    slots = {m: i for i, m in enumerate(members) if m >= 0}
    route = []
    for want in range(workers):
        for step in range(workers):
            slot = slots.get((want + step) % workers)
            if slot is not None:
                route.append(slot)
                break
        else:
            route.append(0)
    return tuple(route)


def program(route: Sequence[int]) -> bytes:
    """The cBPF program (packed struct sock_filter array) for one group's `route`."""
    workers = len(route)
    insns = [
        (_LD_B_ABS, 0, 0, _net(0)),
        (_ALU_RSH_K, 0, 0, 4),
        (_JMP_JEQ_K, 0, 2, 4),  # IPv4? else the IPv6 branch
        (_LD_W_ABS, 0, 0, _net(12)),  # IPv4 source
        (_JMP_JA, 0, 0, 10),
        (_LD_W_ABS, 0, 0, _net(8)),  # IPv6 source: xor of its four words
        (_TAX, 0, 0, 0),
        (_LD_W_ABS, 0, 0, _net(12)),
        (_ALU_XOR_X, 0, 0, 0),
        (_TAX, 0, 0, 0),
        (_LD_W_ABS, 0, 0, _net(16)),
        (_ALU_XOR_X, 0, 0, 0),
        (_TAX, 0, 0, 0),
        (_LD_W_ABS, 0, 0, _net(20)),
        (_ALU_XOR_X, 0, 0, 0),
        (_ALU_MUL_K, 0, 0, _GOLDEN),
        (_ALU_RSH_K, 0, 0, 16),
        (_ALU_MOD_K, 0, 0, workers),
    ]
    if tuple(route) == tuple(range(workers)):
        insns.append((_RET_A, 0, 0, 0))
    else:
        for want, slot in enumerate(route):
            insns.append((_JMP_JEQ_K, 0, 1, want))
            insns.append((_RET_K, 0, 0, slot))
        insns.append((_RET_K, 0, 0, route[0]))
    return b"".join(_INSN.pack(*insn) for insn in insns)


def attach(sock: socket.socket, code: bytes) -> None:
    """Attach `code` to the reuseport group of `sock` (replacing the group's program)."""
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HL", len(code) // _INSN.size, ctypes.addressof(buffer))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)
