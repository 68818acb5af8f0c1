"""The running proxy's check of a would-be successor (`restart.peers`)."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from kube_userspace_proxy import fdpass
from kube_userspace_proxy.restart import peers


def test_a_process_of_this_user_in_this_network_namespace_passes(tmp_path: Path) -> None:
    server = fdpass.listen(tmp_path / "handover.sock")
    server.setblocking(True)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        client.connect(str(tmp_path / "handover.sock"))
        conn, _ = server.accept()
        with conn:
            assert peers.netns_cookie(conn) == peers.netns_cookie(server) is not None
            assert peers.check(conn, server) == os.getpid()
    finally:
        client.close()
        server.close()


async def test_descriptors_pass_through_a_socket_deeper_than_a_unix_address_holds(
    tmp_path: Path,
) -> None:
    # A state directory of a kubelet or pytest is easily over sun_path's 107 bytes: the
    # handover socket (and each worker's) must still be usable there.
    deep = tmp_path.joinpath(*["a-directory-name-of-some-length"] * 5)
    deep.mkdir(parents=True)
    path = deep / "handover.sock"
    assert len(os.fsencode(path)) > fdpass.SUN_PATH_MAX
    server = fdpass.listen(path)
    assert path.exists() and oct(path.stat().st_mode & 0o777) == "0o600"
    try:
        client = await asyncio.to_thread(fdpass.connect, path, 5.0)
        with client, await fdpass.accept(server) as conn:
            mine, theirs = socket.socketpair()
            with mine, theirs:
                await fdpass.send(client, {"op": "pair"}, [theirs.fileno()])
                message, socks = await fdpass.receive(conn)
                assert message == {"op": "pair"} and len(socks) == 1
                with socks[0] as passed:
                    passed.sendall(b"x")
                    assert mine.recv(1) == b"x"
    finally:
        server.close()
