"""The bounded-frequency runner coalesces requests, resyncs periodically and retries failures."""

from __future__ import annotations

import asyncio
import itertools
import time

from kube_userspace_proxy.sync import BoundedFrequencyRunner


async def _until(predicate, seconds: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_a_burst_of_requests_is_coalesced_into_few_syncs() -> None:
    runs: list[float] = []

    async def fn() -> None:
        runs.append(time.monotonic())

    runner = BoundedFrequencyRunner(fn, min_interval=0.2, max_interval=60)
    task = asyncio.create_task(runner.loop())
    try:
        await _until(lambda: len(runs) == 1)  # the first sync runs at once
        for _ in range(100):
            runner.request()
            await asyncio.sleep(0.002)
        await _until(lambda: len(runs) >= 2)
        await asyncio.sleep(0.5)
        # 100 requests over ~0.2 s with min_interval 0.2 s: at most a couple of syncs.
        assert 2 <= len(runs) <= 3
        gaps = [b - a for a, b in itertools.pairwise(runs)]
        assert all(gap >= 0.19 for gap in gaps)
    finally:
        task.cancel()


async def test_without_requests_a_periodic_sync_still_runs() -> None:
    runs = 0

    async def fn() -> None:
        nonlocal runs
        runs += 1

    runner = BoundedFrequencyRunner(fn, min_interval=0.01, max_interval=0.1)
    task = asyncio.create_task(runner.loop())
    try:
        await _until(lambda: runs >= 4)
    finally:
        task.cancel()


async def test_a_failed_sync_is_retried() -> None:
    attempts = 0

    async def fn() -> None:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise RuntimeError("rules could not be applied")

    runner = BoundedFrequencyRunner(fn, min_interval=0.01, max_interval=60, retry_interval=0.05)
    task = asyncio.create_task(runner.loop())
    try:
        await _until(lambda: runner.runs == 1)
        assert runner.failures == 2
    finally:
        task.cancel()
