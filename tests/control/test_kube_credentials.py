"""Credentials that rotate: a kubeconfig's tokenFile is re-read when the kubelet replaces it.

The fake API server accepts one token at a time; rotating it ends the open watches, as an
expired token would, and the source must come back with the new token, without a restart.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.control.conftest import eventually, service
from tests.fakes.apiserver import FakeApiServer


def token_kubeconfig(apiserver: FakeApiServer, tmp_path: Path, token_file: str) -> str:
    config = apiserver.kubeconfig()
    config["users"][0]["user"] = {"tokenFile": token_file}
    path = tmp_path / "kubeconfig.conf"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def write_token(path: Path, token: str) -> None:
    """Replace the file at once, as the kubelet swaps a projected volume's files."""
    partial = path.with_name(path.name + ".new")
    partial.write_text(token)
    os.replace(partial, path)


async def test_a_rotated_token_file_keeps_the_watch_working(
    apiserver: FakeApiServer, tmp_path: Path, start_source: Any
) -> None:
    token = tmp_path / "token"
    write_token(token, "token-1")
    apiserver.accepted_tokens = {"token-1"}
    # Relative to the kubeconfig's directory, as kubeconfig paths are.
    kubeconfig = token_kubeconfig(apiserver, tmp_path, "token")
    watching = await start_source(kubeconfig=kubeconfig)
    apiserver.create(service("before"))
    await eventually(lambda: "before" in watching.services(), what="the first Service")

    write_token(token, "token-2")
    apiserver.rotate_token("token-2")  # the old token stops working; watches end
    apiserver.create(service("after", cluster_ip="10.96.0.11"))
    await eventually(lambda: "after" in watching.services(), what="a Service after rotation")
    assert not watching.task.done()
    rejected = [r for r in apiserver.records() if r.status == 401]
    accepted_after = [r for r in apiserver.records() if r.status == 200]
    assert accepted_after  # lists and watches went on with the new token
    # The source never used the old token after the rotation for more than a request or so
    # per resource: it re-read the file at the next request.
    assert len(rejected) <= 3


async def test_a_token_that_stays_wrong_is_refused_until_the_file_changes(
    apiserver: FakeApiServer, tmp_path: Path, start_source: Any
) -> None:
    token = tmp_path / "token"
    write_token(token, "stale")
    apiserver.accepted_tokens = {"fresh"}
    watching = await start_source(
        kubeconfig=token_kubeconfig(apiserver, tmp_path, str(token)), wait_listed=False
    )
    await eventually(lambda: apiserver.count() >= 3, what="refused requests")
    assert not watching.state.listed
    write_token(token, "fresh")
    await eventually(lambda: watching.state.listed, timeout=10, what="lists with the new token")


PLUGIN = """\
import datetime, json, sys
token_file, runs_file, lifetime = sys.argv[1], sys.argv[2], float(sys.argv[3])
with open(runs_file, "a") as runs:
    runs.write("run\\n")
expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=lifetime)
print(json.dumps({
    "apiVersion": "client.authentication.k8s.io/v1beta1",
    "kind": "ExecCredential",
    "status": {
        "token": open(token_file).read().strip(),
        "expirationTimestamp": expiry.strftime("%Y-%m-%dT%H:%M:%SZ"),
    },
}))
"""


def exec_kubeconfig(apiserver: FakeApiServer, tmp_path: Path, lifetime: float) -> str:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)
    config = apiserver.kubeconfig()
    config["users"][0]["user"] = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": sys.executable,
            "args": [str(plugin), str(tmp_path / "token"), str(tmp_path / "runs"), str(lifetime)],
            "interactiveMode": "Never",
        }
    }
    path = tmp_path / "kubeconfig.conf"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def runs(tmp_path: Path) -> int:
    return len((tmp_path / "runs").read_text().splitlines())


async def test_an_expired_exec_credential_is_renewed_by_running_the_plugin_again(
    apiserver: FakeApiServer, tmp_path: Path, start_source: Any
) -> None:
    write_token(tmp_path / "token", "token-1")
    apiserver.accepted_tokens = {"token-1"}
    # A token that expires at once (within the client's 5-minute skew): every request finds
    # it expired and runs the plugin again, so the rotated token is picked up.
    watching = await start_source(kubeconfig=exec_kubeconfig(apiserver, tmp_path, 1.0))
    write_token(tmp_path / "token", "token-2")
    apiserver.rotate_token("token-2")
    apiserver.create(service("after"))
    await eventually(lambda: "after" in watching.services(), what="a Service after rotation")
    assert runs(tmp_path) >= 2


async def test_an_exec_credential_still_valid_is_not_renewed(
    apiserver: FakeApiServer, tmp_path: Path, start_source: Any
) -> None:
    write_token(tmp_path / "token", "token-1")
    apiserver.accepted_tokens = {"token-1"}
    watching = await start_source(kubeconfig=exec_kubeconfig(apiserver, tmp_path, 3600.0))
    apiserver.drop_watches()  # the watches come back: more requests, same credential
    apiserver.create(service("later"))
    await eventually(lambda: "later" in watching.services(), what="a Service after reconnect")
    assert runs(tmp_path) == 1


async def test_an_unreachable_api_server_is_an_error_at_every_backoff_step(
    tmp_path: Path, start_source: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = FakeApiServer(port=port)
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(dead.kubeconfig()))
    with caplog.at_level(logging.ERROR, logger="kube_userspace_proxy.cluster.sources.kube"):
        await start_source(kubeconfig=str(path), wait_listed=False)

        def errors() -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if r.levelno == logging.ERROR and "Service list failed" in r.getMessage()
            ]

        await eventually(lambda: len(errors()) >= 3, what="three failed Service lists logged")
    for line in errors()[:3]:
        assert f"talking to the API server at http://127.0.0.1:{port}" in line
        assert "Cannot connect" in line or "Connect call failed" in line or "refused" in line
    assert [f"retry {n} in" in line for n, line in enumerate(errors()[:3], 1)] == [True] * 3
