"""KubeSource through API-server trouble: dropped and expired watches, outages, errors, limits."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from kube_userspace_proxy.cluster.sources.watching import (
    WATCH_READ_SLACK,
    WATCH_TIMEOUT,
    watch_timeouts,
)
from tests.control.conftest import (
    StartSource,
    Watching,
    endpoint_slice,
    eventually,
    ips_of,
    node,
    service,
)
from tests.fakes.apiserver import FakeApiServer

OUTAGE_SECONDS = 3.0
"""The issue asks for a 30 s API-server outage; the suite uses 3 s (same code path, the
backoff is capped at 0.5 s in these tests, so 3 s already spans many failed reconnects)."""


async def _listed_with_web(apiserver: FakeApiServer, start_source: StartSource) -> Watching:
    apiserver.create(service("web"))
    apiserver.create(endpoint_slice("web-a", "web", ["10.244.1.5"]))
    watching = await start_source()
    assert ips_of(watching.snapshot(), "web") == {"10.244.1.5"}
    await eventually(lambda: apiserver.watch_count == 3, what="three watches")
    return watching


async def test_dropped_watch_resumes_without_a_relist(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    watching = await _listed_with_web(apiserver, start_source)
    watches = apiserver.count("services", "watch")
    apiserver.drop_watches(abrupt=True)
    apiserver.apply(endpoint_slice("web-a", "web", ["10.244.1.6"]))
    apiserver.create(service("api", cluster_ip="10.96.0.11"))
    await eventually(
        lambda: (
            watching.services() == {"web", "api"}
            and ips_of(watching.snapshot(), "web") == {"10.244.1.6"}
        ),
        what="changes made while the watch was down",
    )
    assert apiserver.count("services", "watch") > watches
    assert apiserver.count("services", "list") == 1
    assert apiserver.count("endpointslices", "list") == 1
    assert watching.source.relists_total == 0


async def test_watch_ended_by_the_server_resumes_without_a_relist(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    watching = await _listed_with_web(apiserver, start_source)
    apiserver.drop_watches(abrupt=False)  # a clean end of stream, as at timeoutSeconds
    apiserver.create(service("api", cluster_ip="10.96.0.11"))
    await eventually(lambda: watching.services() == {"web", "api"}, what="the new service")
    assert apiserver.count("services", "list") == 1


async def test_watch_timeout_renews_the_watch_without_a_relist(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    # watch_timeout=1 asks the server for timeoutSeconds in [1, 2): streams end and renew.
    watching = await start_source(watch_timeout=1.0)
    await eventually(lambda: apiserver.count("services", "watch") >= 3, timeout=8, what="renewals")
    apiserver.create(service("web"))
    await eventually(lambda: watching.services() == {"web"}, what="the service")
    assert apiserver.count("services", "list") == 1


async def test_compacted_history_relists_and_forgets_a_service_deleted_meanwhile(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(service("gone", cluster_ip="10.96.0.12"))
    watching = await _listed_with_web(apiserver, start_source)
    assert watching.services() == {"web", "gone"}
    await apiserver.stop()
    apiserver.delete("Service", "gone")
    apiserver.apply(endpoint_slice("web-a", "web", ["10.244.1.7"]))
    apiserver.compact()
    await apiserver.start()
    await eventually(
        lambda: (
            watching.services() == {"web"} and ips_of(watching.snapshot(), "web") == {"10.244.1.7"}
        ),
        what="the relisted world",
    )
    assert apiserver.count("services", "list") == 2
    assert watching.source.relists_total >= 2  # Services and EndpointSlices (and the Node)


async def test_http_410_on_watch_relists(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.gone_as_http_status = True
    apiserver.create(service("gone", cluster_ip="10.96.0.12"))
    watching = await _listed_with_web(apiserver, start_source)
    await apiserver.stop()
    apiserver.delete("Service", "gone")
    apiserver.compact()
    await apiserver.start()
    await eventually(lambda: watching.services() == {"web"}, what="the relisted services")
    assert 410 in {r.status for r in apiserver.records("services", "watch")}


async def test_outage_keeps_last_state_and_catches_up(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    watching = await _listed_with_web(apiserver, start_source)
    before = watching.snapshot()
    await apiserver.stop()
    apiserver.apply(endpoint_slice("web-a", "web", ["10.244.1.5", "10.244.1.8"]))
    apiserver.create(service("api", cluster_ip="10.96.0.11"))
    # Throughout the outage the last known state stays exactly as it was.
    ends = time.monotonic() + OUTAGE_SECONDS
    while time.monotonic() < ends:
        now = watching.snapshot()
        assert now.services == before.services
        assert now.endpoints == before.endpoints
        await asyncio.sleep(0.1)
    assert watching.source.errors_total > 0
    await apiserver.start()
    # Catching up takes at most one backoff (capped at 0.5 s here) plus the requests.
    await eventually(
        lambda: (
            watching.services() == {"web", "api"}
            and ips_of(watching.snapshot(), "web") == {"10.244.1.5", "10.244.1.8"}
        ),
        timeout=2.0,
        what="the changes made during the outage",
    )
    assert apiserver.count("services", "list") == 1  # resumed from history: no relist needed


async def test_server_errors_back_off_exponentially(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.fail_next(10_000, 500)
    watching = await start_source(wait_listed=False, backoff_initial=0.2, backoff_max=1.0)
    await asyncio.sleep(3.0)  # the observation window itself: count what arrives in it
    lists = apiserver.count("services", "list")
    # Delays of at least 0.1, 0.2, 0.4, 0.5, 0.5, ... s: at most 9 attempts in 3 s (a hot
    # loop would make thousands; the rate limiter is off in these tests).
    assert 3 <= lists <= 9, lists
    assert not watching.state.listed
    apiserver.clear_faults()
    await eventually(lambda: watching.state.listed, timeout=30, what="recovery")


async def test_watch_errors_back_off_and_keep_the_resume_point(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    watching = await _listed_with_web(apiserver, start_source)
    apiserver.fail_next(10_000, 503, plural="services", verb="watch")
    apiserver.drop_watches()
    apiserver.create(service("api", cluster_ip="10.96.0.11"))
    await asyncio.sleep(2.0)  # the observation window
    assert apiserver.count("services", "watch") <= 1 + 8
    assert watching.services() == {"web"}
    apiserver.clear_faults()
    await eventually(lambda: watching.services() == {"web", "api"}, what="resumed watch")
    assert apiserver.count("services", "list") == 1


async def test_too_many_requests_honours_retry_after(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.fail_next(1, 429, retry_after=1.5, plural="services", verb="list")
    watching = await start_source(wait_listed=False)
    await eventually(lambda: watching.state.listed, timeout=4.0, what="both lists")
    first, second = apiserver.records("services", "list")[:2]
    assert first.status == 429
    assert second.status == 200
    assert second.at - first.at >= 1.45  # not the 0.05 s the backoff alone would wait


async def test_rate_limit_bounds_requests(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.fail_next(10_000, 500)
    # Backoff ~0: only the token bucket (2 requests/s, burst 3) holds the retries back.
    await start_source(
        wait_listed=False, qps=2.0, burst=3, backoff_initial=0.001, backoff_max=0.001
    )
    await asyncio.sleep(2.0)  # the observation window
    total = apiserver.count()
    assert 3 <= total <= 3 + 2 * 2 + 1, total


async def test_bookmarks_keep_the_resume_point_fresh(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    watching = await _listed_with_web(apiserver, start_source)
    listed_at = watching.source.resource_version("Service")
    for i in range(5):  # slice changes move the global version past the Service watch's
        apiserver.apply(endpoint_slice("web-a", "web", [f"10.244.1.{10 + i}"]))
    apiserver.send_bookmarks()
    await eventually(
        lambda: watching.source.resource_version("Service") == apiserver.resource_version,
        what="the Service watch to reach the newest version by bookmark",
    )
    assert watching.source.resource_version("Service") != listed_at
    apiserver.compact()  # resuming from the list's version would now be 410
    apiserver.drop_watches()
    apiserver.create(service("api", cluster_ip="10.96.0.11"))
    await eventually(lambda: watching.services() == {"web", "api"}, what="the new service")
    assert apiserver.count("services", "list") == 1


async def test_hung_request_times_out_and_is_retried(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    apiserver.create(service("web"))
    apiserver.hang_next(1, plural="services", verb="list")  # never answered
    started = time.monotonic()
    watching = await start_source(wait_listed=False, request_timeout=0.5)
    await eventually(lambda: watching.state.listed, timeout=3.0, what="both lists")
    assert time.monotonic() - started >= 0.45
    assert watching.services() == {"web"}
    assert watching.source.errors_total >= 1


async def test_periodic_relist_reconciles(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    watching = await start_source(relist_period=0.5)
    apiserver.create(service("web"))
    await eventually(lambda: apiserver.count("services", "list") >= 3, what="relists")
    assert watching.services() == {"web"}
    assert watching.source.relists_total == 0  # periodic relists are not 410 relists


async def test_cut_watch_resumes_after_the_last_event_seen(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    watching = await _listed_with_web(apiserver, start_source)
    apiserver.create(service("api", cluster_ip="10.96.0.11"))
    await eventually(lambda: watching.services() == {"web", "api"}, what="api")
    apiserver.compact()  # only resuming after "api" is still possible
    apiserver.drop_watches()
    apiserver.create(service("db", cluster_ip="10.96.0.12"))
    await eventually(lambda: watching.services() == {"web", "api", "db"}, what="db")
    assert apiserver.count("services", "list") == 1


async def test_watch_closed_at_once_is_retried_with_backoff(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    watching = await _listed_with_web(apiserver, start_source)
    apiserver.end_watches_at_once = True
    apiserver.drop_watches(abrupt=False)
    before = apiserver.count("services", "watch")
    await asyncio.sleep(2.0)  # the observation window
    # Empty streams shorter than a second count as failures: 0.025, 0.05, ... 0.5 s apart.
    assert apiserver.count("services", "watch") - before <= 10
    apiserver.end_watches_at_once = False
    apiserver.create(service("api", cluster_ip="10.96.0.11"))
    await eventually(lambda: watching.services() == {"web", "api"}, what="the new service")


async def test_expired_continue_token_restarts_the_list(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    names = {f"svc-{i}" for i in range(5)}
    for i, name in enumerate(sorted(names)):
        apiserver.create(service(name, cluster_ip=f"10.96.0.{20 + i}"))
    compacted: list[str] = []

    def compact_once_mid_list(request: web.Request) -> None:
        if "continue" in request.query and not compacted:
            compacted.append(request.query["continue"])
            apiserver.create(node("elsewhere"))  # history moves on ...
            apiserver.compact()  # ... and forgets the version the token was listed at

    apiserver.before_request = compact_once_mid_list
    watching = await start_source(page_size=2)
    assert watching.services() == names
    # Page 1, page 2 (410: token expired), then pages 1-3 again from scratch.
    assert apiserver.count("services", "list") == 5
    assert [r.status for r in apiserver.records("services", "list")] == [200, 410, 200, 200, 200]


def test_a_silent_watch_is_noticed_within_60_seconds_with_the_defaults() -> None:
    worst = max(
        watch_timeouts(WATCH_TIMEOUT, WATCH_READ_SLACK, float("inf"), spread)[1]
        for spread in (0.0, 0.5, 0.999999)
    )
    assert worst <= 55  # the read timeout, plus a backoff step and a new request, under 60 s
    assert watch_timeouts(WATCH_TIMEOUT, WATCH_READ_SLACK, 5.0, 0.5) == (5, 5 + WATCH_READ_SLACK)


async def test_a_watch_that_sends_headers_then_nothing_is_restarted(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    # The defaults scaled down 10x: timeoutSeconds in [3, 4.5), silent for 1 s more = dead.
    watching = await start_source(watch_timeout=3.0, watch_read_slack=1.0)
    apiserver.silence_watches()
    watches = apiserver.count("services", "watch")
    began = time.monotonic()
    apiserver.create(service("late"))  # swallowed by the silent stream
    await eventually(
        lambda: apiserver.count("services", "watch") > watches, timeout=15, what="a new watch"
    )
    assert time.monotonic() - began <= 4.5 + 1.0 + 2.0  # read timeout + backoff, with margin
    assert "late" not in watching.services()
    apiserver.clear_faults()  # the server answers again: the resumed watch brings the change
    await eventually(lambda: "late" in watching.services(), timeout=15, what="the late service")
    assert apiserver.count("services", "list") == 1  # resumed from its version, no relist
