"""The floor for a Python TCP proxy: uvloop, asyncio.Protocol, round robin, flow control.

benchmarks/peers.py runs it beside this project (peer `protocol`), so that the project's own
overhead per request is measured against the least a uvloop proxy can do, in the same run.
One process; per connection: accept, pick the next endpoint, dial it, relay both ways with
`pause_reading` / `resume_reading` when the other side's write buffer passes its high-water
mark, close both on EOF or error. No retries, no logging, no counters.

    python benchmarks/protocolproxy.py [--processes N] LISTEN=ENDPOINT[,ENDPOINT...] [LISTEN=...]
    e.g. 0.0.0.0:45080=10.244.2.10:80,10.244.2.11:80 0.0.0.0:45201=10.244.2.10:5201

`--processes N` (peer `protocol-auto`): N such processes on the same ports (SO_REUSEPORT, the
kernel spreads connections by hash), each its own loop and round robin: the floor for a
proxy that runs N workers, so that what N processes cost beyond one (fewer events per loop
wake-up, more processes on the cores) is not counted as the project's own overhead. The
first process forks the others, and ends them (SIGTERM) when it is told to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
import signal
import sys
from collections.abc import Iterator
from typing import cast

import uvloop


class Relay(asyncio.Protocol):
    """One side of a proxied connection: what it reads, the `peer` side writes."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: Relay | None = None
        self.eof = False
        self.early: list[bytes] = []  # the client's bytes that came before the backend's answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def other(self) -> asyncio.Transport | None:
        """The peer's transport while it is open."""
        peer = self.peer
        if peer is None or peer.transport is None or peer.transport.is_closing():
            return None
        return peer.transport

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.early.append(data)
        elif (to := self.other()) is not None:
            to.write(data)

    def eof_received(self) -> bool:
        self.eof = True
        to = self.other()
        if to is None:
            return self.peer is None  # no backend yet: it gets the EOF when it answers
        if self.peer is not None and self.peer.eof:
            to.close()  # both directions ended
            return False
        if to.can_write_eof():
            to.write_eof()
        return True  # half-close: the other direction goes on

    def connection_lost(self, exc: Exception | None) -> None:
        if (to := self.other()) is not None:
            to.close()

    # The peer's reads stop while this side cannot take more.
    def pause_writing(self) -> None:
        if (to := self.other()) is not None:
            to.pause_reading()

    def resume_writing(self) -> None:
        if (to := self.other()) is not None:
            to.resume_reading()


def client_side(endpoints: Iterator[tuple[str, int]]) -> type[Relay]:
    """A Relay for accepted connections that dials the next endpoint when it is made."""

    class Client(Relay):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            # Held: the loop keeps only a weak reference to a task.
            self.dialing = asyncio.get_running_loop().create_task(self.dial(next(endpoints)))

        async def dial(self, endpoint: tuple[str, int]) -> None:
            assert self.transport is not None
            backend = Relay()
            backend.peer = self
            try:
                await asyncio.get_running_loop().create_connection(lambda: backend, *endpoint)
            except OSError:
                self.transport.close()
                return
            assert backend.transport is not None
            if self.transport.is_closing():
                backend.transport.close()
                return
            if self.early:
                backend.transport.write(b"".join(self.early))
                self.early.clear()
            if self.eof and backend.transport.can_write_eof():
                backend.transport.write_eof()
            self.peer = backend  # from now on straight through, after what came early

    return Client


def parse(arg: str) -> tuple[tuple[str, int], list[tuple[str, int]]]:
    listen, _, endpoints = arg.partition("=")

    def address(text: str) -> tuple[str, int]:
        host, _, port = text.rpartition(":")
        return host, int(port)

    return address(listen), [address(e) for e in endpoints.split(",")]


async def main(args: list[str], reuse_port: bool) -> None:
    loop = asyncio.get_running_loop()
    for arg in args:
        (host, port), endpoints = parse(arg)
        await loop.create_server(
            client_side(itertools.cycle(endpoints)),
            host,
            port,
            backlog=4096,
            reuse_port=reuse_port or None,
        )
    await asyncio.Event().wait()


def fork_others(count: int) -> list[int]:
    """`count` more processes that go on from here (the children get []), each ended by the
    kernel if this one dies (PR_SET_PDEATHSIG), and by this one when it gets SIGTERM."""
    parent = os.getpid()
    children: list[int] = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # it died before prctl
                os._exit(0)
            return []
        children.append(pid)

    def end(signum: int, frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGTERM)
        for child in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, 0)
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    return children


PR_SET_PDEATHSIG = 1


if __name__ == "__main__":
    argv = sys.argv[1:]
    processes = 1
    if argv[:1] == ["--processes"] and len(argv) > 1:
        processes = max(1, int(argv[1]))
        argv = argv[2:]
    if not argv:
        sys.exit(__doc__)
    if processes > 1:
        fork_others(processes - 1)
    uvloop.run(main(argv, reuse_port=processes > 1))
