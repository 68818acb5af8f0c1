"""The bounded-frequency runner coalesces requests, resyncs periodically and retries failures."""

from __future__ import annotations

import asyncio
import time

from kube_userspace_proxy.app.runner import BoundedFrequencyRunner

SLACK = 0.05
"""Seconds a sync's recorded time may lag its token on a busy machine (preemption)."""


async def _until(predicate, seconds: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_a_storm_of_requests_is_bounded_by_min_interval() -> None:
    runs: list[float] = []

    async def fn() -> None:
        runs.append(time.monotonic())

    runner = BoundedFrequencyRunner(fn, min_interval=0.2, max_interval=60)
    task = asyncio.create_task(runner.loop())
    try:
        await _until(lambda: len(runs) == 1)  # the first sync runs at once
        started = time.monotonic()
        for _ in range(300):  # a storm of ~0.6 s
            runner.request()
            await asyncio.sleep(0.002)
        await _until(lambda: len(runs) >= 3)
        await asyncio.sleep(0.5)
        elapsed = runs[-1] - started
        # One sync per min_interval on average, plus the burst of two saved up since start.
        assert len(runs) - 1 <= 2 + elapsed / 0.2 + 1
        # Once the burst is spent, syncs follow the token schedule: the k-th one after it comes
        # about k min_intervals later. The times are taken inside fn, a little after the token:
        # on a busy machine a preempted process records one late, so SLACK allows for that (a
        # runner that ignored min_interval would sync every 2 ms of the storm).
        spent = runs[2:]
        assert all(t - spent[0] >= k * 0.2 - SLACK for k, t in enumerate(spent)), spent
    finally:
        task.cancel()


async def test_two_requests_after_a_quiet_spell_both_run_at_once() -> None:
    runs: list[float] = []

    async def fn() -> None:
        runs.append(time.monotonic())
        await asyncio.sleep(0.01)  # a sync takes a little while

    runner = BoundedFrequencyRunner(fn, min_interval=1.0, max_interval=60)
    task = asyncio.create_task(runner.loop())
    try:
        await _until(lambda: len(runs) == 1)
        await asyncio.sleep(1.1)  # the first sync's token is earned back
        asked = time.monotonic()
        runner.request()  # a Service ...
        await _until(lambda: len(runs) == 2)
        runner.request()  # ... and its EndpointSlice, while the first sync may still run
        await _until(lambda: len(runs) == 3)
        # Both at once: neither was held back for a token (held counts those that were), so
        # they are not a whole min_interval (1 s) apart, however busy the machine.
        assert runner.held == 0, runs
        assert runs[2] - asked < 1.0 - SLACK
        runner.request()  # the burst is spent: this one waits for min_interval
        await _until(lambda: len(runs) == 4)
        assert runner.held == 1
        assert runs[3] - runs[2] >= 0.9
    finally:
        task.cancel()


async def test_with_a_burst_of_one_every_sync_waits_min_interval() -> None:
    runs: list[float] = []

    async def fn() -> None:
        runs.append(time.monotonic())

    runner = BoundedFrequencyRunner(fn, min_interval=0.2, max_interval=60, burst=1)
    task = asyncio.create_task(runner.loop())
    try:
        await _until(lambda: len(runs) == 1)
        for _ in range(100):
            runner.request()
            await asyncio.sleep(0.002)
        requested = time.monotonic() - runs[0]  # ~0.2 s; longer on a busy machine
        await _until(lambda: len(runs) >= 2)
        await asyncio.sleep(0.5)
        # One run per min_interval while requests came (3 when they took ~0.2 s), no more.
        assert 2 <= len(runs) <= 2 + int(requested / 0.2), runs
        assert all(t - runs[0] >= k * 0.2 - SLACK for k, t in enumerate(runs)), runs
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
