"""The native core's own surface, through real sockets on loopback: the client address an
accept reports (formatted in C), and `dial`'s argument checks, which `native.NativePlane._dial`
turns into an unreachable endpoint instead of a crash."""

from __future__ import annotations

import importlib
import os
import socket
import time
from typing import Any

import pytest

from kube_userspace_proxy.dataplane import native
from tests import polling

pytestmark = pytest.mark.skipif(
    native.unavailable().startswith("the C extension"), reason="the C extension is not built"
)


def _events(core: Any, want: int, timeout: float = 30.0) -> list[tuple[Any, ...]]:
    """Run the core until it hands back an event of kind `want`; every event so far."""
    got: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got += core.run()
        if any(event[0] == want for event in got):
            return got
        time.sleep(0.005)
    raise AssertionError(f"no event {want} within {timeout} s: {got}")


def _module() -> Any:
    return importlib.import_module("kube_userspace_proxy.dataplane._native")


@pytest.fixture
def core() -> Any:
    core = _module().Core()
    yield core
    core.close()


@pytest.fixture
def listener() -> Any:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        sock.setblocking(False)
        yield sock


@pytest.mark.parametrize("source", ["127.0.0.1", "127.10.200.9", "127.255.0.99", "127.1.20.100"])
def test_native_accept_reports_the_clients_address_and_port(
    core: Any, listener: Any, source: str
) -> None:
    core.add_listener(listener.fileno(), "web", 0, 0, 0, False)
    with socket.socket() as client:
        client.bind((source, 0))
        client.connect(listener.getsockname())
        accepted = _module().EV_ACCEPTED
        event = next(e for e in _events(core, accepted) if e[0] == accepted)
        assert event[1] == "web"
        assert (event[3], event[4]) == client.getsockname()
        core.reset(event[2])


def test_native_dial_refuses_bad_arguments_and_the_client_still_waits(
    core: Any, listener: Any
) -> None:
    core.add_listener(listener.fileno(), "web", 0, 0, 0, False)
    backend = socket.create_server(("127.0.0.1", 0))
    host, port = backend.getsockname()
    with socket.socket() as client, backend:
        client.connect(listener.getsockname())
        accepted, dialed_kind = _module().EV_ACCEPTED, _module().EV_DIALED
        conn = next(e for e in _events(core, accepted) if e[0] == accepted)[2]
        bad: list[tuple[tuple[Any, ...], type[Exception]]] = [
            ((conn, host, port, 100), TypeError),  # too few
            ((conn, host, port, 100, None, b"", None, "x"), TypeError),  # too many
            ((conn, b"127.0.0.1", port, 100, None), TypeError),  # host not str
            ((conn, "127.0.0.1\0", port, 100, None), ValueError),  # a NUL in it
            ((conn, host, "80", 100, None), TypeError),
            ((conn, host, 2**40, 100, None), OverflowError),
            ((conn, host, 0, 100, None), ValueError),
            ((conn, host, 70000, 100, None), ValueError),
            ((conn, host, port, 0, None), ValueError),  # no timeout
            ((conn, "10.0.0.300", port, 100, None), ValueError),
            ((conn, "::1", port, 100, None, b"", "127.0.0.1"), ValueError),  # families differ
            ((conn, host, port, 100, None, "PROXY"), TypeError),  # a header is bytes
            ((conn, host, port, 100, None, b"x" * (1 << 20)), ValueError),  # longer than a buffer
            ((conn, host, port, 100, None, b"", 5), TypeError),  # bind_host not str
            ((conn + (1 << 32), host, port, 100, None), KeyError),  # an older connection's id
        ]
        for args, error in bad:
            with pytest.raises(error):
                core.dial(*args)
        # Still waiting for its dial: a good one connects, and bytes flow both ways.
        core.dial(conn, host, port, 2000, ("data",), b"hello ")
        dialed = next(e for e in _events(core, dialed_kind) if e[0] == dialed_kind)
        assert dialed[1:4] == (("data",), conn, 0)
        peer, _ = backend.accept()
        with peer:
            client.sendall(b"world")
            peer.settimeout(30)
            got = b""
            while len(got) < len(b"hello world"):
                core.run()
                got += peer.recv(100)
            assert got == b"hello world"


@pytest.mark.parametrize("buffers", [6, 7, 8])
def test_native_eof_read_on_a_pumps_last_turn_still_reaches_the_client(
    listener: Any, buffers: int
) -> None:
    """A direction reads at most 8 times a wakeup (then other connections get their turn). The
    endpoint's data and its FIN wait together, and with 7 full buffers the FIN is read on the
    8th, last, read: the EOF must still be passed on (FIN to the client), with no further
    event to come from the endpoint, whose socket is done."""
    size = 1024
    core = _module().Core(buffer_size=size)
    try:
        core.add_listener(listener.fileno(), "web", 0, 0, 0, False)  # copy, no splice
        with socket.socket() as client, socket.create_server(("127.0.0.1", 0)) as backend:
            client.connect(listener.getsockname())
            accepted, dialed = _module().EV_ACCEPTED, _module().EV_DIALED
            conn = next(e for e in _events(core, accepted) if e[0] == accepted)[2]
            core.dial(conn, *backend.getsockname(), 2000, None)
            assert next(e for e in _events(core, dialed) if e[0] == dialed)[3] == 0
            peer, _ = backend.accept()
            with peer:
                data = os.urandom(buffers * size)
                peer.sendall(data)
                peer.shutdown(socket.SHUT_WR)  # its FIN waits behind the data
                time.sleep(0.05)  # both are in the proxy's receive queue before it runs
                client.setblocking(False)
                got = b""
                eof = False

                def arrived() -> bool:
                    nonlocal got, eof
                    core.run()
                    try:
                        while chunk := client.recv(65536):
                            got += chunk
                        eof = True
                    except BlockingIOError:
                        pass
                    return eof

                polling.poll(arrived, "the endpoint's data, then EOF, at the client", 30, 0.01)
                assert got == data
    finally:
        core.close()
