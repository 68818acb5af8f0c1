"""Logs: JSON lines on request; per-connection lines only at high verbosity."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kube_userspace_proxy import logs
from kube_userspace_proxy.model import Protocol, ServicePortName
from tests.loopback.proxyrun import (
    ask,
    endpoint_slice,
    loopback_config,
    running_proxy,
    service,
    start_named_backends,
    write_manifests,
)


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    yield stream
    logs.setup(0)


async def _one_connection(tmp_path: Path) -> None:
    started = await start_named_backends(["pod-a"])
    manifest = tmp_path / "svc.yaml"
    write_manifests(
        manifest,
        [
            service("web", [{"name": "http", "port": 80}]),
            *endpoint_slice("web", "http", [("127.0.0.1", started[0][1])]),
        ],
    )
    try:
        async with running_proxy(loopback_config(manifest)) as proxy:
            port = proxy.proxier.port_of(ServicePortName("default", "web", "http", Protocol.TCP))
            assert await ask(port) == "pod-a"
    finally:
        for _, _, server in started:
            server.close()
            await server.wait_closed()


async def test_verbosity_4_logs_each_connection_as_json_lines(
    tmp_path: Path, log_stream: io.StringIO
) -> None:
    logs.setup(4, "json", stream=log_stream)
    await _one_connection(tmp_path)
    entries = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    assert all({"ts", "level", "logger", "msg"} <= entry.keys() for entry in entries)
    conn = [e for e in entries if e["msg"].startswith("default/web:http: 127.0.0.1:")]
    assert len(conn) == 2  # connected (client -> endpoint) and closed
    assert "->" in conn[0]["msg"] and "closed" in conn[1]["msg"]
    assert any("default/web:http -> 127.0.0.1:" in e["msg"] for e in entries)


async def test_default_verbosity_logs_no_per_connection_lines(
    tmp_path: Path, log_stream: io.StringIO
) -> None:
    logs.setup(0, "text", stream=log_stream)
    await _one_connection(tmp_path)
    text = log_stream.getvalue()
    assert "default/web:http -> 127.0.0.1:" in text  # the service port line, at INFO
    assert "default/web:http: 127.0.0.1:" not in text
