"""The fork server: an interpreter that has imported the data plane and nothing else, and forks
each worker (and each replacement) when the control process asks.

A fresh interpreter per worker cost ~26 MB RSS and a few hundred milliseconds to start. A worker
forked from here shares the interpreter's and the modules' pages with this process and with the
other workers (`gc.freeze()` before the first fork keeps collections from writing to them), and
is ready in milliseconds. This process never imports the control plane (the import contract
covers it) and never runs an event loop or a thread, so a fork of it is clean.

Its socket to the control process carries `forking`'s packets.

The workers are this process's children: it reaps them and reports their exit codes. If it
dies they serve on (their channels go straight to the control process), and the control
process starts another (`forking.ForkServer`, the control process's side).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import selectors
import signal
import socket
import sys
import traceback
from collections.abc import Sequence

from kube_userspace_proxy import logs
from kube_userspace_proxy.workers import process as worker_process
from kube_userspace_proxy.workers.forking import EXITED, FAILED, FORK, FORKED, PACKET, READY

TITLE = "kube-userspace-proxy"


def serve(sock: socket.socket, worker_argv: Sequence[str]) -> int:
    """Fork a worker for each FORK request, reap them, until the control process hangs up."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, not SIG_IGN: that auto-reaps
    for sig in (signal.SIGINT, signal.SIGTERM):  # the control process says when: it hangs up
        signal.signal(sig, signal.SIG_IGN)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    gc.collect()
    gc.freeze()  # what is here now stays shared: no collection in a worker writes to it
    sock.send(PACKET.pack(READY, os.getpid(), 0))
    while True:
        for key, _ in selector.select():
            if key.fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 512):
                        pass
                _report_exits(sock)
                continue
            data, fds, _, _ = socket.recv_fds(sock, PACKET.size, 1)
            if not data:
                return 0  # the control process is gone or done: the workers go on their own
            kind, seq, index = PACKET.unpack(data)
            if kind != FORK or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                sock.send(PACKET.pack(FAILED, seq, errno.EINVAL))
                continue
            pid = _fork(index, fds[0], worker_argv, closing=(sock, selector, wake_r, wake_w))
            if pid < 0:
                sock.send(PACKET.pack(FAILED, seq, -pid))
                continue
            pidfd = os.pidfd_open(pid)
            try:
                socket.send_fds(sock, [PACKET.pack(FORKED, seq, pid)], [pidfd])
            finally:
                os.close(pidfd)


def _report_exits(sock: socket.socket) -> None:
    """Report every child that exited."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(PACKET.pack(EXITED, pid, os.waitstatus_to_exitcode(status)))


def _fork(
    index: int,
    channel: int,
    argv: Sequence[str],
    closing: tuple[socket.socket, selectors.BaseSelector, int, int],
) -> int:
    """The new worker's pid (-errno if the fork failed); the child never returns from here."""
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(channel)
        return -(exc.errno or errno.EAGAIN)
    if pid:
        os.close(channel)
        return pid
    code = 1
    try:
        sock, selector, wake_r, wake_w = closing
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has
        selector.close()
        sock.close()
        os.close(wake_r)
        os.close(wake_w)
        # A spare takes its slot later (`Become`): its title names none, and stays true.
        _set_title(f"worker {index}" if index >= 0 else "worker")
        code = worker_process.main(["--fd", str(channel), "--index", str(index), *argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        logs.stop()  # os._exit runs no atexit: write what is queued first
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    return 0  # not reached: os._exit ends the child  # pragma: no cover


def _set_title(what: str) -> None:
    """Name this process for `ps`: its comm, and its command line (written over the one it
    inherited, which is longer; what `ps -ef` shows is read from that memory)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/comm", "w") as comm:
            comm.write(f"kup-{what.replace(' ', '-')}"[:15])  # 15 bytes at most
        with open("/proc/self/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
        title = f"{TITLE} {what} (forked)".encode()[: end - start - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(title + b"\0" * (end - start - len(title)))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kube_userspace_proxy.workers.forkserver --fd N [worker options]`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "--fd":
        sys.stderr.write("usage: forkserver --fd N [worker options]\n")
        return 2
    # Shared with the workers that will use them (auto: the core's loop, or uvloop).
    if "--event-loop" not in args or args[args.index("--event-loop") + 1] != "asyncio":
        import uvloop  # noqa: F401, PLC0415

        from kube_userspace_proxy.dataplane import coreloop  # noqa: F401, PLC0415

    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write("kup-forkserver")
    return serve(socket.socket(fileno=int(args[1])), args[2:])


if __name__ == "__main__":
    sys.exit(main())
