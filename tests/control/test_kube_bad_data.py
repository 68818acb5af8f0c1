"""KubeSource against malformed input: bad watch lines and list bodies never end the source.

Each bad line or body must give one clear log line naming the resource and the problem, keep
the last good state, and leave the source following: a later good change still arrives.
"""

from __future__ import annotations

import json
import logging

import pytest

from tests.control.conftest import (
    StartSource,
    Watching,
    endpoint_slice,
    eventually,
    ips_of,
    service,
)
from tests.fakes.apiserver import FakeApiServer

KUBE_LOGGER = "kube_userspace_proxy.cluster.sources.kube"


def kube_records(
    caplog: pytest.LogCaptureFixture, level: int = logging.WARNING
) -> list[logging.LogRecord]:
    """Records KubeSource logged at `level` or above (each once: caplog may see it twice)."""
    records = dict.fromkeys(caplog.records)
    return [r for r in records if r.name == KUBE_LOGGER and r.levelno >= level]


def kube_lines(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    """Messages KubeSource logged at `level` or above."""
    return [r.getMessage() for r in kube_records(caplog, level)]


async def _listed_with_web(apiserver: FakeApiServer, start_source: StartSource) -> Watching:
    apiserver.create(service("web"))
    apiserver.create(endpoint_slice("web-a", "web", ["10.244.1.5"]))
    watching = await start_source()
    await eventually(lambda: apiserver.watch_count == 3, what="three watches")
    return watching


async def _still_following(apiserver: FakeApiServer, watching: Watching) -> None:
    """The source runs and a change made now still arrives."""
    assert not watching.task.done()
    apiserver.create(service("api", cluster_ip="10.96.0.11"))
    await eventually(lambda: watching.services() == {"web", "api"}, what="a later good change")
    assert ips_of(watching.snapshot(), "web") == {"10.244.1.5"}


BAD_WATCH_LINES = {
    "object-is-a-string": ('{"type":"MODIFIED","object":"oops"}', "event object is a string"),
    "event-is-an-array": ('["x"]', "event is an array"),
    "not-json": ('{"type":"ADDED","object":{', "line is not JSON"),
    "not-utf8": (b'{"type":"ADDED","object":"\xff"}', "line is not JSON"),
    "object-missing": ('{"type":"ADDED"}', "event object is null or missing"),
    "type-not-a-string": ('{"type":["ADDED"],"object":{}}', "event type is an array"),
    "metadata-not-an-object": (
        '{"type":"ADDED","object":{"metadata":"m"}}',
        "object metadata is a string",
    ),
    "metadata-missing": ('{"type":"DELETED","object":{"kind":"Service"}}', "object metadata"),
    "resource-version-not-a-string": (
        '{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":{"a":1}}}}',
        "resourceVersion is an object",
    ),
    "deeply-nested": ("[" * 100_000 + "]" * 100_000, "line is not JSON"),
}


@pytest.mark.parametrize(
    ("line", "problem"), list(BAD_WATCH_LINES.values()), ids=list(BAD_WATCH_LINES)
)
async def test_malformed_watch_line_is_logged_and_the_watch_resumes(
    apiserver: FakeApiServer,
    start_source: StartSource,
    logged: pytest.LogCaptureFixture,
    line: str | bytes,
    problem: str,
) -> None:
    watching = await _listed_with_web(apiserver, start_source)
    assert apiserver.inject_raw(line, plural="services") == 1
    await eventually(lambda: kube_lines(logged), what="a log line")
    (message,) = kube_lines(logged)
    assert message.startswith("Service watch: bad event from the API server, ")
    assert problem in message
    assert "resuming from version" in message
    assert watching.source.bad_data_total == 1
    await _still_following(apiserver, watching)
    assert apiserver.count("services", "list") == 1  # resumed from the last good version


async def test_repeated_bad_lines_are_logged_once(
    apiserver: FakeApiServer, start_source: StartSource, logged: pytest.LogCaptureFixture
) -> None:
    watching = await _listed_with_web(apiserver, start_source)
    for i in range(5):
        watches = apiserver.count("services", "watch")
        assert apiserver.inject_raw('{"type":"MODIFIED","object":"oops"}', plural="services")
        await eventually(
            lambda n=i + 1, w=watches: (
                watching.source.bad_data_total == n
                and apiserver.count("services", "watch") > w
                and apiserver.watch_count == 3
            ),
            what=f"bad line {i + 1} and the resumed watch",
        )
    assert len(kube_lines(logged)) == 1
    await _still_following(apiserver, watching)


async def test_error_event_with_a_non_numeric_code_is_retried(
    apiserver: FakeApiServer, start_source: StartSource, logged: pytest.LogCaptureFixture
) -> None:
    watching = await _listed_with_web(apiserver, start_source)
    status = {"kind": "Status", "code": "abc", "message": "boom"}
    apiserver.inject_raw(json.dumps({"type": "ERROR", "object": status}), plural="services")
    await eventually(lambda: kube_lines(logged), what="a log line")
    (message,) = kube_lines(logged)
    assert message.startswith("Service watch failed (ApiStatusError: 0 boom (code 'abc'))")
    await _still_following(apiserver, watching)
    assert apiserver.count("services", "list") == 1


async def test_error_event_with_code_410_as_a_string_relists(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    watching = await _listed_with_web(apiserver, start_source)
    status = {"kind": "Status", "code": "410", "reason": "Expired"}
    apiserver.inject_raw(json.dumps({"type": "ERROR", "object": status}), plural="services")
    await eventually(
        lambda: watching.source.relists_total == 1 and apiserver.count("services", "list") == 2,
        what="the relist",
    )
    await _still_following(apiserver, watching)


BAD_LIST_BODIES = {
    "metadata-is-a-string": (
        '{"kind":"ServiceList","metadata":"oops","items":[]}',
        "list metadata is a string",
    ),
    "items-is-an-object": (
        '{"kind":"ServiceList","metadata":{"resourceVersion":"1"},"items":{"a":1}}',
        "list items is an object",
    ),
    "body-is-an-array": ('["x"]', "list body is an array"),
    "not-json": ('{"kind":"ServiceList",', "list body is not JSON"),
    "no-resource-version": (
        '{"kind":"ServiceList","metadata":{},"items":[]}',
        "list metadata.resourceVersion is null or missing",
    ),
    "continue-not-a-string": (
        '{"kind":"ServiceList","metadata":{"continue":7},"items":[]}',
        "list metadata.continue is a number",
    ),
}


@pytest.mark.parametrize(
    ("body", "problem"), list(BAD_LIST_BODIES.values()), ids=list(BAD_LIST_BODIES)
)
async def test_malformed_list_body_is_logged_and_listed_again(
    apiserver: FakeApiServer,
    start_source: StartSource,
    logged: pytest.LogCaptureFixture,
    body: str,
    problem: str,
) -> None:
    apiserver.create(service("web"))
    apiserver.create(endpoint_slice("web-a", "web", ["10.244.1.5"]))
    apiserver.raw_next(1, body, plural="services", verb="list")
    watching = await start_source()
    assert watching.services() == {"web"}
    (message,) = kube_lines(logged)
    assert message.startswith("Service list: bad response from the API server, ")
    assert problem in message
    assert "listing again" in message
    assert apiserver.count("services", "list") == 2
    await _still_following(apiserver, watching)


async def test_list_items_that_are_not_objects_are_skipped(
    apiserver: FakeApiServer, start_source: StartSource, logged: pytest.LogCaptureFixture
) -> None:
    apiserver.create(service("web"))
    apiserver.create(endpoint_slice("web-a", "web", ["10.244.1.5"]))
    body = {
        "kind": "ServiceList",
        "metadata": {"resourceVersion": apiserver.resource_version},
        "items": ["x", 5, apiserver.get("Service", "web")],
    }
    apiserver.raw_next(1, json.dumps(body), plural="services", verb="list")
    watching = await start_source()
    assert watching.services() == {"web"}
    assert kube_lines(logged) == ["Service list: skipping 2 of 3 items that are not objects"]
    await _still_following(apiserver, watching)


async def test_bad_line_on_one_resource_leaves_the_others_alone(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    watching = await _listed_with_web(apiserver, start_source)
    endpoint_watches = apiserver.count("endpointslices", "watch")
    apiserver.inject_raw('["x"]', plural="services")
    await eventually(lambda: watching.source.bad_data_total == 1, what="the bad line")
    apiserver.apply(endpoint_slice("web-a", "web", ["10.244.1.6"]))
    await eventually(
        lambda: ips_of(watching.snapshot(), "web") == {"10.244.1.6"}, what="the slice change"
    )
    assert apiserver.count("endpointslices", "watch") == endpoint_watches


async def test_unexpected_error_is_logged_and_relisted(
    apiserver: FakeApiServer, start_source: StartSource, logged: pytest.LogCaptureFixture
) -> None:
    armed: list[bool] = []

    def fail_once() -> None:
        if armed:
            armed.clear()
            raise RuntimeError("a bug in a change callback")

    watching = await start_source(on_change=fail_once)
    await eventually(lambda: apiserver.watch_count == 3, what="three watches")
    armed.append(True)
    apiserver.create(service("web"))
    await eventually(lambda: apiserver.count("services", "list") == 2, what="the relist")
    (record,) = kube_records(logged, logging.ERROR)
    assert record.getMessage().startswith(
        "Service: unexpected error (RuntimeError: a bug in a change callback); relisting in "
    )
    assert record.exc_info is not None  # the traceback is logged
    assert watching.services() == {"web"}
    apiserver.create(endpoint_slice("web-a", "web", ["10.244.1.5"]))
    await eventually(lambda: ips_of(watching.snapshot(), "web"), what="web's endpoints")
    await _still_following(apiserver, watching)
