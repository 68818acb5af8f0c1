"""ManifestSource: YAML/JSON files into ClusterState, reloaded on change, broken files survived."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_userspace_proxy.cluster.sources.manifests import ManifestSource
from kube_userspace_proxy.cluster.state import ClusterState
from kube_userspace_proxy.errors import ManifestError
from kube_userspace_proxy.model import ServicePortName
from tests import polling

POLL = 0.05


def service(name: str, namespace: str | None = "default", port: int = 80) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": port}]},
    }


def endpoint_slice(service_name: str, ip: str = "127.0.0.11") -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service_name}-abc",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
    }


DEPLOYMENT = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}}


def write(path: Path, text: str) -> None:
    """Replace atomically, as editors and `kubectl` tooling do."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_yaml(path: Path, *objects: dict[str, Any]) -> None:
    write(path, yaml.safe_dump_all(objects))


def names(state: ClusterState) -> set[str]:
    return {str(n) for n in state.snapshot().services}


async def eventually(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    await polling.eventually(check, what, timeout)


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Records of the package logger, even when logs.setup() stopped it propagating."""
    logger = logging.getLogger("kube_userspace_proxy")
    logger.addHandler(caplog.handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(old_level)


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    found = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    return list(dict.fromkeys(found))


@pytest.fixture
async def running() -> AsyncIterator[Callable[[ManifestSource], None]]:
    """Start `source.run()` as a task; cancelled at the end of the test."""
    tasks: list[asyncio.Task[None]] = []

    def start(source: ManifestSource) -> None:
        tasks.append(asyncio.create_task(source.run(), name="manifests"))

    yield start
    for task in tasks:
        task.cancel()
    for task in tasks:
        with pytest.raises(asyncio.CancelledError):
            await task


# -- one-shot loading -------------------------------------------------------------------------


async def test_directory_of_yaml_yml_and_json_is_loaded(tmp_path: Path) -> None:
    write_yaml(tmp_path / "a.yaml", service("a"), DEPLOYMENT, endpoint_slice("a"))
    write_yaml(tmp_path / "b.yml", {"apiVersion": "v1", "kind": "List", "items": [service("b")]})
    write(tmp_path / "c.json", json.dumps(service("c")))
    write(tmp_path / "notes.txt", "kind: Service\n")  # not a manifest suffix
    state = ClusterState(loopback_endpoints=True)
    await ManifestSource([tmp_path], state).load_once()
    snap = state.snapshot()
    assert {str(n) for n in snap.services} == {"default/a:http", "default/b:http", "default/c:http"}
    assert [e.ip for e in snap.endpoints_of(ServicePortName("default", "a", "http"))] == [
        "127.0.0.11"
    ]
    assert state.listed


async def test_object_without_namespace_goes_to_default(tmp_path: Path) -> None:
    write_yaml(tmp_path / "svc.yaml", service("web", namespace=None))
    state = ClusterState()
    await ManifestSource([tmp_path / "svc.yaml"], state).load_once()
    assert names(state) == {"default/web:http"}


async def test_other_kinds_only_means_an_empty_listed_state(tmp_path: Path) -> None:
    write_yaml(tmp_path / "deploy.yaml", DEPLOYMENT)
    state = ClusterState()
    await ManifestSource([tmp_path], state).load_once()
    assert state.listed
    assert names(state) == set()


async def test_broken_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("kind: Service\nmetadata:\n  name: [unclosed\nspec: {}\n")
    with pytest.raises(ManifestError, match=rf"{path}:\d+:\d+: "):
        await ManifestSource([path], ClusterState()).load_once()


async def test_broken_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "kind": "Service",\n  "metadata": {,}\n}\n')
    with pytest.raises(ManifestError, match=rf"{path}:3:\d+: "):
        await ManifestSource([path], ClusterState()).load_once()


async def test_invalid_yaml_value_is_a_manifest_error(tmp_path: Path) -> None:
    path = tmp_path / "date.yaml"
    path.write_text("kind: Service\nmetadata: {name: web, created: 2024-13-45}\n")
    with pytest.raises(ManifestError, match=f"{path}: month must be in 1..12"):
        await ManifestSource([path], ClusterState()).load_once()


async def test_missing_file_is_an_error_for_one_shot_loading(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no such manifest"):
        await ManifestSource([tmp_path / "absent.yaml"], ClusterState()).load_once()


# -- watching ---------------------------------------------------------------------------------


async def test_edit_adds_and_removes_a_service_within_2s(
    tmp_path: Path, running: Callable[[ManifestSource], None]
) -> None:
    path = tmp_path / "services.yaml"
    write_yaml(path, service("web"))
    state = ClusterState()
    running(ManifestSource([tmp_path], state, poll_interval=0.5))
    await eventually(lambda: names(state) == {"default/web:http"}, "initial load")

    write_yaml(path, service("web"), service("api"))
    await eventually(lambda: names(state) == {"default/web:http", "default/api:http"}, "added")

    write_yaml(path, service("api"))
    await eventually(lambda: names(state) == {"default/api:http"}, "removed")


async def test_in_place_edit_is_noticed(
    tmp_path: Path, running: Callable[[ManifestSource], None]
) -> None:
    path = tmp_path / "services.yaml"
    path.write_text(yaml.safe_dump(service("web")))
    state = ClusterState()
    running(ManifestSource([path], state, poll_interval=POLL))
    await eventually(lambda: names(state) == {"default/web:http"}, "initial load")
    with path.open("a") as f:
        f.write("---\n" + yaml.safe_dump(service("api")))
    await eventually(lambda: "default/api:http" in names(state), "appended service")


async def test_broken_file_keeps_last_good_state_and_logs_file_line(
    tmp_path: Path,
    running: Callable[[ManifestSource], None],
    logged: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "services.yaml"
    other = tmp_path / "other.yaml"
    write_yaml(path, service("web"))
    write_yaml(other, service("db"))
    state = ClusterState()
    source = ManifestSource([tmp_path], state, poll_interval=POLL)
    running(source)
    await eventually(lambda: names(state) == {"default/web:http", "default/db:http"}, "loaded")

    write(path, "kind: Service\nmetadata:\n  name: web\nspec:\n  ports: [\n")
    write_yaml(other, service("db"), service("cache"))  # other files keep working
    await eventually(lambda: errors(logged) != [], "error logged")
    await eventually(lambda: "default/cache:http" in names(state), "other file reloaded")
    (line,) = errors(logged)
    assert line.startswith(f"{path}:6:1: ")
    assert "keeping its last good objects" in line
    assert names(state) == {"default/web:http", "default/db:http", "default/cache:http"}

    polls = source.polls
    await eventually(lambda: source.polls >= polls + 5, "five more polls")
    assert len(errors(logged)) == 1  # an unchanged broken file is not reported again


async def test_fixed_file_is_loaded_again(
    tmp_path: Path, running: Callable[[ManifestSource], None]
) -> None:
    path = tmp_path / "services.yaml"
    write(path, "kind: Service\nmetadata: [\n")
    state = ClusterState()
    source = ManifestSource([path], state, poll_interval=POLL)
    running(source)
    await eventually(lambda: state.listed and source.errors == 1, "first load, broken")
    assert names(state) == set()
    write_yaml(path, service("web"))
    await eventually(lambda: names(state) == {"default/web:http"}, "fixed file loaded")


async def test_file_removed_from_directory_removes_its_services(
    tmp_path: Path, running: Callable[[ManifestSource], None]
) -> None:
    write_yaml(tmp_path / "web.yaml", service("web"))
    write_yaml(tmp_path / "api.yaml", service("api"))
    state = ClusterState()
    running(ManifestSource([tmp_path], state, poll_interval=POLL))
    await eventually(lambda: len(names(state)) == 2, "both loaded")
    (tmp_path / "api.yaml").unlink()
    await eventually(lambda: names(state) == {"default/web:http"}, "api removed")


async def test_unchanged_files_are_not_parsed_again(
    tmp_path: Path, running: Callable[[ManifestSource], None]
) -> None:
    write_yaml(tmp_path / "web.yaml", service("web"))
    changes: list[None] = []
    state = ClusterState(on_change=lambda: changes.append(None))
    source = ManifestSource([tmp_path], state, poll_interval=POLL)
    running(source)
    await eventually(lambda: source.reloads == 1, "loaded")
    after_load, polls = len(changes), source.polls
    await eventually(lambda: source.polls >= polls + 10, "ten more polls")
    assert source.reloads == 1
    assert len(changes) == after_load


async def test_later_file_overrides_a_duplicate_object(
    tmp_path: Path, logged: pytest.LogCaptureFixture
) -> None:
    write_yaml(tmp_path / "a.yaml", service("web", port=80))
    write_yaml(tmp_path / "b.yaml", service("web", port=81))
    state = ClusterState()
    await ManifestSource([tmp_path], state).load_once()
    (info,) = state.snapshot().services.values()
    assert info.port == 81
    assert any("overrides" in r.getMessage() for r in logged.records)


async def test_later_file_still_wins_after_the_earlier_one_is_edited(
    tmp_path: Path, running: Callable[[ManifestSource], None]
) -> None:
    write_yaml(tmp_path / "b.yaml", service("web", port=81))
    state = ClusterState()
    source = ManifestSource([tmp_path], state, poll_interval=POLL)
    running(source)
    await eventually(lambda: source.reloads == 1, "loaded")
    write_yaml(tmp_path / "a.yaml", service("web", port=82), service("api"))
    await eventually(lambda: "default/api:http" in names(state), "a.yaml loaded")
    ports = {str(n): i.port for n, i in state.snapshot().services.items()}
    assert ports["default/web:http"] == 81


# -- malformed List nesting and unexpected errors ---------------------------------------------

SELF_REFERENCING_LIST = "kind: List\nitems: &items\n  - kind: List\n    items: *items\n"
LIST_SHARED_BY_ALIAS = """\
kind: List
items:
  - &inner {kind: List, items: [{kind: Service, metadata: {name: web}}]}
  - *inner
"""


def nested_lists(depth: int) -> str:
    document: dict[str, Any] = service("web")
    for _ in range(depth):
        document = {"kind": "List", "items": [document]}
    return yaml.safe_dump(document)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (SELF_REFERENCING_LIST, "a kind: List appears twice or inside itself"),
        (LIST_SHARED_BY_ALIAS, "a kind: List appears twice or inside itself"),
        (nested_lists(17), "kind: List nested over 16 deep"),
    ],
    ids=["self-referencing", "shared-by-alias", "too-deep"],
)
async def test_malformed_list_nesting_is_a_manifest_error(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "lists.yaml"
    path.write_text(text)
    with pytest.raises(ManifestError, match=f"^{path}: {problem}"):
        await ManifestSource([path], ClusterState()).load_once()


async def test_lists_nested_within_the_limit_are_read(tmp_path: Path) -> None:
    write(tmp_path / "lists.yaml", nested_lists(16))
    state = ClusterState()
    await ManifestSource([tmp_path], state).load_once()
    assert names(state) == {"default/web:http"}


async def test_self_referencing_list_keeps_last_good_state_and_polling_goes_on(
    tmp_path: Path,
    running: Callable[[ManifestSource], None],
    logged: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "services.yaml"
    other = tmp_path / "other.yaml"
    write_yaml(path, service("web"))
    write_yaml(other, service("db"))
    state = ClusterState()
    source = ManifestSource([tmp_path], state, poll_interval=POLL)
    running(source)
    await eventually(lambda: names(state) == {"default/web:http", "default/db:http"}, "loaded")

    write(path, SELF_REFERENCING_LIST)
    await eventually(lambda: errors(logged) != [], "error logged")
    assert errors(logged) == [
        f"{path}: a kind: List appears twice or inside itself (a YAML alias loop?)"
        " (keeping its last good objects)"
    ]
    write_yaml(other, service("db"), service("cache"))  # other files keep working
    await eventually(lambda: "default/cache:http" in names(state), "other file reloaded")
    assert names(state) == {"default/web:http", "default/db:http", "default/cache:http"}

    write_yaml(path, service("api"))
    await eventually(lambda: "default/api:http" in names(state), "fixed file loaded")


async def test_unexpected_poll_error_is_logged_and_polling_goes_on(
    tmp_path: Path,
    running: Callable[[ManifestSource], None],
    logged: pytest.LogCaptureFixture,
) -> None:
    failing: list[bool] = []

    def on_change() -> None:
        if failing:
            failing.clear()
            raise RuntimeError("a bug in a change callback")

    path = tmp_path / "services.yaml"
    write_yaml(path, service("web"))
    state = ClusterState(on_change=on_change)
    source = ManifestSource([path], state, poll_interval=POLL)
    running(source)
    await eventually(lambda: names(state) == {"default/web:http"}, "loaded")

    failing.append(True)  # the next feed of the state fails
    write_yaml(path, service("api"))
    await eventually(lambda: errors(logged) != [], "error logged")
    records = list(dict.fromkeys(r for r in logged.records if r.levelno >= logging.ERROR))
    assert [r.getMessage() for r in records] == [
        "manifest poll failed, keeping the last good objects: "
        "RuntimeError: a bug in a change callback"
    ]
    assert records[0].exc_info is not None  # with the traceback
    await eventually(
        lambda: any(r.getMessage() == "manifest polling works again" for r in logged.records),
        "the next poll succeeding",
    )
    write_yaml(path, service("db"))
    await eventually(lambda: names(state) == {"default/db:http"}, "a later edit")
