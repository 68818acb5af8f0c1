"""Waiting for progress in tests: one place that polls, and one floor under every deadline.

A test says how long something *should* take; on a busy machine (CI beside other work, two
CPU hogs) it may take many times that. A wait that ends early fails the test for the machine's
load, not for the code (issue 22, item 8: "no fixed short deadline for progress"). So every wait
polls for at least `PROGRESS_FLOOR` seconds (60, or `KUP_TEST_PROGRESS_FLOOR`), whatever
shorter bound the test names. A wait that succeeds returns as soon as its condition holds, so
the floor costs nothing when the code works. Tests never assert how fast something happened:
speed is measured in benchmarks/.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

PROGRESS_FLOOR = float(os.environ.get("KUP_TEST_PROGRESS_FLOOR", "60"))


def bound(timeout: float) -> float:
    """The seconds a wait really allows: the test's own bound, never less than the floor."""
    return max(timeout, PROGRESS_FLOOR)


def poll(
    check: Callable[[], Any],
    what: str,
    timeout: float = 60.0,
    interval: float = 0.05,
    tolerate: tuple[type[BaseException], ...] = (),
) -> Any:
    """Call `check()` until it returns something truthy (returned); `tolerate`d exceptions
    count as "not yet". AssertionError naming `what` after `bound(timeout)` seconds."""
    allowed = bound(timeout)
    deadline = time.monotonic() + allowed
    last: BaseException | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except tolerate as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {allowed:g}s waiting for {what}" + (f": {last}" if last else "")
            )
        time.sleep(interval)


async def eventually(
    check: Callable[[], Any], what: str, timeout: float = 30.0, interval: float = 0.01
) -> Any:
    """`poll` for a test running in an event loop: sleeps with asyncio between tries."""
    allowed = bound(timeout)
    deadline = time.monotonic() + allowed
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {allowed:g}s waiting for {what}")
        await asyncio.sleep(interval)
