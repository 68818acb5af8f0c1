"""One proxy process owns a state directory at a time: `<state-dir>/lock`.

The owner holds an exclusive `flock` on the file for as long as it owns the directory (it
writes the state file and listens on handover.sock), and writes its PID into it. A process
that finds the lock held either takes over from the owner through the handover (a DaemonSet's
surge pod: the old process passes the lock's descriptor with the state, so the lock is never
free in between, then closes its own) or exits
with an error naming the directory and the owner's PID. The kernel releases the lock when the
owner exits, however it exits, so a crash leaves no stale lock (the PID left in the file is
only read while the lock is held).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
from pathlib import Path

LOCK_NAME = "lock"


class StateLock:
    """The lock on one state directory, held by this process until `release()`."""

    def __init__(self, directory: str, fd: int) -> None:
        self.directory = directory
        self._fd = fd

    @classmethod
    def handed_over(cls, directory: str, fd: int) -> StateLock:
        """The lock the old process passed in the handover (the same open file, so the same
        flock): this process owns the directory from now on, and says so in the file."""
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(directory, fd)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def fileno(self) -> int:
        return self._fd

    def release(self) -> None:
        """Let the directory go (after handing it over, or at exit)."""
        if self._fd >= 0:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = -1


def lock_path(directory: str) -> Path:
    return Path(directory) / LOCK_NAME


def try_acquire(directory: str) -> StateLock | None:
    """The lock if no other process holds it (creating the directory and the file); None when
    another holds it. OSError for a directory or file that cannot be opened."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd = os.open(lock_path(directory), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return StateLock(directory, fd)


def holder(directory: str) -> int | None:
    """The PID the lock file names (the owner's while the lock is held); None if unknown."""
    with contextlib.suppress(OSError, ValueError):
        text = lock_path(directory).read_text(encoding="ascii").strip()
        return int(text) if text else None
    return None


async def acquire(directory: str, timeout: float) -> StateLock | None:  # noqa: ASYNC109
    """Wait up to `timeout` seconds for the lock (the previous owner lets it go as it hands
    over, or exits); None if it is still held then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        lock = try_acquire(directory)
        if lock is not None or loop.time() >= deadline:
            return lock
        await asyncio.sleep(0.05)
