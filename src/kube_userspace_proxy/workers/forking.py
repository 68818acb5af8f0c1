"""The control process's side of the fork server (`forkserver`): start it, start it again
after it exits, fork workers through it, and watch each forked worker.

The fork server's socket (SOCK_SEQPACKET) carries fixed-size packets:
- control -> server: FORK (seq, slot), the worker's end of its channel attached;
- server -> control: READY once; FORKED (seq, pid), a pidfd of the child attached (this
  process sees the exit on it and signals the worker with no pid-reuse race); FAILED (seq,
  errno); EXITED (pid, exit code as asyncio reports it: -N for signal N).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import sys

from kube_userspace_proxy import logs

log = logs.get(__name__)

PACKET = struct.Struct("!cii")
"""Every packet: a kind, then two integers."""
READY, FORK, FORKED, FAILED, EXITED = b"R", b"F", b"P", b"E", b"X"
START_TIMEOUT = 30.0
"""Seconds a new fork server has to import the data plane and say READY."""
EXIT_REPORT_TIMEOUT = 5.0
"""Seconds the fork server has to report the exit code of a worker seen to exit."""
RESTART_DELAYS = (0.0, 0.25, 1.0, 2.0, 5.0)
"""Waits before starting the fork server again after it exited (the longest repeats)."""


class ForkedProcess:
    """A worker forked by the fork server: what `asyncio.subprocess.Process` offers, and no more."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int | None] = self._loop.create_future()
        self.gone = False
        """It has exited (its exit code may still be on its way)."""
        self.orphaned = False
        """Its fork server died: nobody will report its exit code."""
        self._loop.add_reader(pidfd, self._on_exit)

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        self.gone = True
        try:  # its parent died and it was handed to this process (PID 1 in a container)
            result = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            if self.orphaned:
                self.exited(None)
            else:  # the fork server reaps it and reports the code, unless it is stuck
                self._loop.call_later(EXIT_REPORT_TIMEOUT, self.exited, None)
            return
        if result is not None:
            self.exited(result.si_status if result.si_code == os.CLD_EXITED else -result.si_status)

    def exited(self, code: int | None) -> None:
        """Its exit code is known (None: the fork server died before it could say)."""
        if not self._exited.done():
            self.returncode = code
            self._exited.set_result(code)
            if not self.gone:
                self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    def kill(self) -> None:
        """SIGKILL it (nothing if it has exited)."""
        if self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def wait(self) -> int | None:
        """Its exit code once it exited (None if nobody could tell it)."""
        return await asyncio.shield(self._exited)


class ForkServer:
    """The control process's handle on the fork server: starts it, restarts it after an
    exit, and forks workers through it."""

    def __init__(self, worker_argv: list[str], pass_fds: tuple[int, ...] = ()) -> None:
        self._argv = worker_argv
        self._pass_fds = pass_fds  # descriptors every worker inherits (the shared counts)
        self._server: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._ready: asyncio.Future[None] | None = None
        self._starting: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._forks: dict[int, asyncio.Future[ForkedProcess]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._seq = 0
        self._closing = False
        self.starts = 0
        """Fork servers started (1 plus the restarts)."""

    @property
    def pid(self) -> int:
        """The running fork server's pid (0 if none)."""
        return self._server.pid if self._server is not None and self._sock is not None else 0

    async def start(self) -> None:
        """Start the fork server (or wait for the start under way); OSError if it cannot start."""
        if self._sock is not None:
            return
        if self._starting is None or self._starting.done():
            self._starting = asyncio.create_task(self._start(), name="fork server start")
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            server = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kube_userspace_proxy.workers.forkserver",
                "--fd",
                str(theirs.fileno()),
                *self._argv,
                pass_fds=(theirs.fileno(), *self._pass_fds),
                stdin=asyncio.subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        ours.setblocking(False)
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._server, self._sock = server, ours
        self.starts += 1
        loop.add_reader(ours.fileno(), self._on_readable)
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT)
        except BaseException as exc:
            self._lost()
            code = await _end_server(server)
            if isinstance(exc, asyncio.CancelledError):
                raise
            why = "not ready in time" if isinstance(exc, TimeoutError) else "it exited"
            raise OSError(f"the fork server could not start (exit code {code}): {why}") from None
        log.info("fork server started (pid %d)", server.pid)
        self._watcher = asyncio.create_task(self._watch(server), name="fork server watch")

    async def fork(self, index: int, channel: socket.socket) -> ForkedProcess:
        """A worker for slot `index` serving `channel` (which stays this process's to close)."""
        await self.start()
        assert self._sock is not None
        self._seq += 1
        seq = self._seq
        future: asyncio.Future[ForkedProcess] = asyncio.get_running_loop().create_future()
        self._forks[seq] = future
        try:
            socket.send_fds(self._sock, [PACKET.pack(FORK, seq, index)], [channel.fileno()])
            return await future
        finally:
            self._forks.pop(seq, None)

    def _on_readable(self) -> None:
        sock = self._sock
        while sock is not None and sock is self._sock:
            try:
                data, fds, _, _ = socket.recv_fds(sock, PACKET.size, 1)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._lost()
                return
            kind, first, second = PACKET.unpack(data)
            if kind == READY and self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
            elif kind == FORKED and fds:
                child = ForkedProcess(second, fds[0])
                self._children[second] = child
                future = self._forks.get(first)
                if future is not None and not future.done():
                    future.set_result(child)
                else:  # nobody waits for it any more (cancelled): it must not live on
                    child.kill()
            elif kind == FAILED:
                future = self._forks.get(first)
                if future is not None and not future.done():
                    future.set_exception(OSError(second, f"fork failed: {os.strerror(second)}"))
            elif kind == EXITED:
                exited = self._children.pop(first, None)
                if exited is not None:
                    exited.exited(second)

    def _lost(self) -> None:
        """The fork server's socket closed: it exited, or is being ended."""
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ConnectionError("the fork server exited"))
        for future in self._forks.values():
            if not future.done():
                future.set_exception(ConnectionError("the fork server exited"))
        # Its children live on; their exit codes die with it (unless one was handed to us).
        for child in self._children.values():
            if child.gone:
                child.exited(None)
            else:
                child.orphaned = True
        self._children.clear()

    async def _watch(self, server: asyncio.subprocess.Process) -> None:
        """Start another fork server after this one exits (not when this process ends it)."""
        code = await server.wait()
        if self._server is server:
            self._lost()
        if self._closing or self._server is not server:
            return
        log.warning("the fork server exited (code %s); starting another", code)
        for delay in RESTART_DELAYS:
            await asyncio.sleep(delay)
            if self._closing or self._sock is not None:
                return
            try:
                await self.start()
                return
            except OSError as exc:
                log.error("%s", exc)

    async def close(self) -> None:
        """End the fork server (the workers it forked are the caller's to end)."""
        self._closing = True
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        server = self._server
        self._lost()  # its end of the socket closes: it exits
        if server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait(), 5.0)
            await _end_server(server)

    def abandon(self) -> None:
        """Kill the fork server at once (the caller kills the workers)."""
        self._closing = True
        self._lost()
        if self._server is not None and self._server.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._server.kill()


async def _end_server(process: asyncio.subprocess.Process) -> int:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    return await process.wait()
