"""ProxyHealth follows kube-proxy's /healthz and /livez semantics (pkg/proxy/healthcheck)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import datetime

from kube_userspace_proxy.ops.health import LOOP_STALL_SECONDS, ProxyHealth, rfc3339, watch_lag

SYNC_PERIOD = 30.0
START = 1_700_000_000.0


class Clock:
    """A settable clock: tests move time instead of sleeping."""

    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make() -> tuple[ProxyHealth, Clock]:
    clock = Clock()
    return ProxyHealth(SYNC_PERIOD, clock=clock), clock


def test_healthy_while_starting_with_nothing_queued() -> None:
    health, clock = make()
    clock.now += 10 * SYNC_PERIOD
    assert health.livez()[0] == 200
    assert health.healthz()[0] == 200


def test_queued_change_is_healthy_until_twice_the_sync_period() -> None:
    health, clock = make()
    health.queued_update()
    clock.now += 2 * SYNC_PERIOD
    assert health.healthz()[0] == 200
    clock.now += 0.001
    assert health.healthz()[0] == 503


def test_only_the_oldest_queued_change_counts() -> None:
    health, clock = make()
    health.queued_update()
    clock.now += 2 * SYNC_PERIOD - 1
    health.queued_update()  # a newer change must not restart the timer
    clock.now += 2
    assert health.healthz()[0] == 503


def test_successful_sync_makes_it_healthy_again() -> None:
    health, clock = make()
    health.queued_update()
    clock.now += 3 * SYNC_PERIOD
    assert health.healthz()[0] == 503
    health.synced()
    assert health.livez()[0] == 200
    assert health.healthz()[0] == 200


def test_ineligible_node_fails_healthz_but_not_livez() -> None:
    health, _ = make()
    health.set_node_eligible(False)
    code, body = health.healthz()
    assert code == 503
    assert body["nodeEligible"] is False
    assert health.livez()[0] == 200
    health.set_node_eligible(True)
    assert health.healthz()[0] == 200


def test_healthy_body_reports_now_as_last_updated() -> None:
    health, clock = make()
    health.synced()
    clock.now += 5
    code, body = health.healthz()
    assert code == 200
    assert body == {
        "lastUpdated": rfc3339(clock.now),
        "currentTime": rfc3339(clock.now),
        "nodeEligible": True,
        "healthy": True,
        "status": {"IPv4": {"lastUpdated": rfc3339(clock.now - 5), "healthy": True}},
    }
    assert set(health.livez()[1]) == {"lastUpdated", "currentTime", "healthy", "status"}


def test_unhealthy_body_reports_the_last_successful_sync() -> None:
    health, clock = make()
    health.synced()
    synced_at = clock.now
    clock.now += 1
    health.queued_update()
    clock.now += 3 * SYNC_PERIOD
    code, body = health.healthz()
    assert code == 503
    assert body["lastUpdated"] == rfc3339(synced_at)
    assert body["currentTime"] == rfc3339(clock.now)


def test_unhealthy_before_any_sync_reports_zero_time() -> None:
    health, clock = make()
    health.queued_update()
    clock.now += 3 * SYNC_PERIOD
    assert health.livez()[1]["lastUpdated"] == "0001-01-01T00:00:00Z"


def test_timestamps_are_rfc3339_utc() -> None:
    text = rfc3339(START + 0.25)
    assert text == "2023-11-14T22:13:20.25Z"  # Go's RFC3339Nano: trailing zeros dropped
    assert datetime.fromisoformat(text).timestamp() == START + 0.25
    assert rfc3339(START + 0.000123) == "2023-11-14T22:13:20.000123Z"
    assert rfc3339(START) == "2023-11-14T22:13:20Z"


def test_readiness_waits_for_the_first_complete_sync() -> None:
    health, clock = make()
    assert health.healthz()[0] == 200  # kube-proxy's rule: healthy while starting
    code, body = health.readyz()
    assert (code, body["ready"]) == (503, False)
    health.synced()
    assert health.readyz()[0] == 200
    health.queued_update()
    clock.now += 3 * SYNC_PERIOD  # a stuck sync makes it unready again
    assert health.readyz()[0] == 503


def test_every_served_family_has_a_status() -> None:
    health = ProxyHealth(SYNC_PERIOD, families=("IPv4", "IPv6"))
    assert set(health.healthz()[1]["status"]) == {"IPv4", "IPv6"}


def test_livez_never_reports_a_sync_failure() -> None:
    health, clock = make()
    health.beat()
    health.queued_update()  # and no sync ever succeeds
    for _ in range(10):
        clock.now += SYNC_PERIOD
        health.beat()
        assert health.livez()[0] == 200
    assert health.healthz()[0] == 503


def test_livez_fails_when_the_event_loop_misses_its_heartbeat() -> None:
    health, clock = make()
    health.beat()
    clock.now += LOOP_STALL_SECONDS
    assert health.livez()[0] == 200
    clock.now += 0.001
    assert health.livez()[0] == 503
    health.beat()
    assert health.livez()[0] == 200


def test_watch_lag_observes_how_late_its_timer_fires() -> None:
    """Samples are near zero on an idle loop; a loop held for 80 ms yields one of ~80 ms."""

    async def main() -> list[float]:
        seen: list[float] = []
        task = asyncio.create_task(watch_lag(seen.append, interval=0.01, idle_interval=0.01))
        await asyncio.sleep(0.1)
        time.sleep(0.08)  # the stall under test
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return seen

    seen = asyncio.run(main())
    assert len(seen) >= 8
    assert max(seen) >= 0.06
    assert sorted(seen)[len(seen) // 2] < 0.03


def test_watch_lag_samples_an_idle_loop_rarely_and_a_busy_one_often() -> None:
    """An idle loop is woken every `idle_interval` only; while it burns CPU, every `interval`.

    The thread's CPU clock is the test's: on a machine busy with other work this process may
    get little CPU however hard it spins, and the choice under test is the one made from it.
    """
    burning = False
    burnt = 0.0
    since = time.monotonic()

    def cpu_clock() -> float:  # the loop's thread: idle, or using all of a CPU while burning
        nonlocal burnt, since
        now = time.monotonic()
        if burning:
            burnt += now - since
        since = now
        return burnt

    async def main() -> tuple[int, int]:
        nonlocal burning
        seen: list[float] = []
        task = asyncio.create_task(
            watch_lag(seen.append, interval=0.01, idle_interval=0.2, cpu_clock=cpu_clock)
        )
        await asyncio.sleep(0.5)
        idle = len(seen)
        cpu_clock()
        burning = True
        await asyncio.sleep(0.5)
        busy = len(seen) - idle
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return idle, busy

    idle, busy = asyncio.run(main())
    assert idle <= 3
    assert busy >= 10
