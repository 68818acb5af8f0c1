"""A host without a usable iptables: one clear line naming the package and
`--iptables-backend`, exit 1, no traceback.

The host is made in a private mount namespace (and a new network namespace, so that nothing
could ever be installed outside one): an empty directory is mounted over /usr/sbin, so the
iptables tools are gone and /sbin/ldconfig fails, as on a fresh Debian machine without the
iptables package. python-iptables then fails at import with its own
`XTablesError: ldconfig failed, please set XTABLES_LIBDIR` (not an OSError).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import PROXY


def _run_without_iptables(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    (sbin / "ldconfig").write_text("#!/bin/sh\nexit 1\n")
    (sbin / "ldconfig").chmod(0o755)
    manifest = tmp_path / "svc.yaml"
    manifest.write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\n"
        "spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]}\n"
    )
    command = f"mount --bind {sbin} /usr/sbin && exec {PROXY} run --manifests {manifest}"
    command += " --state-dir '' --healthz-bind-address 127.0.0.1:0"
    command += " --metrics-bind-address 127.0.0.1:0 " + " ".join(flags)
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux's unshare"
    return subprocess.run(
        [unshare, "--mount", "--net", "--propagation", "private", "sh", "-c", command],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ((), "install the iptables package"),
        (("--iptables-backend", "iptc"), "python-iptables cannot load"),
        (("--iptables-backend", "restore"), "iptables is not installed"),
    ],
)
def test_a_host_without_iptables_gets_one_line_and_exit_1(
    netns_ok: None, tmp_path: Path, flags: tuple[str, ...], said: str
) -> None:
    done = _run_without_iptables(tmp_path, *flags)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("kube-userspace-proxy:")]
    assert len(errors) == 1, done.stderr
    assert said in errors[0] and "--iptables-backend" in errors[0], errors[0]
    assert "iptables package" in errors[0], errors[0]
