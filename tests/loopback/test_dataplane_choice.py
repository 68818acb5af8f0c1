"""`--dataplane auto|native|python` through the real CLI: which data plane serves, said in the
start log line and in /metrics; `auto` without the extension falls back with one warning;
`native` without it is one clear line and exit 1. And the package builds (and installs)
without a C compiler, leaving the extension out."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest

from kube_userspace_proxy.dataplane import native
from tests.loopback.proxyrun import (
    ask,
    endpoint_slice,
    served_ports,
    service,
    start_named_backends,
    wait_for,
    write_manifests,
)

WEB = "default/web:http"
CLI = [sys.executable, "-m", "kube_userspace_proxy"]
ROOT = Path(__file__).parents[2]
FALLBACK = "the native data plane cannot serve"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return str(reply.read().decode())
    except OSError:
        return ""


@pytest.mark.parametrize(
    ("flag", "extension", "serves", "event_loop"),
    [
        ("auto", True, "native", "auto"),
        ("auto", False, "python", "auto"),
        ("python", True, "python", "auto"),
        ("auto", True, "native", "uvloop"),  # the core nested in uvloop's wait, as before
        ("auto", True, "native", "native"),
    ],
)
async def test_the_data_plane_that_serves_is_said_in_the_log_and_in_metrics(
    tmp_path: Path, flag: str, extension: bool, serves: str, event_loop: str
) -> None:
    assert "not built" not in native.unavailable(), "the suite runs with the extension built"
    backends = await start_named_backends(["pod-a"])
    manifest, log = tmp_path / "svc.yaml", tmp_path / "proxy.log"
    write_manifests(
        manifest,
        [
            service("web", [{"name": "http", "port": 80}]),
            *endpoint_slice("web", "http", [("127.0.0.1", backends[0][1])]),
        ],
    )
    metrics = _free_port()
    env = dict(os.environ)
    env.pop(native.NO_EXTENSIONS, None)
    if not extension:
        env[native.NO_EXTENSIONS] = "1"  # as if the extension were not built
    flags = ["--bind-address", "127.0.0.1", "--iptables-backend", "none"]
    flags += ["--healthz-bind-address", "127.0.0.1:0"]
    flags += ["--metrics-bind-address", f"127.0.0.1:{metrics}", "--manifests", str(manifest)]
    flags += ["--workers", "2", "--loopback-endpoints", "allow", "--dataplane", flag]
    flags += ["--event-loop", event_loop]
    flags += ["--state-dir", str(tmp_path / "state")]
    with open(log, "wb") as out:
        proc = subprocess.Popen([*CLI, "run", *flags], stdout=out, stderr=out, env=env)
    try:
        text = await wait_for(
            lambda: "kube_userspace_proxy_dataplane_info" in (m := _metrics(metrics)) and m,
            60,
            "/metrics",
        )
        state = tmp_path / "state"
        port = await wait_for(lambda: served_ports(state).get(WEB), 60, "the state file")
        assert await ask(port) == "pod-a"
    finally:
        proc.terminate()
        proc.wait(60)
        for _, _, server in backends:
            server.close()
    logged = log.read_text()
    assert f'kube_userspace_proxy_dataplane_info{{dataplane="{serves}"}} 1' in text
    # Where the native data plane serves, the workers wait in its core (--event-loop auto).
    waits_in_core = serves == "native" and event_loop in ("auto", "native")
    where = "asyncio waiting in the native core" if waits_in_core else "uvloop"
    assert f"TCP data plane: {serves} (event loop where it serves: {where})" in logged
    assert logged.count(FALLBACK) == (1 if (flag, extension) == ("auto", False) else 0), logged


def test_native_without_the_extension_is_one_line_and_exit_1(tmp_path: Path) -> None:
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, [service("web", [{"name": "http", "port": 80}])])
    env = {**os.environ, native.NO_EXTENSIONS: "1"}
    flags = ["--bind-address", "127.0.0.1", "--iptables-backend", "none"]
    flags += ["--manifests", str(manifest), "--dataplane", "native"]
    done = subprocess.run(
        [*CLI, "run", *flags],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "--dataplane python" in line]
    assert len(errors) == 1, done.stderr


@pytest.mark.parametrize(("compiler", "has_extension"), [("gcc", True), ("false", False)])
def test_the_wheel_builds_with_and_without_a_compiler(
    tmp_path: Path, compiler: str, has_extension: bool
) -> None:
    # CC=false: a machine whose compiler does not work; the build says so and goes on.
    source = _sources(tmp_path)
    env = {**os.environ, "CC": compiler, "LDSHARED": f"{compiler} -shared"}
    env.pop("KUP_SANITIZE", None)
    done = _wheel(source, tmp_path / "wheels", env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("kube_userspace_proxy-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    built = any(
        name.startswith("kube_userspace_proxy/dataplane/_native.") and name.endswith(".so")
        for name in names
    )
    assert built is has_extension
    assert "kube_userspace_proxy/dataplane/native.py" in names
    if not has_extension:  # setuptools says why it left the optional extension out
        said = done.stdout + done.stderr
        assert 'building extension "kube_userspace_proxy.dataplane._native" failed' in said


def _wheel(source: Path, wheels: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`pip wheel` of `source` into `wheels`, offline, saying what the build did (-v)."""
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v"]
    return subprocess.run(
        [*pip, "--wheel-dir", str(wheels), str(source)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _sources(tmp_path: Path) -> Path:
    """A copy of what a build reads (the checkout's build/ holds objects a build would reuse)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    return source


def test_a_build_that_requires_the_extension_fails_without_a_compiler(tmp_path: Path) -> None:
    # The Dockerfile's build stage: KUP_REQUIRE_NATIVE=1, the image always has it.
    source = _sources(tmp_path)
    env = {**os.environ, "CC": "false", "LDSHARED": "false -shared", "KUP_REQUIRE_NATIVE": "1"}
    done = _wheel(source, tmp_path / "wheels", env)
    assert done.returncode != 0
    assert not list((tmp_path / "wheels").glob("*.whl"))
