"""The collector is held off while the proxy builds its first state, and only then."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

from kube_userspace_proxy import app
from kube_userspace_proxy.errors import ConfigError
from tests.loopback.proxyrun import (
    ask,
    endpoint_slice,
    loopback_config,
    running_proxy,
    service,
    start_named_backends,
    wait_for,
    write_manifests,
)


async def test_the_collector_is_held_off_until_the_first_sync_then_runs(tmp_path: Path) -> None:
    assert gc.isenabled()
    backends = await start_named_backends(["pod-a"])
    manifest = tmp_path / "svc.yaml"
    web = service("web", [{"name": "http", "port": 80}])
    write_manifests(
        manifest, [web, *endpoint_slice("web", "http", [("127.0.0.1", backends[0][1])])]
    )
    seen_at_start: list[bool] = []
    stop = asyncio.Event()

    def started(proxy: app.Proxy) -> None:
        seen_at_start.append(gc.isenabled())  # before the source has listed anything

    task = asyncio.create_task(app.serve(loopback_config(manifest), stop=stop, started=started))
    try:
        await wait_for(lambda: seen_at_start, 10, "the proxy's start")
        assert seen_at_start == [False]
        await wait_for(gc.isenabled, 10, "the collector to run again after the first sync")
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0
        for _, _, server in backends:
            server.close()
    assert gc.isenabled()


async def test_the_proxy_serves_with_the_collector_running(tmp_path: Path) -> None:
    backends = await start_named_backends(["pod-a"])
    manifest = tmp_path / "svc.yaml"
    web = service("web", [{"name": "http", "port": 80}])
    write_manifests(
        manifest, [web, *endpoint_slice("web", "http", [("127.0.0.1", backends[0][1])])]
    )
    try:
        async with running_proxy(loopback_config(manifest)) as proxy:
            assert gc.isenabled() and not proxy.first_build.held
            port = proxy.proxier.port_of(next(iter(proxy.state.snapshot().services)))
            assert await ask(port) == "pod-a"
    finally:
        for _, _, server in backends:
            server.close()


async def test_a_start_that_fails_leaves_the_collector_running(tmp_path: Path) -> None:
    no_such_kubeconfig = {"manifests": (), "kubeconfig": str(tmp_path / "absent")}
    config = loopback_config(tmp_path / "none.yaml").model_copy(update=no_such_kubeconfig)
    with pytest.raises(ConfigError):
        await app.serve(config)
    assert gc.isenabled()
