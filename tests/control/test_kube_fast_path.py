"""Changes reach the data plane without waiting for the sync runner, when no rule changes.

The real kubernetes-asyncio client follows the fake API server; the proxy runs in this event
loop with `--iptables-min-sync-period` 60 s, so a change that waited for a rule sync would
wait a minute. A rule sink at the proxier's boundary records every rule commit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest

from kube_userspace_proxy import app
from kube_userspace_proxy.model import ServicePortName
from kube_userspace_proxy.ops.metrics import sample_value
from tests.control.conftest import endpoint_slice, eventually, service
from tests.control.test_kube_end_to_end import kube_config
from tests.fakes.apiserver import FakeApiServer
from tests.loopback.proxyrun import ask, running_proxy, start_named_backends
from tests.loopback.test_proxier import RecordingRules

MIN_SYNC_PERIOD = 60.0
WEB = ServicePortName("default", "web", "http")


@pytest.fixture
async def web(apiserver: FakeApiServer) -> AsyncIterator[tuple[int, int]]:
    """Service web with its slice on pod-a; the ports of pod-a and pod-b."""
    backends = await start_named_backends(["pod-a", "pod-b"])
    (_, port_a, _), (_, port_b, _) = backends
    apiserver.create(service("web"))
    apiserver.create(endpoint_slice("web-a", "web", ["127.0.0.1"], port=port_a))
    yield port_a, port_b
    for _, _, server in backends:
        server.close()


async def _until_web_answers(proxy: app.Proxy, name: str, failure: str) -> None:
    deadline = time.monotonic() + 10
    while await ask(proxy.proxier.port_of(WEB)) != name:
        assert time.monotonic() < deadline, failure
        await asyncio.sleep(0.01)


@pytest.mark.timeout(60)
async def test_an_endpoint_only_change_reaches_the_pool_without_the_runner_or_a_commit(
    apiserver: FakeApiServer, kubeconfig: str, web: tuple[int, int]
) -> None:
    _, port_b = web
    config = kube_config(kubeconfig, min_sync_period=MIN_SYNC_PERIOD, sync_period=300.0)
    async with running_proxy(config) as proxy:
        await eventually(lambda: proxy.proxier.port_of(WEB), timeout=10, what="web served")
        assert await ask(proxy.proxier.port_of(WEB)) == "pod-a"
        rules = RecordingRules()
        proxy.proxier.set_rule_sink(rules)
        # A new Service needs rules: it spends the runner's second burst token.
        apiserver.create(service("other", cluster_ip="10.96.0.11"))
        await eventually(lambda: rules.applied, timeout=10, what="the rule commit")
        runs, commits = proxy.runner.runs, len(rules.applied)
        ops = proxy.ops
        assert ops is not None
        before = await _programming_count(ops.metrics_port)

        # The runner has no token left for a minute; the endpoint moves all the same.
        moved = endpoint_slice(
            "web-a", "web", ["127.0.0.1"], port=port_b, trigger_time=_now_rfc3339()
        )
        apiserver.update(moved)

        await _until_web_answers(proxy, "pod-b", "the moved endpoint was never served")
        assert proxy.runner.runs == runs, "the change waited for the sync runner"
        assert len(rules.applied) == commits, "an endpoint-only change committed rules"
        # Its network-programming latency is observed when it is served, not at a commit.
        assert await _programming_count(ops.metrics_port) > before

        # A change that does need rules is served at once but its commit waits its turn.
        third = ServicePortName("default", "third", "http")
        apiserver.create(service("third", cluster_ip="10.96.0.12"))
        await eventually(lambda: proxy.proxier.port_of(third), timeout=10, what="listener")
        assert proxy.proxier.rules_pending
        assert len(rules.applied) == commits


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _programming_count(port: int | None) -> float:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    return sample_value(text, "kubeproxy_network_programming_duration_seconds_count", {}) or 0.0


@pytest.mark.timeout(60)
async def test_a_failed_apply_is_followed_by_a_complete_sync_and_the_proxy_stays_up(
    apiserver: FakeApiServer, kubeconfig: str, web: tuple[int, int]
) -> None:
    port_a, port_b = web
    async with running_proxy(kube_config(kubeconfig)) as proxy:
        await eventually(lambda: proxy.proxier.port_of(WEB), timeout=10, what="web served")
        syncs = proxy.pipeline.syncs
        health = proxy.service_health
        real = health.sync
        failures = []

        async def fail_once(snapshot: Any) -> None:
            if not failures:
                failures.append(snapshot)
                raise RuntimeError("injected: the health-check servers failed")
            await real(snapshot)

        health.sync = fail_once  # type: ignore[method-assign]
        apiserver.update(endpoint_slice("web-a", "web", ["127.0.0.1"], port=port_b))
        await _until_web_answers(proxy, "pod-b", "the change was lost with the failed apply")
        assert failures, "the apply did not run"
        await eventually(lambda: proxy.pipeline.syncs > syncs, timeout=10, what="a complete sync")
        # The apply loop still runs: the next change is applied as before.
        apiserver.update(endpoint_slice("web-a", "web", ["127.0.0.1"], port=port_a))
        await _until_web_answers(proxy, "pod-a", "changes stopped after the failed apply")


class SlowCleanupRules(RecordingRules):
    """Rules whose deferred deletes (the second commit) take `DEFERRED_SECONDS`."""

    def commit_deferred(self) -> None:
        time.sleep(DEFERRED_SECONDS)
        super().commit_deferred()


DEFERRED_SECONDS = 2.5


@pytest.mark.timeout(60)
async def test_network_programming_latency_ends_when_the_rules_are_live_not_after_the_cleanup(
    apiserver: FakeApiServer, kubeconfig: str, web: tuple[int, int]
) -> None:
    port_a, _ = web
    async with running_proxy(kube_config(kubeconfig)) as proxy:
        await eventually(lambda: proxy.proxier.port_of(WEB), timeout=10, what="web served")
        rules = SlowCleanupRules()
        proxy.proxier.set_rule_sink(rules)
        ops = proxy.ops
        assert ops is not None
        before = await _programming(ops.metrics_port)
        deferred = rules.deferred_commits
        # A new Service and its slice: live at the rule commit, then its second commit runs.
        apiserver.create(service("late", cluster_ip="10.96.0.13"))
        trigger = _now_rfc3339()  # whole seconds: up to 1 s early
        apiserver.create(endpoint_slice("late-a", "late", ["127.0.0.1"], port=port_a,
                                        trigger_time=trigger))  # fmt: skip
        await eventually(
            lambda: rules.deferred_commits > deferred, timeout=20, what="the second commit"
        )
        await eventually(
            lambda: proxy.pipeline.syncs and not proxy.proxier.rules_pending,
            timeout=20,
            what="synced",
        )
        count, total = await _programming(ops.metrics_port)
        assert count > before[0]
        # Measured to the first commit: the 2.5 s of the second one are not in it.
        assert (total - before[1]) / (count - before[0]) < DEFERRED_SECONDS - 0.3


async def _programming(port: int | None) -> tuple[float, float]:
    """(count, sum) of the network-programming latency histogram."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    name = "kubeproxy_network_programming_duration_seconds"
    count = sample_value(text, f"{name}_count", {}) or 0.0
    return count, sample_value(text, f"{name}_sum", {}) or 0.0
