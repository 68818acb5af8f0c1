"""What the control process loads: only what its mode and backend need (a smaller start)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.loopback.proxyrun import (
    LOOPBACK_RUN_FLAGS,
    endpoint_slice,
    printed_by,
    service,
    write_manifests,
)

# Runs the command as `python -m kube_userspace_proxy` does, and writes the names of the
# modules it loaded to the file in argv[1] as it exits.
RECORDING = """\
import atexit, json, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
from kube_userspace_proxy.cli import main
sys.exit(main())
"""


def modules_of_a_manifest_run(tmp_path: Path) -> set[str]:
    """The modules a `run --manifests` control process loaded from its start to its exit."""
    manifest = tmp_path / "svc.yaml"
    write_manifests(
        manifest,
        [
            service("web", [{"name": "http", "port": 80}]),
            *endpoint_slice("web", "http", [("127.0.0.1", 9)]),
        ],
    )
    out = tmp_path / "modules.json"
    argv = [sys.executable, "-c", RECORDING, str(out), "run", "--manifests", str(manifest)]
    argv += [*LOOPBACK_RUN_FLAGS, "--workers", "1", "--state-dir", ""]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        announced = False
        while not announced and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            announced = "default/web:http ->" in line
        assert announced, "the proxy never announced its port"
        proc.send_signal(signal.SIGTERM)
        proc.stderr.read()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    return set(json.loads(out.read_text()))


def test_a_manifest_mode_control_process_never_imports_the_kube_client(tmp_path: Path) -> None:
    loaded = modules_of_a_manifest_run(tmp_path)
    assert "kube_userspace_proxy.cluster.sources.manifests" in loaded  # it did run
    assert not {m for m in loaded if m.split(".")[0] == "kubernetes_asyncio"}
    assert "kube_userspace_proxy.cluster.sources.kube" not in loaded
    # Netlink (conntrack flushes, the transparent return path) and python-iptables load
    # where they are used: neither is with no UDP flow to flush and no iptc backend.
    assert not {m for m in loaded if m.split(".")[0] in {"pyroute2", "iptc"}}


def test_the_restore_backend_never_imports_iptc() -> None:
    # The whole command and the backend it makes for `--iptables-backend restore` (nothing is
    # installed: only made, so this runs without root and touches no tables).
    script = (
        "import json, sys\n"
        "import kube_userspace_proxy.cli\n"
        "from kube_userspace_proxy.portals.backends import make_backend\n"
        "from kube_userspace_proxy.portals.restore import RestoreBackend\n"
        "assert isinstance(make_backend('restore'), RestoreBackend)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = set(printed_by(script))
    assert "kube_userspace_proxy.portals.restore" in loaded
    assert "iptc" not in loaded
    assert "kube_userspace_proxy.portals.iptc" not in loaded


def test_the_kube_source_loads_none_of_the_generated_models_until_asked() -> None:
    # It reads raw JSON: of kubernetes_asyncio's ~800 generated modules it needs a handful.
    script = (
        "import json, sys\n"
        "from kube_userspace_proxy.cluster.sources.kube import KubeSource\n"
        "from kube_userspace_proxy.cluster.sources.kubeapi import kclient, kconfig\n"
        "assert callable(kconfig.load_kube_config) and callable(kclient.CoreV1Api)\n"
        "before = sorted(sys.modules)\n"
        "from kubernetes_asyncio.client import V1Service\n"  # code that wants more gets it
        "print(json.dumps([before, V1Service.__name__]))\n"
    )
    before, model = printed_by(script)
    assert model == "V1Service"
    assert "kubernetes_asyncio.client.api.core_v1_api" in before
    assert not [m for m in before if m.startswith("kubernetes_asyncio.client.models.")]
    assert len([m for m in before if m.startswith("kubernetes_asyncio")]) < 40
