"""Logs: JSON lines on request; per-connection lines only at high verbosity."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
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
    entries = [json.loads(line) for line in (logs.flush() and log_stream.getvalue()).splitlines()]
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
    text = logs.flush() and log_stream.getvalue()
    assert "default/web:http -> 127.0.0.1:" in text  # the service port line, at INFO
    assert "default/web:http: 127.0.0.1:" not in text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_a_stderr_pipe_nobody_reads_never_stalls_the_data_plane(
    tmp_path: Path, workers: str
) -> None:
    """-v 4 logs two lines per connection: the 64 KiB pipe is full after ~300 of them."""
    started = await start_named_backends(["pod-a"])
    manifest = tmp_path / "svc.yaml"
    write_manifests(
        manifest,
        [
            service("web", [{"name": "http", "port": 80}]),
            *endpoint_slice("web", "http", [("127.0.0.1", started[0][1])]),
        ],
    )
    port = _free_port()
    # stdout and stderr are pipes this test never reads.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kube_userspace_proxy", "run", "--manifests", str(manifest),
         "--iptables-backend", "none", "--bind-address", "127.0.0.1",
         "--proxy-port-range", f"{port}-{port}", "--healthz-bind-address", "",
         "--metrics-bind-address", "", "--workers", workers, "-v", "4", "--state-dir", ""],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if await asyncio.wait_for(ask(port), 2) == "pod-a":
                    break
            except (OSError, TimeoutError):
                pass
            assert proc.poll() is None, "the proxy exited"
            assert time.monotonic() < deadline, "the proxy never served"
            await asyncio.sleep(0.1)
        answered = 0
        for _ in range(2000):  # ~280 KB of log lines, at most ~30 s even on a busy machine
            answer = await asyncio.wait_for(ask(port), 5)
            assert answer == "pod-a"
            answered += 1
        assert answered == 2000
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        for _, _, server in started:
            server.close()
            await server.wait_closed()


def test_records_queue_and_a_full_queue_drops_instead_of_blocking() -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, True)
    stream = os.fdopen(write_end, "w", buffering=1)
    try:
        logs.setup(0, stream=stream)
        log = logs.get("kube_userspace_proxy.test")
        begun = time.monotonic()
        for i in range(logs.QUEUE_RECORDS + 5_000):
            log.info("line %d %s", i, "x" * 100)
        # Never waited for the pipe: nobody reads it, so a wait would last until the test's
        # timeout. (15,000 records take ~1 s; 10 s was not enough beside two CPU hogs.)
        assert time.monotonic() - begun < 60
        assert logs.dropped() > 0
    finally:
        os.close(read_end)  # the writer thread gets EPIPE and drains the queue
        # Let it drain before the stream closes: records written after that would each
        # print "--- Logging error --- ValueError: I/O operation on closed file", after
        # this test (a slow drain on a busy machine outlasts stop()'s 2 s).
        assert logs.flush(timeout=120)
        logs.stop()
        with contextlib.suppress(BrokenPipeError):
            stream.close()
