"""The fake kube-apiserver itself: wire format, selectors, writes from the real client, CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from kubernetes_asyncio import client as kclient
from kubernetes_asyncio import config as kconfig

from tests.control.conftest import endpoint_slice, eventually, service
from tests.fakes.apiserver import FakeApiServer, parse_field_selector, parse_label_selector

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ("a=1", {"a": "1"}, True),
        ("a==1", {"a": "2"}, False),
        ("a!=1", {}, True),
        ("a", {"a": ""}, True),
        ("!a", {"a": ""}, False),
        ("a in (1, 2),!b", {"a": "2"}, True),
        ("a notin (1,2)", {"a": "1"}, False),
        ("", {"x": "y"}, True),
    ],
)
def test_label_selector_forms(selector: str, labels: dict[str, str], expected: bool) -> None:
    assert parse_label_selector(selector)(labels) is expected


def test_field_selector_on_metadata_name() -> None:
    assert parse_field_selector("metadata.name=n1")({"metadata": {"name": "n1"}})
    assert not parse_field_selector("metadata.name!=n1")({"metadata": {"name": "n1"}})


async def test_list_carries_the_global_resource_version(apiserver: FakeApiServer) -> None:
    apiserver.create(service("web"))
    apiserver.create(endpoint_slice("web-a", "web", ["10.244.1.5"]))
    url = f"{apiserver.url}/api/v1/services"
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        body = await response.json()
    assert body["kind"] == "ServiceList"
    assert body["metadata"]["resourceVersion"] == apiserver.resource_version == "3"
    # Like the real API server, list items carry no kind/apiVersion.
    assert "kind" not in body["items"][0]
    assert body["items"][0]["metadata"]["resourceVersion"] == "2"


async def test_watch_from_a_compacted_version_gets_an_expired_error_event(
    apiserver: FakeApiServer,
) -> None:
    apiserver.create(service("web"))
    apiserver.compact()
    url = f"{apiserver.url}/api/v1/services?watch=true&resourceVersion=1"
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.status == 200
        lines = [json.loads(line) async for line in response.content]
    assert lines == [
        {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": "too old resource version: 1 (2)",
                "reason": "Expired",
                "code": 410,
            },
        }
    ]


async def test_watch_streams_changes_after_the_given_version(apiserver: FakeApiServer) -> None:
    apiserver.create(service("web"))
    start = apiserver.resource_version
    url = f"{apiserver.url}/api/v1/services?watch=1&resourceVersion={start}&timeoutSeconds=1"
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        apiserver.apply(service("web", port=81))
        apiserver.delete("Service", "web")
        events = [json.loads(line) async for line in response.content]
    assert [(e["type"], e["object"]["metadata"]["resourceVersion"]) for e in events] == [
        ("MODIFIED", "3"),
        ("DELETED", "4"),
    ]


async def test_real_client_writes_reach_watchers(apiserver: FakeApiServer, kubeconfig: str) -> None:
    apiserver.rbac = None  # this client writes: it is not the proxy (whose role reads only)
    configuration = kclient.Configuration()
    await kconfig.load_kube_config(
        config_file=kubeconfig, client_configuration=configuration, persist_config=False
    )
    async with kclient.ApiClient(configuration) as api:
        core = kclient.CoreV1Api(api)
        await core.create_namespaced_service("default", service("web"))
        await core.patch_namespaced_service(
            "web", "default", {"metadata": {"labels": {"tier": "front"}}}
        )
        listed = await core.list_namespaced_service("default", label_selector="tier=front")
        assert [s.metadata.name for s in listed.items] == ["web"]
        await core.delete_namespaced_service("web", "default")
    assert apiserver.get("Service", "web") is None
    assert apiserver.count("services", "create") == 1


async def test_injected_429_carries_retry_after(apiserver: FakeApiServer) -> None:
    apiserver.fail_next(1, 429, retry_after=2)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{apiserver.url}/api/v1/nodes") as response:
            assert (response.status, response.headers["Retry-After"]) == (429, "2")
        async with http.get(f"{apiserver.url}/api/v1/nodes") as response:
            assert response.status == 200


async def test_objects_survive_a_restart_on_the_same_port(apiserver: FakeApiServer) -> None:
    apiserver.create(service("web"))
    port = apiserver.port
    await apiserver.stop()
    await apiserver.start()
    assert apiserver.port == port
    url = f"{apiserver.url}/api/v1/services"
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert [i["metadata"]["name"] for i in (await response.json())["items"]] == ["web"]


async def test_runs_alone_writing_a_kubeconfig_and_seeding_objects(tmp_path: Path) -> None:
    seed = tmp_path / "seed.yaml"
    seed.write_text(
        yaml.safe_dump_all([service("web"), endpoint_slice("web-a", "web", ["10.1.1.1"])])
    )
    kubeconfig = tmp_path / "kubeconfig"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.fakes.apiserver",
            "--port",
            "0",
            "--kubeconfig",
            str(kubeconfig),
            "--seed",
            str(seed),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        await eventually(kubeconfig.exists, timeout=10, what="the kubeconfig")
        server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        url = f"{server}/apis/discovery.k8s.io/v1/endpointslices"
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            items = (await response.json())["items"]
        assert [i["metadata"]["name"] for i in items] == ["web-a"]
    finally:
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0].decode()
    assert process.returncode == 0, output
    assert "seeded 2 objects" in output
