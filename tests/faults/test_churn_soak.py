"""The fault suite: stable Services keep answering through churn, API-server restarts with
compaction, and backends dying and coming back; the proxy's footprint stays flat.

About 35 s: 5 s of warm-up, then 30 s measured. `benchmarks/soak.py` runs the same for 10
minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.soak import run

FD_SLACK = 8
"""Descriptors the last window may hold beyond the first without counting as a leak."""


@pytest.mark.timeout(180)
async def test_stable_services_never_fail_and_the_footprint_stays_flat(tmp_path: Path) -> None:
    result = await run(
        tmp_path,
        warmup=5,
        measure=30,
        log=tmp_path / "proxy.log",
        api_restart_every=12.0,
        backend_kill_every=2.5,
    )
    print(result.report())
    assert result.requests > 1000
    assert result.churn_events >= 10 * 30  # 10 or more Service/EndpointSlice changes a second
    assert result.api_restarts >= 2 and result.backend_kills >= 6
    assert result.failures == [], f"{len(result.failures)} failed: {result.failures[:5]}"
    rss_drift, fd_drift = result.drift()
    # Leak checks: growth fails, a footprint that shrinks (connections of the warm-up window
    # finishing on a busy machine: descriptors 55 -> 40) does not. A descriptor leaked per
    # request or per churn event would add hundreds to the fewest descriptors of the last
    # window (`Result.window`: connections in flight come and go, a leak stays; their median
    # once went 44 -> 53.5 in CI with no leak), so the bound is the larger of 5 % and
    # FD_SLACK descriptors.
    assert rss_drift <= 0.05, result.report()
    fd_first = result.window(True)[1]
    assert fd_drift * fd_first <= max(0.05 * fd_first, FD_SLACK), result.report()
