"""KubeSource follows Services, EndpointSlices and its Node into ClusterState."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from kube_userspace_proxy.cluster.state import ClusterState
from tests.control.conftest import (
    HEADLESS_LABEL,
    NODE,
    PROXY_NAME_LABEL,
    StartSource,
    endpoint_slice,
    eventually,
    ips_of,
    node,
    port_name,
    service,
)
from tests.fakes.apiserver import FakeApiServer

CHANGE_DEADLINE = 1.0  # the promise: a change reaches the proxy within 1 s


async def test_service_and_slice_added_reach_state_within_a_second(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    watching = await start_source()
    started = time.monotonic()
    apiserver.create(service("web"))
    apiserver.create(endpoint_slice("web-a", "web", ["10.244.1.5", "10.244.1.6"]))
    await eventually(
        lambda: ips_of(watching.snapshot(), "web") == {"10.244.1.5", "10.244.1.6"},
        timeout=CHANGE_DEADLINE,
        what="web's endpoints",
    )
    assert time.monotonic() - started < CHANGE_DEADLINE
    info = watching.snapshot().services[port_name("web")]
    assert (info.port, info.cluster_ips) == (80, ("10.96.0.10",))


async def test_service_update_reaches_state_within_a_second(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(service("web", port=80))
    watching = await start_source()
    apiserver.apply(service("web", port=8000))
    await eventually(
        lambda: watching.snapshot().services[port_name("web")].port == 8000,
        timeout=CHANGE_DEADLINE,
        what="the new service port",
    )


async def test_service_delete_reaches_state_within_a_second(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(service("web"))
    apiserver.create(service("api", cluster_ip="10.96.0.11"))
    watching = await start_source()
    assert watching.services() == {"web", "api"}
    apiserver.delete("Service", "web")
    await eventually(lambda: watching.services() == {"api"}, timeout=CHANGE_DEADLINE, what="delete")


async def test_slice_update_reaches_state_within_a_second(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(service("web"))
    apiserver.create(endpoint_slice("web-a", "web", ["10.244.1.5"]))
    watching = await start_source()
    assert ips_of(watching.snapshot(), "web") == {"10.244.1.5"}
    apiserver.apply(endpoint_slice("web-a", "web", ["10.244.1.7"]))
    await eventually(
        lambda: ips_of(watching.snapshot(), "web") == {"10.244.1.7"},
        timeout=CHANGE_DEADLINE,
        what="the replaced endpoint",
    )


async def test_slice_readiness_change_reaches_state(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(service("web"))
    apiserver.create(endpoint_slice("web-a", "web", ["10.244.1.5"]))
    watching = await start_source()
    apiserver.apply(endpoint_slice("web-a", "web", ["10.244.1.5"], ready=False))

    def not_ready() -> bool:
        endpoints = watching.snapshot().endpoints_of(port_name("web"))
        return len(endpoints) == 1 and not endpoints[0].ready

    await eventually(not_ready, timeout=CHANGE_DEADLINE, what="endpoint not ready")


async def test_slice_delete_reaches_state_within_a_second(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(service("web"))
    apiserver.create(endpoint_slice("web-a", "web", ["10.244.1.5"]))
    watching = await start_source()
    apiserver.delete("EndpointSlice", "web-a")
    await eventually(
        lambda: ips_of(watching.snapshot(), "web") == set(),
        timeout=CHANGE_DEADLINE,
        what="no endpoints",
    )
    assert port_name("web") in watching.snapshot().services


async def test_several_slices_of_one_service_are_merged(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(service("web"))
    apiserver.create(endpoint_slice("web-a", "web", ["10.244.1.5", "10.244.1.6"]))
    apiserver.create(endpoint_slice("web-b", "web", ["10.244.2.5"]))
    watching = await start_source()
    assert ips_of(watching.snapshot(), "web") == {"10.244.1.5", "10.244.1.6", "10.244.2.5"}
    apiserver.create(endpoint_slice("web-c", "web", ["10.244.3.5"]))
    apiserver.delete("EndpointSlice", "web-a")
    await eventually(
        lambda: ips_of(watching.snapshot(), "web") == {"10.244.2.5", "10.244.3.5"},
        timeout=CHANGE_DEADLINE,
        what="slices b and c merged",
    )


async def test_state_is_not_listed_until_both_lists_are_in(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(service("web"))
    apiserver.fail_next(3, 500, plural="endpointslices", verb="list")
    # Backoff from 0.2 s: the slice list cannot succeed before ~0.7 s, the Service watch is
    # up within milliseconds.
    watching = await start_source(wait_listed=False, backoff_initial=0.2)
    await eventually(
        lambda: apiserver.count("services", "watch") >= 1, what="the Service watch to start"
    )
    assert apiserver.count("endpointslices", "list") < 4
    assert not watching.state.listed  # Services are in, slices are not: nothing to program
    await eventually(lambda: watching.state.listed, what="both lists")
    assert apiserver.count("endpointslices", "list") == 4


async def test_paginated_list_is_complete(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    names = {f"svc-{i}" for i in range(5)}
    for i, name in enumerate(sorted(names)):
        apiserver.create(service(name, cluster_ip=f"10.96.0.{20 + i}"))
    watching = await start_source(page_size=2)
    assert watching.services() == names
    assert apiserver.count("services", "list") == 3


async def test_default_selector_skips_other_proxies_and_headless(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(service("plain"))
    apiserver.create(service("other", labels={PROXY_NAME_LABEL: "other-proxy"}))
    apiserver.create(service("headless", labels={HEADLESS_LABEL: ""}))
    apiserver.create(
        endpoint_slice("other-a", "other", ["10.244.1.9"], labels={PROXY_NAME_LABEL: "x"})
    )
    watching = await start_source()
    assert watching.services() == {"plain"}
    assert apiserver.records("services", "list")[0].status == 200
    # Filtered by the API server, not after the fact: the slice never reached the state.
    assert watching.state.endpoint_changes_total == 0


async def test_service_proxy_name_selects_only_its_services(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    ours = {PROXY_NAME_LABEL: "userspace"}
    apiserver.create(service("plain"))
    apiserver.create(service("mine", labels=ours))
    apiserver.create(service("theirs", labels={PROXY_NAME_LABEL: "other-proxy"}))
    apiserver.create(service("mine-headless", labels={**ours, HEADLESS_LABEL: ""}))
    apiserver.create(endpoint_slice("mine-a", "mine", ["10.244.1.5"], labels=ours))
    watching = await start_source(service_proxy_name="userspace")
    assert watching.services() == {"mine"}
    assert ips_of(watching.snapshot(), "mine") == {"10.244.1.5"}


async def test_service_relabelled_for_another_proxy_leaves_state(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(service("web"))
    watching = await start_source()
    apiserver.apply(service("web", labels={PROXY_NAME_LABEL: "other-proxy"}))
    await eventually(lambda: watching.services() == set(), timeout=CHANGE_DEADLINE, what="gone")
    apiserver.apply(service("web"))
    await eventually(lambda: watching.services() == {"web"}, timeout=CHANGE_DEADLINE, what="back")


async def test_own_node_gives_node_ips(apiserver: FakeApiServer, start_source: StartSource) -> None:
    apiserver.create(node(NODE, addresses=[("InternalIP", "10.0.0.5"), ("Hostname", NODE)]))
    apiserver.create(node("node-2", addresses=[("InternalIP", "10.0.0.6")]))
    watching = await start_source()
    await eventually(lambda: watching.snapshot().node_ips == ("10.0.0.5",), what="node IPs")
    apiserver.apply(node(NODE, addresses=[("InternalIP", "10.0.0.7")]))
    await eventually(
        lambda: watching.snapshot().node_ips == ("10.0.0.7",),
        timeout=CHANGE_DEADLINE,
        what="the new node IP",
    )


async def test_node_watch_uses_a_field_selector_for_its_own_node(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(node(NODE, addresses=[("InternalIP", "10.0.0.5")]))
    watching = await start_source()
    await eventually(lambda: watching.state.node_ips, what="node IPs")
    apiserver.apply(node("node-2", addresses=[("InternalIP", "10.0.0.9")]))
    apiserver.apply(service("marker"))
    await eventually(lambda: watching.services() == {"marker"}, what="a later event")
    assert watching.state.node_ips == ("10.0.0.5",)


async def test_node_tainted_for_scale_down_is_not_eligible(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(node(NODE))
    watching = await start_source()
    await eventually(lambda: watching.state.node_ips, what="node IPs")
    assert watching.state.node_eligible
    taint = {"key": "ToBeDeletedByClusterAutoscaler", "value": "1", "effect": "NoSchedule"}
    apiserver.apply(node(NODE, taints=[taint]))
    await eventually(
        lambda: not watching.state.node_eligible, timeout=CHANGE_DEADLINE, what="ineligible"
    )


async def test_node_being_deleted_is_not_eligible(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(node(NODE, deleting=True))
    watching = await start_source()
    await eventually(lambda: not watching.state.node_eligible, what="ineligible")


async def test_trigger_time_annotation_reaches_the_snapshot(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(service("web"))
    watching = await start_source()
    watching.snapshot()  # start from no pending trigger times
    stamp = "2024-05-01T10:00:00Z"
    apiserver.create(endpoint_slice("web-a", "web", ["10.244.1.5"], trigger_time=stamp))
    await eventually(lambda: watching.state.pending_endpoint_changes, what="the slice")
    expected = datetime(2024, 5, 1, 10, 0, 0, tzinfo=UTC).timestamp()
    assert watching.snapshot().trigger_times == (expected,)


async def test_changes_call_on_change(apiserver: FakeApiServer, start_source: StartSource) -> None:
    watching = await start_source()
    before = len(watching.changes)
    apiserver.create(service("web"))
    await eventually(lambda: len(watching.changes) > before, timeout=CHANGE_DEADLINE, what="call")


async def test_cancelling_run_closes_its_watches(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    watching = await start_source()
    await eventually(lambda: apiserver.watch_count == 3, what="three watches")
    watching.task.cancel()
    await asyncio.gather(watching.task, return_exceptions=True)
    assert watching.task.cancelled()
    await eventually(lambda: apiserver.watch_count == 0, what="watches closed")


async def test_state_objects_are_not_shared_with_the_fake(apiserver: FakeApiServer) -> None:
    # A guard for the other tests: the fake hands out copies, so tests cannot cheat.
    created = apiserver.create(service("web"))
    created["spec"]["clusterIP"] = "10.96.9.9"
    stored = apiserver.get("Service", "web")
    assert stored is not None
    assert stored["spec"]["clusterIP"] == "10.96.0.10"
    state = ClusterState()
    state.replace("Service", [stored])
    assert port_name("web") in state.snapshot().services
