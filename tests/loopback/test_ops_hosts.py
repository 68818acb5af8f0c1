"""The metrics site answers only to its own names (issue 22, item 6): DNS rebinding.

A web page on evil.example whose name a rebinding resolver points at 127.0.0.1 makes the
browser send `Host: evil.example`; the site must not show it /debug/state, /debug/ui or
anything else. IP literals, `localhost` and the names given with `--metrics-allowed-hosts`
are answered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from kube_userspace_proxy import cli
from kube_userspace_proxy.config.settings import ProxyConfig
from kube_userspace_proxy.ops.health import ProxyHealth
from kube_userspace_proxy.ops.metrics import ProxyMetrics, sample_value
from kube_userspace_proxy.ops.server import start_ops

SECRET = "default/secret-service:http"
PATHS = ["/debug/state", "/debug/ui", "/metrics", "/configz", "/proxyMode", "/healthz"]


@pytest.fixture
async def metrics_port() -> AsyncIterator[int]:
    server = await start_ops(
        healthz_bind="",
        metrics_bind="127.0.0.1:0",
        health=ProxyHealth(30.0),
        metrics=ProxyMetrics(list, process_metrics=False),
        debug_state=lambda: {SECRET: {"endpoints": ["10.1.0.1:8080"]}},
        configz=dict,
        allowed_hosts=("proxy.node-1.example",),
    )
    try:
        assert server.metrics_port is not None
        yield server.metrics_port
    finally:
        await server.close()


async def get(port: int, path: str, host: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}{path}", headers={"Host": host}) as resp,
    ):
        return resp.status, await resp.text()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "localhost.evil.example"])
async def test_a_foreign_host_name_gets_421_and_no_state(
    metrics_port: int, path: str, host: str
) -> None:
    status, body = await get(metrics_port, path, host.format(port=metrics_port))
    assert status == 421
    assert SECRET not in body and "endpoints" not in body


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:{port}",
        "127.0.0.1",
        "10.0.0.5:{port}",
        "[::1]:{port}",
        "localhost:{port}",
        "LOCALHOST.",
        "proxy.node-1.example:{port}",
        "Proxy.Node-1.Example",
    ],
)
async def test_ip_literals_localhost_and_configured_names_are_answered(
    metrics_port: int, host: str
) -> None:
    status, body = await get(metrics_port, "/debug/state", host.format(port=metrics_port))
    assert status == 200
    assert SECRET in body


async def test_refused_hosts_are_counted(metrics_port: int) -> None:
    await get(metrics_port, "/debug/state", "evil.example")
    _, text = await get(metrics_port, "/metrics", "127.0.0.1")
    refused = sample_value(
        text, "kube_userspace_proxy_ops_requests_refused_total", {"site": "metrics"}
    )
    assert refused is not None and refused >= 1


def test_the_flag_names_the_allowed_hosts_and_defaults_to_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert ProxyConfig().metrics_allowed_hosts == ()
    args = cli.make_parser().parse_args(
        ["run", "--metrics-allowed-hosts", "a.example,b.example", "--manifests", "m"]
    )
    assert cli.parse_config(args).metrics_allowed_hosts == ("a.example", "b.example")
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    start = text.index("--metrics-allowed-hosts strings Host names")
    assert "default [])" in text[start : text.index("--", start + 3)]
