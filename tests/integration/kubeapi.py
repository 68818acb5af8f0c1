"""The fake API server (tests/fakes/apiserver.py) serving inside a test's node namespace.

The proxy in the node namespace reaches it on that namespace's 127.0.0.1: its listening socket
is made by a thread that joined the namespace (setns), then served by an event loop on another
thread of the test process. Nothing is added to the root namespace.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from tests.fakes.apiserver import FakeApiServer
from tests.fakes.rbac import Rbac, chart_rules
from tests.integration.netns import Netns

T = TypeVar("T")
CLONE_NEWNET = 0x40000000


def listening_socket_in(ns: Netns) -> socket.socket:
    """A TCP socket listening on 127.0.0.1 (ephemeral port) of namespace `ns`."""
    made: list[socket.socket | BaseException] = []

    def make() -> None:  # setns changes this thread's namespace only; the thread then ends
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{ns.name}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            made.append(sock)
        except BaseException as exc:
            made.append(exc)

    thread = threading.Thread(target=make, name="setns")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


class ApiInNamespace:
    """A FakeApiServer on its own loop thread; `call` runs a function of it on that loop."""

    def __init__(self, server: FakeApiServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self._loop = loop

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        async def run() -> T:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def apply(self, obj: dict[str, Any]) -> None:
        """Create or replace an object (as `kubectl apply`)."""
        self.call(self.server.apply, obj)

    def kubeconfig(self, path: Path) -> Path:
        return self.server.write_kubeconfig(path)


@contextmanager
def api_in(ns: Netns) -> Iterator[ApiInNamespace]:
    """The fake serving in `ns`, stopped (and its thread ended) on exit."""
    sock = listening_socket_in(ns)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-apiserver", daemon=True)
    thread.start()
    server = FakeApiServer()
    server.rbac = Rbac(chart_rules())  # the chart's ClusterRole, enforced
    try:
        asyncio.run_coroutine_threadsafe(server.start(sock), loop).result(timeout=30)
        yield ApiInNamespace(server, loop)
    finally:
        try:
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            loop.close()
            sock.close()
