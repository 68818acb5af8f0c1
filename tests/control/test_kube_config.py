"""Where KubeSource finds its API server: kubeconfig, $KUBECONFIG, --master, in-cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kube_userspace_proxy.cluster.sources.client import load_client_configuration
from kube_userspace_proxy.cluster.sources.kube import KubeSource, label_selector
from kube_userspace_proxy.cluster.state import ClusterState
from kube_userspace_proxy.errors import ConfigError, ProxyError
from tests.control.conftest import NODE, StartSource, node, service
from tests.fakes.apiserver import FakeApiServer


def _dead_kubeconfig(apiserver: FakeApiServer, path: Path) -> str:
    """A kubeconfig like the fake's, but naming a port where nothing listens."""
    config = apiserver.kubeconfig()
    config["clusters"][0]["cluster"]["server"] = "http://127.0.0.1:9"
    path.write_text(yaml.safe_dump(config))
    return str(path)


async def test_kubeconfig_from_the_environment_is_used(
    apiserver: FakeApiServer,
    start_source: StartSource,
    kubeconfig: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    apiserver.create(service("web"))
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    watching = await start_source(kubeconfig=None)
    assert watching.services() == {"web"}


async def test_master_alone_is_enough(apiserver: FakeApiServer, start_source: StartSource) -> None:
    apiserver.create(service("web"))
    watching = await start_source(kubeconfig=None, master=apiserver.url)
    assert watching.services() == {"web"}


async def test_master_overrides_the_kubeconfig_server(
    apiserver: FakeApiServer, start_source: StartSource, tmp_path: Path
) -> None:
    apiserver.create(service("web"))
    dead = _dead_kubeconfig(apiserver, tmp_path / "dead")
    watching = await start_source(kubeconfig=dead, master=apiserver.url)
    assert watching.services() == {"web"}


async def test_missing_kubeconfig_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="nope: no such file"):
        await load_client_configuration(str(missing))


async def test_no_configuration_at_all_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="in-cluster"):
        await load_client_configuration()


async def test_run_raises_config_error_for_a_broken_kubeconfig(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.write_text("apiVersion: v1\nkind: Config\nclusters: [}\n")
    source = KubeSource(ClusterState(), kubeconfig=str(broken), node_name=NODE)
    with pytest.raises(ConfigError, match="broken"):
        await source.run()


def test_selector_without_a_proxy_name_excludes_named_and_headless() -> None:
    assert label_selector() == (
        "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
    )


def test_selector_with_a_proxy_name_requires_it() -> None:
    assert label_selector("userspace") == (
        "service.kubernetes.io/service-proxy-name=userspace,!service.kubernetes.io/headless"
    )


async def test_load_once_lists_everything_once(apiserver: FakeApiServer, kubeconfig: str) -> None:
    apiserver.create(service("web"))
    apiserver.create(node(NODE, addresses=[("InternalIP", "10.0.0.5")]))
    state = ClusterState(node_name=NODE)
    await KubeSource(state, kubeconfig=kubeconfig, node_name=NODE).load_once()
    assert state.listed
    snapshot = state.snapshot()
    assert {name.name for name in snapshot.services} == {"web"}
    assert snapshot.node_ips == ("10.0.0.5",)
    assert apiserver.count(verb="watch") == 0


async def test_load_once_names_the_server_when_it_is_down(
    apiserver: FakeApiServer, tmp_path: Path
) -> None:
    dead = _dead_kubeconfig(apiserver, tmp_path / "dead")
    source = KubeSource(ClusterState(), kubeconfig=dead, node_name=NODE, request_timeout=2)
    with pytest.raises(ProxyError, match=r"cannot list Services from http://127\.0\.0\.1:9"):
        await source.load_once()
