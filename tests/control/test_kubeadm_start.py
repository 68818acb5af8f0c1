"""kubeadm's kube-proxy ConfigMap and DaemonSet command line start the proxy unchanged.

The ConfigMap's config.conf is used as kubeadm wrote it; its kubeconfig.conf differs only in
the paths that point into a pod (the API server URL, the service account's token file), which
the test points at the fake API server and a token file of its own.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import pytest
import yaml

from kube_userspace_proxy import app, cli
from kube_userspace_proxy.config.settings import ProxyConfig
from tests.fakes.apiserver import FakeApiServer
from tests.loopback.proxyrun import running_proxy
from tests.unit.test_kubeadm_config import RELEASES, configmap


def kubeadm_files(release: str, apiserver: FakeApiServer, tmp_path: Path) -> tuple[Path, Path]:
    """config.conf (unchanged) and kubeconfig.conf (pod paths pointed at the test's files)."""
    data = configmap(release)
    config = tmp_path / "config.conf"
    config.write_text(data["config.conf"])
    token = tmp_path / "token"
    token.write_text("kubeadm-token")
    kubeconfig = yaml.safe_load(data["kubeconfig.conf"])
    cluster = kubeconfig["clusters"][0]["cluster"]
    assert cluster.pop("certificate-authority").endswith("serviceaccount/ca.crt")
    cluster["server"] = apiserver.url
    user = kubeconfig["users"][0]["user"]
    assert user["tokenFile"].endswith("serviceaccount/token")
    user["tokenFile"] = str(token)
    path = tmp_path / "kubeconfig.conf"
    path.write_text(yaml.safe_dump(kubeconfig))
    return config, path


@pytest.mark.parametrize("release", RELEASES)
async def test_kubeadm_configmap_starts_the_proxy_with_kube_proxys_values(
    release: str, apiserver: FakeApiServer, tmp_path: Path
) -> None:
    config_file, kubeconfig = kubeadm_files(release, apiserver, tmp_path)
    argv = [
        # kubeadm's DaemonSet command line, as the kubelet expands it:
        f"--config={config_file}",
        "--hostname-override=node-1",
        # the test's own: the fake's kubeconfig, loopback sites, no iptables.
        f"--kubeconfig={kubeconfig}",
        "--healthz-bind-address=127.0.0.1:0",
        "--metrics-bind-address=127.0.0.1:0",
        "--iptables-backend=none",
        "--oom-score-adj=0",
        "--workers=1",
        f"--state-dir={tmp_path / 'state'}",
    ]
    config = cli.parse_config(cli.make_parser().parse_args(["run", *argv]))
    async with running_proxy(config) as proxy, aiohttp.ClientSession() as http:
        assert proxy.ops is not None
        base = f"http://127.0.0.1:{proxy.ops.metrics_port}"
        async with http.get(f"{base}/configz") as resp:
            assert resp.status == 200
            body = await resp.json()
        async with http.get(f"http://127.0.0.1:{proxy.ops.healthz_port}/healthz") as resp:
            assert resp.status == 200
    doc = body["kubeproxy.config.k8s.io"]
    assert doc["iptables"]["syncPeriod"] == "30s"
    assert doc["iptables"]["minSyncPeriod"] == "1s"
    assert doc["udpIdleTimeout"] == "250ms"
    assert doc["clientConnection"]["qps"] == 5
    assert doc["clientConnection"]["burst"] == 10
    assert doc["configSyncPeriod"] == "15m0s"
    assert doc["hostnameOverride"] == "node-1"
    assert doc["clusterCIDR"] == "10.244.0.0/16"
    # The proxy authenticated with the token file kubeadm's kubeconfig names.
    assert apiserver.count() > 0


async def test_a_proxy_without_api_access_is_live_but_not_ready(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    server = FakeApiServer(port=dead)
    kubeconfig.write_text(yaml.safe_dump(server.kubeconfig()))
    config = ProxyConfig(
        kubeconfig=str(kubeconfig),
        bind_address="127.0.0.1",
        iptables_backend="none",
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="",
        hostname_override="node-1",
        workers="1",
    )
    stop = asyncio.Event()
    started: asyncio.Future[app.Proxy] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(app.serve(config, stop=stop, started=started.set_result))
    try:
        proxy = await asyncio.wait_for(started, 10)
        assert proxy.ops is not None
        base = f"http://127.0.0.1:{proxy.ops.healthz_port}"
        async with aiohttp.ClientSession() as http:
            for path, want in (("/readyz", 503), ("/healthz", 200), ("/livez", 200)):
                async with http.get(base + path) as resp:
                    assert resp.status == want, path
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0
