"""The running proxy's check of a would-be successor (`restart.peers`)."""

from __future__ import annotations

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
